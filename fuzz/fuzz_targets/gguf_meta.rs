//! #18 item 11: any byte string, parsed as a GGUF, must either give a model config whose
//! values are sane (bounded counts, positive finite floats, one entry per layer) or be
//! refused with an error; never a panic, overflow or hang in the config or layout check.
#![no_main]

use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::check_layout;
use ds4_gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let Ok(cfg) = Config::from_gguf(&file) else {
        return;
    };
    // What the loader derives from an accepted config must be computable.
    assert_eq!(cfg.compress_ratios.len(), cfg.n_layer);
    assert_eq!(cfg.swiglu_clamp.len(), cfg.n_layer);
    assert!(cfg.sinkhorn_iters <= 1000);
    for x in [cfg.rms_eps, cfg.hc_eps, cfg.rope_freq_base, cfg.rope_scaling_factor] {
        assert!(x.is_finite() && x > 0.0);
    }
    let _ = (cfg.q_dim(), cfg.hc_mix(), cfg.profile_deviations());
    for il in 0..cfg.n_layer {
        let _ = cfg.has_indexer(il);
    }
    let _ = check_layout(&cfg, &file);
});
