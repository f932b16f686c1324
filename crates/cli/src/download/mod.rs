//! Resumable download of the published DeepSeek V4 Flash GGUF files from Hugging Face
//! (`ds4-tool download`), the Rust counterpart of the reference `download_model.sh`.
//!
//! The files are 80-150 GB, so every design choice favours surviving a flaky network:
//! bytes go to `<file>.part`, each attempt resumes with an HTTP `Range` from the size on
//! disk, transient failures are retried with backoff (and an attempt that made progress
//! resets the retry budget), and only a complete file is renamed to its final name, so a
//! final name on disk always means "finished".

mod http;
mod link;
mod progress;
mod range;
mod token;
mod transfer;

pub use link::{update_link, LinkUpdate};
pub use range::{parse_content_range, ContentRange};
pub use token::{hf_token_file, pick_token, resolve_token};
pub use transfer::{download, part_path, remove_if_empty, DownloadOptions, Outcome};

/// The Hugging Face model repository holding the published files.
pub const HF_REPO: &str = "antirez/deepseek-v4-gguf";
/// Where files are fetched from unless `--base-url` / `DS4_DOWNLOAD_BASE_URL` says otherwise.
pub const DEFAULT_BASE_URL: &str = "https://huggingface.co";
/// The link the `ds4` programs open by default; points at the chosen main model.
pub const MODEL_LINK: &str = "ds4flash.gguf";

/// One downloadable file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Name on the command line.
    pub name: &'static str,
    /// File name in the Hugging Face repository.
    pub file: &'static str,
    /// Approximate size on disk, for the help text.
    pub size: &'static str,
    /// A complete main model (then `ds4flash.gguf` is pointed at it); false for the MTP
    /// component, which is only an add-on to a main model.
    pub main_model: bool,
    /// One-line description for the help text.
    pub about: &'static str,
}

/// Every target, in the order the help lists them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "q2-imatrix",
        file: "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",
        size: "~81 GB",
        main_model: true,
        about: "2-bit routed experts; recommended for 96 and 128 GB RAM machines",
    },
    Target {
        name: "q2-q4-imatrix",
        file: "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-fixed.gguf",
        size: "~98 GB",
        main_model: true,
        about: "2-bit routed experts, 4-bit in the last 6 layers",
    },
    Target {
        name: "q4-imatrix",
        file: "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf",
        size: "~153 GB",
        main_model: true,
        about: "4-bit routed experts; for machines with 256 GB RAM or more",
    },
    Target {
        name: "q2",
        file: "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf",
        size: "~81 GB",
        main_model: true,
        about: "like q2-imatrix, quantised without an importance matrix",
    },
    Target {
        name: "q4",
        file: "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf",
        size: "~153 GB",
        main_model: true,
        about: "like q4-imatrix, quantised without an importance matrix",
    },
    Target {
        name: "mtp",
        file: "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf",
        size: "~3.5 GB",
        main_model: false,
        about: "optional speculative-decoding component; enable with --mtp (ds4flash.gguf is left alone)",
    },
];

/// Looks a target up by its command-line name.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// `BASE/antirez/deepseek-v4-gguf/resolve/main/FILE`. The published names are plain ASCII
/// without reserved characters, so no percent-encoding is needed.
pub fn file_url(base_url: &str, file: &str) -> String {
    format!(
        "{}/{HF_REPO}/resolve/main/{file}",
        base_url.trim_end_matches('/')
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_unique_and_point_at_gguf_files() {
        for (i, t) in TARGETS.iter().enumerate() {
            assert!(t.file.ends_with(".gguf"), "{}", t.file);
            assert!(TARGETS[i + 1..]
                .iter()
                .all(|u| u.name != t.name && u.file != t.file));
            assert_eq!(target(t.name), Some(t));
        }
        assert!(!target("mtp").unwrap().main_model);
        assert!(target("q2-imatrix").unwrap().main_model);
        assert_eq!(target("q8"), None);
    }

    #[test]
    fn url_layout_matches_hugging_face() {
        assert_eq!(
            file_url("https://huggingface.co/", "a.gguf"),
            "https://huggingface.co/antirez/deepseek-v4-gguf/resolve/main/a.gguf"
        );
        assert_eq!(
            file_url("http://127.0.0.1:9", "b.gguf"),
            "http://127.0.0.1:9/antirez/deepseek-v4-gguf/resolve/main/b.gguf"
        );
    }
}
