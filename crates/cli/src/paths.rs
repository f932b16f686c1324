//! Start-up checks of path flags (#19 item 4): input files exist, output paths have a
//! writable directory, before a model loads for minutes only to fail at the end. The
//! errors read like clap's own (`error: invalid value 'X' for '--flag <FILE>': …`) and
//! exit with status 2 like any bad flag.
//!
//! Shared by `ds4`, `ds4-tool`, `ds4-bench` and (through `#[path]`, as the server crate
//! does not depend on this one) `ds4-server`; it uses only std, clap and libc.

use std::path::{Path, PathBuf};

/// What a path flag must name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// A model: an existing regular file (it is memory-mapped).
    Model,
    /// An input file: exists, is not a directory, is readable (a FIFO such as
    /// /dev/stdin is fine).
    File,
    /// An existing, readable directory.
    Dir,
    /// An output file: not a directory; its directory exists and is writable.
    OutFile,
    /// An output directory, created when missing: the nearest existing ancestor is a
    /// writable directory.
    OutDir,
}

/// One path flag to check: the clap argument id, its value, what it must be.
pub struct PathFlag<'a> {
    pub id: &'a str,
    pub path: &'a Path,
    pub want: Want,
}

impl<'a> PathFlag<'a> {
    pub fn new(id: &'a str, path: &'a Path, want: Want) -> PathFlag<'a> {
        PathFlag { id, path, want }
    }

    /// The flags of `list` (id, value if given, what it must be) that were given.
    pub fn given(list: &[(&'a str, Option<&'a Path>, Want)]) -> Vec<PathFlag<'a>> {
        list.iter()
            .filter_map(|&(id, path, want)| Some(PathFlag::new(id, path?, want)))
            .collect()
    }
}

fn access(path: &Path, mode: libc::c_int) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated C string.
    unsafe { libc::access(c.as_ptr(), mode) == 0 }
}

/// The directory an output file goes to ("." for a bare file name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn writable_dir(dir: &Path) -> Result<(), String> {
    match std::fs::metadata(dir) {
        Err(_) => Err(format!("directory {} does not exist", dir.display())),
        Ok(m) if !m.is_dir() => Err(format!("{} is not a directory", dir.display())),
        Ok(_) if !access(dir, libc::W_OK | libc::X_OK) => {
            Err(format!("directory {} is not writable", dir.display()))
        }
        Ok(_) => Ok(()),
    }
}

/// Why `path` does not fit `want`, or `Ok`.
pub fn check(path: &Path, want: Want) -> Result<(), String> {
    if path.as_os_str().is_empty() {
        return Err("the path is empty".into());
    }
    let meta = std::fs::metadata(path);
    match want {
        Want::Model | Want::File => {
            let m = meta.map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => "no such file".to_string(),
                _ => format!("cannot read it: {e}"),
            })?;
            if m.is_dir() {
                return Err("it is a directory, not a file".into());
            }
            if want == Want::Model && !m.is_file() {
                return Err("not a regular file".into());
            }
            if !access(path, libc::R_OK) {
                return Err("the file is not readable".into());
            }
            Ok(())
        }
        Want::Dir => match meta {
            Err(_) => Err("no such directory".into()),
            Ok(m) if !m.is_dir() => Err("not a directory".into()),
            Ok(_) if !access(path, libc::R_OK | libc::X_OK) => {
                Err("the directory is not readable".into())
            }
            Ok(_) => Ok(()),
        },
        Want::OutFile => {
            if let Ok(m) = &meta {
                if m.is_dir() {
                    return Err("it is a directory, not a file".into());
                }
                if !access(path, libc::W_OK) {
                    return Err("the file exists and is not writable".into());
                }
            }
            writable_dir(&parent_of(path))
        }
        Want::OutDir => {
            if let Ok(m) = &meta {
                if !m.is_dir() {
                    return Err("not a directory".into());
                }
                return writable_dir(path).map_err(|_| "the directory is not writable".into());
            }
            // Created on use (create_dir_all): the first existing ancestor decides.
            let mut up = parent_of(path);
            while std::fs::metadata(&up).is_err() {
                match up.parent() {
                    Some(p) if !p.as_os_str().is_empty() => up = p.to_path_buf(),
                    _ => {
                        up = PathBuf::from(".");
                        break;
                    }
                }
            }
            writable_dir(&up)
        }
    }
}

/// How clap shows an argument in its errors: `--model <FILE>`, `-o <OUT>`, `<FILE>`.
pub fn flag_display(cmd: &clap::Command, id: &str) -> String {
    let Some(arg) = cmd.get_arguments().find(|a| a.get_id() == id) else {
        return format!("--{id}");
    };
    let value = arg
        .get_value_names()
        .and_then(|v| v.first())
        .map(|v| v.to_string())
        .unwrap_or_else(|| id.to_uppercase());
    match (arg.get_long(), arg.get_short()) {
        (Some(l), _) => format!("--{l} <{value}>"),
        (None, Some(s)) => format!("-{s} <{value}>"),
        (None, None) => format!("<{value}>"),
    }
}

/// The clap-style error for a bad path value (`extra`, when not empty, follows on its
/// own lines: what to do about it).
pub fn invalid(
    cmd: &mut clap::Command,
    id: &str,
    path: &Path,
    why: &str,
    extra: &str,
) -> clap::Error {
    let mut msg = format!(
        "invalid value '{}' for '{}': {why}",
        path.display(),
        flag_display(cmd, id)
    );
    if !extra.is_empty() {
        msg.push_str("\n\n");
        msg.push_str(extra);
    }
    cmd.error(clap::error::ErrorKind::ValueValidation, msg)
}

/// Checks every flag in order; the first bad one is the error.
pub fn validate(cmd: &mut clap::Command, flags: &[PathFlag]) -> Result<(), clap::Error> {
    for f in flags {
        if let Err(why) = check(f.path, f.want) {
            return Err(invalid(cmd, f.id, f.path, &why, ""));
        }
    }
    Ok(())
}

/// What a missing default model needs said: where the weights come from.
pub const MODEL_HINT: &str = "Download the published weights (about 81 GB) and link ./ds4flash.gguf with:\n\n    ds4-tool download q2-imatrix\n\nor point -m at a GGUF file.";

/// The model flag's check, with [`MODEL_HINT`] when the file is missing.
pub fn validate_model(cmd: &mut clap::Command, id: &str, path: &Path) -> Result<(), clap::Error> {
    check(path, Want::Model).map_err(|why| {
        let hint = if why == "no such file" {
            MODEL_HINT
        } else {
            ""
        };
        invalid(cmd, id, path, &why, hint)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, Command};

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ds4-paths-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn inputs_must_exist_and_be_files() {
        let d = tmp("in");
        let f = d.join("f.txt");
        std::fs::write(&f, "x").unwrap();
        assert_eq!(check(&f, Want::File), Ok(()));
        assert_eq!(check(&f, Want::Model), Ok(()));
        assert_eq!(
            check(&d.join("nope"), Want::File),
            Err("no such file".into())
        );
        assert!(check(&d, Want::Model).unwrap_err().contains("directory"));
        assert_eq!(check(&d, Want::Dir), Ok(()));
        assert_eq!(check(&f, Want::Dir), Err("not a directory".into()));
        // A character device is an input, not a model.
        assert_eq!(check(Path::new("/dev/null"), Want::File), Ok(()));
        assert_eq!(
            check(Path::new("/dev/null"), Want::Model),
            Err("not a regular file".into())
        );
        assert_eq!(
            check(Path::new(""), Want::File),
            Err("the path is empty".into())
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn outputs_need_an_existing_writable_directory() {
        let d = tmp("out");
        assert_eq!(check(&d.join("o.bin"), Want::OutFile), Ok(()));
        assert_eq!(check(Path::new("o.bin"), Want::OutFile), Ok(()));
        let e = check(&d.join("no/o.bin"), Want::OutFile).unwrap_err();
        assert!(e.contains("does not exist") && e.contains("/no"), "{e}");
        assert!(check(&d, Want::OutFile)
            .unwrap_err()
            .contains("is a directory"));
        let f = d.join("f");
        std::fs::write(&f, "x").unwrap();
        assert!(check(&f.join("o.bin"), Want::OutFile)
            .unwrap_err()
            .contains("not a directory"));
        // Output directories are created, below an existing writable one.
        assert_eq!(check(&d.join("a/b/c"), Want::OutDir), Ok(()));
        assert_eq!(check(&d, Want::OutDir), Ok(()));
        assert_eq!(check(&f, Want::OutDir), Err("not a directory".into()));
        assert!(check(&f.join("sub"), Want::OutDir)
            .unwrap_err()
            .contains("not a directory"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn errors_read_like_clap() {
        let mut cmd = Command::new("t")
            .arg(
                Arg::new("model")
                    .short('m')
                    .long("model")
                    .value_name("FILE"),
            )
            .arg(Arg::new("out").short('o'))
            .arg(Arg::new("file"));
        assert_eq!(flag_display(&cmd, "model"), "--model <FILE>");
        assert_eq!(flag_display(&cmd, "out"), "-o <OUT>");
        assert_eq!(flag_display(&cmd, "file"), "<FILE>");
        let e = validate_model(&mut cmd, "model", Path::new("/nonexistent/m.gguf")).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let s = e.render().to_string();
        assert!(
            s.starts_with(
                "error: invalid value '/nonexistent/m.gguf' for '--model <FILE>': no such file"
            ),
            "{s}"
        );
        assert!(s.contains("ds4-tool download q2-imatrix"), "{s}");
    }
}
