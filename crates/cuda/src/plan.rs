//! The decode plan: which kernel variants and decode-graph restructurings are on.
//!
//! A [`DecodePlan`] is a small `Copy` set of [`Variant`]s, built once (by the engine
//! from `DS4_CUDA_FUSE` through [`DecodePlan::from_env`], the only place that reads it)
//! and handed to whoever launches: kernels are launched through a [`Launcher`], a view
//! of a [`Gpu`] together with a plan (`gpu.launcher(plan)`). The `Gpu` itself holds no
//! plan, so sessions with different plans can share one device and one weight upload
//! (`ds4-bench --fuse-ab`), and a check compares a variant with its plain twin by
//! launching through `launcher.with(variant, false)` and `with(variant, true)`.
//!
//! The history of each variant (what it measured when it was promoted, and the
//! variants that lost and were removed) is in `crates/cuda/NOTES.md`.

use std::fmt;
use std::ops::Deref;

use crate::device::Gpu;
use crate::matmul_f16::F16Work;

macro_rules! variants {
    ($($v:ident = $name:literal, $on:literal, $doc:literal;)*) => {
        /// A kernel variant or decode-graph restructuring that the plan turns on or off.
        ///
        /// Every variant keeps its plain twin (the kernel or graph shape it replaces)
        /// only because `ds4-tool gpu-selftest` compares the two bit for bit (or, for
        /// graph restructurings, the decode outputs with it off and on): a twin with no
        /// such check leaves the build.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Variant {
            $(#[doc = $doc] $v,)*
        }

        impl Variant {
            /// Every variant, in bit order.
            pub const ALL: &'static [Variant] = &[$(Variant::$v),*];

            /// The name `DS4_CUDA_FUSE` uses.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Variant::$v => $name,)*
                }
            }

            /// What it does, in one line.
            pub const fn doc(self) -> &'static str {
                match self {
                    $(Variant::$v => $doc,)*
                }
            }

            /// Whether it is on when `DS4_CUDA_FUSE` is unset.
            pub const fn default_on(self) -> bool {
                match self {
                    $(Variant::$v => $on,)*
                }
            }
        }
    };
}

variants! {
    CombLane = "comb_lane", true, "hc_comb on a lane of its own, not ahead of a branch's matvecs.";
    SharedPair = "shared_pair", true, "The shared expert's gate and up in one launch.";
    QNorm = "q_norm", true, "head_norm_rope inside the decode attention.";
    Iq2Rx = "iq2_rx", true, "The IQ2_XXS expert matvec with its activations in registers (matvec_iq2_xxs_q8_rx).";
    Q2kRx = "q2k_rx", true, "The Q2_K expert down at 2048 columns with its activations in registers (matvec_q2_k_q8_rx).";
    Q8Early = "q8_early", true, "The Q8_0 matvec's first weight loads before the PDL wait where the selection is fixed (matvec_q8_0_q8_early).";
    Prio = "prio", true, "Decode-graph kernels at the highest priority, background work (q_b, shared expert, hc_comb) at the lowest.";
    AttStage = "att_stage", true, "A decode token's attention blocks copy their rows into shared memory (attention_split_staged).";
    // Off since session 26: 2k decode 175.7 -> 177.4 tok/s without it (4 interleaved
    // rounds, H200, q2; +1.5 in 2 more), MTP draft 1 level (NOTES session 26).
    F16Early = "f16_early", false, "The F16 matvec's first weight loads before the PDL wait where no ids select the matrix (matvec_f16_early); off by default.";
    Router4 = "router4", true, "The router's rank loop reads four keys per shared-memory load (router_wide).";
    HcPreload = "hc_preload", true, "The hyper-connection kernels with every load issued before the first use (hc_pre_pl, hc_mix_pl, hc_post_pl).";
    IdxBanks = "idx_banks", true, "The indexer scores' loads staged so the transposed stores hit 32 banks (indexer_scores_sp).";
    TopkReg = "topk_reg", true, "The top-k select with each thread's scores in registers across the radix passes (topk_select_rg).";
    CombinePl = "combine_pl", true, "The attention combine with all 32 chunk partials in flight at once (attention_combine_pl).";
    NormPl = "norm_pl", true, "The fused norm + Q8_0 with its weights fetched before the PDL wait (rmsnorm_q8_pl).";
    IdxqWarp = "idxq_warp", true, "The indexer query's RoPE, Hadamard and FP4 with one warp per head (indexer_q_warp).";
    AttEarly = "att_early", true, "With att_stage: the first row copies issued before the query's load (attention_split_early).";
    RouterSplit = "router_split", true, "The router's rank loop split at the warp's own experts; takes the place of router4 (router_split).";
    Iq2Early = "iq2_early", true, "With iq2_rx: the IQ2_XXS tables built before the PDL wait (matvec_iq2_xxs_q8_rxe).";
    IdxStep = "idx_step", true, "A decode token's indexer query, scores and top-k in one launch (indexer_step) for contexts of up to INDEXER_STEP_MAX_ROWS compressed rows, not three.";
    IdxStepRows = "idx_step_rows", true, "With idx_step: a multi-row step of up to IDX_STEP_ROWS tokens (an MTP verify) takes indexer_step too, a token a grid row, with a decode token's bits, not the batch chain (indexer_q, indexer_scores_mma on bf16 tensor cores, topk_select).";
    IdxMma = "idx_mma", true, "A batch's indexer scores on bf16 tensor cores (indexer_scores_mma).";
    MmPitch = "mm_pitch", true, "The prefill F16/BF16 tensor-core GEMM tiles without their store bank conflicts (mm_tc_*_p).";
    Iq2Tab = "iq2_tab", true, "With iq2_rx: the IQ2_XXS lookups in one table addressed by a single LOP3 (matvec_iq2_xxs_q8_rxt).";
    Iq2Pipe = "iq2_pipe", true, "With iq2_rx: the next row unit's weights loaded while the current one is computed (_rxp, _rxtp).";
    ShexpLate = "shexp_late", true, "A decode token's (and a multi-row or batched step's) shared expert forked after the router's F16 matvec, not beside it.";
    Q8Rows = "q8_rows", true, "The early-load Q8_0 matvec with 4 rows a warp for rows of up to 1,024 columns (matvec_q8_0_q8_r4).";
    Q8Rows2 = "q8_rows2", true, "The early-load Q8_0 matvec with 2 rows a warp for longer one-warp rows (matvec_q8_0_q8_r2).";
    Tokens = "tokens", true, "A multi-row step's plain Q8_0 (int8 activations) and F16 products read each weight block once for all their tokens (matvec_q8_0_q8_t*, matvec_f16_t*), not once per token.";
    TokensPair = "tokens_pair", true, "With tokens and shared_pair: a step's (3 to 7 rows) shared-expert gate and up in one dp4a launch of two groups (matvec_q8_0_q8_t*, a decode token's pair launch's rows a warp), not two launches that the starved low-priority lane ran one after the other.";
    Tokens5 = "tokens5", true, "With tokens: a 5-token step's (4-draft MTP verify, 5 batched sessions) Q8_0 and F16 products on 5-token kernels (matvec_q8_0_q8_t5r*, matvec_f16_t5), not the 8-token ones, whose 3 padding tokens were 3/8 of their work.";
    Tokens3 = "tokens3", true, "With tokens: a 3-token step's (an MTP verify of two drafts) Q8_0 and F16 products on 3-token kernels (matvec_q8_0_q8_t3r*, matvec_f16_t3), not the 4-token ones, whose padding token was a quarter of their work.";
    AttMmaSplit = "att_mma_split", true, "A multi-row step's attention in the fast numerics on tensor cores, each token's rows split over chunks (attention_split_mma), not on the FMA pipes (attention_split_early).";
    OutaEarly = "outa_early", true, "The attention's grouped output projection through the early-load Q8_0 kernels (constant ids).";
    // On since session 36 (H200, 2k, q2, two interleaved pairs): decode 199.5 -> 200.6
    // tok/s, R = 2 6.96 -> 6.91 ms, 16 sessions 648 -> 660 tok/s; the 6-pair gate+up
    // alone 16.4 -> 15.8 µs.
    Iq2Prmt = "iq2_prmt", true, "With iq2_lut32: the code lookups' address one PRMT of the code byte into the lane's table address (matvec_iq2_xxs_q8_rxtm: tables at a 64 KB boundary, one 16-warp block an SM; GPUs that give a block 128 KB of shared memory).";
    Iq2Lut32 = "iq2_lut32", true, "With iq2_tab and iq2_pipe: the IQ2_XXS lookups in 32 interleaved copies of the tables, one bank per lane (matvec_iq2_xxs_q8_rxtl).";
    TokensMma = "tokens_mma", true, "With tokens: a step's plain and grouped Q8_0 products of 8 to 16 tokens (a batched step over sessions, a long multi-row step) on int8 tensor cores (matvec_q8_0_q8_mma8/16), not the dp4a kernels (matvec_q8_0_q8_t*).";
    MmaWide = "mma_wide", true, "With tokens_mma: ~4,096 warps a product, a row tile split over up to 16 warps (blocks of up to 16 warps), not ~1,024 warps and up to 8.";
    Wide = "wide", true, "Element-wise work of many tokens one block a token with its RoPE angles computed once (prefill chunks; the query norm also in the multi-row and batched steps): the attention output's inverse RoPE + Q8_0 in one launch (rope_tail_q8), the query norm + RoPE a warp a head (head_norm_rope_t), the experts' swiglu + Q8_K a warp a 256-block (swiglu_q8k_w), wide Q8_0 and the HC post four values a thread (quantize_q8_32x4, hc_post_x4).";
    ExpWide = "exp_wide", true, "A prefill chunk's routed-expert GEMMs over 64 pairs a block (mm_exp_*_w: 8 warps of 16 rows × 64 pairs) where the experts average 32 pairs or more: each weight tile decoded once per 64 pairs, not per 32.";
    AttHalf = "att_half", true, "A prefill chunk's tensor-core attention over fp16 copies of the ring and compressed rows made once a layer (rows_f16, attention_prefill_mma_h), not each token's rows converted in every block.";
    Q8F16 = "q8_f16", true, "A prefill chunk's Q8_0 products on fp16 tensor cores (q8_0_to_f16, q8act_to_f16, mm_f16_128x128: weights and int8 activations expanded to fp16 once a call, no per-32 scale epilogue), not int8 mma with two block scales per 32 values (mm_q8_0_*).";
    F16Split = "f16_split", true, "A prefill chunk's F16-weight products (compressors, indexer, router) on fp16 tensor cores with each activation as fp16 hi + lo (f32_to_f16x2, mm_f16_128x128), not two tf32 mma a product on 64×64 tiles (mm_tc_f16_p_*).";
    F16Wgmma = "f16_wgmma", true, "With q8_f16 / f16_split: the fp16 prefill GEMM on warpgroup MMA (mm_f16_wg_128x128: wgmma.m64n128k16 from swizzled shared memory), not mma.sync with ldmatrix (mm_f16_128x128); sm_90a builds on 9.0 GPUs only.";
    ExpF16 = "exp_f16", true, "A prefill chunk's IQ2_XXS and Q2_K routed-expert GEMMs on fp16 warpgroup MMA (q8act_to_f16_perm, mm_exp_f16_*: each weight decoded once a block to fp16 with its scales folded in, straight into wgmma's A registers), not int8 mma with an integer sub-block scale per mma (mm_exp_*); sm_90a builds on 9.0 GPUs only.";
    ExpF16Qs = "exp_f16_qs", true, "With exp_f16: each row's few fp16 values formed once a quad (a lane a quarter, handed out by shuffle; mm_exp_f16_*_qs), not by all four lanes that decode the row.";
    F16Mma = "f16_mma", true, "With tokens: a step's F16 products of 8 to 16 tokens (a batched step over sessions, a long multi-row step) on tf32 tensor cores with each activation as tf32 hi + lo (matvec_f16_mma8/16), not the FMA kernels (matvec_f16_t8/16) that read every token's activations per weight.";
    IdxLane = "idx_lane", true, "A decode token's indexer compressor on a lane of its own, joined just before the indexer scores, not ahead of the indexer query on its lane.";
    CompDefer = "comp_defer", true, "A decode token whose position ends no window of a layer's compressors runs them on lane 4, joined at the attention sublayer's end, not before the attention (decode graphs keyed by which ratios emit).";
    Q4kRx = "q4k_rx", true, "The Q4_K expert matvecs at 4096 and 2048 columns with their activations in registers and the gate and up in one launch (matvec_q4_k_q8_rx4 / _rx2: the MTP block's experts, the q4 GGUF's), not the staged kernel a matrix at a time (matvec_q4_k_q8).";
    HcMixTc = "hc_mix_tc", true, "A prefill chunk's hyper-connection mix in one pass over H (hc_mix_tc: 16 tokens a block, the values read straight into tf32 mma fragments and squared on the way), not the 64×64-tile tf32 GEMM and a second read of H for the RMS factor (mm_tc_f16_p_*, hc_mix_scale).";
    HcGram = "hc_gram", true, "In the fast numerics, a decode token's (and a step's of up to 16 rows) sublayer ends with hc_post_gram (hc_post plus each block's share of the next sublayer's mix dots and of the streams' Gram products) and the next one starts with hc_start_gram (the mix, pre and both RMS factors from those shares; the normed input and its Q8_0 several blocks wide), not hc_post, hc_mix and the one-block hc_pre: one grid-wide wait on the chain instead of two. Starts that no end prepared (layer 0, a split model's first layer on a GPU, the MTP block) form the same shares from their streams (hc_gram_shares).";
}

const _: () = assert!(Variant::ALL.len() <= 64, "DecodePlan is a u64 bitset");

impl Variant {
    /// The variant `DS4_CUDA_FUSE` calls `name`.
    pub fn from_name(name: &str) -> Option<Variant> {
        Variant::ALL.iter().copied().find(|v| v.name() == name)
    }

    const fn bit(self) -> u64 {
        1 << self as u32
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A `DS4_CUDA_FUSE` value that names no variant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{var}: unknown variant `{name}` (valid: {valid}; `0` for none, `+name,-name` to edit the defaults)",
    var = DecodePlan::ENV,
    valid = valid_names()
)]
pub struct PlanError {
    /// The item that named no variant.
    pub name: String,
}

fn valid_names() -> String {
    Variant::ALL
        .iter()
        .map(|v| v.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Which [`Variant`]s are on. `Default` is the variants that are on by default.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodePlan(u64);

impl Default for DecodePlan {
    fn default() -> Self {
        Variant::ALL
            .iter()
            .filter(|v| v.default_on())
            .fold(DecodePlan::none(), |p, &v| p.with(v, true))
    }
}

impl DecodePlan {
    /// The environment variable [`DecodePlan::from_env`] reads.
    pub const ENV: &'static str = "DS4_CUDA_FUSE";

    /// Every variant off: the plain kernels and graph.
    pub const fn none() -> DecodePlan {
        DecodePlan(0)
    }

    /// Whether `v` is on.
    pub const fn has(self, v: Variant) -> bool {
        self.0 & v.bit() != 0
    }

    /// This plan with `v` turned on or off.
    #[must_use]
    pub const fn with(self, v: Variant, on: bool) -> DecodePlan {
        if on {
            DecodePlan(self.0 | v.bit())
        } else {
            DecodePlan(self.0 & !v.bit())
        }
    }

    /// The variants on, in bit order.
    pub fn variants(self) -> impl Iterator<Item = Variant> {
        Variant::ALL.iter().copied().filter(move |&v| self.has(v))
    }

    /// The plan `DS4_CUDA_FUSE` asks for (unset: the defaults).
    pub fn from_env() -> Result<DecodePlan, PlanError> {
        DecodePlan::parse(std::env::var(DecodePlan::ENV).ok().as_deref())
    }

    /// The plan a `DS4_CUDA_FUSE` value names (`None`: unset, the defaults). `0` or an
    /// empty value: none. A plain comma list names exactly the variants on; a list whose
    /// first item starts with `+` or `-` edits the defaults (`+a,-b`: the defaults with
    /// `a`, without `b`; the last mention of a name decides, an unprefixed name is on).
    /// A name that is no variant is an error that lists the valid ones.
    pub fn parse(setting: Option<&str>) -> Result<DecodePlan, PlanError> {
        let Some(setting) = setting else {
            return Ok(DecodePlan::default());
        };
        let items: Vec<&str> = setting
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.is_empty() || items == ["0"] {
            return Ok(DecodePlan::none());
        }
        let edit = items[0].starts_with(['+', '-']);
        let mut plan = if edit {
            DecodePlan::default()
        } else {
            DecodePlan::none()
        };
        for item in items {
            let (on, name) = match item.strip_prefix('-') {
                Some(name) if edit => (false, name),
                _ if edit => (true, item.strip_prefix('+').unwrap_or(item)),
                _ => (true, item),
            };
            let v = Variant::from_name(name).ok_or_else(|| PlanError {
                name: item.to_string(),
            })?;
            plan = plan.with(v, on);
        }
        Ok(plan)
    }
}

/// The `DS4_CUDA_FUSE` value of this plan: its variants' names, or `0` for none.
impl fmt::Display for DecodePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("0");
        }
        let names: Vec<&str> = self.variants().map(Variant::name).collect();
        f.write_str(&names.join(","))
    }
}

impl fmt::Debug for DecodePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DecodePlan({self})")
    }
}

/// A [`Gpu`] with the [`DecodePlan`] its launches follow: the only way to launch the
/// ds4 kernels. Every launcher that has variants picks its kernel from `plan`; the
/// device-wide machinery (streams, lanes, captures) is the `Gpu`'s, reached through
/// `Deref`. Cheap to make and `Copy`: make one per plan where the plan is known
/// (`gpu.launcher(plan)`), and pass `&Launcher` where `&Gpu` was passed before.
#[derive(Clone, Copy)]
pub struct Launcher<'g> {
    gpu: &'g Gpu,
    plan: DecodePlan,
    /// A prefill chunk's fp16 buffers: with them the batched products may run on fp16
    /// tensor cores (`matmul_f16.rs`); without them (decode, steps) they never do.
    f16: Option<&'g F16Work>,
}

impl Gpu {
    /// This GPU launching under `plan`.
    pub fn launcher(&self, plan: DecodePlan) -> Launcher<'_> {
        Launcher {
            gpu: self,
            plan,
            f16: None,
        }
    }
}

impl<'g> Launcher<'g> {
    /// The plan launches follow.
    pub fn plan(&self) -> DecodePlan {
        self.plan
    }

    /// The device.
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Whether variant `v` is on.
    pub fn on(&self, v: Variant) -> bool {
        self.plan.has(v)
    }

    /// This launcher with `v` turned on or off.
    #[must_use]
    pub fn with(&self, v: Variant, on: bool) -> Launcher<'g> {
        Launcher {
            plan: self.plan.with(v, on),
            ..*self
        }
    }

    /// This launcher with a prefill chunk's fp16 buffers (`None`: without).
    #[must_use]
    pub fn with_f16(&self, work: Option<&'g F16Work>) -> Launcher<'g> {
        Launcher { f16: work, ..*self }
    }

    /// The fp16 buffers, if this launcher has them.
    pub(crate) fn f16_work(&self) -> Option<&'g F16Work> {
        self.f16
    }

    /// `f` run on this launcher with `v` turned on or off: the selftest's comparisons
    /// of a variant with its plain twin through the same launcher.
    pub fn with_variant<T>(&self, v: Variant, on: bool, f: impl FnOnce(&Launcher<'g>) -> T) -> T {
        f(&self.with(v, on))
    }

    /// `variant` when `v` is on, else `plain`: the kernel of a launcher with one
    /// replacement.
    pub(crate) fn pick(
        &self,
        v: Variant,
        plain: &'static str,
        variant: &'static str,
    ) -> &'static str {
        if self.on(v) {
            variant
        } else {
            plain
        }
    }
}

impl Deref for Launcher<'_> {
    type Target = Gpu;

    fn deref(&self) -> &Gpu {
        self.gpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(p: DecodePlan) -> Vec<&'static str> {
        p.variants().map(Variant::name).collect()
    }

    #[test]
    fn every_variant_has_a_unique_name_and_bit() {
        for (i, a) in Variant::ALL.iter().enumerate() {
            assert_eq!(*a as usize, i, "{a} is out of bit order");
            assert_eq!(Variant::from_name(a.name()), Some(*a));
            assert!(!a.doc().is_empty() && !a.doc().contains('\n'), "{a}'s doc");
            for b in &Variant::ALL[i + 1..] {
                assert_ne!(a.name(), b.name());
            }
        }
    }

    #[test]
    fn unset_is_the_defaults() {
        let p = DecodePlan::parse(None).unwrap();
        assert_eq!(p, DecodePlan::default());
        for &v in Variant::ALL {
            assert_eq!(p.has(v), v.default_on(), "{v}");
        }
    }

    #[test]
    fn zero_or_empty_is_none() {
        for s in ["0", "", " ", " 0 ", ","] {
            assert_eq!(
                DecodePlan::parse(Some(s)).unwrap(),
                DecodePlan::none(),
                "{s:?}"
            );
        }
        assert_eq!(DecodePlan::none().to_string(), "0");
    }

    #[test]
    fn a_plain_list_is_exactly_those() {
        let p = DecodePlan::parse(Some(" q_norm ,comb_lane")).unwrap();
        assert_eq!(names(p), ["comb_lane", "q_norm"]);
        assert_eq!(p.to_string(), "comb_lane,q_norm");
        assert_eq!(DecodePlan::parse(Some(&p.to_string())).unwrap(), p);
    }

    #[test]
    fn a_signed_list_edits_the_defaults() {
        let d = DecodePlan::default();
        let p = DecodePlan::parse(Some("-prio")).unwrap();
        assert_eq!(p, d.with(Variant::Prio, false));
        let p = DecodePlan::parse(Some("-prio, q_norm,-iq2_rx")).unwrap();
        assert_eq!(p, d.with(Variant::Prio, false).with(Variant::Iq2Rx, false));
        // The last mention decides.
        assert_eq!(DecodePlan::parse(Some("-q_norm,q_norm")).unwrap(), d);
        assert_eq!(DecodePlan::parse(Some("-q_norm,+q_norm")).unwrap(), d);
        let off = DecodePlan::parse(Some("+q_norm,-q_norm")).unwrap();
        assert!(!off.has(Variant::QNorm));
        // From none, a signed list builds up from the defaults, not from nothing.
        assert_eq!(DecodePlan::parse(Some("+prio")).unwrap(), d);
    }

    #[test]
    fn an_unknown_name_is_an_error_that_lists_the_valid_ones() {
        for s in [
            "nonsense",
            "q_norm,bogus",
            "-prio,+bogus",
            "q_norm,-prio",
            "0,q_norm",
        ] {
            let e = DecodePlan::parse(Some(s)).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("DS4_CUDA_FUSE"), "{text}");
            for v in Variant::ALL {
                assert!(text.contains(v.name()), "{text} lacks {v}");
            }
        }
        let e = DecodePlan::parse(Some("nonsense")).unwrap_err();
        assert_eq!(e.name, "nonsense");
        assert!(e.to_string().contains("`nonsense`"));
    }

    #[test]
    fn with_turns_one_variant_on_or_off() {
        let p = DecodePlan::none().with(Variant::IdxMma, true);
        assert_eq!(names(p), ["idx_mma"]);
        assert!(p.with(Variant::IdxMma, false) == DecodePlan::none());
    }
}
