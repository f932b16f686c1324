//! Block sizes and the activation-side block types.

/// Q8_0 weight block: f16 `d`, 32 × i8.
pub const Q8_0_BLOCK_BYTES: usize = 34;
pub const QK8_0: usize = 32;
/// K-quant super-block size.
pub const QK_K: usize = 256;
pub const Q2_K_BLOCK_BYTES: usize = 84;
pub const Q4_K_BLOCK_BYTES: usize = 144;
pub const IQ2_XXS_BLOCK_BYTES: usize = 66;
pub const Q8_K_BLOCK_BYTES: usize = 292;

/// A Q8_0 **activation** block. Unlike the weight format its scale stays f32
/// (ds4 never rounds activation scales to f16).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; QK8_0],
}

impl Default for BlockQ8_0 {
    fn default() -> Self {
        BlockQ8_0 {
            d: 0.0,
            qs: [0; QK8_0],
        }
    }
}

/// A Q8_K activation block (llama.cpp `block_q8_K`): f32 scale, 256 × i8 and the sums
/// of each 16-element group, which the K-quant dots use for the `min` terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

impl BlockQ8K {
    /// The GGUF byte form (292 bytes: f32 d, i8 qs[256], i16 bsums[16]).
    pub fn to_bytes(&self) -> [u8; Q8_K_BLOCK_BYTES] {
        let mut b = [0u8; Q8_K_BLOCK_BYTES];
        b[..4].copy_from_slice(&self.d.to_le_bytes());
        for (i, q) in self.qs.iter().enumerate() {
            b[4 + i] = *q as u8;
        }
        for (i, s) in self.bsums.iter().enumerate() {
            b[260 + 2 * i..262 + 2 * i].copy_from_slice(&s.to_le_bytes());
        }
        b
    }
}

/// `lrintf` in the default rounding mode: nearest, ties to even.
#[inline]
fn round_even_i32(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Quantises activations to Q8_0 blocks (ds4 `quantize_q8_0_activation`):
/// `d = amax/127` kept in f32, `q = clamp(lrintf(x/d), -128, 127)`.
/// `x.len()` must be a multiple of 32 and `out.len() == x.len()/32`.
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    assert_eq!(x.len(), out.len() * QK8_0, "quantize_q8_0: length mismatch");
    for (xb, ob) in x.chunks_exact(QK8_0).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob.d = d;
        for (q, v) in ob.qs.iter_mut().zip(xb) {
            *q = round_even_i32(v * id).clamp(-128, 127) as i8;
        }
    }
}

/// Quantises activations to Q8_K blocks (llama.cpp `quantize_row_q8_K_ref`): the scale
/// comes from the signed value of largest magnitude (first one wins), mapped to -127.
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(x.len(), out.len() * QK_K, "quantize_q8_k: length mismatch");
    for (xb, ob) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *ob = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            *q = round_even_i32(iscale * v).clamp(-128, 127) as i8;
        }
        for (j, s) in ob.bsums.iter_mut().enumerate() {
            *s = ob.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
        }
        ob.d = 1.0 / iscale;
    }
}

/// Q8_0 activation blocks for a vector of `n` (multiple of 32) values.
pub fn quantize_q8_0_vec(x: &[f32]) -> Vec<BlockQ8_0> {
    let mut out = vec![BlockQ8_0::default(); x.len() / QK8_0];
    quantize_q8_0(x, &mut out);
    out
}

/// Q8_K activation blocks for a vector of `n` (multiple of 256) values.
pub fn quantize_q8_k_vec(x: &[f32]) -> Vec<BlockQ8K> {
    let mut out = vec![BlockQ8K::default(); x.len() / QK_K];
    quantize_q8_k(x, &mut out);
    out
}
