//! Free-space checks before the tools write large files.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// Bytes available to this user on the file system that would hold `path`.
pub fn free_space(path: &Path) -> Result<u64> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{} contains a NUL byte", dir.display()))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid C string and `st` a writable statvfs that the call fills.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!("cannot check free space in {}: {e}", dir.display());
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Fails, naming both sizes, when fewer than `need` bytes are free where `path` goes.
pub fn ensure_free_space(path: &Path, need: u64) -> Result<()> {
    let free = free_space(path)?;
    if free < need {
        bail!(
            "not enough disk space for {}: it needs {need} bytes ({:.1} GB), {free} are free ({:.1} GB)",
            path.display(),
            need as f64 / 1e9,
            free as f64 / 1e9
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // #19 item 4: synth refuses up front when the disk is short.
    #[test]
    fn a_request_larger_than_the_disk_is_refused_with_both_sizes() {
        let p = std::env::temp_dir().join("x.gguf");
        let err = ensure_free_space(&p, u64::MAX).unwrap_err().to_string();
        assert!(
            err.contains("not enough disk space") && err.contains("are free"),
            "{err}"
        );
        ensure_free_space(&p, 1).unwrap();
        let missing = Path::new("/nonexistent-dir/x.gguf");
        assert!(ensure_free_space(missing, 1).is_err());
    }
}
