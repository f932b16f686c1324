//! Any byte string read as a KVC cache file (server.md §4.4) must parse into sections
//! that lie inside it, or be rejected with an error; never a panic, an overflow or an
//! allocation sized by an untrusted length (#18 item 4).
#![no_main]

use libfuzzer_sys::fuzz_target;

// The format module has no dependency on the rest of the server (model, HTTP), so the
// target compiles it alone instead of the whole server crate.
#[path = "../../crates/server/src/kvcache/format.rs"]
#[allow(dead_code)]
mod format;

/// The server's limit with its default `--tool-memory-max-ids` (4 × 100000).
const MAX_TOOL_ENTRIES: usize = 400_000;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = format::parse_file(data) else {
        return;
    };
    let h = &file.header;
    assert_eq!(file.key.len(), h.key_len as usize);
    assert_eq!(file.payload.len() as u64, h.payload_len);
    assert!(h.min_file_len() <= data.len() as u64);
    assert_eq!(format::Header::decode(&h.encode()).as_ref(), Ok(h));
    if let Some(i) = &file.integrity {
        assert_eq!(format::checksum(h, file.key, file.payload), i.checksum);
    }
    if let Ok(map) = format::decode_tool_map(file.tool_map, MAX_TOOL_ENTRIES) {
        let entries: Vec<_> = map.into_iter().map(|(id, b)| (id, b.into())).collect();
        let again = format::encode_tool_map(&entries);
        assert_eq!(again.is_empty(), entries.is_empty());
    }
});
