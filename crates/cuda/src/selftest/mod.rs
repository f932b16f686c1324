//! The GPU kernel checks of `ds4-tool gpu-selftest` and of this crate's `gpu_kernels`
//! test: every kernel against its CPU twin on fresh random inputs (f64 references,
//! bit-exact quantisers), every kernel variant against the kernel it replaces bit for
//! bit, and the kernel timings (`--bench`, `--probe-q8`, `--only-matmul`).
//!
//! [`CHECKS`] is the list of checks, in the order they print, each with the decode
//! variants ([`Variant`]) it covers. Restructurings of the decode graph
//! rather than of one kernel are checked on the whole model instead (each off and on
//! over a tiny fixture, `ds4_engine::dev::fixture`): [`GRAPH_VARIANTS`] lists them.
//! A variant that neither covers is reported by [`uncovered`], which a unit test runs
//! over every variant, so a new variant without a check fails the build's tests.
//!
//! Layout: `common` (result lines, tolerances, random inputs, comparisons) is used by
//! the check files `matvec`, `variants`, `matmul`, `attention`, `pick` and the timings in
//! `bench`; none of them uses another.

mod attention;
mod bench;
mod common;
mod indexer_step;
mod matmul;
mod matmul_f16;
mod matmul_f16_exp;
mod matvec;
mod pick;
mod tokens;
mod variants;
mod wide;

use anyhow::Result;

use crate::{Gpu, Launcher, Variant};

pub use attention::bench_attention;
pub use bench::{bench_tokens, probe_q8_splits};
pub use common::{
    bit_identical, same_bits, summary_line, BitDiff, Check, Timing, BOUND_F32, BOUND_FP16_MMA,
    BOUND_MATVEC, NAME_WIDTH,
};
pub use matmul::bench_matmul;

/// One entry of [`CHECKS`]: a group of result lines and the variants it covers.
pub struct KernelCheck {
    pub name: &'static str,
    /// The variants whose kernels this group compares with their plain twins (or
    /// against a reference).
    pub covers: &'static [Variant],
    /// Runs the group on `gpu` with inputs drawn from `seed`.
    pub run: fn(&Launcher, u64) -> Result<Vec<Check>>,
}

/// Every kernel check, in the order `gpu-selftest` prints them.
pub const CHECKS: &[KernelCheck] = &[
    // shared_pair is `matvec_q8act_pair`.
    check(
        "matvec",
        &[
            Variant::Iq2Rx,
            Variant::Iq2Early,
            Variant::Iq2Tab,
            Variant::Iq2Pipe,
            Variant::Iq2Lut32,
            Variant::Iq2Prmt,
            Variant::Q2kRx,
            Variant::Q4kRx,
            Variant::Q8Early,
            Variant::SharedPair,
        ],
        matvec::check_matvecs,
    ),
    check(
        "hc_preload",
        &[Variant::HcPreload],
        variants::check_hc_preload,
    ),
    check("hc_gram", &[Variant::HcGram], variants::check_hc_gram),
    check(
        "router",
        &[Variant::Router4, Variant::RouterSplit],
        variants::check_router_wide,
    ),
    check("f16_early", &[Variant::F16Early], variants::check_f16_early),
    check(
        "tokens",
        &[
            Variant::Tokens,
            Variant::Tokens3,
            Variant::TokensPair,
            Variant::Tokens5,
            Variant::TokensMma,
            Variant::MmaWide,
            Variant::F16Mma,
        ],
        tokens::check_tokens,
    ),
    check(
        "q8_rows",
        &[Variant::Q8Rows, Variant::Q8Rows2, Variant::OutaEarly],
        variants::check_q8_rows,
    ),
    check(
        "indexer_scores",
        &[Variant::IdxBanks],
        variants::check_indexer_scores,
    ),
    check(
        "indexer_mma",
        &[Variant::IdxMma],
        variants::check_indexer_mma,
    ),
    check("topk", &[Variant::TopkReg], variants::check_topk),
    check(
        "indexer_step",
        &[Variant::IdxStep, Variant::IdxStepRows],
        indexer_step::check_indexer_step,
    ),
    check("norm_pl", &[Variant::NormPl], variants::check_norm_pl),
    check("indexer_q", &[Variant::IdxqWarp], |gpu, seed| {
        Ok(vec![variants::check_indexer_q_warp(gpu, seed)?])
    }),
    check(
        "matmul",
        &[Variant::MmPitch, Variant::ExpWide],
        matmul::check_matmul,
    ),
    check(
        "f16_gemm",
        &[Variant::Q8F16, Variant::F16Split, Variant::F16Wgmma],
        matmul_f16::check_f16_gemm,
    ),
    check(
        "exp_f16",
        &[Variant::ExpF16, Variant::ExpF16Qs],
        matmul_f16_exp::check_exp_f16,
    ),
    check("wide", &[Variant::Wide], wide::check_wide),
    check("hc_mix_tc", &[Variant::HcMixTc], matvec::check_hc_mix_tc),
    check("greedy_pick", &[], pick::check_pick),
    check("spec_pick", &[], pick::check_spec_pick),
    check(
        "attention",
        &[
            Variant::AttStage,
            Variant::AttEarly,
            Variant::CombinePl,
            Variant::QNorm,
            Variant::AttMmaSplit,
            Variant::AttHalf,
        ],
        attention::check_attention_mma,
    ),
];

/// A [`CHECKS`] entry.
const fn check(
    name: &'static str,
    covers: &'static [Variant],
    run: fn(&Launcher, u64) -> Result<Vec<Check>>,
) -> KernelCheck {
    KernelCheck { name, covers, run }
}

/// A decode variant checked on the whole model: the tiny fixture run with it off and
/// on (`ds4_engine::dev::fixture::check_graph_variants`).
pub struct GraphVariant {
    pub variant: Variant,
    /// The variant only moves work between lanes, launches or priorities, so the
    /// logits must not change by a bit; otherwise they must agree within the fixture
    /// tier of the numeric mode.
    pub bit_identical: bool,
}

/// The variants that restructure the decode graph (each one's doc: [`Variant`]).
pub const GRAPH_VARIANTS: &[GraphVariant] = &[
    graph(Variant::CombLane, true),
    graph(Variant::SharedPair, true),
    // head_norm_rope inside the attention: the norm sums in another order.
    graph(Variant::QNorm, false),
    graph(Variant::Prio, true),
    graph(Variant::ShexpLate, true),
    graph(Variant::OutaEarly, true),
    graph(Variant::IdxLane, true),
    graph(Variant::CompDefer, true),
    // The Gram form of the HC boundaries sums in another order (fast numerics only).
    graph(Variant::HcGram, false),
];

/// A [`GRAPH_VARIANTS`] entry.
const fn graph(variant: Variant, bit_identical: bool) -> GraphVariant {
    GraphVariant {
        variant,
        bit_identical,
    }
}

/// The variants of `variants` that no entry of [`CHECKS`] covers and that are not in
/// [`GRAPH_VARIANTS`].
pub fn uncovered(variants: &[Variant]) -> Vec<Variant> {
    variants
        .iter()
        .copied()
        .filter(|v| {
            !CHECKS.iter().any(|c| c.covers.contains(v))
                && !GRAPH_VARIANTS.iter().any(|g| g.variant == *v)
        })
        .collect()
}

/// The batched (prefill) GEMM checks: int8 and f32 (`matmul`), fp16 (`f16_gemm`) and
/// the fp16 expert GEMM (`exp_f16`).
pub fn check_matmul(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut out = matmul::check_matmul(gpu, seed)?;
    out.extend(matmul_f16::check_f16_gemm(gpu, seed)?);
    out.extend(matmul_f16_exp::check_exp_f16(gpu, seed)?);
    Ok(out)
}

/// Every check of [`CHECKS`], in order.
pub fn check_kernels(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    run_all(gpu, seed, &mut |_| {})
}

/// Every check of [`CHECKS`], in order, handing each result line ([`Check::line`] at
/// [`NAME_WIDTH`]) to `line` as its group finishes; the results.
pub fn run_all(gpu: &Launcher, seed: u64, line: &mut dyn FnMut(&str)) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    for c in CHECKS {
        let group = (c.run)(gpu, seed)?;
        for r in &group {
            line(&r.line(NAME_WIDTH));
        }
        checks.extend(group);
    }
    Ok(checks)
}

/// The checks of the [`CHECKS`] group `name` alone; an error naming the groups if there
/// is none of that name.
pub fn run_group(gpu: &Launcher, seed: u64, name: &str) -> Result<Vec<Check>> {
    match CHECKS.iter().find(|c| c.name == name) {
        Some(c) => (c.run)(gpu, seed),
        None => {
            let names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
            anyhow::bail!("no check group {name:?}; the groups: {}", names.join(", "))
        }
    }
}

/// Achieved bandwidth of the decode matvecs, then the prefill GEMMs, at the real
/// model's shapes.
pub fn bench_kernels(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
    let mut out = bench::bench_matvecs(gpu, seed)?;
    out.extend(bench_matmul(gpu, seed)?);
    Ok(out)
}

/// A seed for fresh random inputs on every run.
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// Device `ordinal` for a test target, or `None` after saying why the GPU checks are
/// skipped (`skipped: no CUDA driver` or `skipped: no CUDA device N`, written to stderr
/// past the test harness's capture). Any other failure to open the device is an error.
pub fn open_for_test(ordinal: usize) -> Result<Option<Gpu>, crate::CudaError> {
    use std::io::Write;
    let why = match Gpu::open(ordinal) {
        Ok(gpu) => return Ok(Some(gpu)),
        Err(crate::CudaError::NoDriver) => "no CUDA driver".to_string(),
        Err(crate::CudaError::NoDevice(..)) => format!("no CUDA device {ordinal}"),
        Err(e) => return Err(e),
    };
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
    // Under `./test` the skip is listed in its summary (#19 item 1).
    if let Some(dir) = std::env::var_os("DS4_TEST_SKIPS") {
        let exe = std::env::current_exe().ok();
        let name = exe
            .as_ref()
            .and_then(|p| p.file_stem())
            .map_or("gpu".into(), |s| s.to_string_lossy().into_owned());
        let name = name.split('-').next().unwrap_or("gpu").to_string();
        let _ = std::fs::create_dir_all(&dir);
        let path = std::path::Path::new(&dir).join(format!("{name}.txt"));
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "skipped: {name} ({why})");
        }
    }
    Ok(None)
}

/// The device line a run starts with: name, architecture, SMs, memory, L2, kernels.
pub fn device_line(gpu: &Gpu, ordinal: usize) -> String {
    let i = gpu.info();
    format!(
        "device {ordinal}: {} (sm_{}{}, {} SMs, {:.1} GiB, L2 {} MiB), kernels: {:?}",
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.multiprocessors,
        i.total_mem as f64 / (1u64 << 30) as f64,
        i.l2_bytes >> 20,
        i.kernels
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant of the plan has a check: a new `Variant` without one fails here.
    #[test]
    fn every_variant_has_a_check() {
        assert_eq!(uncovered(Variant::ALL), Vec::<Variant>::new());
    }

    #[test]
    fn check_groups_and_graph_variants_are_listed_once() {
        let mut names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CHECKS.len(), "a check group name repeats");
        let mut graph: Vec<&str> = GRAPH_VARIANTS.iter().map(|g| g.variant.name()).collect();
        graph.sort_unstable();
        graph.dedup();
        assert_eq!(graph.len(), GRAPH_VARIANTS.len(), "a graph variant repeats");
    }
}
