//! Session payloads (model-spec.md §6): the same little-endian layout on every
//! backend.
//!
//! ```text
//! u32 × 13: "DSV4" (0x34565344), version 1, ctx, prefill chunk, raw cap, raw window,
//!           comp cap, token count, n_layer, head_dim, idx_head_dim, vocab,
//!           R = live raw rows = min(raw cap, tokens)
//! u32 tokens[count]; f32 logits[vocab]; u32 n_comp[n_layer]; u32 n_index[n_layer]
//! per layer: R raw rows (oldest first);
//!            ratio ≠ 0: n_comp rows, attn_state_kv, attn_state_score;
//!            indexer:   n_index rows, index_state_kv, index_state_score
//! ```
//! Rows and states are f32 (f16-exact values in the fast mode).

use std::io::{Read, Write};

use crate::error::{EngineError, Result};
use crate::kv::{Frontier, KvCache};
use crate::session::Session;

pub const MAGIC: u32 = 0x3456_5344;
pub const VERSION: u32 = 1;

fn put_u32(w: &mut impl Write, v: u32) -> Result<()> {
    w.write_all(&v.to_le_bytes())?;
    Ok(())
}

fn put_f32s(w: &mut impl Write, v: &[f32]) -> Result<()> {
    let mut buf = Vec::with_capacity(v.len() * 4);
    for x in v {
        buf.extend_from_slice(&x.to_le_bytes());
    }
    w.write_all(&buf)?;
    Ok(())
}

fn get_u32(r: &mut impl Read) -> Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn get_f32s(r: &mut impl Read, n: usize) -> Result<Vec<f32>> {
    let mut buf = vec![0u8; n * 4];
    r.read_exact(&mut buf)?;
    Ok(buf
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::Payload(msg.into())
}

fn to_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| bad(format!("{what} {v} does not fit u32")))
}

/// The compressed capacity ds4 allocates: ctx / (smallest ratio) + 2.
fn comp_cap(ratios: &[usize], ctx: usize) -> usize {
    ratios
        .iter()
        .filter(|&&r| r != 0)
        .min()
        .map_or(0, |&r| ctx / r + 2)
}

impl Session {
    /// Writes the session state in the `DSV4` payload layout.
    pub fn save_payload(&self, w: &mut impl Write) -> Result<()> {
        let cfg = self.model_ref().config();
        let kv = self.backend_ref().export_state()?;
        let raw_cap = kv.layers.first().map_or(0, |l| l.raw_cap);
        let n_raw = kv.layers.first().map_or(0, |l| l.n_raw());
        let mut logits = self.logits().to_vec();
        logits.resize(cfg.vocab, 0.0);
        let header = [
            MAGIC,
            VERSION,
            to_u32(kv.ctx, "ctx")?,
            to_u32(self.prefill_chunk(), "prefill chunk")?,
            to_u32(raw_cap, "raw cap")?,
            to_u32(cfg.window, "window")?,
            to_u32(comp_cap(&cfg.compress_ratios, kv.ctx), "comp cap")?,
            to_u32(self.n_tokens(), "token count")?,
            to_u32(cfg.n_layer, "n_layer")?,
            to_u32(cfg.head_dim, "head_dim")?,
            to_u32(cfg.idx_head_dim, "idx_head_dim")?,
            to_u32(cfg.vocab, "vocab")?,
            to_u32(n_raw, "raw rows")?,
        ];
        let mut out = Vec::new();
        for v in header {
            put_u32(&mut out, v)?;
        }
        for &t in self.tokens() {
            put_u32(&mut out, t)?;
        }
        put_f32s(&mut out, &logits)?;
        for l in &kv.layers {
            put_u32(&mut out, to_u32(l.n_comp(), "n_comp")?)?;
        }
        for l in &kv.layers {
            put_u32(&mut out, to_u32(l.n_index(), "n_index")?)?;
        }
        for l in &kv.layers {
            put_f32s(&mut out, &l.raw_rows())?;
            if let Some(st) = &l.comp_state {
                put_f32s(&mut out, &l.comp)?;
                put_f32s(&mut out, &st.kv)?;
                put_f32s(&mut out, &st.score)?;
            }
            if let Some(st) = &l.index_state {
                put_f32s(&mut out, &l.index)?;
                put_f32s(&mut out, &st.kv)?;
                put_f32s(&mut out, &st.score)?;
            }
        }
        w.write_all(&out)?;
        Ok(())
    }

    /// Replaces the session state with a payload written by [`Session::save_payload`]
    /// (on any backend). The payload's model dimensions must match; its token count
    /// must fit this session's context.
    pub fn load_payload(&mut self, r: &mut impl Read) -> Result<()> {
        let cfg = self.model_ref().config().clone();
        let mut h = [0u32; 13];
        for v in h.iter_mut() {
            *v = get_u32(r)?;
        }
        if h[0] != MAGIC {
            return Err(bad(format!("magic {:#x}, expected {MAGIC:#x}", h[0])));
        }
        if h[1] != VERSION {
            return Err(bad(format!("version {}, expected {VERSION}", h[1])));
        }
        let want = [
            (8, cfg.n_layer, "n_layer"),
            (9, cfg.head_dim, "head_dim"),
            (10, cfg.idx_head_dim, "idx_head_dim"),
            (11, cfg.vocab, "vocab"),
            (5, cfg.window, "window"),
        ];
        for (i, v, what) in want {
            if h[i] as usize != v {
                return Err(bad(format!(
                    "{what} {} does not match the model ({v})",
                    h[i]
                )));
            }
        }
        let count = h[7] as usize;
        let n_raw = h[12] as usize;
        let ctx = self.ctx();
        if count > ctx {
            return Err(bad(format!("{count} tokens do not fit a context of {ctx}")));
        }
        let mut kv = KvCache::new(&cfg, ctx);
        kv.n_tokens = count;
        let expect_raw = count.min(kv.layers.first().map_or(0, |l| l.raw_cap));
        if n_raw != expect_raw {
            return Err(bad(format!(
                "{n_raw} raw rows; {count} tokens in a context of {ctx} keep {expect_raw}"
            )));
        }
        let mut tokens = Vec::with_capacity(count);
        for _ in 0..count {
            let t = get_u32(r)?;
            if t as usize >= cfg.vocab {
                return Err(bad(format!("token {t} outside the vocabulary")));
            }
            tokens.push(t);
        }
        let logits = get_f32s(r, cfg.vocab)?;
        let mut n_comp = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            n_comp.push(get_u32(r)? as usize);
        }
        let mut n_index = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            n_index.push(get_u32(r)? as usize);
        }
        for (il, l) in kv.layers.iter_mut().enumerate() {
            let ratio = l.ratio;
            let rows = get_f32s(r, n_raw * cfg.head_dim)?;
            l.set_raw(&rows);
            let check = |n: usize, what: &str| -> Result<()> {
                let want = count.checked_div(ratio).unwrap_or(0);
                if n != want {
                    return Err(bad(format!(
                        "layer {il}: {n} {what} rows, {count} tokens at ratio {ratio} give {want}"
                    )));
                }
                Ok(())
            };
            check(n_comp[il], "compressed")?;
            if let Some(st) = l.comp_state.as_mut() {
                l.comp = get_f32s(r, n_comp[il] * cfg.head_dim)?;
                read_frontier(r, st)?;
            }
            if l.index_state.is_some() {
                check(n_index[il], "index")?;
            } else if n_index[il] != 0 {
                return Err(bad(format!(
                    "layer {il} has no indexer but {} index rows",
                    n_index[il]
                )));
            }
            if let Some(st) = l.index_state.as_mut() {
                l.index = get_f32s(r, n_index[il] * cfg.idx_head_dim)?;
                read_frontier(r, st)?;
            }
        }
        let (backend, tok, lg) = self.parts_mut();
        backend.import_state(kv)?;
        *tok = tokens;
        *lg = if count == 0 { Vec::new() } else { logits };
        Ok(())
    }
}

fn read_frontier(r: &mut impl Read, st: &mut Frontier) -> Result<()> {
    st.kv = get_f32s(r, st.rows * st.width)?;
    st.score = get_f32s(r, st.rows * st.width)?;
    Ok(())
}
