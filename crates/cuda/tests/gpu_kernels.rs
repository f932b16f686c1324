//! Every GPU kernel check of `ds4_cuda::selftest` (what `ds4-tool gpu-selftest` runs
//! before the fixtures) on device 0, printing the selftest's result lines (shown with
//! `--nocapture` or on failure). Without a CUDA driver it says so and passes.

use ds4_cuda::selftest::{self, summary_line};

#[test]
fn every_kernel_check_passes() {
    let Some(gpu) = selftest::open_for_test(0).expect("opening the GPU") else {
        return;
    };
    println!("{}", selftest::device_line(&gpu, 0));
    // DS4_SELFTEST_SEED repeats a run's inputs (the seed is printed).
    let seed = std::env::var("DS4_SELFTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(selftest::fresh_seed);
    println!("seed {seed}");
    let l = gpu.launcher(ds4_cuda::DecodePlan::default());
    let checks = selftest::run_all(&l, seed, &mut |l| println!("{l}")).expect("a check ran");
    let failed = checks.iter().filter(|c| !c.passed()).count();
    println!("\n{}", summary_line(checks.len() - failed, failed));
    assert_eq!(failed, 0, "{failed} GPU kernel checks failed (seed {seed})");
}
