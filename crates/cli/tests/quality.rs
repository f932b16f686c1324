//! `ds4-tool quality` and `ds4-tool logprob-vectors` on vectors made for the tiny
//! fixture (fixtures/vectors/, PROVENANCE.md there): the stored vectors pass, perturbed
//! ones fail (a wrong greedy token, a logprob off by 5, an official top token that is
//! not among the local top 20), and the quality scores equal an independent
//! recomputation from all-position logits.
//!
//! The vectors are regenerated with
//! `DS4_WRITE_VECTORS=1 cargo test -p ds4-cli --test quality -- --ignored write_vectors`.

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use ds4_engine::{BackendChoice, Engine, EngineOptions, Numerics};

fn vectors() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/vectors")
}

const PROMPTS: [(&str, &str); 3] = [
    ("short_fact", "What is the capital of Japan?"),
    (
        "short_code",
        "Complete this C comment: /* This lock protects",
    ),
    (
        "short_italian",
        "Rispondi brevemente: chi ha scritto la Divina Commedia?",
    ),
];

/// The quality cases' "official" continuations: what the real model answers (the tiny
/// model's random weights give them some likelihood, which is all the test needs).
const CONTINUATIONS: [&str; 3] = [
    "The capital of Japan is **Tokyo**.",
    " the shared queue head and the count of waiting readers. */",
    "La *Divina Commedia* è stata scritta da **Dante Alighieri**.",
];

fn engine(numerics: Numerics) -> Engine {
    Engine::open(
        common::model(),
        EngineOptions {
            backend: BackendChoice::Cpu { threads: None },
            numerics,
            ..EngineOptions::default()
        },
    )
    .unwrap()
}

fn chat(e: &Engine, text: &str) -> Vec<u32> {
    let tok = e.tokenizer().unwrap();
    let sp = tok.special_ids().unwrap();
    let mut v = vec![sp.bos, sp.user];
    v.extend(tok.encode_plain(text));
    v.extend([sp.assistant, sp.think_end]);
    v
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = l.iter().map(|&v| (v as f64 - m).exp()).sum();
    l.iter().map(|&v| v as f64 - m - s.ln()).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The .vec text from the CPU engine in Exact numerics: 4 greedy steps per prompt
/// with the top 5 logprobs.
fn generate() -> String {
    let e = engine(Numerics::Exact);
    let tok = e.tokenizer().unwrap();
    let mut vec = String::from(
        "# ds4-official-logprob-vectors-v1 (tiny fixture, CPU Exact; see PROVENANCE.md)\n\
         # case <id> <ctx> <steps> <prompt-file>\n\
         # step <index> <selected-hex> <top-count>\n\
         # top <token-hex> <official-logprob>\n\n",
    );
    for (id, text) in PROMPTS {
        let mut s = e.new_session(4096).unwrap();
        s.prefill(&chat(&e, text)).unwrap();
        writeln!(vec, "case {id} 4096 4 prompts/{id}.txt").unwrap();
        for i in 0..4 {
            let l = s.logits().to_vec();
            let lp = log_softmax(&l);
            let g = ds4_engine::argmax(&l);
            let mut order: Vec<usize> = (0..l.len()).collect();
            order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
            let b = tok.decode_to_bytes(&[g], false);
            writeln!(vec, "step {i} {} 5", hex(&b)).unwrap();
            for &t in &order[..5] {
                let tb = tok.decode_to_bytes(&[t as u32], false);
                writeln!(vec, "top {} {:.6}", hex(&tb), lp[t]).unwrap();
            }
            s.decode(g).unwrap();
        }
        vec += "end\n\n";
    }
    vec
}

#[test]
#[ignore = "writes fixtures/vectors; run with DS4_WRITE_VECTORS=1"]
fn write_vectors() {
    if std::env::var("DS4_WRITE_VECTORS").is_err() {
        return;
    }
    let vec = generate();
    let d = vectors();
    for sub in [
        "logprob/prompts",
        "quality/prompts",
        "quality/continuations",
    ] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    std::fs::write(d.join("logprob/official.vec"), vec).unwrap();
    let mut manifest = String::from("# id\tprompt_file\tcontinuation_file\tresponse_file\n");
    for ((id, text), cont) in PROMPTS.iter().zip(CONTINUATIONS) {
        std::fs::write(d.join(format!("logprob/prompts/{id}.txt")), text).unwrap();
        std::fs::write(d.join(format!("quality/prompts/{id}.txt")), text).unwrap();
        std::fs::write(d.join(format!("quality/continuations/{id}.txt")), cont).unwrap();
        // Written relative to a checkout, as the reference's collector does: the
        // scorer finds them under the data directory.
        writeln!(
            manifest,
            "{id}\tdata/prompts/{id}.txt\tdata/continuations/{id}.txt\tdata/responses/{id}.json"
        )
        .unwrap();
    }
    std::fs::write(d.join("quality/manifest.tsv"), manifest).unwrap();
}

fn run_vec(vec: &Path, extra: &[&str]) -> (bool, String, String) {
    let model = common::model();
    let mut args = vec![
        "logprob-vectors",
        "--vec",
        vec.to_str().unwrap(),
        "-m",
        model.to_str().unwrap(),
        "--backend",
        "cpu",
    ];
    args.extend_from_slice(extra);
    common::tool(&args)
}

#[test]
fn stored_vectors_pass_in_both_numerics() {
    let vec = vectors().join("logprob/official.vec");
    for extra in [&[][..], &["--quality"][..]] {
        let (ok, out, err) = run_vec(&vec, extra);
        assert!(ok, "{extra:?}: {out}{err}");
        assert!(
            out.contains("summary: 3 passed, 0 failed, 0 skipped"),
            "{out}"
        );
    }
    // The stored greedy tokens are the engine's (not just any passing file).
    let want = generate();
    let sel = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.starts_with("step "))
            .map(|l| l.split_whitespace().nth(2).unwrap().to_string())
            .collect()
    };
    let stored = std::fs::read_to_string(&vec).unwrap();
    assert_eq!(sel(&stored), sel(&want));
}

/// A copy of the stored vectors with `edit` applied to its lines, in a scratch dir
/// (prompts found through the `prompts/` fallback next to it).
fn perturbed(name: &str, edit: impl Fn(&mut Vec<String>)) -> PathBuf {
    let dir = common::tmp_dir(name);
    std::fs::create_dir_all(dir.join("prompts")).unwrap();
    for (id, text) in PROMPTS {
        common::write_file(&dir.join("prompts"), &format!("{id}.txt"), text);
    }
    let stored = std::fs::read_to_string(vectors().join("logprob/official.vec")).unwrap();
    let mut lines: Vec<String> = stored.lines().map(String::from).collect();
    edit(&mut lines);
    common::write_file(&dir, "official.vec", lines.join("\n") + "\n")
}

/// Index of the `n`-th line starting with `prefix`.
fn nth(lines: &[String], prefix: &str, n: usize) -> usize {
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with(prefix))
        .nth(n)
        .unwrap()
        .0
}

#[test]
fn a_wrong_token_fails() {
    let vec = perturbed("vec-token", |l| {
        let i = nth(l, "step 2 ", 1);
        let f: Vec<&str> = l[i].split_whitespace().collect();
        // Any other byte string: "zz" is no greedy token of the tiny model here.
        l[i] = format!("step 2 7a7a {}", f[3]);
    });
    let (ok, out, _) = run_vec(&vec, &[]);
    assert!(!ok, "{out}");
    assert!(out.contains("short_code: FAIL"), "{out}");
    assert!(out.contains("step 2: greedy token"), "{out}");
    assert!(out.contains("2 passed, 1 failed"), "{out}");
}

#[test]
fn a_logprob_off_by_5_fails() {
    let vec = perturbed("vec-logprob", |l| {
        let i = nth(l, "top ", 7);
        let f: Vec<&str> = l[i].split_whitespace().collect();
        let v: f64 = f[2].parse().unwrap();
        l[i] = format!("top {} {:.6}", f[1], v - 5.0);
    });
    let (ok, out, _) = run_vec(&vec, &[]);
    assert!(!ok, "{out}");
    assert!(out.contains("|Δ| > 4"), "{out}");
    // Off by 3 is within the reference's tolerance.
    let vec = perturbed("vec-logprob3", |l| {
        let i = nth(l, "top ", 7);
        let f: Vec<&str> = l[i].split_whitespace().collect();
        let v: f64 = f[2].parse().unwrap();
        l[i] = format!("top {} {:.6}", f[1], v - 3.0);
    });
    let (ok, out, _) = run_vec(&vec, &[]);
    assert!(ok, "{out}");
}

#[test]
fn a_token_outside_the_local_top_20_fails_and_the_archive_case_is_skipped() {
    let vec = perturbed("vec-missing", |l| {
        let i = nth(l, "top ", 0);
        // A byte sequence no token of the tiny vocabulary spells.
        l[i] = "top 00ff00ff00ff -9.5".into();
        // The reference skips this id whatever it holds.
        l.extend(
            [
                "case long_memory_archive 4096 1 prompts/nowhere.txt",
                "step 0 7a7a 0",
                "end",
            ]
            .map(String::from),
        );
    });
    let (ok, out, _) = run_vec(&vec, &[]);
    assert!(!ok, "{out}");
    assert!(out.contains("is not in the local top 20"), "{out}");
    assert!(out.contains("long_memory_archive: skipped"), "{out}");
    assert!(out.contains("2 passed, 1 failed, 1 skipped"), "{out}");
}

#[test]
fn malformed_vectors_are_refused() {
    let vec = perturbed("vec-bad", |l| {
        let i = nth(l, "end", 0);
        l.remove(i);
    });
    let (ok, _, err) = run_vec(&vec, &[]);
    assert!(!ok);
    assert!(err.contains("unexpected line inside a case"), "{err}");
}

/// The scorer's NLL, greedy match and LCP against a recomputation from one
/// all-position prefill of prompt + continuation.
#[test]
fn quality_scores_equal_a_recomputation() {
    let dir = vectors().join("quality");
    let json = common::tmp_file("quality.json");
    let csv = common::tmp_file("quality.csv");
    let model = common::model();
    let out = common::tool_ok(&[
        "quality",
        "--vectors",
        dir.to_str().unwrap(),
        "-m",
        model.to_str().unwrap(),
        "--backend",
        "cpu",
        "--json",
        json.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert!(
        out.starts_with("id\tprompt_tokens\ttarget_tokens\tnll"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    assert_eq!(std::fs::read_to_string(&csv).unwrap().lines().count(), 4);
    let e = engine(Numerics::Fast);
    let tok = e.tokenizer().unwrap();
    let (mut total, mut tokens) = (0.0, 0usize);
    for (c, (id, text)) in cases.iter().zip(PROMPTS) {
        assert_eq!(c["id"], id);
        let cont = std::fs::read_to_string(dir.join(format!("continuations/{id}.txt"))).unwrap();
        let p = chat(&e, text);
        let t = tok.encode_plain(&cont);
        let mut all = p.clone();
        all.extend(&t[..t.len() - 1]);
        let mut s = e.new_session(4096).unwrap();
        let logits = s.prefill_all_logits(&all).unwrap();
        let vocab = s.vocab();
        let (mut nll, mut lcp, mut on) = (0.0f64, 0, true);
        for (i, &tk) in t.iter().enumerate() {
            let row = &logits[(p.len() - 1 + i) * vocab..(p.len() + i) * vocab];
            nll -= log_softmax(row)[tk as usize];
            let g = ds4_engine::argmax(row);
            if i == 0 {
                assert_eq!(c["first_match"], g == tk, "{id}");
            }
            on &= g == tk;
            lcp += on as u64;
        }
        assert_eq!(c["prompt_tokens"], p.len());
        assert_eq!(c["target_tokens"], t.len());
        assert_eq!(c["greedy_lcp"], lcp, "{id}");
        let got = c["nll"].as_f64().unwrap();
        assert!(
            (got - nll).abs() < 1e-4 * nll.max(1.0),
            "{id}: {got} vs {nll}"
        );
        let avg = nll / t.len() as f64;
        assert!((c["ppl"].as_f64().unwrap() - avg.exp()).abs() < 1e-4 * avg.exp());
        total += nll;
        tokens += t.len();
    }
    let avg = v["summary"]["avg_nll"].as_f64().unwrap();
    assert!((avg - total / tokens as f64).abs() < 1e-6 * avg.max(1.0));
    assert!(total > 0.0);
}

#[test]
fn quality_without_a_manifest_and_bad_layouts() {
    // prompts/ + continuations/ only.
    let dir = common::tmp_dir("quality-nomanifest");
    for sub in ["prompts", "continuations"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        let src = vectors().join("quality").join(sub).join("short_fact.txt");
        std::fs::copy(src, dir.join(sub).join("short_fact.txt")).unwrap();
    }
    let model = common::model();
    let m = model.to_str().unwrap();
    let out = common::tool_ok(&[
        "quality",
        "--vectors",
        dir.to_str().unwrap(),
        "-m",
        m,
        "--backend",
        "cpu",
    ]);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(
        out.lines().nth(1).unwrap().starts_with("short_fact\t"),
        "{out}"
    );
    // A manifest row naming a missing file.
    common::write_file(
        &dir,
        "manifest.tsv",
        "x\tprompts/none.txt\tcontinuations/none.txt\n",
    );
    let err = common::tool_err(&[
        "quality",
        "--vectors",
        dir.to_str().unwrap(),
        "-m",
        m,
        "--backend",
        "cpu",
    ]);
    assert!(err.contains("none.txt"), "{err}");
}
