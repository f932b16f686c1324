//! The model hyperparameters, read from `deepseek4.*` GGUF metadata.
//!
//! Any sizes are accepted (tiny test models have the real structure at small width);
//! [`Config::profile_deviations`] lists every way a file differs from DeepSeek V4 Flash.

use ds4_gguf::{GgufFile, Value};

const PREFIX: &str = "deepseek4.";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "metadata key {key:?} is missing: this does not look like a DeepSeek V4 (deepseek4) GGUF"
    )]
    Missing { key: String },
    #[error("metadata key {key:?}: {msg}")]
    Invalid { key: String, msg: String },
    #[error("general.architecture is {0}, expected \"deepseek4\"")]
    WrongArchitecture(String),
}

/// Upper bounds of the counts (#18 item 11): far above any real DeepSeek V4 but small
/// enough that products of them (q_dim, hc_mix, per-layer tables) cannot overflow and a
/// corrupt file fails at load instead of hanging or allocating terabytes.
const MAX_COUNT: u32 = 1 << 24;
const LIMITS: &[(&str, u32)] = &[
    ("block_count", 4096),
    ("attention.head_count", 1 << 16),
    ("attention.head_count_kv", 1 << 16),
    ("attention.key_length", 1 << 16),
    ("rope.dimension_count", 1 << 16),
    ("expert_count", 1 << 16),
    ("expert_used_count", 1 << 16),
    ("expert_shared_count", 1 << 10),
    ("hash_layer_count", 4096),
    ("attention.indexer.head_count", 1 << 16),
    ("attention.indexer.key_length", 1 << 16),
    ("attention.output_group_count", 1 << 16),
    ("hyper_connection.count", 64),
    // Flash uses 20; every token runs these per layer, so 2^31 would hang the model.
    ("hyper_connection.sinkhorn_iterations", 1000),
];

/// Hyperparameters of a DeepSeek V4 model. Field names follow the GGUF keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `general.name`.
    pub name: Option<String>,
    /// `context_length`: the context the model was trained for (`None`: not in the file).
    pub context_length: Option<u64>,
    /// `block_count`.
    pub n_layer: usize,
    /// `embedding_length`: the width of the residual stream.
    pub n_embd: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `attention.head_count` query heads over `attention.head_count_kv` (= 1) KV head.
    pub n_head: usize,
    pub n_head_kv: usize,
    /// `attention.key_length`: key (= value) length of one head.
    pub head_dim: usize,
    /// `rope.dimension_count`: RoPE acts on the last `rope_dim` dims of each head.
    pub rope_dim: usize,
    /// `attention.q_lora_rank`, `attention.output_lora_rank`, `attention.output_group_count`.
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
    /// `expert_count` routed experts, `expert_used_count` of them per token, each of
    /// width `expert_feed_forward_length`; `expert_shared_count` shared experts.
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_expert_shared: usize,
    /// `hash_layer_count`: layers `0..n_hash_layer` route by token id (`ffn_gate_tid2eid`).
    pub n_hash_layer: usize,
    /// `attention.sliding_window`: the raw window (includes the current token).
    pub window: usize,
    /// `attention.indexer.{head_count, key_length, top_k}`.
    pub idx_heads: usize,
    pub idx_head_dim: usize,
    pub idx_topk: usize,
    /// `hyper_connection.count` streams, `hyper_connection.sinkhorn_iterations`.
    pub n_hc: usize,
    pub sinkhorn_iters: usize,
    /// `attention.compress_ratios`, one entry per layer: 0 (raw window only),
    /// 4 (overlapping compressor + indexer) or another ratio (plain compressor).
    pub compress_ratios: Vec<usize>,
    /// `swiglu_clamp_exp` per layer; `swiglu_clamp_shexp` (default: the same).
    pub swiglu_clamp: Vec<f32>,
    pub swiglu_clamp_shexp: Vec<f32>,
    /// `rope.freq_base` (uncompressed layers), `attention.compress_rope_freq_base`.
    pub rope_freq_base: f32,
    pub compress_rope_freq_base: f32,
    /// YaRN: `rope.scaling.{factor, original_context_length, yarn_beta_fast, yarn_beta_slow}`.
    pub rope_scaling_factor: f32,
    pub rope_orig_ctx: u64,
    pub yarn_beta_fast: f32,
    pub yarn_beta_slow: f32,
    /// `expert_weights_scale` and `expert_weights_norm` of the routing weights.
    pub expert_weights_scale: f32,
    pub expert_weights_norm: bool,
    /// `attention.layer_norm_rms_epsilon`, `hyper_connection.epsilon`.
    pub rms_eps: f32,
    pub hc_eps: f32,
}

impl Config {
    /// DeepSeek V4 Flash as published (model-spec.md §1).
    pub fn flash() -> Config {
        let n_layer = 43;
        Config {
            name: Some("DeepSeek-V4-Flash".into()),
            context_length: Some(1_048_576),
            n_layer,
            n_embd: 4096,
            vocab: 129_280,
            n_head: 64,
            n_head_kv: 1,
            head_dim: 512,
            rope_dim: 64,
            q_lora_rank: 1024,
            o_lora_rank: 1024,
            o_groups: 8,
            n_expert: 256,
            n_expert_used: 6,
            n_ff_exp: 2048,
            n_expert_shared: 1,
            n_hash_layer: 3,
            window: 128,
            idx_heads: 64,
            idx_head_dim: 128,
            idx_topk: 512,
            n_hc: 4,
            sinkhorn_iters: 20,
            compress_ratios: Self::flash_ratios(n_layer),
            swiglu_clamp: vec![10.0; n_layer],
            swiglu_clamp_shexp: vec![10.0; n_layer],
            rope_freq_base: 10000.0,
            compress_rope_freq_base: 160000.0,
            rope_scaling_factor: 16.0,
            rope_orig_ctx: 65536,
            yarn_beta_fast: 32.0,
            yarn_beta_slow: 1.0,
            expert_weights_scale: 1.5,
            expert_weights_norm: true,
            rms_eps: 1e-6,
            hc_eps: 1e-6,
        }
    }

    /// The Flash pattern: layers 0 and 1 raw only, then 4, 128, 4, 128, …
    pub fn flash_ratios(n_layer: usize) -> Vec<usize> {
        (0..n_layer)
            .map(|il| match il {
                0 | 1 => 0,
                _ if il % 2 == 0 => 4,
                _ => 128,
            })
            .collect()
    }

    /// The same structure at tiny width, as in the shared test fixtures.
    pub fn tiny(n_layer: usize) -> Config {
        Config {
            name: Some("DeepSeek-V4-Flash tiny".into()),
            context_length: Some(4096),
            n_layer,
            n_embd: 256,
            vocab: 512,
            n_head: 4,
            n_head_kv: 1,
            head_dim: 160,
            rope_dim: 32,
            q_lora_rank: 64,
            o_lora_rank: 32,
            o_groups: 2,
            n_expert: 8,
            n_expert_used: 4,
            n_ff_exp: 256,
            n_expert_shared: 1,
            n_hash_layer: 3.min(n_layer),
            window: 16,
            idx_heads: 16,
            idx_head_dim: 64,
            idx_topk: 8,
            compress_ratios: Self::flash_ratios(n_layer),
            swiglu_clamp: vec![10.0; n_layer],
            swiglu_clamp_shexp: vec![10.0; n_layer],
            ..Config::flash()
        }
    }

    /// Reads and checks the `deepseek4.*` keys. Sizes may be anything consistent;
    /// structural impossibilities (zero heads, a rope longer than the head, ratio
    /// arrays shorter than the layer count, …) are errors.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Config, ConfigError> {
        let m = Meta(gguf);
        // #18 item 11: a non-string value used to skip this check.
        match gguf.get("general.architecture") {
            None => {}
            Some(Value::String(arch)) if arch == "deepseek4" => {}
            Some(Value::String(arch)) => {
                return Err(ConfigError::WrongArchitecture(format!("{arch:?}")))
            }
            Some(other) => {
                return Err(ConfigError::WrongArchitecture(format!(
                    "a {}, not a string",
                    other.value_type().name()
                )))
            }
        }
        let n_layer = m.count("block_count")?;
        let ratios = m.int_array("attention.compress_ratios", n_layer)?;
        let clamp = m.float_array("swiglu_clamp_exp", n_layer)?;
        let clamp_sh = match gguf.get(&format!("{PREFIX}swiglu_clamp_shexp")) {
            Some(_) => m.float_array("swiglu_clamp_shexp", n_layer)?,
            None => clamp.clone(),
        };
        for key in ["expert_group_count", "expert_group_used_count"] {
            if let Some(v) = gguf.get(&format!("{PREFIX}{key}")) {
                if v.as_i64() != Some(0) {
                    return Err(
                        m.invalid(key, "group-limited routing is not supported (must be 0)")
                    );
                }
            }
        }
        let cfg = Config {
            name: gguf.get_str("general.name").map(str::to_string),
            context_length: gguf
                .get(&format!("{PREFIX}context_length"))
                .and_then(Value::as_i64)
                .and_then(|v| u64::try_from(v).ok()),
            n_layer,
            n_embd: m.count("embedding_length")?,
            vocab: m.count("vocab_size")?,
            n_head: m.count("attention.head_count")?,
            n_head_kv: m.count("attention.head_count_kv")?,
            head_dim: m.count("attention.key_length")?,
            rope_dim: m.count("rope.dimension_count")?,
            q_lora_rank: m.count("attention.q_lora_rank")?,
            o_lora_rank: m.count("attention.output_lora_rank")?,
            o_groups: m.count("attention.output_group_count")?,
            n_expert: m.count("expert_count")?,
            n_expert_used: m.count("expert_used_count")?,
            n_ff_exp: m.count("expert_feed_forward_length")?,
            n_expert_shared: m.count("expert_shared_count")?,
            n_hash_layer: m.u32("hash_layer_count")? as usize,
            window: m.count("attention.sliding_window")?,
            idx_heads: m.count("attention.indexer.head_count")?,
            idx_head_dim: m.count("attention.indexer.key_length")?,
            idx_topk: m.count("attention.indexer.top_k")?,
            n_hc: m.count("hyper_connection.count")?,
            sinkhorn_iters: m.count("hyper_connection.sinkhorn_iterations")?,
            compress_ratios: ratios,
            swiglu_clamp: clamp,
            swiglu_clamp_shexp: clamp_sh,
            rope_freq_base: m.positive("rope.freq_base")?,
            compress_rope_freq_base: m.positive("attention.compress_rope_freq_base")?,
            rope_scaling_factor: m.positive("rope.scaling.factor")?,
            rope_orig_ctx: m.uint("rope.scaling.original_context_length")?,
            yarn_beta_fast: m.float("rope.scaling.yarn_beta_fast")?,
            yarn_beta_slow: m.float("rope.scaling.yarn_beta_slow")?,
            expert_weights_scale: m.positive("expert_weights_scale")?,
            expert_weights_norm: m.bool("expert_weights_norm")?,
            rms_eps: m.positive("attention.layer_norm_rms_epsilon")?,
            hc_eps: m.positive("hyper_connection.epsilon")?,
        };
        if let Some(v) = gguf.get(&format!("{PREFIX}attention.value_length")) {
            if v.as_i64() != Some(cfg.head_dim as i64) {
                return Err(m.invalid(
                    "attention.value_length",
                    "must equal attention.key_length (K and V share one row)",
                ));
            }
        }
        cfg.check_structure()?;
        Ok(cfg)
    }

    fn check_structure(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, msg: String| ConfigError::Invalid {
            key: format!("{PREFIX}{key}"),
            msg,
        };
        if self.n_head_kv != 1 {
            return Err(bad(
                "attention.head_count_kv",
                format!("{} KV heads; DeepSeek V4 uses exactly 1", self.n_head_kv),
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(bad(
                "rope.dimension_count",
                format!(
                    "{} does not fit a {}-dim head as an even tail",
                    self.rope_dim, self.head_dim
                ),
            ));
        }
        if self.rope_dim > self.idx_head_dim {
            return Err(bad(
                "attention.indexer.key_length",
                format!(
                    "{} is shorter than the rope tail {}",
                    self.idx_head_dim, self.rope_dim
                ),
            ));
        }
        if !self.n_head.is_multiple_of(self.o_groups) {
            return Err(bad(
                "attention.output_group_count",
                format!(
                    "{} heads do not split into {} groups",
                    self.n_head, self.o_groups
                ),
            ));
        }
        if self.n_expert_used > self.n_expert {
            return Err(bad(
                "expert_used_count",
                format!("{} used of {} experts", self.n_expert_used, self.n_expert),
            ));
        }
        if self.n_hash_layer > self.n_layer {
            return Err(bad(
                "hash_layer_count",
                format!("{} hash layers of {}", self.n_hash_layer, self.n_layer),
            ));
        }
        if let Some(r) = self.compress_ratios.iter().find(|&&r| r == 1) {
            return Err(bad(
                "attention.compress_ratios",
                format!("ratio {r} is not a compression"),
            ));
        }
        if !self.expert_weights_norm {
            return Err(bad(
                "expert_weights_norm",
                "must be true: unnormalised routing is not implemented".into(),
            ));
        }
        Ok(())
    }

    /// Mixing weights per hyper-connection sublayer: pre (n_hc), post (n_hc), comb (n_hc²).
    pub fn hc_mix(&self) -> usize {
        2 * self.n_hc + self.n_hc * self.n_hc
    }

    /// Query dims (all heads).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Compressor lanes: the ratio-4 compressor overlaps two windows.
    pub fn compressor_lanes(ratio: usize) -> usize {
        if ratio == 4 {
            2
        } else {
            1
        }
    }

    /// Whether layer `il` has the top-k indexer (the overlapping ratio-4 layers).
    pub fn has_indexer(&self, il: usize) -> bool {
        self.compress_ratios[il] == 4
    }

    /// Every difference from DeepSeek V4 Flash, one line each (empty for a real file).
    pub fn profile_deviations(&self) -> Vec<String> {
        let f = Config::flash();
        let mut out = Vec::new();
        macro_rules! cmp {
            ($($field:ident),*) => {$(
                if self.$field != f.$field {
                    out.push(format!("{}: {:?} (Flash: {:?})", stringify!($field), self.$field, f.$field));
                }
            )*};
        }
        cmp!(
            n_layer,
            n_embd,
            vocab,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            q_lora_rank,
            o_lora_rank,
            o_groups,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_expert_shared,
            n_hash_layer,
            window,
            idx_heads,
            idx_head_dim,
            idx_topk,
            n_hc,
            sinkhorn_iters,
            compress_ratios,
            rope_orig_ctx,
            expert_weights_norm
        );
        macro_rules! cmp_f {
            ($($field:ident),*) => {$(
                if !close(self.$field as f64, f.$field as f64) {
                    out.push(format!("{}: {} (Flash: {})", stringify!($field), self.$field, f.$field));
                }
            )*};
        }
        cmp_f!(
            rope_freq_base,
            compress_rope_freq_base,
            rope_scaling_factor,
            yarn_beta_fast,
            yarn_beta_slow,
            expert_weights_scale,
            rms_eps,
            hc_eps
        );
        if self
            .swiglu_clamp
            .iter()
            .chain(&self.swiglu_clamp_shexp)
            .any(|&c| !close(c as f64, 10.0))
        {
            out.push("swiglu_clamp: not 10.0 in every layer".into());
        }
        out
    }
}

/// The reference's float tolerance: within max(1,|expected|)·1e-6.
fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= want.abs().max(1.0) * 1e-6
}

struct Meta<'a>(&'a GgufFile);

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&Value, ConfigError> {
        let full = format!("{PREFIX}{key}");
        self.0.get(&full).ok_or(ConfigError::Missing { key: full })
    }

    fn invalid(&self, key: &str, msg: &str) -> ConfigError {
        ConfigError::Invalid {
            key: format!("{PREFIX}{key}"),
            msg: msg.to_string(),
        }
    }

    /// A u32 key, strictly typed as in the reference.
    fn u32(&self, key: &str) -> Result<u32, ConfigError> {
        match self.get(key)? {
            Value::U32(v) => Ok(*v),
            other => Err(self.invalid(
                key,
                &format!("must be u32, found {}", other.value_type().name()),
            )),
        }
    }

    /// A u32 count that must be positive and within its [`LIMITS`] entry.
    fn count(&self, key: &str) -> Result<usize, ConfigError> {
        let max = LIMITS
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(MAX_COUNT, |l| l.1);
        match self.u32(key)? {
            0 => Err(self.invalid(key, "must be positive")),
            v if v > max => Err(self.invalid(key, &format!("{v} is above the limit {max}"))),
            v => Ok(v as usize),
        }
    }

    fn uint(&self, key: &str) -> Result<u64, ConfigError> {
        match self.get(key)? {
            Value::U32(v) => Ok(*v as u64),
            Value::U64(v) => Ok(*v),
            other => Err(self.invalid(
                key,
                &format!("must be u32 or u64, found {}", other.value_type().name()),
            )),
        }
    }

    fn float(&self, key: &str) -> Result<f32, ConfigError> {
        let v = match self.get(key)? {
            Value::F32(v) => *v as f64,
            Value::F64(v) => *v,
            Value::U32(v) => *v as f64,
            Value::I32(v) => *v as f64,
            other => {
                return Err(self.invalid(
                    key,
                    &format!("must be a number, found {}", other.value_type().name()),
                ))
            }
        };
        finite_f32(v).ok_or_else(|| self.invalid(key, "must be finite"))
    }

    /// A float that must be finite and > 0 (epsilons, rope bases and scales: #18 item 11).
    fn positive(&self, key: &str) -> Result<f32, ConfigError> {
        match self.float(key)? {
            v if v > 0.0 => Ok(v),
            v => Err(self.invalid(key, &format!("{v} must be > 0"))),
        }
    }

    fn bool(&self, key: &str) -> Result<bool, ConfigError> {
        self.get(key)?
            .as_bool()
            .ok_or_else(|| self.invalid(key, "must be bool"))
    }

    /// The first `n` entries (one per layer) of the array `key`.
    fn layer_array(&self, key: &str, n: usize) -> Result<&[Value], ConfigError> {
        let (_, items) = self
            .get(key)?
            .as_array()
            .ok_or_else(|| self.invalid(key, "must be an array"))?;
        if items.len() < n {
            return Err(self.invalid(
                key,
                &format!("has {} entries, the model has {n} layers", items.len()),
            ));
        }
        Ok(&items[..n])
    }

    fn int_array(&self, key: &str, n: usize) -> Result<Vec<usize>, ConfigError> {
        self.layer_array(key, n)?
            .iter()
            .map(|v| match v {
                Value::I32(x) if *x >= 0 => Ok(*x as usize),
                Value::U32(x) => Ok(*x as usize),
                _ => Err(self.invalid(key, "entries must be non-negative i32 or u32")),
            })
            .collect()
    }

    fn float_array(&self, key: &str, n: usize) -> Result<Vec<f32>, ConfigError> {
        self.layer_array(key, n)?
            .iter()
            .map(|v| {
                let x = match v {
                    Value::F32(x) => *x as f64,
                    Value::F64(x) => *x,
                    _ => return Err(self.invalid(key, "entries must be f32 or f64")),
                };
                // A NaN clamp disables clamping (every comparison is false): #18 item 11.
                finite_f32(x)
                    .filter(|c| *c > 0.0)
                    .ok_or_else(|| self.invalid(key, &format!("entry {x} must be finite and > 0")))
            })
            .collect()
    }
}

/// `v` as an f32 when it is finite there too (1e300 as f64 is finite, as f32 inf).
fn finite_f32(v: f64) -> Option<f32> {
    Some(v as f32).filter(|x| x.is_finite())
}
