//! The fixture checker used by `gpu-selftest`, exercised on the CPU backend (which
//! must pass it) and on a deliberately wrong backend (which must fail it).

use std::path::PathBuf;

use ds4_engine::dev::fixture::{check_sequence, pooled_agreement, Manifest};
use ds4_engine::dev::{Backend, CpuBackend, KvCache, LoadOptions, LogitRows, Model};
use ds4_engine::Numerics;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

#[test]
fn cpu_backend_passes_both_tiers_on_sequence_a() {
    let m = Manifest::load(&dir()).unwrap();
    let model = Model::load(dir().join("tiny-q2.gguf"), LoadOptions::default()).unwrap();
    for numerics in [Numerics::Exact, Numerics::Fast] {
        let mut b = CpuBackend::new(&model, 4096, numerics);
        let r = check_sequence(&mut b, &m, &dir(), "q2", "q2", "a", numerics).unwrap();
        assert!(r.passed, "{r:?}");
        assert!(r.greedy_ok);
        assert!(pooled_agreement(&[r]).1);
    }
}

/// A backend that perturbs every logit: the checker must notice.
struct Skewed(CpuBackend);

impl Backend for Skewed {
    fn name(&self) -> &str {
        "skewed"
    }
    fn n_tokens(&self) -> usize {
        self.0.n_tokens()
    }
    fn ctx(&self) -> usize {
        self.0.ctx()
    }
    fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> ds4_engine::Result<Vec<f32>> {
        let mut l = self.0.forward(tokens, rows)?;
        for (i, v) in l.iter_mut().enumerate() {
            *v += if i % 7 == 0 { 0.01 } else { 0.0 };
        }
        Ok(l)
    }
    fn export_state(&self) -> ds4_engine::Result<KvCache> {
        self.0.export_state()
    }
    fn import_state(&mut self, s: KvCache) -> ds4_engine::Result<()> {
        self.0.import_state(s)
    }
    fn reset(&mut self) {
        self.0.reset()
    }
    fn try_clone_box(&self) -> ds4_engine::Result<Box<dyn Backend>> {
        Ok(Box::new(Skewed(self.0.clone())))
    }
}

#[test]
fn a_small_error_fails_the_exact_tier() {
    let m = Manifest::load(&dir()).unwrap();
    let model = Model::load(dir().join("tiny-q2.gguf"), LoadOptions::default()).unwrap();
    let mut b = Skewed(CpuBackend::new(&model, 4096, Numerics::Exact));
    let r = check_sequence(&mut b, &m, &dir(), "q2", "q2", "a", Numerics::Exact).unwrap();
    assert!(!r.passed && r.max > 9e-3, "{r:?}");
}
