//! Fuzzes the streaming DSML parser (and the strict parser on the same text).
//!
//! Input: byte 0 picks the options, byte 1 seeds the piece lengths, the rest is the
//! completion text (lossy UTF-8). Checked: no panic; the outcome does not depend on how the
//! text is cut into pieces; the streamed reasoning/content pieces add up to the outcome;
//! every completed call's argument deltas add up to its arguments.
#![no_main]

use ds4_tokenizer::chat::ThinkingMode;
use ds4_tokenizer::dsml;
use ds4_tokenizer::dsml_stream::{StreamEvent, StreamOptions, StreamParser};
use libfuzzer_sys::fuzz_target;

#[path = "../../tests/common/streamed.rs"]
mod streamed;
use streamed::Streamed;

fn run(
    text: &str,
    opts: StreamOptions,
    cuts: &[usize],
) -> (Vec<StreamEvent>, ds4_tokenizer::dsml_stream::StreamOutcome) {
    let mut p = StreamParser::new(opts);
    let mut ev = Vec::new();
    let mut start = 0;
    for &c in cuts {
        ev.extend(p.push(&text[start..c]));
        start = c;
    }
    ev.extend(p.push(&text[start..]));
    let (last, out) = p.finish();
    ev.extend(last);
    (ev, out)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let opts = StreamOptions {
        thinking: data[0] & 1 != 0,
        tools: data[0] & 2 == 0,
        accept_plain_xml: data[0] & 4 == 0,
    };
    let text = String::from_utf8_lossy(&data[2..]).into_owned();

    let _ = dsml::parse_completion(&text, ThinkingMode::Thinking);
    let _ = dsml::parse_completion(&text, ThinkingMode::Chat);

    let (_, whole) = run(&text, opts, &[]);
    // Cut points on character boundaries, spaced by a seeded step.
    let mut cuts = Vec::new();
    let mut step = 1 + (data[1] as usize % 7);
    let mut i = 0;
    while i < text.len() {
        i += step;
        while i < text.len() && !text.is_char_boundary(i) {
            i += 1;
        }
        if i < text.len() {
            cuts.push(i);
        }
        step = 1 + (step * 5 + 3) % 11;
    }
    let (events, pieces) = run(&text, opts, &cuts);
    assert_eq!(whole, pieces, "outcome depends on the split");

    let Streamed {
        reasoning,
        content,
        args,
    } = Streamed::of(&events);
    assert_eq!(content, pieces.content);
    assert_eq!(
        Some(reasoning),
        pieces.reasoning.clone().or(Some(String::new()))
    );
    if !pieces.malformed {
        let complete: Vec<&String> = args.iter().take(pieces.tool_calls.len()).collect();
        for (call, streamed) in pieces.tool_calls.iter().zip(complete) {
            assert_eq!(&call.arguments, streamed);
        }
    }
});
