//! #24 part 2 acceptance on the tiny fixture: a checkpoint in the official naming and
//! dtypes (FP8 block-scaled attention/shared experts, FP4 routed experts, BF16/F32 rest,
//! made from tiny-q2.gguf's weights) converts to GGUFs that load, carry the published
//! tensor types and metadata keys, and whose logits stay within the fixture's ds4 tier
//! of the unquantised conversion; unquantised types round-trip exactly; a stopped run
//! resumes; `splice` mixes q4 layers into a q2 file.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ds4_convert::compare::compare;
use ds4_convert::hf::Checkpoint;
use ds4_convert::imatrix::{Entry, Imatrix};
use ds4_convert::plan::tensor_specs;
use ds4_convert::write::{fingerprint, partial_paths, write};
use ds4_convert::{splice, Mix, Options, Plan};
use ds4_engine::dev::layout::check_layout;
use ds4_engine::dev::{Config, LoadOptions, Model, SessionExt};
use ds4_engine::{Numerics, Session};
use ds4_gguf::{GgmlType, GgufFile};

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tiny")
        .join(rel)
}

/// The tests' scratch folder: one fixed folder under cargo's target tmp dir, emptied when
/// the test process starts (one process runs these tests). A folder per process id in
/// the system temp dir was never removed (statics are not dropped) and left 124 MB
/// behind every run.
fn tmp() -> &'static Path {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ds4-convert-test");
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

/// The tiny checkpoint, written once per test process.
fn checkpoint() -> &'static Path {
    static C: OnceLock<PathBuf> = OnceLock::new();
    C.get_or_init(|| {
        let dir = tmp().join("hf");
        let g = GgufFile::open(fixture("tiny-q2.gguf")).unwrap();
        let cfg = Config::from_gguf(&g).unwrap();
        ds4_convert::testckpt::write_checkpoint(&g, &cfg, &dir, Some(&fixture("tokenizer.json")))
            .unwrap();
        dir
    })
}

fn opts(mix: Mix) -> Options {
    Options {
        hf: checkpoint().to_path_buf(),
        mix,
        imatrix: None,
        template: None,
    }
}

fn convert(o: &Options, name: &str) -> PathBuf {
    let ck = Checkpoint::open(&o.hf).unwrap();
    let plan = Plan::new(o, Some(&ck)).unwrap();
    let out = tmp().join(name);
    let im = o
        .imatrix
        .as_ref()
        .map(|p| Imatrix::read(p).unwrap().index());
    write(&ck, &plan, im.as_ref(), &out, &|_| {}).unwrap();
    assert!(!partial_paths(&out).0.exists());
    assert_eq!(
        std::fs::metadata(&out).unwrap().len(),
        plan.layout.file_size
    );
    out
}

/// Converted files, each made once.
fn converted(mix: Mix) -> &'static Path {
    static F: [OnceLock<PathBuf>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let i = mix as usize;
    F[i].get_or_init(|| convert(&opts(mix), &format!("{}.gguf", mix.name())))
}

fn tokens(seq: &str) -> Vec<u32> {
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("manifest.json")).unwrap()).unwrap();
    m["sequences"][seq]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn logits(path: &Path, numerics: Numerics, toks: &[u32]) -> Vec<f32> {
    let model = Model::load(path, LoadOptions { numerics }).unwrap();
    let mut s = Session::new(&model, 1024).unwrap();
    s.prefill_all_logits(toks).unwrap()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

/// The fixture's ds4 tier (fixtures/tiny/README.md; crates/engine/tests/fixture_logits.rs):
/// per-position max |Δ| median ≤ 0.15, p99 ≤ 0.5, max ≤ 1.0, argmax agreement ≥ 95%
/// and equal wherever the reference margin ≥ 0.75.
fn check_ds4_tier(what: &str, got: &[f32], want: &[f32], vocab: usize) {
    let n = want.len() / vocab;
    let mut per = Vec::new();
    let (mut agree, mut worst) = (0usize, 0.0f32);
    for t in 0..n {
        let (g, w) = (&got[t * vocab..][..vocab], &want[t * vocab..][..vocab]);
        per.push(
            g.iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max),
        );
        if argmax(g) == argmax(w) {
            agree += 1;
        } else {
            let mut s = w.to_vec();
            s.sort_by(|a, b| b.total_cmp(a));
            worst = worst.max(s[0] - s[1]);
        }
    }
    let mut s = per.clone();
    s.sort_by(f32::total_cmp);
    let q = |p: f32| s[((s.len() - 1) as f32 * p).round() as usize];
    let (median, p99, max) = (q(0.5), q(0.99), s[s.len() - 1]);
    let agree = agree as f32 / n as f32;
    println!("{what}: {n} positions, median {median:.4}, p99 {p99:.4}, max {max:.4}, argmax {:.1}%, worst mismatch margin {worst:.3}", 100.0 * agree);
    assert!(
        median <= 0.15 && p99 <= 0.5 && max <= 1.0 && agree >= 0.95 && worst < 0.75,
        "{what}: outside the ds4 tier"
    );
}

#[test]
fn q2_and_q4_have_the_published_types_and_keys_and_stay_in_the_ds4_tier() {
    let reference = GgufFile::open(fixture("tiny-q2.gguf")).unwrap();
    let cfg = Config::from_gguf(&reference).unwrap();
    let toks = tokens("b");
    let plain = logits(converted(Mix::Plain), Numerics::Exact, &toks);
    for mix in [Mix::Q2, Mix::Q4] {
        let path = converted(mix);
        let g = GgufFile::open(path).unwrap();
        // The published types, tensor for tensor, in the published order.
        let specs = tensor_specs(&cfg, mix);
        let got: Vec<_> = g
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ty))
            .collect();
        let want: Vec<_> = specs
            .iter()
            .map(|s| (s.name.clone(), s.dims.clone(), s.published))
            .collect();
        assert_eq!(got, want);
        assert_eq!(check_layout(&cfg, &g), vec![]);
        // The metadata keys (and their values, but for the name and description) of the
        // fixture, which follows the published files.
        for (k, v) in reference.metadata() {
            if k != "general.name" && k != "general.description" {
                assert_eq!(g.get(k), Some(v), "{k}");
            }
        }
        let q = logits(path, Numerics::Fast, &toks);
        check_ds4_tier(&format!("{mix:?} vs plain"), &q, &plain, cfg.vocab);
    }
}

#[test]
fn unquantised_types_round_trip_exactly() {
    let ck = Checkpoint::open(checkpoint()).unwrap();
    let g = GgufFile::open(converted(Mix::Plain)).unwrap();
    let q2 = GgufFile::open(converted(Mix::Q2)).unwrap();
    let mut checked = 0;
    for t in g.tensors() {
        let Some(ds4_convert::names::Source::Tensor(hf)) = ds4_convert::names::source(&t.name)
        else {
            continue;
        };
        let src = ck.tensor(&hf).unwrap();
        let bytes = ck.bytes(src);
        let data = g.view(t).data;
        match src.dtype.as_str() {
            // F32 → F32: the same bytes, in both mixes when the target is F32.
            "F32" => {
                assert_eq!(data, bytes, "{}", t.name);
                let t2 = q2.tensor_info(&t.name).unwrap();
                if t2.ty == GgmlType::F32 {
                    assert_eq!(q2.view(t2).data, bytes, "{}", t.name);
                }
            }
            // BF16 → F32: every value exact (the bf16 bits are the f32's top half).
            "BF16" => {
                for (o, i) in data.chunks_exact(4).zip(bytes.chunks_exact(2)) {
                    assert_eq!(&o[..2], &[0, 0], "{}", t.name);
                    assert_eq!(&o[2..], i, "{}", t.name);
                }
            }
            "I64" => assert_eq!(t.ty, GgmlType::I32),
            _ => {}
        }
        // Every non-expert tensor of the plain file equals the checkpoint's exact values.
        let st = compare(&ck, &g, &t.name).unwrap();
        assert_eq!(st.differing, 0, "{}: {st}", t.name);
        checked += 1;
    }
    assert!(checked > 100, "{checked}");
    // Expert stacks: FP4 → F32 exact in the plain file, quantisation error in q2.
    let st = compare(&ck, &g, "blk.3.ffn_up_exps.weight").unwrap();
    assert_eq!(st.differing, 0, "{st}");
    let st = compare(&ck, &q2, "blk.3.ffn_up_exps.weight").unwrap();
    assert!(st.differing > 0 && st.relative() < 0.6, "{st}");
    let st = compare(&ck, &q2, "blk.3.attn_q_a.weight").unwrap();
    assert!(st.relative() < 0.01, "Q8_0: {st}");
}

#[test]
fn a_stopped_run_resumes_and_a_stale_one_restarts() {
    let full = std::fs::read(converted(Mix::Q4)).unwrap();
    let o = opts(Mix::Q4);
    let ck = Checkpoint::open(&o.hf).unwrap();
    let plan = Plan::new(&o, Some(&ck)).unwrap();
    let out = tmp().join("resume.gguf");
    let (partial, done) = partial_paths(&out);
    // Tensor j is "done" (but scribbled over, so we can see it is not redone); tensor
    // k is not done (zeroed): a resume rewrites k only.
    let (j, k) = (5, plan.specs.len() - 1);
    let range = |i: usize| {
        let a = plan.layout.tensor_offsets[i] as usize;
        a..a + plan.layout.tensor_sizes[i] as usize
    };
    let mut img = full.clone();
    img[range(j)].fill(0xAB);
    img[range(k)].fill(0);
    std::fs::write(&partial, &img).unwrap();
    let mut list = format!("{}\n", fingerprint(&plan.layout.header));
    for i in (0..plan.specs.len()).filter(|&i| i != k) {
        list.push_str(&format!("{i}\n"));
    }
    std::fs::write(&done, &list).unwrap();
    write(&ck, &plan, None, &out, &|_| {}).unwrap();
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got[range(k)], full[range(k)]);
    assert!(got[range(j)].iter().all(|&b| b == 0xAB));
    assert!(!partial.exists() && !done.exists());
    // A progress list of another plan is ignored: everything is rewritten.
    std::fs::write(&partial, &img).unwrap();
    std::fs::write(&done, "ds4-quantize 0000000000000000 1\n5\n").unwrap();
    write(&ck, &plan, None, &out, &|_| {}).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), full);
}

#[test]
fn imatrix_changes_the_routed_experts_only() {
    let cfg = Config::from_gguf(&GgufFile::open(fixture("tiny-q2.gguf")).unwrap()).unwrap();
    // Packed per-stack entries (n_expert × input width), as ds4 --imatrix-out writes.
    let mut entries = Vec::new();
    for il in 0..cfg.n_layer {
        for (part, cols) in [
            ("gate", cfg.n_embd),
            ("up", cfg.n_embd),
            ("down", cfg.n_ff_exp),
        ] {
            entries.push(Entry {
                name: format!("blk.{il}.ffn_{part}_exps.weight"),
                ncall: 3,
                values: (0..cols * cfg.n_expert)
                    .map(|i| 1.0 + ((i * 7919) % 97) as f32)
                    .collect(),
            });
        }
    }
    let im = Imatrix {
        entries,
        last_call: Some(3),
        dataset: Some("test".into()),
    };
    let p = tmp().join("test.imatrix.dat");
    std::fs::write(&p, im.to_bytes()).unwrap();
    let mut o = opts(Mix::Q4);
    o.imatrix = Some(p);
    let path = convert(&o, "q4-imatrix.gguf");
    let a = GgufFile::open(&path).unwrap();
    let b = GgufFile::open(converted(Mix::Q4)).unwrap();
    assert_eq!(
        a.get("quantize.imatrix.entries_count")
            .and_then(|v| v.as_i64()),
        Some(18)
    );
    for t in b.tensors() {
        let (x, y) = (a.tensor(&t.name).unwrap().data, b.view(t).data);
        if t.name.contains("_exps.") {
            assert_ne!(x, y, "{}", t.name);
        } else {
            assert_eq!(x, y, "{}", t.name);
        }
    }
    let model = Model::load(
        &path,
        LoadOptions {
            numerics: Numerics::Fast,
        },
    )
    .unwrap();
    assert!(Session::new(&model, 64)
        .unwrap()
        .prefill_all_logits(&tokens("a"))
        .unwrap()
        .iter()
        .all(|v| v.is_finite()));
}

#[test]
fn splice_takes_the_donor_experts_of_the_chosen_layers() {
    let (base, donor) = (converted(Mix::Q2), converted(Mix::Q4));
    let out = tmp().join("mixed.gguf");
    let layers = splice::parse_layers("0,3-4").unwrap();
    let n = splice::splice(base, donor, &layers, &out).unwrap();
    assert_eq!(n, 9);
    let (m, b, d) = (
        GgufFile::open(&out).unwrap(),
        GgufFile::open(base).unwrap(),
        GgufFile::open(donor).unwrap(),
    );
    assert_eq!(m.tensors().len(), b.tensors().len());
    for t in m.tensors() {
        let from_donor = t.name.contains("_exps.")
            && ["blk.0.", "blk.3.", "blk.4."]
                .iter()
                .any(|p| t.name.starts_with(p));
        let src = if from_donor { &d } else { &b };
        let s = src.tensor(&t.name).unwrap();
        assert_eq!((t.ty, m.view(t).data), (s.ty(), s.data), "{}", t.name);
    }
    let cfg = Config::from_gguf(&m).unwrap();
    assert!(check_layout(&cfg, &m).iter().all(|i| !i.is_fatal()));
    let model = Model::load(
        &out,
        LoadOptions {
            numerics: Numerics::Fast,
        },
    )
    .unwrap();
    assert!(Session::new(&model, 64)
        .unwrap()
        .prefill_all_logits(&tokens("a"))
        .unwrap()
        .iter()
        .all(|v| v.is_finite()));
    assert!(splice::splice(base, donor, &[6], &tmp().join("bad.gguf")).is_err());
}

#[test]
fn a_template_supplies_the_metadata_and_the_tensor_data_is_the_same() {
    let mut o = opts(Mix::Q4);
    o.template = Some(fixture("tiny-q4.gguf"));
    let path = convert(&o, "q4-template.gguf");
    let (a, t, b) = (
        GgufFile::open(&path).unwrap(),
        GgufFile::open(fixture("tiny-q4.gguf")).unwrap(),
        GgufFile::open(converted(Mix::Q4)).unwrap(),
    );
    // Every template key but the description, in the template's order.
    let keys = |g: &GgufFile| {
        g.metadata()
            .iter()
            .filter(|(k, _)| k != "general.description")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&a), keys(&t));
    for x in b.tensors() {
        assert_eq!(
            a.tensor(&x.name).unwrap().data,
            b.view(x).data,
            "{}",
            x.name
        );
    }
}

#[test]
fn a_checkpoint_that_does_not_fit_is_refused_before_writing() {
    // A copy of the checkpoint whose config claims narrower experts than it stores.
    let dir = tmp().join("hf-broken");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(checkpoint()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let mut v = v.as_object().unwrap().clone();
    v.insert("moe_inter_dim".into(), 128.into());
    std::fs::write(
        dir.join("config.json"),
        serde_json::Value::Object(v).to_string(),
    )
    .unwrap();
    let o = Options {
        hf: dir.clone(),
        mix: Mix::Q4,
        imatrix: None,
        template: None,
    };
    let ck = Checkpoint::open(&dir).unwrap();
    let err = Plan::new(&o, Some(&ck)).err().expect("refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("layers.0.ffn.experts.0.w1.weight: I8 [256, 128]"),
        "{msg}"
    );
    assert!(msg.contains("[128, 256] expert"), "{msg}");
}
