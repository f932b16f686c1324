//! DeepSeek V4 tokenizer, chat encoding and DSML.
//!
//! * [`Tokenizer`]: byte-level BPE, byte-exact with Hugging Face `tokenizers` on the
//!   official `tokenizer.json` (added tokens matched inside text, the official
//!   pre-tokenizer for all of Unicode), plus decoding and a streaming decoder.
//! * [`MarkedText`] and [`Tokenizer::encode_marked`]: prompts whose client text never
//!   becomes a control token.
//! * [`chat`]: the official `encoding_dsv4.py` prompt renderer.
//! * [`dsml`]: tool schemas and tool calls in DSML, the strict completion parser and an
//!   incremental parser for streaming.

mod added;
mod bpe;
pub mod chat;
mod decode;
pub mod dsml;
pub mod dsml_stream;
mod error;
mod marked;
mod pretokenize;
pub mod pyjson;
mod special;
mod tokenizer;
mod unicode_tables;
mod vocab;

pub use decode::StreamDecoder;
pub use error::{ChatError, ParseError, TokenizerError};
pub use marked::{clip_ranges, clip_ranges_to, MarkedText};
pub use special::SpecialIds;
pub use tokenizer::Tokenizer;
pub use vocab::token_type;

/// Marker strings of the chat format.
pub mod markers {
    pub use crate::special::{
        ASSISTANT, BOS, DSML, EOS, LATEST_REMINDER, THINK_END, THINK_START, USER,
    };
}
