//! Any byte string sent to any generation endpoint must either become a prompt or be
//! rejected with a 4xx/5xx error; never a panic. The first byte picks the API (chat
//! completions, completions, responses, Anthropic messages), the rest is the body, which
//! goes through JSON parsing, rendering and tokenizing with the tiny test tokenizer.
#![no_main]

use std::sync::{Arc, OnceLock};

use ds4_server::api::{prepare_request, Endpoint};
use ds4_server::config::ServerConfig;
use ds4_server::worker::Shared;
use ds4_tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

/// Small enough that long prompts hit the context check too.
const CTX: usize = 4096;

fn shared() -> &'static Arc<Shared> {
    static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();
    SHARED.get_or_init(|| {
        let json = include_bytes!("../../fixtures/tiny/tokenizer.json");
        let tok = Tokenizer::from_tokenizer_json(json).expect("tiny tokenizer");
        Shared::new(ServerConfig::for_tests(CTX), Arc::new(tok))
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let ep = Endpoint::ALL[pick as usize % Endpoint::ALL.len()];
    match prepare_request(shared(), ep, body) {
        Ok(p) => {
            assert!(!p.prompt_tokens.is_empty(), "a prompt without tokens");
            assert!(p.prompt_tokens.len() < CTX, "the context check let a long prompt by");
            // Client text never becomes a control token (issue #18 item 13): the tokens
            // spell the prompt, and no added token starts inside a client-text range.
            let tok = &shared().tok;
            assert_eq!(tok.decode(&p.prompt_tokens, false), p.prompt_text);
            let mut at = 0;
            for &t in &p.prompt_tokens {
                if tok.is_added(t) {
                    assert!(
                        !p.prompt_plain.iter().any(|r| r.contains(&at)),
                        "control token {t} at byte {at} inside client text"
                    );
                }
                at += tok.token_bytes(t).len();
            }
        }
        Err(e) => assert!((400..600).contains(&e.status), "status {}", e.status),
    }
});
