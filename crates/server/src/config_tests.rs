use clap::{CommandFactory, Parser};

use super::Args;

fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
    Args::try_parse_from(std::iter::once("ds4-server").chain(extra.iter().copied()))
}

// #18 item 10: every numeric flag rejects values that overflow, with clap's error naming
// the flag, instead of wrapping (a huge --kv-disk-space-mb became a 0-byte budget).
#[test]
fn numeric_flags_reject_overflow() {
    let too_big_int = "18446744073709551616"; // 2^64
    let too_many_mib = "17592186044416"; // 2^44 MiB = 2^64 bytes
    let cases: &[(&str, &str)] = &[
        ("--kv-disk-space-mb", too_many_mib),
        ("--max-body-mb", too_many_mib),
        ("--ctx", too_big_int),
        ("--tokens", too_big_int),
        ("--threads", too_big_int),
        ("--port", "65536"),
        ("--queue-max", too_big_int),
        ("--keepalive-secs", "31536001"),
        ("--max-connections", too_big_int),
        ("--header-read-timeout-secs", "31536001"),
        ("--idle-timeout-secs", too_big_int),
        ("--kv-cache-min-tokens", too_big_int),
        ("--kv-cache-cold-max-tokens", too_big_int),
        ("--kv-cache-continued-interval-tokens", too_big_int),
        ("--kv-cache-boundary-trim-tokens", too_big_int),
        ("--kv-cache-boundary-align-tokens", too_big_int),
        ("--tool-memory-max-ids", too_big_int),
        ("--mtp-draft", too_big_int),
        ("--mtp-draft", "16"),
        ("--mtp-draft", "0"),
        ("--mtp-margin", "inf"),
        ("--mtp-margin", "nan"),
        ("--fake-delay-ms", "60001"),
        ("--fake-load-ms", "600001"),
    ];
    for (flag, value) in cases {
        let err = parse(&[flag, value]).expect_err(flag);
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::ValueValidation,
            "{flag}"
        );
        assert!(err.to_string().contains(flag), "{flag}: {err}");
    }
    // The largest budget that fits is kept exactly.
    let max_mib = (u64::MAX >> 20).to_string();
    let a = parse(&[
        "--kv-disk-dir",
        "/nonexistent",
        "--kv-disk-space-mb",
        &max_mib,
    ])
    .unwrap();
    let cfg = a.to_config().unwrap();
    assert_eq!(cfg.kv_disk.unwrap().budget_bytes, (u64::MAX >> 20) << 20);
    // A continued interval whose rounding up to the alignment overflows is a clear error.
    let a = parse(&[
        "--kv-cache-continued-interval-tokens",
        &usize::MAX.to_string(),
        "--kv-cache-boundary-align-tokens",
        "2",
    ])
    .unwrap();
    assert!(a.to_config().unwrap_err().contains("continued-interval"));
}

// #19: every ds4-server flag has --help text.
#[test]
fn every_flag_has_help() {
    let cmd = Args::command();
    let missing: Vec<String> = cmd
        .get_arguments()
        .filter(|a| a.get_help().is_none())
        .map(|a| a.get_id().to_string())
        .collect();
    assert!(missing.is_empty(), "flags without help: {missing:?}");
}

// #18 item 14: the key comes from --api-key-file (first line, trimmed) so it stays out
// of `ps`; an empty file is an error, not "no key".
#[test]
fn api_key_from_file() {
    let f = std::env::temp_dir().join(format!("ds4-apikey-{}", std::process::id()));
    std::fs::write(&f, "s3cret  \nignored\n").unwrap();
    let mut a = parse(&["--api-key-file", f.to_str().unwrap()]).unwrap();
    a.resolve_api_key().unwrap();
    assert_eq!(a.to_config().unwrap().api_key.as_deref(), Some("s3cret"));
    std::fs::write(&f, "\n").unwrap();
    let mut a = parse(&["--api-key-file", f.to_str().unwrap()]).unwrap();
    assert!(a.resolve_api_key().unwrap_err().contains("empty"));
    assert!(parse(&["--api-key", "x", "--api-key-file", "y"]).is_err());
    let _ = std::fs::remove_file(&f);
}

// #19 item 4: path flags are checked before the load, naming the flag as clap does.
#[test]
fn path_flags_are_checked_before_the_load() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny");
    let model = root.join("tiny-q2.gguf");
    let m = model.to_str().unwrap();
    let missing = root.join("no-such-file");
    let x = missing.to_str().unwrap();
    let ok = parse(&["-m", m, "--trace", "t.log", "--kv-disk-dir", "kv/new"]).unwrap();
    ok.check_paths().unwrap();
    ok.check_chdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["-m", x], "'--model <MODEL>': no such file"),
        (&["-m", m, "--mtp", x], "'--mtp <MTP>': no such file"),
        (
            &["-m", m, "--api-key-file", x],
            "'--api-key-file <PATH>': no such file",
        ),
        (
            &["-m", m, "--trace", &format!("{x}/t.log")],
            "'--trace <TRACE>': directory",
        ),
        (
            &["-m", m, "--kv-disk-dir", &format!("{m}/kv")],
            "'--kv-disk-dir <KV_DISK_DIR>'",
        ),
        (
            &["--fake-engine", x],
            "'--fake-engine <FAKE_ENGINE>': no such file",
        ),
    ];
    for (args, want) in cases {
        let err = parse(args).unwrap().check_paths().expect_err(want);
        assert_eq!(err.exit_code(), 2);
        let text = err.render().to_string();
        assert!(text.contains(want), "{args:?}: {text}");
    }
    // The fake engine needs no model.
    let tj = root.join("tokenizer.json");
    parse(&["-m", x, "--fake-engine", tj.to_str().unwrap()])
        .unwrap()
        .check_paths()
        .unwrap();
    let err = parse(&["--chdir", x]).unwrap().check_chdir().unwrap_err();
    assert!(err.render().to_string().contains("no such directory"));
}

// #23: the placement flags parse as on `ds4`, and bad values name the rule.
#[test]
fn placement_flags_parse() {
    let a = parse(&["--gpus", "1,0", "--offload-experts", "2"]).unwrap();
    assert_eq!(a.gpus, Some(ds4_engine::GpuList(vec![1, 0])));
    assert_eq!(a.offload_experts, ds4_engine::Offload::Layers(2));
    let a = parse(&[]).unwrap();
    assert_eq!(
        (a.gpus, a.offload_experts),
        (None, ds4_engine::Offload::Auto)
    );
    let e = parse(&["--gpus", "2,2"]).unwrap_err().to_string();
    assert!(e.contains("names device 2 twice"), "{e}");
    let e = parse(&["--offload-experts", "-1"]).unwrap_err().to_string();
    assert!(e.contains("takes `auto` or a number of layers"), "{e}");
    let help = Args::command().render_long_help().to_string();
    assert!(help.contains("--gpus") && help.contains("--offload-experts"));
    assert!(help.contains("--device-map <GPU:LAYERS,...>"), "{help}");
}

// #23: `--device-map` parses to the map the engine plans with; its syntax is checked
// at flag time, and it does not go with --gpus.
#[test]
fn device_map_flag_parses_and_excludes_gpus() {
    let a = parse(&["--device-map", "1:0-20,0:21-42"]).unwrap();
    let map = a.device_map.expect("a map");
    assert_eq!(map.entries(), &[(1, 0..21), (0, 21..43)][..]);
    assert_eq!(a.gpus, None);
    assert_eq!(parse(&[]).unwrap().device_map, None);
    for (args, want) in [
        (&["--device-map", "0:0-20,0:21-42"][..], "names GPU 0 twice"),
        (
            &["--device-map", "0:20-0"][..],
            "run backwards (write 0-20)",
        ),
        (&["--device-map", "0-20"][..], "takes GPU:LAYERS entries"),
        (
            &["--gpus", "0,1", "--device-map", "0:0-20,1:21-42"][..],
            "cannot be used with",
        ),
    ] {
        let e = parse(args).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(want), "{args:?}: {msg}");
        if want == "cannot be used with" {
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
            assert!(
                msg.contains("--gpus") && msg.contains("--device-map"),
                "{msg}"
            );
        }
    }
}
