//! Directional steering on the CPU backend (docs/architecture.md §8 item 17): zero
//! scales are bit-identical to none, a direction built on the tiny model moves each
//! layer's FFN output projection as `y − s·d·(d·y)` says, and bad inputs are refused.

mod common;

use std::sync::Arc;

use common::*;
use ds4_engine::dev::steer::{project_rows, DirectionBuilder};
use ds4_engine::dev::{Backend, CpuBackend, LogitRows, Model};
use ds4_engine::{BackendChoice, Component, Engine, EngineOptions, Numerics, Steering};

fn model() -> Model {
    load("q2", Numerics::Exact)
}

/// `n` token ids spread over the vocabulary.
fn spread(n: usize, vocab: usize, mul: u64, add: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i * mul + add) % vocab as u64) as u32)
        .collect()
}

/// The last token's `c` row of every layer (`[n_layer][n_embd]`) after `tokens`.
fn last_rows(m: &Model, tokens: &[u32], c: Component) -> Vec<f32> {
    let cfg = m.config();
    let (nl, e, n) = (cfg.n_layer, cfg.n_embd, tokens.len());
    let (_, act) = CpuBackend::new(m, 256, Numerics::Exact)
        .forward_tap(tokens, c)
        .unwrap();
    assert_eq!(act.len(), nl * n * e);
    (0..nl)
        .flat_map(|il| act[(il * n + n - 1) * e..(il * n + n) * e].to_vec())
        .collect()
}

/// A direction built like `ds4-tool steer build` from two sets of token prompts.
fn built(m: &Model, c: Component) -> Vec<f32> {
    let cfg = m.config();
    let v = cfg.vocab;
    let mut b = DirectionBuilder::new(cfg.n_layer, cfg.n_embd);
    for i in 0..3u64 {
        b.add(true, &last_rows(m, &spread(9, v, 7, 3 + i), c));
        b.add(false, &last_rows(m, &spread(9, v, 11, 101 + 5 * i), c));
    }
    b.finish(true).unwrap().0
}

fn steering(m: &Model, dirs: Vec<f32>, ffn: f32, attn: f32) -> Arc<Steering> {
    let c = m.config();
    Arc::new(Steering::new(dirs, c.n_layer, c.n_embd, ffn, attn).unwrap())
}

fn logits(m: &Model, s: Option<Arc<Steering>>, tokens: &[u32]) -> Vec<f32> {
    let mut b = CpuBackend::new(m, 256, Numerics::Exact).with_steering(s);
    b.forward(tokens, LogitRows::All).unwrap()
}

#[test]
fn zero_scales_are_bit_identical_to_no_steering() {
    let m = model();
    let tokens = tokens("b");
    let dirs = built(&m, Component::FfnOut);
    let plain = logits(&m, None, &tokens);
    let zero = logits(&m, Some(steering(&m, dirs.clone(), 0.0, 0.0)), &tokens);
    assert_eq!(
        plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        zero.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    // And the same through the engine API: scale 0 means no steering at all.
    let mut e = Engine::open(
        dir().join("tiny-q2.gguf"),
        EngineOptions::new(BackendChoice::Cpu { threads: None }, Numerics::Exact),
    )
    .unwrap();
    let c = m.config();
    e.set_steering(Some(
        Steering::new(dirs.clone(), c.n_layer, c.n_embd, 0.0, 0.0).unwrap(),
    ))
    .unwrap();
    assert!(e.steering().is_none(), "zero scales turn steering off");
    let mut s = e.new_session(256).unwrap();
    s.prefill(&tokens).unwrap();
    let last = &plain[(tokens.len() - 1) * c.vocab..];
    assert_eq!(s.logits(), last);
    // A nonzero scale through the engine changes the logits.
    e.set_steering(Some(
        Steering::new(dirs, c.n_layer, c.n_embd, 1.0, 0.0).unwrap(),
    ))
    .unwrap();
    let mut s = e.new_session(256).unwrap();
    s.prefill(&tokens).unwrap();
    let moved = s.logits().iter().zip(last).map(|(a, b)| (a - b).abs());
    assert!(moved.fold(0.0f32, f32::max) > 1e-3);
}

/// Per layer L, with only layer L's direction set (the others zero, which changes
/// nothing): layers before L are untouched, and layer L's FFN output projection onto
/// d is (1 − s) times the unsteered one, for every token: ~0 at s = 1, doubled at −1.
#[test]
fn a_built_direction_moves_each_layers_ffn_projection_as_the_formula_says() {
    let m = model();
    let cfg = m.config();
    let (nl, e) = (cfg.n_layer, cfg.n_embd);
    let dirs = built(&m, Component::FfnOut);
    for il in 0..nl {
        let d = &dirs[il * e..(il + 1) * e];
        let n2: f32 = d.iter().map(|v| v * v).sum();
        assert!((n2 - 1.0).abs() < 1e-5, "layer {il}: |d|² {n2}");
    }
    let tokens = spread(40, cfg.vocab, 13, 29);
    let n = tokens.len();
    let tap = |s: Option<Arc<Steering>>| {
        CpuBackend::new(&m, 256, Numerics::Exact)
            .with_steering(s)
            .forward_tap(&tokens, Component::FfnOut)
            .unwrap()
            .1
    };
    let plain = tap(None);
    let proj = |rows: &[f32], d: &[f32]| -> Vec<f32> {
        rows.chunks_exact(e)
            .map(|r| r.iter().zip(d).map(|(a, b)| a * b).sum())
            .collect()
    };
    for il in 0..nl {
        let mut only = vec![0.0f32; nl * e];
        only[il * e..(il + 1) * e].copy_from_slice(&dirs[il * e..(il + 1) * e]);
        let d = &dirs[il * e..(il + 1) * e];
        let layer = |a: &[f32]| a[il * n * e..(il + 1) * n * e].to_vec();
        let p0 = proj(&layer(&plain), d);
        let scale0: f32 = p0.iter().map(|v| v.abs()).fold(0.0, f32::max);
        assert!(
            scale0 > 1e-3,
            "layer {il}: the direction is seen ({scale0})"
        );
        for s in [1.0f32, -1.0, 0.5] {
            let got = tap(Some(steering(&m, only.clone(), s, 0.0)));
            assert_eq!(got[..il * n * e], plain[..il * n * e], "layers before {il}");
            let p = proj(&layer(&got), d);
            for (t, (&a, &b)) in p.iter().zip(&p0).enumerate() {
                let want = (1.0 - s) * b;
                assert!(
                    (a - want).abs() <= 1e-4 * (1.0 + scale0),
                    "layer {il} token {t} scale {s}: projection {a}, want {want}"
                );
            }
            // The part orthogonal to d is unchanged.
            let mut a = layer(&got);
            let mut b = layer(&plain);
            project_rows(&mut a, d, 1.0);
            project_rows(&mut b, d, 1.0);
            let diff = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(
                diff < 1e-4,
                "layer {il} scale {s}: orthogonal part moved {diff}"
            );
        }
    }
}

/// Attention steering edits attn_out the same way, and a steered session still
/// prefills in chunks exactly as token by token, and copies keep the steering.
#[test]
fn attention_steering_chunks_and_copies() {
    let m = model();
    let cfg = m.config();
    let (nl, e) = (cfg.n_layer, cfg.n_embd);
    let dirs = built(&m, Component::AttnOut);
    let s = steering(&m, dirs.clone(), 0.0, 1.0);
    let tokens = spread(30, cfg.vocab, 17, 5);
    let n = tokens.len();
    let (_, act) = CpuBackend::new(&m, 256, Numerics::Exact)
        .with_steering(Some(s.clone()))
        .forward_tap(&tokens, Component::AttnOut)
        .unwrap();
    for il in 0..nl {
        let d = &dirs[il * e..(il + 1) * e];
        for r in act[il * n * e..(il + 1) * n * e].chunks_exact(e) {
            let p: f32 = r.iter().zip(d).map(|(a, b)| a * b).sum();
            assert!(
                p.abs() < 1e-4,
                "layer {il}: attn_out projection {p} after s = 1"
            );
        }
    }
    let both = steering(&m, dirs, 1.0, 0.5);
    let whole = logits(&m, Some(both.clone()), &tokens);
    let mut b = CpuBackend::new(&m, 256, Numerics::Exact).with_steering(Some(both.clone()));
    let mut chunked = b.forward(&tokens[..7], LogitRows::All).unwrap();
    let mut c = b.try_clone_box().unwrap();
    for &t in &tokens[7..] {
        chunked.extend(b.forward(&[t], LogitRows::All).unwrap());
    }
    assert_eq!(chunked, whole);
    let rest = c.forward(&tokens[7..], LogitRows::All).unwrap();
    assert_eq!(rest, whole[7 * cfg.vocab..]);
    assert_ne!(whole, logits(&m, None, &tokens));
}

#[test]
fn steering_of_the_wrong_shape_is_refused() {
    let mut e = Engine::open(
        dir().join("tiny-q2.gguf"),
        EngineOptions::new(BackendChoice::Cpu { threads: None }, Numerics::Exact),
    )
    .unwrap();
    let c = e.info().hparams.clone();
    let wrong = Steering::new(vec![0.0; 43 * 4096], 43, 4096, 1.0, 0.0).unwrap();
    let err = e.set_steering(Some(wrong.clone())).unwrap_err().to_string();
    assert!(
        err.contains("43 × 4096") && err.contains(&format!("{} × {}", c.n_layer, c.n_embd)),
        "{err}"
    );
    let mut s = e.new_session(64).unwrap();
    assert!(s.set_steering(Some(Arc::new(wrong))).is_err());
    // A file of the reference's layout but the wrong size for this model.
    let path = std::env::temp_dir().join(format!("ds4-steer-test-{}.f32", std::process::id()));
    ds4_engine::dev::steer::write_dirs(&path, &vec![0.5; c.n_layer * c.n_embd - 1]).unwrap();
    let err = Steering::load(&path, c.n_layer, c.n_embd, 1.0, 0.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&path.display().to_string()) && err.contains("expected"),
        "{err}"
    );
    let _ = std::fs::remove_file(&path);
}

/// The reference's own direction file (fixtures/steering, its `dir-steering/out`) loads
/// for the DeepSeek V4 Flash shape: 43 unit directions of 4096, used as stored.
#[test]
fn the_reference_direction_file_loads() {
    let path = dir().join("../steering/verbosity.f32");
    let c = ds4_engine::Config::flash();
    let s = Steering::load(
        &path,
        c.n_layer,
        c.n_embd,
        Steering::DEFAULT_FFN,
        Steering::DEFAULT_ATTN,
    )
    .unwrap();
    assert_eq!((s.n_layer, s.n_embd, s.ffn, s.attn), (43, 4096, 1.0, 0.0));
    for il in 0..43 {
        let n: f64 = s.dir(il).iter().map(|&v| (v as f64) * (v as f64)).sum();
        assert!((n - 1.0).abs() < 1e-5, "layer {il}: |d|² = {n}");
    }
    // Not the tiny model's shape: refused, naming the file.
    let err = Steering::load(&path, 6, 256, 1.0, 0.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("verbosity.f32") && err.contains("704512 bytes"),
        "{err}"
    );
}
