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
