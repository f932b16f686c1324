//! Process locks (server.md §3): one ds4 process per lock file (`$DS4_LOCK_FILE`,
//! default `/tmp/ds4.lock`, as the reference), and one server per KV cache directory.
//!
//! The lock is an advisory `flock`-style lock on the open file, so the kernel drops it
//! when the process dies: a file left behind by a crashed server is stale and is simply
//! taken over (its pid line is rewritten).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The default lock file of every ds4 process.
pub const DEFAULT_LOCK_FILE: &str = "/tmp/ds4.lock";
/// The lock file inside a `--kv-disk-dir` (not a `<sha1>.kv` name, so the cache
/// ignores it).
pub const KV_DIR_LOCK: &str = "ds4-server.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another ds4 process is already running (pid {pid}); it holds {path}")]
    Held { pid: String, path: PathBuf },
    #[error("cannot use the lock file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A held lock; released when dropped (or when the process exits).
#[derive(Debug)]
pub struct ProcessLock {
    _file: File,
    pub path: PathBuf,
}

/// `$DS4_LOCK_FILE`, or the default.
pub fn lock_file_path() -> PathBuf {
    std::env::var_os("DS4_LOCK_FILE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_LOCK_FILE))
}

/// Takes the lock on `path` without waiting, and writes this process's pid into it.
pub fn acquire(path: &Path) -> Result<ProcessLock, LockError> {
    let io = |source| LockError::Io {
        path: path.to_path_buf(),
        source,
    };
    // No truncation before the lock is ours: the holder's pid must stay readable.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut s = String::new();
            let _ = file.read_to_string(&mut s);
            let pid = s.trim();
            return Err(LockError::Held {
                pid: if pid.is_empty() {
                    "unknown".into()
                } else {
                    pid.to_string()
                },
                path: path.to_path_buf(),
            });
        }
        Err(TryLockError::Error(e)) => return Err(io(e)),
    }
    file.set_len(0).map_err(io)?;
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(ProcessLock {
        _file: file,
        path: path.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_and_stale_files_are_taken_over() {
        let dir = std::env::temp_dir().join(format!("ds4-lock-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.lock");
        // A stale file from a dead process: taken over, pid rewritten.
        std::fs::write(&path, "4194303\n").unwrap();
        let held = acquire(&path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap().trim(),
            std::process::id().to_string()
        );
        // flock locks belong to the open file description: a second open conflicts
        // even within one process.
        match acquire(&path) {
            Err(LockError::Held { pid, .. }) => assert_eq!(pid, std::process::id().to_string()),
            other => panic!("expected Held, got {other:?}"),
        }
        drop(held);
        acquire(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
