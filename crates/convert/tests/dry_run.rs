//! `--dry-run` on a config-only checkpoint directory of the full dimensions predicts the
//! published q2/q4 tensor data to the byte (architecture.md §2.6) and equals the
//! synthetic writer's layout for the same mix, tensor for tensor.

use ds4_convert::{Mix, Options, Plan};
use ds4_engine::dev::{Config, ExpertQuant};
use ds4_synth::{flash_config, Vocab};

#[test]
fn dry_run_on_the_full_layout_predicts_the_published_sizes() {
    let dir = std::env::temp_dir().join(format!("ds4-convert-dry-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("inference")).unwrap();
    let mut ratios = Config::flash_ratios(43);
    ratios.push(0);
    let cfg = serde_json::json!({
        "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43,
        "n_hash_layers": 3, "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1,
        "n_activated_experts": 6, "score_func": "sqrtsoftplus", "route_scale": 1.5,
        "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
        "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536,
        "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "compress_rope_theta": 160000, "compress_ratios": ratios
    });
    std::fs::write(dir.join("inference/config.json"), cfg.to_string()).unwrap();
    for (mix, eq, published) in [
        (Mix::Q2, ExpertQuant::Q2, 86_714_775_900u64),
        (Mix::Q4, ExpertQuant::Q4, 164_628_167_004),
    ] {
        let o = Options {
            hf: dir.clone(),
            mix,
            imatrix: None,
            template: None,
        };
        let plan = Plan::new(&o, None).unwrap();
        assert_eq!(plan.specs.len(), 1328);
        assert_eq!(plan.tensor_bytes(), published, "{mix:?}");
        let fc = flash_config(43);
        let synth =
            ds4_synth::Plan::new(fc.clone(), eq, &Vocab::builtin(fc.vocab).unwrap(), "x").unwrap();
        assert_eq!(synth.tensor_bytes(), published);
        assert_eq!(plan.layout.tensor_sizes, synth.layout.tensor_sizes);
        let names = |s: &[ds4_engine::dev::TensorSpec]| {
            s.iter()
                .map(|t| (t.name.clone(), t.dims.clone(), t.published))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&plan.specs), names(&synth.specs));
        // The file: the header, then every tensor at its aligned offset.
        let last = plan.specs.len() - 1;
        assert_eq!(
            plan.layout.file_size,
            plan.layout.tensor_offsets[last] + plan.layout.tensor_sizes[last]
        );
        assert_eq!(
            plan.layout.tensor_offsets[0],
            plan.layout.header.len() as u64
        );
        let report = plan.report();
        assert!(
            report.contains(&format!("tensor data {published} bytes")),
            "{report}"
        );
        assert!(report.contains("blk.42.ffn_down_exps.weight"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
