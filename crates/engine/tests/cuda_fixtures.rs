//! The tiny fixtures on the CUDA backend (`ds4_engine::dev::fixture`, what `ds4-tool
//! gpu-selftest` runs after the kernel checks) on device 0, printing the selftest's
//! result lines (shown with `--nocapture` or on failure). Without a CUDA driver each
//! test says so and passes.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ds4_cuda::selftest::{open_for_test, GRAPH_VARIANTS};
use ds4_engine::dev::fixture::{
    check_graph_variants, check_mtp, check_steering, run_fixtures, Tally,
};
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::{Config, Gpu};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

/// A fixture run of `ds4_engine::dev::fixture`.
type FixtureRun = fn(&Arc<Gpu>, &Path, &mut dyn FnMut(&str)) -> anyhow::Result<Tally>;

/// Runs `check` on device 0 unless the machine has no GPU; its tally.
fn on_gpu(check: FixtureRun) -> Option<Tally> {
    let gpu = Arc::new(open_for_test(0).expect("opening the GPU")?);
    Some(check(&gpu, &dir(), &mut |l| println!("{l}")).expect("a check ran"))
}

#[test]
fn tiny_fixtures_pass_on_cuda() {
    if let Some(t) = on_gpu(run_fixtures) {
        assert_eq!(t.failed, 0, "{t:?}");
        // 3 models × 2 modes × (3 sequences, 3 prefill chunks, 3 snapshots, pooled).
        assert_eq!(t.checks, 60);
    }
}

#[test]
fn graph_variants_keep_the_logits() {
    if let Some(t) = on_gpu(check_graph_variants) {
        assert_eq!(t.failed, 0, "{t:?}");
        assert_eq!(t.checks, 2 * GRAPH_VARIANTS.len());
    }
}

/// The synthetic MTP file of a fixture model (Q4 experts, as shipped).
fn mtp_image(config: &Config) -> anyhow::Result<Vec<u8>> {
    let plan = ds4_synth::Plan::mtp(config.clone(), ExpertQuant::Q4, "cuda_fixtures MTP")?;
    Ok(plan.build(20, &|_| {}))
}

#[test]
fn mtp_drafts_match_the_cpu_block() {
    if let Some(t) = on_gpu(|g, d, l| check_mtp(g, d, &mtp_image, l)) {
        assert_eq!(t.failed, 0, "{t:?}");
        // 3 models × (2 modes × (drafts, 2 keep checks) + the refusals).
        assert_eq!(t.checks, 21);
    }
}

#[test]
fn steering_matches_the_cpu() {
    if let Some(t) = on_gpu(check_steering) {
        assert_eq!(t.failed, 0, "{t:?}");
        // 2 modes × (steered, zero scales, switched on mid-session).
        assert_eq!(t.checks, 6);
    }
}
