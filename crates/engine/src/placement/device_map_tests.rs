//! `--device-map`: the parser, the coverage check and the planner's decisions for
//! given sizes (the published q2 and q4 files' byte counts, `super::super::tests`).

use super::super::tests::{q2, q4, GIB};
use super::super::{gib, plan_split, split_layers, MemoryOptions, Placement};
use super::*;

fn map(s: &str) -> DeviceMap {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// The message of `map`'s coverage check against `n_layer` layers.
fn refusal(s: &str, n_layer: usize) -> String {
    match map(s).check(n_layer) {
        Err(PlanError::DeviceMap(why)) => why,
        other => panic!("{s} over {n_layer} layers: {other:?}"),
    }
}

#[test]
fn maps_parse_and_print_back() {
    assert_eq!(
        map("0:0-20,1:21-42").entries(),
        &[(0, 0..21), (1, 21..43)][..]
    );
    assert_eq!(
        map(" 1 : 3 , 0: 4 - 5").entries(),
        &[(1, 3..4), (0, 4..6)][..]
    );
    assert_eq!(map("0:0-42").gpus(), vec![0]);
    assert_eq!(map("3:0-9,1:10-12").gpus(), vec![3, 1]);
    for s in ["0:0-20,1:21-42", "2:7", "0:0-0,5:1-3", "1:0-41,0:42"] {
        // `0:0-0` prints as `0:0`; the printed map parses back to the same one.
        let m = map(s);
        assert_eq!(map(&m.to_string()), m, "{s}");
    }
    assert_eq!(map("0:0-0,5:1-3").to_string(), "0:0,5:1-3");
}

#[test]
fn malformed_maps_say_what_is_wrong() {
    for (s, want) in [
        (
            "",
            "takes GPU:LAYERS entries like 0:0-20,1:21-42 (not an empty entry)",
        ),
        ("0", "(`0` is not one)"),
        ("0:", "(`0:` is not one)"),
        ("x:0-3", "(`x:0-3` is not one)"),
        ("0:0-20,", "(not an empty entry)"),
        ("0:0-", "(`0:0-` is not one)"),
        ("0:-3", "(`0:-3` is not one)"),
        ("0:1-2-3", "(`0:1-2-3` is not one)"),
        ("0:0-20;1:21-42", "is not one"),
        (
            "0:3-1",
            "--device-map 0:3-1: layers 3-1 run backwards (write 1-3)",
        ),
        ("0:0-20,0:21-42", "--device-map names GPU 0 twice"),
        (
            "0:0-18446744073709551615",
            "layer 18446744073709551615 is too large",
        ),
    ] {
        let e = parse_device_map(s).unwrap_err();
        assert!(e.contains(want), "{s:?}: {e}");
    }
}

#[test]
fn a_map_that_covers_the_model_passes() {
    for s in [
        "0:0-20,1:21-42",
        "0:0-42",
        "1:0-0,0:1-41,2:42",
        "7:0-10,2:11-20,0:21-42",
    ] {
        assert_eq!(map(s).check(43), Ok(()), "{s}");
    }
}

#[test]
fn a_map_that_misses_or_doubles_layers_names_them_and_a_right_map() {
    let why = refusal("0:0-20,1:22-42", 43);
    assert!(why.contains("layer 21 is on no GPU"), "{why}");
    assert!(why.contains("this model's 43 layers (0–42)"), "{why}");
    assert!(why.ends_with("--device-map 0:0-21,1:22-42"), "{why}");
    let why = refusal("0:0-21,1:21-42", 43);
    assert!(why.contains("layer 21 is on both GPU 0 and GPU 1"), "{why}");
    let why = refusal("0:0-25,1:20-42", 43);
    assert!(
        why.contains("layers 20–25 are on both GPU 0 and GPU 1"),
        "{why}"
    );
    let why = refusal("0:3-42", 43);
    assert!(why.contains("layers 0–2 are on no GPU"), "{why}");
    assert!(why.ends_with("--device-map 0:0-42"), "{why}");
    let why = refusal("0:0-20,1:21-40", 43);
    assert!(why.contains("layers 41–42 are on no GPU"), "{why}");
    // Written for a bigger model: past the last layer.
    let why = refusal("0:0-30,1:31-60", 43);
    assert!(
        why.contains("GPU 1's layers 31–60 go past the model's last layer (42)"),
        "{why}"
    );
    assert!(!why.contains("on no GPU"), "{why}");
    // Every problem at once.
    let why = refusal("0:1-10,1:12-50", 43);
    for part in ["layer 0 is on no GPU", "layer 11 is on no GPU", "go past"] {
        assert!(why.contains(part), "{part}: {why}");
    }
}

#[test]
fn stages_out_of_layer_order_are_refused_as_such() {
    // The layers are all there, but the stages run in the order given.
    let why = refusal("1:21-42,0:0-20", 43);
    assert!(
        why.contains("so list them in layer order (as in 0:0-20,1:21-42)"),
        "{why}"
    );
    assert!(!why.contains("no GPU") && !why.contains("both"), "{why}");
    // The suggestion keeps the GPUs in the order the user gave them.
    assert!(why.ends_with("--device-map 1:0-21,0:22-42"), "{why}");
}

#[test]
fn the_suggested_map_always_fits_the_model() {
    assert_eq!(DeviceMap::even(&[0, 1], 43).to_string(), "0:0-21,1:22-42");
    assert_eq!(
        DeviceMap::even(&[3, 2, 1, 0], 6).to_string(),
        "3:0-1,2:2-3,1:4,0:5"
    );
    // More GPUs than layers: one layer each on the first ones.
    assert_eq!(DeviceMap::even(&[0, 1, 2], 2).to_string(), "0:0,1:1");
    for n_layer in 1..50 {
        for k in 1..9 {
            let gpus: Vec<usize> = (0..k).collect();
            let m = DeviceMap::even(&gpus, n_layer);
            assert_eq!(m.len(), k.min(n_layer));
            assert_eq!(m.check(n_layer), Ok(()), "{m} over {n_layer}");
            assert_eq!(map(&m.to_string()), m);
        }
    }
}

#[test]
fn gpus_and_a_map_together_are_refused() {
    let both = MemoryOptions {
        gpus: vec![0, 1],
        device_map: Some(map("0:0-20,1:21-42")),
        ..Default::default()
    };
    let e = both.check(43).unwrap_err().to_string();
    assert!(
        e.contains("--gpus and --device-map") && e.contains("pick one"),
        "{e}"
    );
    let only_map = MemoryOptions {
        device_map: Some(map("0:0-20,1:21-41")),
        ..Default::default()
    };
    assert!(matches!(only_map.check(43), Err(PlanError::DeviceMap(_))));
    assert_eq!(only_map.check(42), Ok(()));
    let only_gpus = MemoryOptions {
        gpus: vec![0, 1],
        ..Default::default()
    };
    assert_eq!(only_gpus.check(43), Ok(()));
    assert_eq!(MemoryOptions::default().check(43), Ok(()));
}

#[test]
fn a_map_that_fits_keeps_everything_on_the_cards() {
    let needs = q2();
    // Lopsided on purpose: the planner takes the ranges as given.
    let stages =
        plan_device_map(&needs, &map("0:0-9,1:10-42"), &[79 * GIB; 2], Offload::Auto).unwrap();
    assert_eq!(stages.len(), 2);
    assert_eq!(
        (stages[0].layers.clone(), stages[1].layers.clone()),
        (0..10, 10..43)
    );
    assert!(stages.iter().all(|s| !s.placement.offloads()), "{stages:?}");
    // Not what the automatic split picks for the same cards.
    assert_ne!(split_layers(&needs, &[79 * GIB; 2]).unwrap()[0], 0..10);
}

#[test]
fn a_stage_too_big_for_its_card_offloads_its_own_last_layers() {
    let needs = q2();
    let free = [79 * GIB, 79 * GIB];
    // 41 layers need 80.07 GiB with the session: the embedding and layer 40's experts
    // go to host memory (79.09, then 77.40); the second stage fits as it is.
    let stages = plan_device_map(&needs, &map("0:0-40,1:41-42"), &free, Offload::Auto).unwrap();
    let p = &stages[0].placement;
    assert!(p.embedding_on_host);
    let on: Vec<usize> = (0..43).filter(|&il| p.experts_on_host[il]).collect();
    assert_eq!(on, vec![40]);
    assert!(!stages[1].placement.offloads());
    for (s, f) in stages.iter().zip(free) {
        let part = needs.stage(&s.layers);
        assert!(s.placement.device_bytes(&part) + part.session + part.reserve <= f);
    }
    // The startup line says where the split came from and what each stage moved.
    let gpus = [(0, "H100".to_string()), (1, "H100".to_string())];
    let line = describe_split(&needs, &stages, &gpus, &free, Some(&map("0:0-40,1:41-42")));
    assert!(
        line.starts_with(
            "--device-map 0:0-40,1:41-42: layers 0–40 on GPU 0 (H100) with the \
                          routed experts of 1 layer (layer 40) and the token embedding in \
                          pinned host memory"
        ),
        "{line}"
    );
    assert!(line.ends_with(", layers 41–42 on GPU 1 (H100)"), "{line}");
    // The automatic split's line has no map to name.
    let auto = describe_split(&needs, &stages, &gpus, &free, None);
    assert!(
        auto.starts_with("layers 0–40 on GPU 0 (H100) with"),
        "{auto}"
    );
}

#[test]
fn without_offload_a_stage_too_big_is_refused_with_what_to_do() {
    let needs = q2();
    let e = plan_device_map(
        &needs,
        &map("3:0-40,1:41-42"),
        &[79 * GIB, 79 * GIB],
        Offload::Layers(0),
    )
    .unwrap_err();
    let PlanError::StageDoesNotFit {
        stage,
        gpu,
        ref layers,
        need,
        free,
        choice,
        all_offloaded,
    } = e
    else {
        panic!("{e:?}")
    };
    assert_eq!((stage, gpu, layers.clone()), (0, 3, 0..41));
    assert_eq!(
        (free, choice, all_offloaded),
        (79 * GIB, Offload::Layers(0), false)
    );
    let stage_0 = needs.stage(&(0..41));
    assert_eq!(need, stage_0.weights + stage_0.session + stage_0.reserve);
    let msg = e.to_string();
    let short = format!("({:.2} GiB short)", gib(need - free));
    assert_eq!(short, "(1.07 GiB short)");
    for part in [
        "--device-map stage 1 (layers 0–40 on GPU 3) needs 80.07 GiB there but 79.00 GiB are free",
        &short,
        "with --offload-experts 0",
        "--offload-experts auto",
        "give GPU 3 fewer layers",
        "smaller --ctx",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
}

#[test]
fn a_card_too_small_even_with_every_expert_offloaded_is_refused() {
    let needs = q2();
    // 42 layers with all their experts and the embedding on the host still need 10.06
    // GiB; the card has 8.
    let e = plan_device_map(
        &needs,
        &map("0:0-41,1:42"),
        &[8 * GIB, 79 * GIB],
        Offload::Auto,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            PlanError::StageDoesNotFit {
                stage: 0,
                gpu: 0,
                all_offloaded: true,
                ..
            }
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("(2.06 GiB short)"), "{msg}");
    assert!(
        msg.contains("even with the embedding and all its layers' experts in host memory"),
        "{msg}"
    );
    assert!(msg.contains("give GPU 0 fewer layers"), "{msg}");
    // The same card with a fair share of the layers works.
    let ok = plan_device_map(
        &needs,
        &map("0:0-1,1:2-42"),
        &[8 * GIB, 79 * GIB],
        Offload::Auto,
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn an_explicit_offload_count_takes_the_models_last_layers_on_a_map() {
    let needs = q2();
    let m = map("0:0-20,1:21-42");
    let stages = plan_device_map(&needs, &m, &[79 * GIB; 2], Offload::Layers(3)).unwrap();
    assert!(!stages[0].placement.experts_on_host.iter().any(|&h| h));
    let on: Vec<usize> = (0..43)
        .filter(|&il| stages[1].placement.experts_on_host[il])
        .collect();
    assert_eq!(on, vec![40, 41, 42]);
    assert!(stages.iter().all(|s| s.placement.embedding_on_host));
    // Too few for the second card (42.38 GiB with the embedding and layer 42 on the
    // host, 40 free): refused naming that stage.
    let e = plan_device_map(&needs, &m, &[79 * GIB, 40 * GIB], Offload::Layers(1)).unwrap_err();
    assert!(
        matches!(
            e,
            PlanError::StageDoesNotFit {
                stage: 1,
                gpu: 1,
                ..
            }
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("stage 2 (layers 21–42 on GPU 1)"), "{msg}");
    assert!(
        msg.contains("with --offload-experts 1: offload more layers"),
        "{msg}"
    );
    assert_eq!(
        plan_device_map(&needs, &m, &[79 * GIB; 2], Offload::Layers(44)).unwrap_err(),
        PlanError::TooManyLayers {
            asked: 44,
            n_layer: 43
        }
    );
}

#[test]
fn a_bad_map_is_refused_before_any_memory_question() {
    let needs = q2();
    let e = plan_device_map(&needs, &map("0:0-20"), &[200 * GIB], Offload::Auto).unwrap_err();
    assert!(matches!(e, PlanError::DeviceMap(_)), "{e:?}");
    assert!(e.to_string().contains("layers 21–42 are on no GPU"), "{e}");
    // One free size per stage.
    let e = plan_device_map(&needs, &map("0:0-20,1:21-42"), &[200 * GIB], Offload::Auto);
    assert!(matches!(e, Err(PlanError::Split(_))), "{e:?}");
}

#[test]
fn a_one_entry_map_plans_as_one_gpu_does() {
    let needs = q2();
    for offload in [Offload::Auto, Offload::Layers(0), Offload::Layers(2)] {
        for free in [79 * GIB, 139 * GIB] {
            let single = Placement::plan(&needs, free, offload);
            let mapped = plan_device_map(&needs, &map("0:0-42"), &[free], offload);
            match (single, mapped) {
                (Ok(p), Ok(stages)) => {
                    assert_eq!(stages.len(), 1);
                    assert_eq!(stages[0].layers, 0..43);
                    assert_eq!(stages[0].placement, p, "{offload} at {free}");
                }
                (Err(_), Err(e)) => {
                    assert!(matches!(e, PlanError::StageDoesNotFit { .. }), "{e:?}")
                }
                (a, b) => panic!("{offload} at {free}: {a:?} against {b:?}"),
            }
        }
    }
}

#[test]
fn a_map_of_the_automatic_ranges_plans_as_the_automatic_split() {
    // q4 over two 80 GB cards: the automatic split cuts 22 + 21 layers and offloads on
    // the first card; the same ranges given by hand get the same placements.
    let needs = q4();
    let free = [79 * GIB, 79 * GIB];
    let auto = plan_split(&needs, &free, Offload::Auto).unwrap();
    let given = format!(
        "0:0-{},1:{}-42",
        auto[0].layers.end - 1,
        auto[1].layers.start
    );
    let mapped = plan_device_map(&needs, &map(&given), &free, Offload::Auto).unwrap();
    assert_eq!(mapped, auto);
    assert!(mapped[0].placement.offloaded_layers() > 0);
}

#[test]
fn a_one_layer_stage_reads_layer_n() {
    assert_eq!(layer_span(&(0..1)), "layer 0");
    assert_eq!(layer_span(&(3..6)), "layers 3–5");
}
