//! Diagnostic modes: `--dump-tokens`, `--dump-logprobs`, `--perplexity-file`, `--inspect`.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use ds4_engine::argmax;
use ds4_tokenizer::Tokenizer;

use crate::args::Args;
use crate::engine::{check_model_exists, Engine};
use crate::generate::{budget, prefill};

/// `--dump-tokens`: the rendered-chat tokenizer on the text exactly as written (only
/// the vocabulary is loaded). Prints `[id, id, …]`, then `%6d  <vocab string>` lines.
pub fn dump_tokens(model: &Path, text: &str) -> Result<()> {
    check_model_exists(model)?;
    let tok = ds4_engine::load_tokenizer(model)
        .with_context(|| format!("tokenizer of {}", model.display()))?;
    let ids = tok.encode(text);
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    write_token_dump(&mut w, &tok, &ids)?;
    w.flush()?;
    Ok(())
}

pub fn write_token_dump(w: &mut impl Write, tok: &Tokenizer, ids: &[u32]) -> std::io::Result<()> {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    writeln!(w, "[{}]", list.join(", "))?;
    for &id in ids {
        if let Some(s) = tok.id_to_token(id) {
            writeln!(w, "{id:6}  {s}")?;
        }
    }
    Ok(())
}

/// A JSON string as the reference writes it: `\"`, `\\`, `\n`, `\r`, `\t`, other
/// controls as `\u00XX`; when the bytes are not valid UTF-8, every byte ≥ 0x80 is
/// escaped as `\u00XX` too (the `bytes` array is authoritative).
fn json_string(out: &mut String, bytes: &[u8]) {
    let valid = std::str::from_utf8(bytes).is_ok();
    out.push('"');
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0..0x20 => out.push_str(&format!("\\u{c:04x}")),
            0x80.. if !valid => out.push_str(&format!("\\u{c:04x}")),
            0x80.. => {
                // Valid UTF-8: copy the whole character.
                let len = match c {
                    0xf0.. => 4,
                    0xe0.. => 3,
                    _ => 2,
                };
                out.push_str(std::str::from_utf8(&bytes[i..i + len]).unwrap_or("\u{fffd}"));
                i += len;
                continue;
            }
            _ => out.push(c as char),
        }
        i += 1;
    }
    out.push('"');
}

fn json_token(out: &mut String, tok: &Tokenizer, id: u32) {
    let bytes = tok.token_bytes(id);
    out.push_str(&format!("{{\"id\":{id},\"text\":"));
    json_string(out, bytes);
    let list: Vec<String> = bytes.iter().map(u8::to_string).collect();
    out.push_str(&format!(",\"bytes\":[{}]}}", list.join(",")));
}

/// A finite float as JSON (shortest round-trip form), `null` otherwise.
fn json_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".into()
    }
}

/// The `k` largest logits with their log-softmax values, best first.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32, f64)> {
    let mx = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = mx
        + logits
            .iter()
            .filter(|v| v.is_finite())
            .map(|&v| (v as f64 - mx).exp())
            .sum::<f64>()
            .ln();
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    // The k best by selection, then only they are sorted (the whole vocabulary took
    // milliseconds a step).
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx.into_iter()
        .map(|i| (i, logits[i as usize], logits[i as usize] as f64 - lse))
        .collect()
}

/// `--dump-logprobs FILE`: up to `-n` greedy steps (the EOS step included), each with
/// its top-k alternatives, in the reference's JSON layout.
pub fn dump_logprobs(engine: &Engine, args: &Args, prompt: &str, path: &Path) -> Result<()> {
    let (_, tokens) = crate::oneshot::fitting_prompt(engine, args, prompt)?;
    let sp = engine.specials();
    let mut session = engine.session(args.ctx)?;
    prefill(&mut session, &tokens, None)?;
    let k = args.logprobs_top_k;
    let mut s = format!(
        "{{\n  \"source\":\"ds4\",\n  \"prompt_tokens\":{},\n  \"ctx\":{},\n  \"top_k\":{k},\n  \"steps\":[\n",
        tokens.len(),
        args.ctx
    );
    let max = budget(args.tokens, args.ctx, session.n_tokens());
    for step in 0..max {
        let logits = session.logits();
        let token = argmax(logits);
        if step > 0 {
            s.push_str(",\n");
        }
        s.push_str(&format!("    {{\"step\":{step},\"selected\":"));
        json_token(&mut s, &engine.tok, token);
        s.push_str(",\"top_logprobs\":[");
        for (i, (id, logit, lp)) in top_logprobs(logits, k).into_iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str("{\"token\":");
            json_token(&mut s, &engine.tok, id);
            s.push_str(&format!(
                ",\"logit\":{},\"logprob\":{}}}",
                json_num(logit as f64),
                json_num(lp)
            ));
        }
        s.push_str("]}");
        if token == sp.eos {
            break;
        }
        session
            .decode(token)
            .with_context(|| format!("decode failed while dumping logprobs (step {step})"))?;
    }
    s.push_str("\n  ]\n}\n");
    std::fs::write(path, s)
        .with_context(|| format!("cannot write --dump-logprobs file {}", path.display()))?;
    Ok(())
}

/// Context tokens before scoring starts (the reference's fixed prefix).
const PPL_PREFIX: usize = 32;

/// `--perplexity-file FILE`: plain-text tokens, 32 of context, then teacher-forced
/// scoring of up to `-n` (and ctx − 32) tokens. Prints
/// `tokens=N scored=M nll=… avg_nll=… ppl=…` on stdout.
pub fn perplexity(engine: &Engine, args: &Args, path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --perplexity-file {}", path.display()))?;
    let tokens = engine.tok.encode_plain(&text);
    if tokens.len() <= PPL_PREFIX {
        bail!("--perplexity-file needs more than {PPL_PREFIX} tokens");
    }
    let scored = (tokens.len() - PPL_PREFIX)
        .min(args.tokens)
        .min(args.ctx.saturating_sub(PPL_PREFIX));
    if scored == 0 {
        bail!("context too small for perplexity scoring");
    }
    let mut session = engine.session(args.ctx)?;
    session
        .prefill(&tokens[..PPL_PREFIX])
        .context("perplexity: the context prefix failed")?;
    let vocab = session.vocab();
    let mut nll = 0.0f64;
    let logprob = |row: &[f32], t: u32| -> f64 {
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z: f64 = row.iter().map(|&v| (v as f64 - mx).exp()).sum();
        row[t as usize] as f64 - mx - z.ln()
    };
    nll -= logprob(session.logits(), tokens[PPL_PREFIX]);
    // The logits after each scored token (but the last) predict the next one; run
    // them in chunks, which gives the same values as one token at a time.
    let feed = &tokens[PPL_PREFIX..PPL_PREFIX + scored - 1];
    let mut done = 1;
    for chunk in feed.chunks(256) {
        let rows = session.prefill_all_logits(chunk)?;
        for (r, row) in rows.chunks_exact(vocab).enumerate() {
            let target = tokens[PPL_PREFIX + done - 1 + r + 1];
            nll -= logprob(row, target);
        }
        done += chunk.len();
        eprint!("ds4: perplexity scored {done}/{scored}\r");
    }
    eprintln!();
    let avg = nll / scored as f64;
    println!(
        "tokens={} scored={scored} nll={nll:.9} avg_nll={avg:.9} ppl={:.9}",
        tokens.len(),
        avg.exp()
    );
    Ok(())
}

/// `--inspect`: what the model is and how it will run.
pub fn inspect(engine: &Engine, args: &Args) -> Result<()> {
    let info = engine.info();
    let c = &info.hparams;
    println!("model: {}", args.model.display());
    if let Some(name) = &c.name {
        println!("name: {name}");
    }
    println!(
        "file: {} bytes, {} tensors, {:.2} GiB of tensor data",
        info.file_bytes,
        info.n_tensors,
        info.tensor_bytes as f64 / (1u64 << 30) as f64
    );
    println!(
        "layers: {} (compress ratios {:?})",
        c.n_layer, c.compress_ratios
    );
    println!(
        "n_embd {}, vocab {}, heads {} × {}, q_lora {}, o_lora {} × {} groups",
        c.n_embd, c.vocab, c.n_head, c.head_dim, c.q_lora_rank, c.o_lora_rank, c.o_groups
    );
    println!(
        "experts: {} routed ({} used, width {}), {} shared, {} hash layers",
        c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_expert_shared, c.n_hash_layer
    );
    if let Some(q) = info.routed_quant {
        println!("routed expert quantisation: {q}");
    }
    println!(
        "window {}, indexer {} heads × {} (top {}), hyper-connections {}",
        c.window, c.idx_heads, c.idx_head_dim, c.idx_topk, c.n_hc
    );
    if let Some(n) = c.context_length {
        println!("trained context: {n}");
    }
    if info.profile_deviations.is_empty() {
        println!("profile: DeepSeek V4 Flash");
    } else {
        println!(
            "profile: differs from DeepSeek V4 Flash in {} hyperparameters",
            info.profile_deviations.len()
        );
    }
    let sp = engine.specials();
    println!(
        "chat markers: bos {} eos {} user {} assistant {} think {}/{}",
        sp.bos, sp.eos, sp.user, sp.assistant, sp.think_start, sp.think_end
    );
    println!(
        "backend: {}, numerics: {:?}, ctx: {}",
        engine.backend_name(),
        engine.numerics(),
        args.ctx
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_like_the_reference() {
        let mut s = String::new();
        json_string(&mut s, b"a\"b\\\n\x01\xc3\xa9");
        assert_eq!(s, "\"a\\\"b\\\\\\n\\u0001é\"");
        let mut s = String::new();
        json_string(&mut s, b"x\xc3");
        assert_eq!(s, "\"x\\u00c3\"");
    }

    #[test]
    fn top_logprobs_select_what_a_full_sort_keeps() {
        // Coarse values (many ties) and a NaN / -inf: the k best, ties by lower id.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut v: Vec<f32> = (0..5000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 40) as f32 / 4.0
            })
            .collect();
        v[10] = f32::NAN;
        v[11] = f32::NEG_INFINITY;
        let mut all: Vec<u32> = (0..5000u32)
            .filter(|&i| v[i as usize].is_finite())
            .collect();
        all.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b)));
        for k in [0usize, 1, 7, 50, 4998, 6000] {
            let got: Vec<u32> = top_logprobs(&v, k).iter().map(|t| t.0).collect();
            assert_eq!(got, all[..k.min(all.len())], "k {k}");
        }
    }

    #[test]
    fn top_logprobs_are_sorted_and_normalised() {
        let t = top_logprobs(&[0.0, 2.0, 1.0, 2.0], 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let total: f64 = top_logprobs(&[0.0, 2.0, 1.0, 2.0], 4)
            .iter()
            .map(|x| x.2.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-12);
    }
}
