//! Process locks (server.md §3): one ds4 process per lock file (`$DS4_LOCK_FILE`,
//! default `ds4.lock` in `$XDG_RUNTIME_DIR` or the user's cache directory), and one
//! server per KV cache directory.
//!
//! The lock is an advisory `flock`-style lock on the open file, so the kernel drops it
//! when the process dies: a file left behind by a crashed server is stale and is simply
//! taken over (its pid line is rewritten).
//!
//! #18 item 2: the path may sit in a directory others can write, so the file is opened
//! without following a symlink and without truncating, and used only when it is a
//! regular file owned by this user; only then is its content replaced.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The default lock file's name, in [`default_lock_dir`].
pub const DEFAULT_LOCK_NAME: &str = "ds4.lock";
/// The lock file inside a `--kv-disk-dir` (not a `<sha1>.kv` name, so the cache
/// ignores it).
pub const KV_DIR_LOCK: &str = "ds4-server.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another ds4 process is already running (pid {pid}); it holds {path}")]
    Held { pid: String, path: PathBuf },
    #[error("refusing the lock file {path}: {why}")]
    Unsafe { path: PathBuf, why: String },
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

/// `$DS4_LOCK_FILE`, or `ds4.lock` in [`default_lock_dir`] (created when missing).
pub fn lock_file_path() -> PathBuf {
    if let Some(p) = std::env::var_os("DS4_LOCK_FILE").filter(|v| !v.is_empty()) {
        return PathBuf::from(p);
    }
    let dir = default_lock_dir();
    // A failure shows up as the open's error, naming the path.
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir);
    dir.join(DEFAULT_LOCK_NAME)
}

/// A directory only this user writes: `$XDG_RUNTIME_DIR`, else `$XDG_CACHE_HOME/ds4`,
/// else `~/.cache/ds4`; the system temp directory only when none is known.
pub fn default_lock_dir() -> PathBuf {
    let env = |k| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("XDG_RUNTIME_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("ds4")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/ds4")))
        .unwrap_or_else(std::env::temp_dir)
}

/// Opens `path` for locking: never through a symlink, never truncating, and only a
/// regular file that this user owns.
fn open_lock_file(path: &Path) -> Result<File, LockError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            Some(libc::ELOOP) => LockError::Unsafe {
                path: path.to_path_buf(),
                why: "it is a symbolic link".into(),
            },
            _ => LockError::Io {
                path: path.to_path_buf(),
                source,
            },
        })?;
    let meta = file.metadata().map_err(|source| LockError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let why = if !meta.file_type().is_file() {
        "it is not a regular file"
    } else if meta.uid() != me {
        "it belongs to another user"
    } else {
        return Ok(file);
    };
    Err(LockError::Unsafe {
        path: path.to_path_buf(),
        why: why.into(),
    })
}

/// Takes the lock on `path` without waiting, and writes this process's pid into it.
pub fn acquire(path: &Path) -> Result<ProcessLock, LockError> {
    let io = |source| LockError::Io {
        path: path.to_path_buf(),
        source,
    };
    // No truncation before the lock is ours: the holder's pid must stay readable.
    let mut file = open_lock_file(path)?;
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

    // #18 item 2: a symlink planted at the lock path is refused and its target is left
    // untouched (it used to be followed and truncated); so is a non-regular file.
    #[test]
    fn symlinks_and_non_files_are_refused_untouched() {
        let dir = std::env::temp_dir().join(format!("ds4-lock-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let link = dir.join("x.lock");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        match acquire(&link) {
            Err(LockError::Unsafe { why, .. }) => assert!(why.contains("symbolic"), "{why}"),
            other => panic!("expected Unsafe, got {other:?}"),
        }
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
        // A dangling symlink is not created through either.
        let dangling = dir.join("d.lock");
        std::os::unix::fs::symlink(dir.join("made"), &dangling).unwrap();
        assert!(acquire(&dangling).is_err());
        assert!(!dir.join("made").exists());
        // A directory at the path.
        let sub = dir.join("sub.lock");
        std::fs::create_dir(&sub).unwrap();
        assert!(acquire(&sub).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    // #18 item 2: without $DS4_LOCK_FILE the lock is not in a world-writable directory.
    #[test]
    fn default_lock_dir_is_per_user() {
        let d = default_lock_dir();
        if std::env::var_os("XDG_RUNTIME_DIR").is_some() || std::env::var_os("HOME").is_some() {
            assert_ne!(d, std::env::temp_dir(), "{}", d.display());
        }
    }
}
