//! Any byte string must either parse into a file whose every tensor view is in bounds
//! or be rejected with an error; never a panic, overflow or out-of-bounds access.
#![no_main]

use ds4_gguf::{quant, GgufFile};
use libfuzzer_sys::fuzz_target;

/// Dequantising is linear in the tensor size; larger tensors add run time, not coverage.
const MAX_DEQUANT_ELEMS: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for (key, value) in file.metadata() {
        let _ = (key.len(), value.summary());
        assert!(file.get(key).is_some());
    }
    let _ = file.alignment();
    let len = file.len();
    // A file without tensors may end before the aligned data offset; only tensor
    // bytes must lie inside the file.
    let mut end = 0;
    for info in file.tensors() {
        let view = file.tensor(&info.name).expect("listed tensor must be found");
        assert_eq!(view.data.len() as u64, info.size);
        assert!(info.offset + info.size <= len);
        assert!(info.offset >= file.data_offset());
        end = end.max(info.offset + info.size);
        let n = info.n_elements();
        if n <= MAX_DEQUANT_ELEMS {
            let mut out = vec![0.0f32; n as usize];
            let _ = quant::dequantize(info.ty, view.data, &mut out);
        }
    }
    assert!(end <= len);
});
