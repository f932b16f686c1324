//! The narrow API: `Engine::open` and its backend choice, model info, the tokenizer,
//! routed-expert bits, session state moves and error kinds, on the tiny fixtures.

mod common;

use common::*;
use ds4_engine::dev::{EngineExt, SessionExt};
use ds4_engine::{
    BackendChoice, BackendKind, Engine, EngineError, EngineOptions, ErrorKind, Numerics, Session,
};

fn open(variant: &str, backend: BackendChoice) -> ds4_engine::Result<Engine> {
    Engine::open(
        dir().join(format!("tiny-{variant}.gguf")),
        EngineOptions {
            backend,
            numerics: Numerics::Exact,
            ..EngineOptions::default()
        },
    )
}

fn cpu(variant: &str) -> Engine {
    open(variant, BackendChoice::Cpu { threads: None }).unwrap()
}

#[test]
fn cpu_engine_reports_its_backend_and_model() {
    let e = cpu("q2");
    assert_eq!(e.backend(), BackendKind::Cpu);
    assert_eq!(e.backend().name(), "cpu");
    assert!(!e.backend_reason().is_empty());
    assert_eq!(e.numerics(), Numerics::Exact);
    let info = e.info();
    assert_eq!(
        (
            info.hparams.n_layer,
            info.hparams.vocab,
            info.hparams.n_embd
        ),
        (6, 512, 256)
    );
    assert_eq!(info.hparams.compress_ratios, vec![0, 0, 4, 128, 4, 128]);
    assert_eq!(
        info.hparams.context_length,
        e.model().config().context_length
    );
    assert!(info.n_tensors > 0 && info.tensor_bytes > 0 && info.file_bytes > info.tensor_bytes);
    // The tiny model differs from the full-size profile.
    assert!(!info.profile_deviations.is_empty());
}

#[test]
fn engine_sessions_match_the_reference_session() {
    let e = cpu("q2");
    let toks = tokens("a");
    let mut s = e.new_session(64).unwrap();
    assert_eq!(s.backend_name(), "cpu");
    assert_eq!(s.vocab(), 512);
    let got = s.prefill_all_logits(&toks).unwrap();
    let mut r = Session::new(e.model(), 64).unwrap();
    let want = r.prefill_all_logits(&toks).unwrap();
    assert!(got == want);
}

#[test]
fn a_cpu_pool_of_its_own_gives_the_same_logits() {
    let e = open("q4", BackendChoice::Cpu { threads: Some(2) }).unwrap();
    assert_eq!(e.cpu_pool().map(|p| p.current_num_threads()), Some(2));
    let toks = tokens("b");
    let got = e
        .new_session(256)
        .unwrap()
        .prefill_all_logits(&toks)
        .unwrap();
    let want = cpu("q4")
        .new_session(256)
        .unwrap()
        .prefill_all_logits(&toks)
        .unwrap();
    assert!(got == want);
}

#[test]
fn cuda_that_cannot_run_is_an_error_not_a_fallback() {
    // No machine has a device 999: with or without a driver, this is refused.
    let err = open("q2", BackendChoice::Cuda { device: 999 }).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BackendUnavailable, "{err}");
    #[cfg(feature = "cuda")]
    let gpu_here = ds4_engine::dev::driver_present();
    #[cfg(not(feature = "cuda"))]
    let gpu_here = false;
    if !gpu_here {
        let err = open("q2", BackendChoice::Cuda { device: 0 }).unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::Unavailable {
                    backend: "cuda",
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("cuda backend is not available"), "{msg}");
        // Auto falls back to the CPU and says why.
        let auto = open("q2", BackendChoice::Auto).unwrap();
        assert_eq!(auto.backend(), BackendKind::Cpu);
        assert!(
            auto.backend_reason().contains("CUDA"),
            "{}",
            auto.backend_reason()
        );
    }
}

// #18 item 5: the model identity the disk KV cache records: stable for one file,
// different for another model (here the q4 variant of the same tiny shapes).
#[test]
fn fingerprint_is_stable_per_file_and_differs_between_models() {
    let q2 = cpu("q2").info().fingerprint;
    assert_eq!(q2, cpu("q2").info().fingerprint);
    assert_ne!(q2, cpu("q4").info().fingerprint);
    assert_ne!(q2, [0; 32]);
}

#[test]
fn routed_quant_bits_come_from_the_expert_types() {
    let q2 = cpu("q2");
    assert_eq!(q2.routed_quant_bits(), 2);
    assert_eq!(q2.info().routed_quant, Some("IQ2_XXS"));
    let q4 = cpu("q4");
    assert_eq!(q4.routed_quant_bits(), 4);
    assert_eq!(q4.info().routed_quant, Some("Q4_K"));
    // The plain file keeps q2's quantised experts.
    assert_eq!(cpu("plain").routed_quant_bits(), 2);
}

#[test]
fn the_tokenizer_loads_with_and_without_the_model() {
    let e = cpu("q2");
    let a = e.tokenizer().unwrap();
    let b = ds4_engine::load_tokenizer(dir().join("tiny-q2.gguf")).unwrap();
    assert_eq!(a.vocab_size(), 512);
    let text = "Hello, tiny world!";
    assert_eq!(a.encode(text), b.encode(text));
    // Built once, then shared.
    assert!(std::sync::Arc::ptr_eq(&a, &e.tokenizer().unwrap()));
}

#[test]
fn exported_state_imports_and_continues_bit_identically() {
    let e = cpu("q2");
    let toks = tokens("b");
    let cut = 40;
    let mut a = e.new_session(256).unwrap();
    a.prefill(&toks[..cut]).unwrap();
    let state = a.export_state().unwrap();
    assert_eq!(state.tokens(), &toks[..cut]);
    assert_eq!(state.ctx(), 256);
    let mut b = e.new_session(256).unwrap();
    b.import_state(state.clone()).unwrap();
    assert_eq!(b.tokens(), a.tokens());
    assert!(b.logits() == a.logits());
    a.prefill(&toks[cut..]).unwrap();
    b.prefill(&toks[cut..]).unwrap();
    assert!(a.logits() == b.logits());
    // A clone continues the same way too.
    let mut c = b.try_clone().unwrap();
    c.decode(7).unwrap();
    b.decode(7).unwrap();
    assert!(b.logits() == c.logits());
    // Another context size is a state that does not fit.
    let mut small = e.new_session(128).unwrap();
    let err = small.import_state(state).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadState, "{err}");
    assert!(small.tokens().is_empty());
}

#[test]
fn errors_keep_their_kind() {
    let missing =
        Engine::open(dir().join("no-such-model.gguf"), EngineOptions::default()).unwrap_err();
    assert!(matches!(missing, EngineError::Open { .. }), "{missing:?}");
    assert_eq!(missing.kind(), ErrorKind::BadFile);
    assert!(std::error::Error::source(&missing).is_some());
    let e = cpu("q2");
    let mut s = e.new_session(2).unwrap();
    s.prefill(&[1, 2]).unwrap();
    let full = s.decode(3).unwrap_err();
    assert_eq!(full.kind(), ErrorKind::ContextFull);
    let mut fresh = e.new_session(2).unwrap();
    assert_eq!(
        fresh.prefill(&[9999]).unwrap_err().kind(),
        ErrorKind::BadInput
    );
    assert_eq!(e.new_session(0).unwrap_err().kind(), ErrorKind::BadInput);
    let garbage = fresh.load_payload(&mut &[0u8; 52][..]).unwrap_err();
    assert_eq!(garbage.kind(), ErrorKind::BadState, "{garbage}");
    let short = fresh.load_payload(&mut &[0u8; 8][..]).unwrap_err();
    assert_eq!(short.kind(), ErrorKind::Io, "{short}");
}
