//! Ids of the chat marker tokens, looked up by string (none are hard-coded).

use crate::Tokenizer;

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
pub const DSML: &str = "｜DSML｜";
pub const LATEST_REMINDER: &str = "<｜latest_reminder｜>";

/// Ids of the chat markers. The first seven are required; the rest exist in the official
/// vocabulary but not necessarily in small test vocabularies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: u32,
    pub eos: u32,
    pub user: u32,
    pub assistant: u32,
    pub think_start: u32,
    pub think_end: u32,
    pub dsml: u32,
    pub latest_reminder: Option<u32>,
    /// Quick-instruction task tokens: action, query, authority, domain, title, read_url.
    pub action: Option<u32>,
    pub query: Option<u32>,
    pub authority: Option<u32>,
    pub domain: Option<u32>,
    pub title: Option<u32>,
    pub read_url: Option<u32>,
}

impl SpecialIds {
    pub(crate) fn lookup(t: &Tokenizer) -> Result<SpecialIds, &'static str> {
        let req = |s: &'static str| t.token_to_id(s).ok_or(s);
        let opt = |s: &str| t.token_to_id(s);
        Ok(SpecialIds {
            bos: req(BOS)?,
            eos: req(EOS)?,
            user: req(USER)?,
            assistant: req(ASSISTANT)?,
            think_start: req(THINK_START)?,
            think_end: req(THINK_END)?,
            dsml: req(DSML)?,
            latest_reminder: opt(LATEST_REMINDER),
            action: opt("<｜action｜>"),
            query: opt("<｜query｜>"),
            authority: opt("<｜authority｜>"),
            domain: opt("<｜domain｜>"),
            title: opt("<｜title｜>"),
            read_url: opt("<｜read_url｜>"),
        })
    }
}
