//! Property test against the reference implementation itself: Python `tokenizers` 0.23.3
//! encodes ≥ 10,000 seeded random mixed-script strings (plus every code point of the BMP
//! and the first supplementary planes in a few contexts) in one subprocess, and our ids
//! must be identical.
//!
//! Needs `python3` with `tokenizers==0.23.3` (`.ci/requirements.txt`). Without it the test
//! fails, unless `DS4_SKIP_PYTHON_TESTS=1` is set.

mod common;

#[path = "../../../tests-support/record_skip.rs"]
mod record_skip;
use record_skip::record_skip;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use common::*;

const ORACLE: &str = r#"
import json, sys
import tokenizers
from tokenizers import Tokenizer
if tokenizers.__version__ != "0.23.3":
    sys.exit("tokenizers %s installed, 0.23.3 required" % tokenizers.__version__)
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(line)["text"] for line in sys.stdin]
for enc in tok.encode_batch(texts, add_special_tokens=False):
    sys.stdout.write(json.dumps({"ids": enc.ids}) + "\n")
"#;

/// splitmix64: a fixed, dependency-free generator so the cases never change.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
    fn word(&mut self, v: &[&'static str]) -> &'static str {
        v[self.below(v.len())]
    }
    fn in_range(&mut self, lo: u32, hi: u32) -> char {
        loop {
            let cp = lo + (self.next() % u64::from(hi - lo + 1)) as u32;
            if let Some(c) = char::from_u32(cp) {
                return c;
            }
        }
    }
}

/// Code point ranges of scripts and blocks that exercise different pre-tokenizer rules.
const SCRIPTS: &[(u32, u32)] = &[
    (0x61, 0x7A),       // a-z
    (0x41, 0x5A),       // A-Z
    (0xC0, 0x17F),      // Latin-1 and Extended-A letters
    (0x370, 0x3FF),     // Greek
    (0x400, 0x4FF),     // Cyrillic
    (0x590, 0x5FF),     // Hebrew
    (0x600, 0x6FF),     // Arabic, harakat, Arabic-Indic digits
    (0x900, 0x97F),     // Devanagari
    (0xE00, 0xE7F),     // Thai
    (0x1100, 0x11FF),   // Hangul Jamo
    (0xAC00, 0xD7A3),   // Hangul syllables
    (0x3040, 0x30FF),   // Hiragana, Katakana (pre-tokenizer CJK rule)
    (0x4E00, 0x9FA5),   // CJK inside the rule
    (0x9FA6, 0x9FFF),   // CJK just outside the rule
    (0x3400, 0x4DBF),   // Extension A
    (0x20000, 0x2A6DF), // Extension B
    (0xFF61, 0xFF9F),   // half-width kana
    (0x300, 0x36F),     // combining marks
    (0x1E00, 0x1EFF),   // Vietnamese
    (0x10A0, 0x10FF),   // Georgian
    (0x1200, 0x137F),   // Ethiopic
    (0x0F00, 0x0FFF),   // Tibetan
];

const DIGITS: &[(u32, u32)] = &[
    (0x30, 0x39),
    (0x660, 0x669),
    (0x966, 0x96F),
    (0xE50, 0xE59),
    (0xFF10, 0xFF19),
    (0x2160, 0x2188),
    (0x2460, 0x249B),
    (0xB2, 0xB3),
    (0xBC, 0xBE),
    (0x1D7CE, 0x1D7FF),
];

const SPACES: &[&str] = &[
    " ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", "\u{b}", "\u{c}", "\u{a0}", "\u{2009}",
    "\u{202f}", "\u{3000}", "\u{2028}", "\u{2029}", "\u{85}", "\u{1680}", "\u{180e}", "\u{200b}",
    "\u{feff}", "\u{2000}", "\u{200a}", " \n ", "\t\t", "    ",
];

const PUNCT: &[&str] = &[
    ".", ",", "!", "?", ";", ":", "'", "\"", "(", ")", "[", "]", "{", "}", "<", ">", "/", "\\",
    "-", "_", "=", "+", "*", "&", "^", "%", "$", "#", "@", "~", "`", "|", "...", "—", "–", "«",
    "»", "“", "”", "¿", "¡", "、", "。", "，", "！", "？", "・", "€", "£", "©", "°", "±", "×", "÷",
    "∑", "√", "∞", "→", "★", "♥", "://", "->", "=>", "!=", "#!", "'s", "'t",
];

const EMOJI: &[&str] = &[
    "😀",
    "🎉",
    "👍🏽",
    "👨‍👩‍👧",
    "🇮🇹",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "❤️",
    "1️⃣",
    "☺︎",
    "🤖",
    "\u{200d}",
    "\u{fe0f}",
    "🏻",
];

fn piece(rng: &mut Rng, added: &[String], out: &mut String) {
    let n = 1 + rng.below(8);
    match rng.below(14) {
        0..=3 => {
            let &(lo, hi) = rng.pick(SCRIPTS);
            for _ in 0..n {
                out.push(rng.in_range(lo, hi));
            }
        }
        4 => {
            let &(lo, hi) = rng.pick(DIGITS);
            for _ in 0..n {
                out.push(rng.in_range(lo, hi));
            }
        }
        5 | 6 => out.push_str(rng.word(SPACES)),
        7 | 8 => {
            for _ in 0..1 + rng.below(3) {
                out.push_str(rng.word(PUNCT));
            }
        }
        9 => out.push_str(rng.word(EMOJI)),
        10 => {
            let t = rng.pick(added);
            match rng.below(4) {
                // Near misses: a cut-off marker or ASCII bars instead of fullwidth ones.
                0 => out.push_str(&t.chars().take(t.chars().count() - 1).collect::<String>()),
                1 => out.push_str(&t.replace('｜', "|")),
                _ => out.push_str(t),
            }
        }
        11 => {
            // Controls, private use, noncharacters, anything at all.
            let c = match rng.below(4) {
                0 => rng.in_range(0, 0x1F),
                1 => rng.in_range(0x7F, 0x9F),
                2 => rng.in_range(0xE000, 0xF8FF),
                _ => rng.in_range(0, 0x10FFFF),
            };
            out.push(c);
        }
        _ => {
            let words = [
                "the",
                "Hello",
                "don't",
                "x_y",
                "API",
                "naïve",
                "über",
                "東京",
                "日本語",
                "ありがとう",
            ];
            out.push_str(rng.word(&words));
        }
    }
}

fn random_cases(added: &[String]) -> Vec<String> {
    let mut rng = Rng(0x05EE_D0D5_4DEE_9001);
    (0..12_000)
        .map(|_| {
            let mut s = String::new();
            for _ in 0..1 + rng.below(12) {
                piece(&mut rng, added, &mut s);
            }
            s
        })
        .collect()
}

/// Every code point below U+30000 (the assigned planes that vary between Unicode
/// versions), each between letters, repeated, after a space and before punctuation.
fn code_point_sweep() -> Vec<String> {
    let mut out = Vec::new();
    for block in 0..(0x30000u32 / 512) {
        let mut s = String::new();
        for cp in block * 512..(block + 1) * 512 {
            if let Some(c) = char::from_u32(cp) {
                s.push('a');
                s.push(c);
                s.push(c);
                s.push(' ');
                s.push(c);
                s.push('!');
            }
        }
        out.push(s);
    }
    out
}

fn run_oracle(texts: &[String]) -> Option<Vec<Vec<u32>>> {
    let skip = std::env::var("DS4_SKIP_PYTHON_TESTS").is_ok_and(|v| v == "1");
    let tokenizer = fixture("tokenizer/tokenizer.json");
    let child = Command::new("python3")
        .arg("-c")
        .arg(ORACLE)
        .arg(&tokenizer)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if skip => {
            record_skip(&format!("python3 not runnable: {e}"));
            return None;
        }
        Err(e) => panic!("python3 not runnable ({e}); install it or set DS4_SKIP_PYTHON_TESTS=1"),
    };
    let mut stdin = child.stdin.take().expect("stdin");
    let lines: Vec<String> = texts
        .iter()
        .map(|t| serde_json::json!({ "text": t }).to_string())
        .collect();
    let writer = std::thread::spawn(move || {
        for l in lines {
            if writeln!(stdin, "{l}").is_err() {
                break;
            }
        }
    });
    let stdout = child.stdout.take().expect("stdout");
    let ids: Vec<Vec<u32>> = BufReader::new(stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(&l.expect("line")).expect("json");
            ids_of(&v["ids"])
        })
        .collect();
    let _ = writer.join();
    let out = child.wait_with_output().expect("python3 exit");
    if !out.status.success() || ids.len() != texts.len() {
        let err = String::from_utf8_lossy(&out.stderr);
        if skip {
            record_skip(&format!("python oracle failed: {}", err.trim()));
            return None;
        }
        panic!(
            "python oracle failed (pip install tokenizers==0.23.3, or set DS4_SKIP_PYTHON_TESTS=1): {err}"
        );
    }
    Some(ids)
}

#[test]
fn random_strings_match_python_tokenizers() {
    let json: serde_json::Value =
        serde_json::from_slice(&read_fixture("tokenizer/tokenizer.json")).unwrap();
    let added: Vec<String> = json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["content"].as_str().unwrap().to_string())
        .collect();
    let mut texts = random_cases(&added);
    let n_random = texts.len();
    texts.extend(code_point_sweep());
    let Some(want) = run_oracle(&texts) else {
        return;
    };
    let tok = official();
    let mut failures = Vec::new();
    for (k, (text, want)) in texts.iter().zip(&want).enumerate() {
        let got = tok.encode(text);
        if got != *want {
            let d = first_diff(&got, want);
            failures.push(format!(
                "case {k}{}: first diff at #{d}: got {:?} want {:?}; text {:?}",
                if k >= n_random { " (sweep)" } else { "" },
                &got[d..(d + 4).min(got.len())],
                &want[d..(d + 4).min(want.len())],
                text.chars().take(60).collect::<String>()
            ));
        } else if tok.decode(&got, false) != *text {
            failures.push(format!("case {k}: decode(encode(text)) != text"));
        }
    }
    assert!(n_random >= 10_000);
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        texts.len(),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
