//! The MTP draft block (architecture.md §2.5 and §7) on the CPU.
//!
//! The published MTP GGUF holds one extra transformer block, `mtp.0.*`. Given a token
//! `x` at position `p` and the main model's final hyper-connection state `G` at `p`
//! (`[n_hc][n_embd]`, before the output head collapses the streams; see
//! [`crate::dev::CpuBackend::forward_with_hc`]), it computes
//!
//! ```text
//! e     = e_proj · rmsnorm(token_embd[x], enorm)
//! g_s   = h_proj · rmsnorm(G_s, hnorm)            for each stream s
//! Hin_s = e + g_s
//! Hout  = Layer(mtp.0, Hin, p)                    ratio 0, top-k routing with bias
//! logits = head(Hout; mtp.0.hc_head_*, mtp.0.norm, main output.weight)
//! ```
//!
//! `Layer` is the main model's own CPU layer code ([`crate::cpu::forward::layer_forward`])
//! with the block bound as a [`crate::weights::LayerWeights`]. The block keeps its own raw
//! KV ring ([`MtpState`], at most `window` rows) that is never part of a session's
//! [`crate::kv::KvCache`], its payloads or snapshots. `Hout` is returned with the logits
//! so drafts can be chained (the next draft takes it as its `G`).

pub mod layout;
pub(crate) mod ring;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use ds4_gguf::GgufFile;

use crate::backend::check_vocab;
use crate::cpu::forward::{head, layer_forward};
use crate::error::{EngineError, Result};
use crate::kv::LayerCache;
use crate::model::Model;
use crate::ops::linear::{matmul_f32, Numerics};
use crate::ops::norm::rmsnorm_rows_inplace;
use crate::ops::rope::Rope;
use weights::{mtp_layer_index, MtpWeights};

/// A loaded MTP block bound to the main model it drafts for. Cloning is cheap.
#[derive(Clone)]
pub struct Mtp {
    inner: Arc<MtpInner>,
    numerics: Numerics,
}

struct MtpInner {
    main: Model,
    weights: MtpWeights,
    /// RoPE of a ratio-0 layer: base `rope_freq_base`, no YaRN.
    rope: Rope,
    file: Arc<GgufFile>,
}

impl std::fmt::Debug for Mtp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mtp")
            .field("main", &self.inner.main)
            .field("numerics", &self.numerics)
            .finish()
    }
}

/// The block's own state: its raw KV ring (ratio-0 layer, `window` rows at most).
#[derive(Clone, Debug, PartialEq)]
pub struct MtpState {
    cache: LayerCache,
}

impl MtpState {
    /// Rows in the raw ring (at most the window).
    pub fn n_raw(&self) -> usize {
        self.cache.n_raw()
    }

    /// Capacity of the raw ring.
    pub fn capacity(&self) -> usize {
        self.cache.raw_cap
    }

    /// Empties the ring.
    pub fn reset(&mut self) {
        self.cache.set_raw(&[]);
    }

    /// Raw row `i` of the ring in logical order (0 = oldest).
    pub fn raw_row(&self, i: usize) -> &[f32] {
        self.cache.raw_row(i)
    }

    pub(crate) fn layer(&mut self) -> &mut LayerCache {
        &mut self.cache
    }

    pub(crate) fn layer_ref(&self) -> &LayerCache {
        &self.cache
    }
}

/// One draft step's result.
#[derive(Clone, Debug, PartialEq)]
pub struct MtpDraft {
    /// `[vocab]` logits of the drafted next token.
    pub logits: Vec<f32>,
    /// The block's output HC state `[n_hc][n_embd]`: the `G` of a chained draft.
    pub hc: Vec<f32>,
}

impl Mtp {
    /// Maps the MTP GGUF at `path` and binds it against `main`'s config.
    pub fn load(main: &Model, path: impl AsRef<Path>) -> Result<Mtp> {
        let path = path.as_ref();
        let file = GgufFile::open(path).map_err(|source| EngineError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Mtp::from_gguf(main, Arc::new(file))
    }

    /// Binds an open MTP GGUF against `main`'s config (see [`MtpWeights::bind`]).
    pub fn from_gguf(main: &Model, file: Arc<GgufFile>) -> Result<Mtp> {
        let cfg = main.config();
        let weights = MtpWeights::bind(cfg, &file)?;
        Ok(Mtp {
            inner: Arc::new(MtpInner {
                main: main.clone(),
                weights,
                rope: Rope::new(cfg.rope_dim, cfg.rope_freq_base, None),
                file,
            }),
            numerics: main.numerics(),
        })
    }

    /// The same block in another numeric mode (default: the main model's).
    pub fn with_numerics(mut self, numerics: Numerics) -> Mtp {
        self.numerics = numerics;
        self
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn weights(&self) -> &MtpWeights {
        &self.inner.weights
    }

    pub fn main(&self) -> &Model {
        &self.inner.main
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.inner.file
    }

    /// An empty state (raw ring of `window` rows).
    pub fn new_state(&self) -> MtpState {
        let cfg = self.inner.main.config();
        // The ring of a ratio-0 layer, whatever the ratio of the main layer `il`.
        let mut c = cfg.clone();
        c.compress_ratios = vec![0; cfg.n_layer];
        let il = mtp_layer_index(cfg);
        MtpState {
            cache: LayerCache::new(&c, il, cfg.window),
        }
    }

    /// The block's input `Hin` (`[n_hc][n_embd]`) for `token` and the incoming HC
    /// state `g`: `e_proj·rmsnorm(emb, enorm) + h_proj·rmsnorm(g_s, hnorm)` per stream.
    pub fn input_state(&self, token: u32, g: &[f32]) -> Result<Vec<f32>> {
        let m = self.inner.main.inner();
        let cfg = &m.config;
        let w = &self.inner.weights;
        let (e, nhc) = (cfg.n_embd, cfg.n_hc);
        check_vocab(&[token], cfg.vocab)?;
        if g.len() != nhc * e {
            return Err(EngineError::Invalid(format!(
                "MTP draft: the HC state has {} values, expected n_hc·n_embd = {}",
                g.len(),
                nhc * e
            )));
        }
        let mut emb = vec![0.0f32; e];
        m.weights
            .token_embd
            .view()
            .dequant_row(token as usize, &mut emb);
        rmsnorm_rows_inplace(&mut emb, &w.enorm, cfg.rms_eps);
        let mut ev = vec![0.0f32; e];
        matmul_f32(w.e_proj.view(), &emb, self.numerics, &mut ev);
        // Each stream is normed on its own, then all go through h_proj as one batch.
        let mut gn = g.to_vec();
        rmsnorm_rows_inplace(&mut gn, &w.hnorm, cfg.rms_eps);
        let mut hin = vec![0.0f32; nhc * e];
        matmul_f32(w.h_proj.view(), &gn, self.numerics, &mut hin);
        for stream in hin.chunks_exact_mut(e) {
            for (h, v) in stream.iter_mut().zip(&ev) {
                *h += v;
            }
        }
        Ok(hin)
    }

    /// Drafts from `token` at position `pos` with incoming HC state `g` (the main
    /// model's final state at `pos`, or a previous draft's [`MtpDraft::hc`]). Appends
    /// the block's raw KV row for `pos` to `state`'s ring.
    pub fn draft(
        &self,
        state: &mut MtpState,
        token: u32,
        g: &[f32],
        pos: usize,
    ) -> Result<MtpDraft> {
        let cfg = self.inner.main.config();
        let w = &self.inner.weights;
        let mut h = self.input_state(token, g)?;
        layer_forward(
            cfg,
            &w.layer,
            &self.inner.rope,
            self.numerics,
            pos,
            &[token],
            &mut h,
            &mut state.cache,
            None,
        );
        let main = &self.inner.main.inner().weights;
        let logits = head(
            cfg,
            self.numerics,
            &w.head_hc,
            &w.norm,
            &main.output,
            &h,
            &[0],
        );
        Ok(MtpDraft { logits, hc: h })
    }
}
