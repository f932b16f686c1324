//! `--warm-weights`: read a model file once, start to end, so the page cache holds the
//! memory-mapped weights before the first token (the CPU backend otherwise faults them
//! in lazily, token by token, from the disk).

use std::io::Read;
use std::path::Path;

/// Reads `path` to the end in 16 MiB blocks, calling `progress(done, total)` after
/// each; returns the bytes read.
pub fn warm_file(path: &Path, mut progress: impl FnMut(u64, u64)) -> std::io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let total = f.metadata()?.len();
    let mut buf = vec![0u8; 16 << 20];
    let mut done = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(done);
        }
        done += n as u64;
        progress(done, total);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_whole_file_with_progress() {
        let path = std::env::temp_dir().join(format!("ds4-warm-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; (16 << 20) + 5]).unwrap();
        let mut calls = Vec::new();
        let n = super::warm_file(&path, |d, t| calls.push((d, t))).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(n, (16 << 20) + 5);
        assert_eq!(calls.last(), Some(&(n, n)));
        assert!(calls.len() >= 2);
    }
}
