//! The Hugging Face token: from the command line, `HF_TOKEN`, or the file
//! `huggingface-cli login` writes.

use std::path::PathBuf;

/// The token precedence of `download_model.sh`: the explicit option, then a non-empty
/// `HF_TOKEN`, then the token file `huggingface-cli login` writes. Kept free of any
/// environment access so it can be tested directly.
pub fn pick_token(
    explicit: Option<&str>,
    env_token: Option<&str>,
    token_file: Option<&str>,
) -> Option<String> {
    [explicit, env_token, token_file]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|t| !t.is_empty())
        .map(str::to_owned)
}

/// Where `huggingface-cli login` stores the token: `$HF_HOME/token`, by default
/// `~/.cache/huggingface/token`.
pub fn hf_token_file() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("HF_HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(home).join("token"));
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty())?;
    Some(PathBuf::from(home).join(".cache/huggingface/token"))
}

/// [`pick_token`] fed from the real environment.
pub fn resolve_token(explicit: Option<&str>) -> Option<String> {
    let env_token = std::env::var("HF_TOKEN").ok();
    let file_token = hf_token_file().and_then(|p| std::fs::read_to_string(p).ok());
    pick_token(explicit, env_token.as_deref(), file_token.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_precedence() {
        assert_eq!(
            pick_token(Some("a"), Some("b"), Some("c")).as_deref(),
            Some("a")
        );
        assert_eq!(pick_token(None, Some("b"), Some("c")).as_deref(), Some("b"));
        assert_eq!(
            pick_token(None, Some(""), Some("c\n")).as_deref(),
            Some("c")
        );
        assert_eq!(pick_token(None, None, Some("  \n")), None);
        assert_eq!(pick_token(None, None, None), None);
    }
}
