//! `./ds4flash.gguf`: the link the `ds4` programs open by default, pointed at the
//! downloaded main model.

use std::io;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

/// What happened to the link in [`update_link`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkUpdate {
    Created,
    Replaced,
}

/// Points the symlink `link` at `target`, atomically: a temporary link is created next to
/// it and renamed over it, so a reader sees the old or the new model, never no file.
/// Refuses to replace anything that is not a symlink (a real model file would be lost).
#[cfg(unix)]
pub fn update_link(link: &Path, target: &Path) -> Result<LinkUpdate> {
    let existed = match std::fs::symlink_metadata(link) {
        Ok(m) if m.file_type().is_symlink() => true,
        Ok(_) => bail!(
            "{} exists and is not a symlink, so it was left alone; move it away (or run \
             ds4 with -m {}), then run the same command again: the download will be \
             skipped and the link created",
            link.display(),
            target.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(e).with_context(|| format!("cannot stat {}", link.display())),
    };
    let name = link
        .file_name()
        .ok_or_else(|| anyhow!("bad link path {}", link.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = link.with_file_name(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .with_context(|| format!("cannot create the symlink {}", tmp.display()))?;
    if let Err(e) = std::fs::rename(&tmp, link) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot replace {}", link.display()));
    }
    Ok(if existed {
        LinkUpdate::Replaced
    } else {
        LinkUpdate::Created
    })
}

#[cfg(not(unix))]
pub fn update_link(link: &Path, target: &Path) -> Result<LinkUpdate> {
    bail!(
        "symlinks are not supported here: run ds4 with -m {} instead of relying on {}",
        target.display(),
        link.display()
    )
}
