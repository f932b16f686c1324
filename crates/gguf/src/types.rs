//! The ggml tensor type table: ids, block shapes and byte sizes.

use std::fmt;

/// A ggml tensor element type as stored in a GGUF tensor info.
///
/// Every type ggml defines is known here so that `inspect` can size any file; only the
/// types DeepSeek V4 files use (F32, F16, BF16, Q8_0, Q2_K, Q4_K, Q8_K, IQ2_XXS, I32) can
/// be dequantized.
#[allow(non_camel_case_types)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, ggml id, elements per block, bytes per block, name)
const TABLE: &[(GgmlType, u32, usize, usize, &str)] = &[
    (GgmlType::F32, 0, 1, 4, "F32"),
    (GgmlType::F16, 1, 1, 2, "F16"),
    (GgmlType::Q4_0, 2, 32, 18, "Q4_0"),
    (GgmlType::Q4_1, 3, 32, 20, "Q4_1"),
    (GgmlType::Q5_0, 6, 32, 22, "Q5_0"),
    (GgmlType::Q5_1, 7, 32, 24, "Q5_1"),
    (GgmlType::Q8_0, 8, 32, 34, "Q8_0"),
    (GgmlType::Q8_1, 9, 32, 36, "Q8_1"),
    (GgmlType::Q2_K, 10, 256, 84, "Q2_K"),
    (GgmlType::Q3_K, 11, 256, 110, "Q3_K"),
    (GgmlType::Q4_K, 12, 256, 144, "Q4_K"),
    (GgmlType::Q5_K, 13, 256, 176, "Q5_K"),
    (GgmlType::Q6_K, 14, 256, 210, "Q6_K"),
    (GgmlType::Q8_K, 15, 256, 292, "Q8_K"),
    (GgmlType::IQ2_XXS, 16, 256, 66, "IQ2_XXS"),
    (GgmlType::IQ2_XS, 17, 256, 74, "IQ2_XS"),
    (GgmlType::IQ3_XXS, 18, 256, 98, "IQ3_XXS"),
    (GgmlType::IQ1_S, 19, 256, 50, "IQ1_S"),
    (GgmlType::IQ4_NL, 20, 32, 18, "IQ4_NL"),
    (GgmlType::IQ3_S, 21, 256, 110, "IQ3_S"),
    (GgmlType::IQ2_S, 22, 256, 82, "IQ2_S"),
    (GgmlType::IQ4_XS, 23, 256, 136, "IQ4_XS"),
    (GgmlType::I8, 24, 1, 1, "I8"),
    (GgmlType::I16, 25, 1, 2, "I16"),
    (GgmlType::I32, 26, 1, 4, "I32"),
    (GgmlType::I64, 27, 1, 8, "I64"),
    (GgmlType::F64, 28, 1, 8, "F64"),
    (GgmlType::IQ1_M, 29, 256, 56, "IQ1_M"),
    (GgmlType::BF16, 30, 1, 2, "BF16"),
    (GgmlType::TQ1_0, 34, 256, 54, "TQ1_0"),
    (GgmlType::TQ2_0, 35, 256, 66, "TQ2_0"),
    (GgmlType::MXFP4, 39, 32, 17, "MXFP4"),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, usize, usize, &'static str) {
        TABLE
            .iter()
            .find(|e| e.0 == self)
            .expect("every GgmlType variant has a table entry")
    }

    /// The type with ggml id `id`, if ggml defines one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// Every known type, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|e| e.0)
    }

    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// Elements per block (1 for plain scalar types).
    pub fn block_elems(self) -> usize {
        self.entry().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.entry().3
    }

    pub fn name(self) -> &'static str {
        self.entry().4
    }

    /// Parses a type name as printed by [`GgmlType::name`] (case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE
            .iter()
            .find(|e| e.4.eq_ignore_ascii_case(name))
            .map(|e| e.0)
    }

    /// Bytes of `n_elems` elements, or `None` if `n_elems` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elems: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if n_elems % be != 0 {
            return None;
        }
        (n_elems / be).checked_mul(self.block_bytes() as u64)
    }

    /// Bytes of one row of `n_elems` elements (see [`GgmlType::bytes_for`]).
    pub fn row_bytes(self, n_elems: usize) -> Option<usize> {
        self.bytes_for(n_elems as u64)
            .and_then(|b| usize::try_from(b).ok())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ds4_type_sizes() {
        assert_eq!(GgmlType::Q8_0.row_bytes(4096), Some(4352));
        assert_eq!(GgmlType::IQ2_XXS.row_bytes(4096), Some(1056));
        assert_eq!(GgmlType::Q2_K.row_bytes(2048), Some(672));
        assert_eq!(GgmlType::Q4_K.bytes_for(4096 * 2048), Some(4_718_592));
        assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
    }
}
