//! Hostile and broken GGUF files are rejected with the right error, never a panic.

use ds4_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value};

/// A hand-assembled GGUF image, so that tests can write what the writer refuses to.
#[derive(Default)]
struct Raw {
    b: Vec<u8>,
}

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw::default();
        r.u32(0x4655_4747).u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.b.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.b.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.b.extend_from_slice(s.as_bytes());
        self
    }
    fn bytes(&mut self, s: &[u8]) -> &mut Self {
        self.b.extend_from_slice(s);
        self
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to the 32-byte data section and appends `data_len` zero bytes.
    fn data(&mut self, data_len: usize) -> Vec<u8> {
        let mut b = self.b.clone();
        b.resize(b.len().div_ceil(32) * 32 + data_len, 0);
        b
    }
}

fn parse(b: Vec<u8>) -> GgufError {
    match GgufFile::from_bytes(b) {
        Ok(f) => panic!("parsed a malformed file: {f:?}"),
        Err(e) => e,
    }
}

fn small_valid() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("deepseek4".into()))
        .unwrap();
    w.add("a.list", Value::i32_array(&[1, 2, 3])).unwrap();
    w.add_tensor("t.f32", &[4, 2], GgmlType::F32).unwrap();
    w.add_tensor("t.q8", &[32], GgmlType::Q8_0).unwrap();
    let mut out = Vec::new();
    let sizes = w.layout().tensor_sizes;
    w.write_to(&mut out, |i, buf| {
        buf.resize(sizes[i] as usize, 1);
        Ok(())
    })
    .unwrap();
    out
}

#[test]
fn small_valid_file_parses() {
    let f = GgufFile::from_bytes(small_valid()).unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(f.tensor("t.q8").unwrap().data.len(), 34);
}

#[test]
fn bad_magic() {
    let mut b = small_valid();
    b[0] = b'X';
    assert!(matches!(parse(b), GgufError::BadMagic(_)));
}

#[test]
fn version_2_and_4_rejected() {
    for v in [1u32, 2, 4] {
        let mut b = small_valid();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(matches!(parse(b), GgufError::BadVersion(x) if x == v));
    }
}

#[test]
fn every_truncation_is_an_error() {
    let full = small_valid();
    for len in 0..full.len() {
        match parse(full[..len].to_vec()) {
            GgufError::Truncated { .. } | GgufError::AbsurdCount { .. } => {}
            e => panic!("prefix of {len} bytes: unexpected {e:?}"),
        }
    }
}

#[test]
fn absurd_counts() {
    let e = parse(Raw::header(3, u64::MAX, 0).data(64));
    assert!(
        matches!(e, GgufError::AbsurdCount { what: "tensor", .. }),
        "{e:?}"
    );
    let e = parse(Raw::header(3, 0, 1 << 40).data(64));
    assert!(
        matches!(
            e,
            GgufError::AbsurdCount {
                what: "metadata",
                ..
            }
        ),
        "{e:?}"
    );
    // An array claiming more items than bytes remain.
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(9).u32(4).u64(1 << 50);
    assert!(matches!(parse(r.data(0)), GgufError::Truncated { .. }));
}

#[test]
fn string_length_past_eof() {
    let mut r = Raw::header(3, 0, 1);
    r.u64(1000).bytes(b"abc");
    assert!(matches!(parse(r.data(0)), GgufError::Truncated { .. }));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(8).u64(u64::MAX);
    assert!(matches!(parse(r.b.clone()), GgufError::Truncated { .. }));
}

#[test]
fn metadata_errors() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u32(0);
    assert!(matches!(
        parse(r.data(0)),
        GgufError::UnknownValueType { type_id: 13, .. }
    ));
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(7).bytes(&[2]);
    assert!(matches!(parse(r.data(0)), GgufError::BadMetadata { .. }));
    let mut r = Raw::header(3, 0, 2);
    r.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    assert!(matches!(parse(r.data(0)), GgufError::DuplicateKey(k) if k == "k"));
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).bytes(&[0xff, 0xfe]).u32(4).u32(1);
    assert!(matches!(parse(r.data(0)), GgufError::InvalidUtf8 { .. }));
    // Arrays of arrays nested past the limit.
    let mut r = Raw::header(3, 0, 1);
    r.str("deep");
    r.u32(9);
    for _ in 0..20 {
        r.u32(9).u64(1);
    }
    r.u32(4).u64(0);
    assert!(matches!(parse(r.data(0)), GgufError::TooDeep { .. }));
}

#[test]
fn bad_alignment_key() {
    for a in [0u32, 3, 48] {
        let mut r = Raw::header(3, 0, 1);
        r.str("general.alignment").u32(4).u32(a);
        assert!(
            matches!(parse(r.data(0)), GgufError::BadMetadata { .. }),
            "alignment {a}"
        );
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(8).str("32");
    assert!(matches!(parse(r.data(0)), GgufError::BadMetadata { .. }));
}

#[test]
fn overlapping_tensors() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[64], 0, 0).tensor("b", &[8], 0, 224);
    let e = parse(r.data(512));
    assert!(matches!(e, GgufError::Overlap { .. }), "{e:?}");
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[8], 0, 64).tensor("b", &[8], 0, 64);
    assert!(matches!(parse(r.data(512)), GgufError::Overlap { .. }));
}

#[test]
fn unknown_tensor_type() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("a", &[8], 4, 0);
    assert!(matches!(
        parse(r.data(64)),
        GgufError::UnknownTensorType { type_id: 4, .. }
    ));
    let mut r = Raw::header(3, 1, 0);
    r.tensor("a", &[8], 1000, 0);
    assert!(matches!(
        parse(r.data(64)),
        GgufError::UnknownTensorType { .. }
    ));
}

#[test]
fn tensor_shape_errors() {
    let cases: [(&[u64], u32); 6] = [
        (&[1 << 32, 1 << 32], 0), // element count overflows u64 when × 4 bytes
        (&[u64::MAX, 2], 0),      // element count overflows
        (&[0, 4], 0),             // zero dimension
        (&[], 0),                 // no dimensions
        (&[1, 1, 1, 1, 1, 1, 1, 1, 1], 0), // too many dimensions
        (&[33], 8),               // not a whole Q8_0 block
    ];
    for (dims, ty) in cases {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("a", dims, ty, 0);
        let e = parse(r.data(64));
        assert!(matches!(e, GgufError::BadTensor { .. }), "{dims:?}: {e:?}");
    }
    // Huge but representable: the data runs past the end of the file.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("a", &[1 << 40], 0, 0);
    assert!(matches!(parse(r.data(64)), GgufError::Truncated { .. }));
}

#[test]
fn misaligned_and_out_of_range_offsets() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("a", &[8], 0, 4);
    assert!(matches!(parse(r.data(64)), GgufError::BadTensor { .. }));
    let mut r = Raw::header(3, 1, 0);
    r.tensor("a", &[8], 0, u64::MAX - 31);
    assert!(matches!(parse(r.data(64)), GgufError::Truncated { .. }));
}

#[test]
fn duplicate_tensor_name() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[8], 0, 0).tensor("a", &[8], 0, 32);
    assert!(matches!(parse(r.data(64)), GgufError::DuplicateTensor(_)));
}

/// Found by the `gguf_parse` fuzz target (its own assertion was too strict, not a
/// reader bug): a tensor-less file may end before its aligned data offset.
#[test]
fn fuzz_regression_no_tensors_short_header() {
    let input: &[u8] = &[
        0x47, 0x47, 0x55, 0x46, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00,
    ];
    let f = GgufFile::from_bytes(input.to_vec()).unwrap();
    assert!(f.tensors().is_empty() && f.metadata().is_empty());
    assert_eq!(f.len(), 31);
}
