//! The MTP draft block on the CPU (architecture.md §2.5, §7): loading and refusing MTP
//! files, the draft math against an f64 reference, the block's layer against the main
//! model's own layer on the same weights, its raw ring, determinism.
//!
//! A synthetic tiny main model (2 ratio-0 layers, top-k routed: no hash layers, so that
//! the main model has a layer of the block's kind) and its matching synthetic MTP file
//! are built in memory once (byte-identical to the files `Plan::write` makes; one test
//! writes and opens them from a temporary directory); variants are rewritten in memory.

use std::sync::{Arc, OnceLock};

use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::mtp::layout::mtp_name;
use ds4_engine::dev::weights::HcWeights;
use ds4_engine::dev::{cpu_layer_forward, CpuBackend, LayerCache, LoadOptions, LogitRows, Model};
use ds4_engine::{
    BackendChoice, Engine, EngineError, EngineOptions, ErrorKind, Mtp, MtpState, Numerics,
};
use ds4_gguf::{GgmlType, GgufFile, GgufWriter};
use ds4_synth::{Plan, Vocab};

fn main_config() -> Config {
    let mut cfg = Config::tiny(2);
    cfg.n_hash_layer = 0;
    cfg
}

fn main_plan() -> Plan {
    let cfg = main_config();
    let vocab = Vocab::builtin(cfg.vocab).unwrap();
    Plan::new(cfg, ExpertQuant::Q2, &vocab, "mtp test main").unwrap()
}

fn mtp_plan() -> Plan {
    Plan::mtp(main_config(), ExpertQuant::Q4, "mtp test").unwrap()
}

const MAIN_SEED: u64 = 11;
const MTP_SEED: u64 = 12;

/// The two files' images, built once (byte-identical to the written files).
fn images() -> &'static (Vec<u8>, Vec<u8>) {
    static F: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    F.get_or_init(|| {
        (
            main_plan().build(MAIN_SEED, &|_| {}),
            mtp_plan().build(MTP_SEED, &|_| {}),
        )
    })
}

fn main_model() -> Model {
    let file = GgufFile::from_bytes(images().0.clone()).unwrap();
    Model::from_gguf(
        Arc::new(file),
        LoadOptions {
            numerics: Numerics::Exact,
        },
    )
    .unwrap()
}

fn mtp_file() -> GgufFile {
    GgufFile::from_bytes(images().1.clone()).unwrap()
}

fn load_mtp(main: &Model) -> Mtp {
    Mtp::from_gguf(main, Arc::new(mtp_file())).unwrap()
}

/// A new in-memory GGUF from `src`'s tensors: `edit(name, dims, type)` gives each
/// tensor's new (dims, type, data) (`None` drops it); `extra` tensors are appended.
fn rewrite(
    src: &GgufFile,
    edit: impl Fn(&str, &[u64], GgmlType, &[u8]) -> Option<(Vec<u64>, GgmlType, Vec<u8>)>,
    extra: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
) -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add(k.clone(), v.clone()).unwrap();
    }
    let mut data = Vec::new();
    let kept = src
        .tensors()
        .iter()
        .filter_map(|t| {
            edit(&t.name, &t.dims, t.ty, src.view(t).data)
                .map(|(d, ty, b)| (t.name.clone(), d, ty, b))
        })
        .chain(extra);
    for (name, dims, ty, bytes) in kept {
        w.add_tensor(name, &dims, ty).unwrap();
        data.push(bytes);
    }
    let mut out = Vec::new();
    w.write_to(&mut out, |i, buf| {
        buf.extend_from_slice(&data[i]);
        Ok(())
    })
    .unwrap();
    Arc::new(GgufFile::from_bytes(out).unwrap())
}

fn same(_: &str, d: &[u64], t: GgmlType, b: &[u8]) -> Option<(Vec<u64>, GgmlType, Vec<u8>)> {
    Some((d.to_vec(), t, b.to_vec()))
}

/// The MTP file without the tensor `name`.
fn mtp_without(name: &str) -> Arc<GgufFile> {
    rewrite(
        &mtp_file(),
        |n, d, t, b| (n != name).then(|| (d.to_vec(), t, b.to_vec())),
        Vec::new(),
    )
}

/// The MTP file with the tensor `name` replaced by what `edit` makes of its dims, type
/// and bytes; the other tensors unchanged.
fn mtp_edited(
    name: &str,
    edit: impl Fn(&[u64], GgmlType, &[u8]) -> (Vec<u64>, GgmlType, Vec<u8>),
) -> Arc<GgufFile> {
    rewrite(
        &mtp_file(),
        |n, d, t, b| {
            Some(if n == name {
                edit(d, t, b)
            } else {
                (d.to_vec(), t, b.to_vec())
            })
        },
        Vec::new(),
    )
}

/// The MTP file with its block tensors replaced by copies of main layer 1's (a ratio-0,
/// top-k layer like the block): the block then computes exactly main layer 1.
fn mtp_copying_layer1(main: &GgufFile) -> Arc<GgufFile> {
    rewrite(
        &mtp_file(),
        |name, d, t, b| {
            let rest = name.strip_prefix("mtp.0.").unwrap();
            match main.tensor(&format!("blk.1.{rest}")) {
                Some(v) => Some((v.dims().to_vec(), v.ty(), v.data.to_vec())),
                None => Some((d.to_vec(), t, b.to_vec())),
            }
        },
        Vec::new(),
    )
}

fn load_err(file: Arc<GgufFile>) -> EngineError {
    Mtp::from_gguf(&main_model(), file).unwrap_err()
}

/// Deterministic pseudo-random values in about ±1.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The main model's final HC state after `tokens` (from the CPU forward's hook).
fn main_state(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut b = CpuBackend::new(model, 64, Numerics::Exact);
    let (logits, hc) = b.forward_with_hc(tokens, LogitRows::Last).unwrap();
    assert_eq!(logits.len(), model.config().vocab);
    hc
}

// ---------------------------------------------------------------- (a) loading

#[test]
fn the_synthetic_mtp_file_loads_against_its_main_model() {
    // Written to disk and opened by path, as a user would.
    let dir = std::env::temp_dir().join(format!("ds4-mtp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (main_path, mtp_path) = (dir.join("main.gguf"), dir.join("mtp.gguf"));
    main_plan().write(&main_path, MAIN_SEED, &|_| {}).unwrap();
    mtp_plan().write(&mtp_path, MTP_SEED, &|_| {}).unwrap();
    let main = Model::load(&main_path, LoadOptions::default()).unwrap();
    let mtp = Mtp::load(&main, &mtp_path);
    let engine = Engine::open(
        &main_path,
        EngineOptions::new(BackendChoice::Cpu { threads: None }, Numerics::Exact),
    )
    .unwrap();
    let via_engine = engine.load_mtp(&mtp_path);
    let main_as_mtp = Mtp::load(&main, &main_path);
    std::fs::remove_dir_all(&dir).unwrap();

    let mtp = mtp.unwrap();
    let w = mtp.weights();
    assert_eq!(w.layer.ratio, 0);
    assert!(w.layer.compressor.is_none() && w.layer.indexer.is_none());
    assert!(w.layer.tid2eid.is_none(), "the block routes top-k");
    assert!(w.layer.exp_probs_b.is_some());
    assert_eq!(
        w.layer.gate_exps.ty,
        GgmlType::Q4_K,
        "the shipped expert type"
    );
    assert_eq!(w.e_proj.ty, GgmlType::Q8_0);
    assert_eq!((w.e_proj.n_in, w.e_proj.n_out), (256, 256));
    assert_eq!(w.head_hc.base.len(), 4);
    assert_eq!(via_engine.unwrap().numerics(), Numerics::Exact);

    // The main model passed as the MTP file.
    let err = main_as_mtp.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::NotMtp(_)), "{msg}");
    assert!(msg.contains("main model"), "{msg}");
    assert_eq!(err.kind(), ErrorKind::BadFile);
}

#[test]
fn a_missing_tensor_is_refused_by_name() {
    let name = mtp_name("hnorm");
    let err = load_err(mtp_without(&name));
    let msg = err.to_string();
    assert!(matches!(err, EngineError::MissingTensor { .. }), "{msg}");
    assert!(msg.contains("mtp.0.hnorm.weight"), "{msg}");
    assert_eq!(err.kind(), ErrorKind::BadFile);
    // exp_probs_b is optional in the main layout but required in the block.
    let err = load_err(mtp_without("mtp.0.exp_probs_b.bias"));
    assert!(err.to_string().contains("mtp.0.exp_probs_b.bias"), "{err}");
    // Without the marker tensor it is still recognised as an MTP file.
    let err = load_err(mtp_without("mtp.0.e_proj.weight"));
    assert!(matches!(err, EngineError::MissingTensor { .. }), "{err}");
    assert!(err.to_string().contains("mtp.0.e_proj.weight"), "{err}");
}

/// Asserts that loading `file` fails with a shape error that names `tensor` and both
/// `shapes` (the file's and the expected one).
fn assert_wrong_shape(file: Arc<GgufFile>, tensor: &str, shapes: [&str; 2]) {
    let err = load_err(file);
    let msg = err.to_string();
    assert!(matches!(err, EngineError::TensorDims { .. }), "{msg}");
    assert!(msg.contains(tensor), "{msg}");
    assert!(shapes.iter().all(|s| msg.contains(s)), "{msg}");
}

#[test]
fn a_wrong_shape_is_refused_with_both_shapes() {
    // [256, 128] Q8_0: 128 rows of 8 blocks of 34 bytes.
    let file = mtp_edited("mtp.0.e_proj.weight", |_, t, _| {
        (vec![256, 128], t, vec![0; 128 * 8 * 34])
    });
    assert_wrong_shape(file, "mtp.0.e_proj.weight", ["[256, 128]", "[256, 256]"]);
}

#[test]
fn an_extra_tensor_and_an_unsupported_type_are_refused() {
    let err = load_err(rewrite(
        &mtp_file(),
        same,
        vec![(
            "mtp.0.attn_compressor_norm.weight".into(),
            vec![160],
            GgmlType::F32,
            vec![0; 640],
        )],
    ));
    assert!(
        err.to_string()
            .contains("mtp.0.attn_compressor_norm.weight"),
        "{err}"
    );
    let err = load_err(mtp_edited("mtp.0.norm.weight", |d, _, b| {
        (d.to_vec(), GgmlType::I32, b.to_vec())
    }));
    assert!(matches!(err, EngineError::TensorType { .. }), "{err}");
    assert!(err.to_string().contains("mtp.0.norm.weight"), "{err}");
}

#[test]
fn an_mtp_file_for_another_n_embd_is_refused() {
    let mut other = main_config();
    other.n_embd = 512; // Q4_K experts need a multiple of 256
    let image = Plan::mtp(other, ExpertQuant::Q4, "other width")
        .unwrap()
        .build(3, &|_| {});
    // The first block tensor: hc_attn_fn is [n_hc·n_embd, mix].
    assert_wrong_shape(
        Arc::new(GgufFile::from_bytes(image).unwrap()),
        "mtp.0.hc_attn_fn.weight",
        ["[2048, 24]", "[1024, 24]"],
    );
}

// ---------------------------------------------------------------- (b) the draft math

fn rms64(x: &[f64]) -> f64 {
    1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + 1e-6).sqrt()
}

/// `x` RMS-normalised and scaled by the weight `norm`.
fn rmsnorm64(x: &[f64], norm: &[f32]) -> Vec<f64> {
    let rs = rms64(x);
    x.iter()
        .zip(norm)
        .map(|(v, &n)| v * rs * n as f64)
        .collect()
}

/// `out = W·x` with `w` row-major `[rows][x.len()]`.
fn matvec64(w: &[f32], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|r| r.iter().zip(x).map(|(&a, b)| a as f64 * b).sum())
        .collect()
}

fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: all zero");
    let worst = got
        .iter()
        .zip(want)
        .map(|(&g, w)| (g as f64 - w).abs())
        .fold(0.0, f64::max);
    assert!(
        worst <= rel * scale,
        "{what}: max error {worst} vs scale {scale}"
    );
}

#[test]
fn draft_input_and_head_match_an_f64_reference() {
    let main = main_model();
    let cfg = main.config().clone();
    let (e, nhc) = (cfg.n_embd, cfg.n_hc);
    let mtp = load_mtp(&main);
    let w = mtp.weights();
    let g = main_state(&main, &[0, 70, 71, 72, 73]);
    assert_eq!(g.len(), nhc * e);
    let x = 74u32;

    // e = e_proj·rmsnorm(emb[x], enorm); g_s = h_proj·rmsnorm(G_s, hnorm); Hin_s = e + g_s.
    let mut emb = vec![0.0f32; e];
    main.weights()
        .token_embd
        .view()
        .dequant_row(x as usize, &mut emb);
    let emb: Vec<f64> = emb.iter().map(|&v| v as f64).collect();
    let en = rmsnorm64(&emb, &w.enorm);
    let ev = matvec64(&w.e_proj.to_f32(), &en);
    let hp = w.h_proj.to_f32();
    let mut hin_ref = Vec::with_capacity(nhc * e);
    for s in 0..nhc {
        let gs: Vec<f64> = g[s * e..(s + 1) * e].iter().map(|&v| v as f64).collect();
        let gv = matvec64(&hp, &rmsnorm64(&gs, &w.hnorm));
        hin_ref.extend(ev.iter().zip(&gv).map(|(a, b)| a + b));
    }
    let hin = mtp.input_state(x, &g).unwrap();
    assert_close(&hin, &hin_ref, 1e-5, "Hin");

    // The head: w_s = sigmoid(hc_head_fn·flat·rms·scale + base_s) + eps, the weighted
    // stream sum, mtp.0.norm, and the main model's output.weight.
    let mut st = mtp.new_state();
    let d = mtp.draft(&mut st, x, &g, 5).unwrap();
    assert_eq!(d.hc.len(), nhc * e);
    let logits_ref = head64(
        &d.hc,
        &w.head_hc,
        &w.norm,
        &main.weights().output.to_f32(),
        nhc,
    );
    assert_close(&d.logits, &logits_ref, 1e-5, "logits");
}

/// The output head in f64 (architecture.md §5.7): `w_s = sigmoid(fn·flat·rms·scale +
/// base_s) + 1e-6`, the weighted stream sum, rmsnorm with `norm`, then `output`.
fn head64(hc: &[f32], head: &HcWeights, norm: &[f32], output: &[f32], nhc: usize) -> Vec<f64> {
    let e = hc.len() / nhc;
    let h: Vec<f64> = hc.iter().map(|&v| v as f64).collect();
    let rs = rms64(&h);
    let pre = matvec64(&head.fn_.to_f32(), &h);
    let wts: Vec<f64> = (0..nhc)
        .map(|s| {
            let z = pre[s] * rs * head.scale[0] as f64 + head.base[s] as f64;
            1.0 / (1.0 + (-z).exp()) + 1e-6
        })
        .collect();
    let mut y = vec![0.0f64; e];
    for s in 0..nhc {
        for (yi, hv) in y.iter_mut().zip(&h[s * e..(s + 1) * e]) {
            *yi += wts[s] * hv;
        }
    }
    matvec64(output, &rmsnorm64(&y, norm))
}

#[test]
fn the_forward_hook_returns_the_state_the_head_reads() {
    let main = main_model();
    let mut b = CpuBackend::new(&main, 64, Numerics::Exact);
    let (logits, hc) = b
        .forward_with_hc(&[0, 60, 61, 62], LogitRows::Last)
        .unwrap();
    let w = main.weights();
    let want = head64(&hc, &w.head_hc, &w.output_norm, &w.output.to_f32(), 4);
    assert_close(&logits, &want, 1e-5, "main logits from the hooked state");
    // The last token's state, whether it ran in a chunk or as one decode step.
    let mut c = CpuBackend::new(&main, 64, Numerics::Exact);
    c.forward_with_hc(&[0, 60, 61], LogitRows::None).unwrap();
    let (_, hc1) = c.forward_with_hc(&[62], LogitRows::Last).unwrap();
    assert!(hc1 == hc);
    let (_, other) = c.forward_with_hc(&[63], LogitRows::Last).unwrap();
    assert!(other != hc);
}

#[test]
fn the_block_runs_exactly_the_main_layer_code_on_copied_weights() {
    let main = main_model();
    let cfg = main.config().clone();
    let mtp = Mtp::from_gguf(&main, mtp_copying_layer1(main.gguf())).unwrap();
    assert_eq!(mtp.weights().layer.il, 1, "ds4 runs the block as layer 1");
    let mut st = mtp.new_state();
    let mut cache = LayerCache::new(&cfg, 1, 64);
    let mut g = main_state(&main, &[0, 80, 81]);
    // More positions than the window (16), so both rings roll over.
    for pos in 3..3 + cfg.window + 6 {
        let x = (pos as u32 * 37 + 11) % cfg.vocab as u32;
        let mut h = mtp.input_state(x, &g).unwrap();
        cpu_layer_forward(&main, 1, Numerics::Exact, pos, &[x], &mut h, &mut cache);
        let d = mtp.draft(&mut st, x, &g, pos).unwrap();
        assert!(
            d.hc == h,
            "position {pos}: block output differs from main layer 1"
        );
        assert!(d.logits.iter().all(|v| v.is_finite()));
        g = d.hc; // a chained draft
    }
    assert_eq!(st.n_raw(), cfg.window);
    // With its own (random) block the output differs: the comparison can fail.
    let own = load_mtp(&main);
    let g0 = main_state(&main, &[0, 80, 81]);
    let a = own.draft(&mut own.new_state(), 5, &g0, 3).unwrap();
    let b = mtp.draft(&mut mtp.new_state(), 5, &g0, 3).unwrap();
    assert_ne!(a.hc, b.hc);
}

// ---------------------------------------------------------------- (c) the raw ring

/// Drafts at positions `from..=to` (token and incoming state a function of the
/// position) and returns the last logits.
fn run(mtp: &Mtp, st: &mut MtpState, from: usize, to: usize) -> Vec<f32> {
    let cfg = mtp.main().config();
    let mut last = Vec::new();
    for pos in from..=to {
        let x = (pos as u32 * 53 + 7) % cfg.vocab as u32;
        let g = values(cfg.n_hc * cfg.n_embd, pos as u64);
        last = mtp.draft(st, x, &g, pos).unwrap().logits;
    }
    last
}

#[test]
fn the_raw_ring_rolls_over_past_128_positions() {
    let main = main_model();
    let mtp = load_mtp(&main);
    let w = main.config().window;
    let n = 140; // past 128 (the real window) and many times the tiny window
    let mut all = mtp.new_state();
    assert_eq!(all.capacity(), w);
    let full = run(&mtp, &mut all, 0, n);
    assert_eq!(all.n_raw(), w);
    // A raw row depends only on its own position's input, so after rolling over the
    // ring must hold exactly the last `w` positions: a fresh state fed only those
    // gives the same logits bit for bit …
    let mut last_w = mtp.new_state();
    assert_eq!(run(&mtp, &mut last_w, n + 1 - w, n), full);
    // … and one that saw a row fewer does not.
    let mut short = mtp.new_state();
    assert_ne!(run(&mtp, &mut short, n + 2 - w, n), full);
    // reset empties the ring.
    all.reset();
    assert_eq!(all.n_raw(), 0);
    assert_eq!(run(&mtp, &mut all, n + 1 - w, n), full);
}

// ---------------------------------------------------------------- (d) determinism

#[test]
fn the_same_inputs_give_bit_identical_drafts() {
    let main = main_model();
    let g = main_state(&main, &[0, 90, 91, 92]);
    let chain = |mtp: &Mtp| {
        let mut st = mtp.new_state();
        let mut g = g.clone();
        let mut out = Vec::new();
        for (i, x) in [93u32, 94, 95, 96].into_iter().enumerate() {
            let d = mtp.draft(&mut st, x, &g, 4 + i).unwrap();
            g = d.hc.clone();
            out.push(d);
        }
        out
    };
    let a = chain(&load_mtp(&main));
    let b = chain(&load_mtp(&main));
    assert_eq!(a, b);
    // Chained drafts see their own output state: the steps differ.
    assert_ne!(a[0].logits, a[1].logits);
    // The main model's final state is itself deterministic.
    assert_eq!(g, main_state(&main, &[0, 90, 91, 92]));
}

#[test]
fn bad_inputs_are_errors() {
    let main = main_model();
    let mtp = load_mtp(&main);
    let mut st = mtp.new_state();
    let g = vec![0.5f32; 4 * 256];
    let err = mtp.draft(&mut st, 512, &g, 0).unwrap_err();
    assert!(matches!(err, EngineError::BadToken { .. }), "{err}");
    let err = mtp.draft(&mut st, 1, &g[..256], 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadInput, "{err}");
    assert_eq!(st.n_raw(), 0, "a refused draft leaves the ring alone");
}

#[test]
fn the_block_routes_top_k_on_a_model_whose_layer_1_is_hash_routed() {
    // The tiny fixture has hash layers 0..3; the block still runs as layer 1 (for its
    // per-layer tables) but binds and routes as a top-k layer.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny");
    let main = Model::load(dir.join("tiny-q4.gguf"), LoadOptions::default()).unwrap();
    assert!(main.weights().layers[1].tid2eid.is_some());
    let mtp = load_mtp(&main);
    assert!(mtp.weights().layer.tid2eid.is_none());
    let g = main_state(&main, &[0, 100, 101]);
    let exact = mtp.draft(&mut mtp.new_state(), 102, &g, 3).unwrap();
    assert!(exact.logits.iter().all(|v| v.is_finite()));
    // Fast numerics (ds4's quantised activations) reach the block too.
    let fast = mtp.clone().with_numerics(Numerics::Fast);
    let f1 = fast.draft(&mut fast.new_state(), 102, &g, 3).unwrap();
    let f2 = fast.draft(&mut fast.new_state(), 102, &g, 3).unwrap();
    assert_eq!(f1, f2);
    assert_ne!(f1.logits, exact.logits);
    assert!(f1.logits.iter().all(|v| v.is_finite()));
}
