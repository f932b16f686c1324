//! The disk KV cache against hostile and broken files (#18 items 3–6): integrity section
//! checks, quarantine of bad files, the directory's mode, and crash leftovers, through
//! `DiskCache` with the fake engine and through the `ds4-server` process (kill -9).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{root, temp_dir, tokenizer};
use ds4_server::config::KvDiskConfig;
use ds4_server::engine::{default_script, FAKE_FINGERPRINT};
use ds4_server::kvcache::disk::{parse_file, EXT_INTEGRITY, INTEGRITY_LEN};
use ds4_server::kvcache::{DiskCache, SaveReason, HEADER_LEN};
use ds4_server::{EngineBackend, FakeEngine};

const CTX: usize = 4096;
const OTHER_MODEL: [u8; 32] = [7; 32];

fn disk_cfg(dir: &Path) -> KvDiskConfig {
    KvDiskConfig {
        min_tokens: 4,
        ..KvDiskConfig::for_tests(dir.to_path_buf())
    }
}

fn open(dir: &Path, fingerprint: [u8; 32], strict: bool) -> DiskCache {
    let cfg = KvDiskConfig {
        strict,
        ..disk_cfg(dir)
    };
    DiskCache::open(cfg, CTX, 2, fingerprint).unwrap()
}

fn engine() -> FakeEngine {
    FakeEngine::new(tokenizer(), CTX, default_script())
}

/// Stores a session of a short system prompt; returns (file, key text).
fn stored(cache: &DiskCache) -> (PathBuf, String) {
    let mut e = engine();
    let tok = tokenizer();
    let ids = tok.encode("You are a careful assistant. Answer briefly and well.");
    e.prefill(&ids).unwrap();
    let key = tok.decode(e.tokens(), false);
    let path = cache.store(&e, &key, SaveReason::Cold, &[], 0).unwrap();
    (path, key)
}

/// A cache in a fresh directory `tag` with one stored file: (dir, cache, file, key).
fn fresh(tag: &str) -> (PathBuf, DiskCache, PathBuf, String) {
    let dir = temp_dir(tag);
    let cache = open(&dir, FAKE_FINGERPRINT, false);
    let (path, key) = stored(&cache);
    (dir, cache, path, key)
}

/// Rewrites the file at `path` through `f`; returns the new bytes.
fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    std::fs::write(path, &b).unwrap();
    b
}

/// The lookup of `key` fails, leaves the engine empty and deletes the file (so it is
/// never tried again); then removes the scratch directory.
fn assert_refused_and_deleted(cache: &DiskCache, key: &str, path: &Path, dir: &Path) {
    let mut e = engine();
    assert!(cache.lookup(key, &mut e).is_none(), "{path:?} loaded");
    assert!(
        e.tokens().is_empty(),
        "engine not reset after the failed load"
    );
    assert!(!path.exists(), "bad file {path:?} kept");
    let _ = std::fs::remove_dir_all(dir);
}

/// Applies `corrupt` to a freshly stored file and looks it up again: the load must
/// fail and the file must be gone (quarantined), so it is never tried again.
fn assert_rejected(tag: &str, corrupt: impl Fn(&mut Vec<u8>)) {
    let dir = temp_dir(tag);
    let cache = open(&dir, FAKE_FINGERPRINT, false);
    let (path, key) = stored(&cache);
    let mut e = engine();
    assert!(
        cache.lookup(&key, &mut e).is_some(),
        "{tag}: intact file loads"
    );
    let mut bytes = std::fs::read(&path).unwrap();
    corrupt(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    let mut e = engine();
    assert!(
        cache.lookup(&key, &mut e).is_none(),
        "{tag}: corrupt file loaded"
    );
    assert!(
        e.tokens().is_empty(),
        "{tag}: engine reset after the failed load"
    );
    assert!(!path.exists(), "{tag}: bad file kept");
    let _ = std::fs::remove_dir_all(&dir);
}

fn payload_start(bytes: &[u8]) -> usize {
    HEADER_LEN + u32::from_le_bytes(bytes[48..52].try_into().unwrap()) as usize
}

// #18 item 5: a flipped bit in the payload (a float of a real DSV4 payload).
#[test]
fn flipped_payload_bit_is_rejected() {
    assert_rejected("flip", |b| {
        let end = b.len() - INTEGRITY_LEN - 1;
        b[end] ^= 0x40;
    });
}

// #18 item 5: two token ids swapped inside the payload (the fake payload's ids start
// after its 12-byte header); the payload still parses, only the checksum catches it.
#[test]
fn swapped_token_ids_are_rejected() {
    assert_rejected("swap", |b| {
        let p = payload_start(b) + 12;
        let (first, second) = (b[p..p + 4].to_vec(), b[p + 4..p + 8].to_vec());
        assert_ne!(first, second);
        b[p..p + 4].copy_from_slice(&second);
        b[p + 4..p + 8].copy_from_slice(&first);
    });
}

// #18 item 5: the quant byte changed from 2 to 4 (a q2 checkpoint posing as q4).
#[test]
fn changed_quant_byte_is_rejected() {
    assert_rejected("quant", |b| {
        assert_eq!(b[4], 2);
        b[4] = 4;
    });
}

// #18 item 5: a file written by another model with the same shapes (same payload
// layout, another fingerprint) is refused and removed.
#[test]
fn another_models_file_is_rejected() {
    let dir = temp_dir("other-model");
    let theirs = open(&dir, OTHER_MODEL, false);
    let (path, key) = stored(&theirs);
    let ours = open(&dir, FAKE_FINGERPRINT, false);
    assert_refused_and_deleted(&ours, &key, &path, &dir);
}

// #18 item 5: the reference's files (no integrity section) load unless strict, and
// strict skips them without deleting them (they are valid, only unverifiable).
#[test]
fn reference_files_load_unless_strict() {
    let (dir, cache, path, key) = fresh("reference");
    let b = edit(&path, |b| {
        b.truncate(b.len() - INTEGRITY_LEN);
        b[6] &= !EXT_INTEGRITY;
    });
    let parsed = parse_file(&b).unwrap();
    assert!(parsed.integrity.is_none());
    let strict = open(&dir, FAKE_FINGERPRINT, true);
    let mut e = engine();
    assert!(strict.lookup(&key, &mut e).is_none());
    assert!(
        path.exists(),
        "strict mode must not delete the reference's files"
    );
    let mut e = engine();
    let hit = cache.lookup(&key, &mut e).expect("reference file loads");
    assert_eq!(e.tokens().len(), hit.tokens);
    let _ = std::fs::remove_dir_all(&dir);
}

// #18 item 4: a payload length near 2^64 used to wrap `HEADER_LEN + key + payload` and
// panic; now the header is refused and the file deleted, so neither this process nor a
// restart tries it again.
#[test]
fn huge_payload_length_is_refused_and_deleted() {
    let (dir, cache, path, key) = fresh("huge-len");
    let b = edit(&path, |b| {
        b[40..48].copy_from_slice(&(u64::MAX - 20).to_le_bytes())
    });
    assert!(parse_file(&b).unwrap_err().contains("overflows"));
    assert_refused_and_deleted(&cache, &key, &path, &dir);
}

// #18 item 4: a payload length larger than the file (no overflow) is a truncated file.
#[test]
fn payload_longer_than_the_file_is_deleted_at_open() {
    let (dir, cache, path, _) = fresh("long-len");
    drop(cache);
    edit(&path, |b| {
        b[40..48].copy_from_slice(&(1u64 << 40).to_le_bytes())
    });
    let _cache = open(&dir, FAKE_FINGERPRINT, false);
    assert!(!path.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[cfg(unix)]
fn set_mode(p: &Path, m: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

/// Opens a cache on an existing directory of mode `m` and checks the mode is unchanged.
#[cfg(unix)]
fn open_with_mode(tag: &str, m: u32) -> (PathBuf, DiskCache) {
    let dir = temp_dir(tag);
    std::fs::create_dir_all(&dir).unwrap();
    set_mode(&dir, m);
    let cache = open(&dir, FAKE_FINGERPRINT, false);
    assert_eq!(mode(&dir), m, "the mode of an existing directory changed");
    (dir, cache)
}

// #18 item 3: an existing directory keeps its mode; a new one is created 0700.
#[cfg(unix)]
#[test]
fn existing_directory_mode_is_kept_and_new_ones_are_private() {
    let (dir, cache) = open_with_mode("dir-mode", 0o755);
    assert_eq!(cache.cfg.dir, dir);
    let new = dir.join("a/b");
    let cache = open(&new, FAKE_FINGERPRINT, false);
    assert_eq!(cache.cfg.dir, new);
    assert_eq!(mode(&new), 0o700);
    let _ = std::fs::remove_dir_all(&dir);
}

// #18 item 3: a world-writable sticky directory (like /tmp) is never chmodded; the
// files go to a private subdirectory, and a planted non-private one is refused.
#[cfg(unix)]
#[test]
fn world_writable_directory_gets_a_private_subdirectory() {
    let (dir, cache) = open_with_mode("dir-tmp", 0o1777);
    assert_ne!(cache.cfg.dir, dir);
    assert!(cache.cfg.dir.starts_with(&dir));
    assert_eq!(mode(&cache.cfg.dir), 0o700);
    let (path, _) = stored(&cache);
    assert!(path.starts_with(&cache.cfg.dir));
    set_mode(&cache.cfg.dir, 0o777);
    let err = DiskCache::open(disk_cfg(&dir), CTX, 2, FAKE_FINGERPRINT).err();
    assert!(err.is_some(), "a non-private subdirectory must be refused");
    let _ = std::fs::remove_dir_all(&dir);
}

fn temp_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains(".kv.tmp."))
        .collect()
}

/// A pid that is not alive: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

// #18 item 6: temp files of dead writers are removed at open; a live writer's temp file
// is kept and counted in the budget (here it alone fills it, so the stored file goes).
#[test]
fn stale_temp_files_are_removed_and_live_ones_counted() {
    let (dir, _cache, path, _) = fresh("temps");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let dead = dir.join(format!("{name}.tmp.{}", dead_pid()));
    std::fs::write(&dead, b"KVC torn").unwrap();
    // Our parent (the test harness) is alive for the whole test.
    let live = dir.join(format!(
        "{name}.tmp.{}",
        std::os::unix::process::parent_id()
    ));
    let budget = KvDiskConfig::for_tests(dir.clone()).budget_bytes;
    std::fs::File::create(&live)
        .unwrap()
        .set_len(budget)
        .unwrap();
    let _cache = open(&dir, FAKE_FINGERPRINT, false);
    assert!(!dead.exists(), "dead writer's temp file kept");
    assert!(live.exists(), "live writer's temp file removed");
    assert!(!path.exists(), "temp bytes not counted in the budget");
    let _ = std::fs::remove_dir_all(&dir);
}

fn spawn_server(dir: &Path, lock: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .env("DS4_LOCK_FILE", lock)
        .arg("--fake-engine")
        .arg(root().join("fixtures/tiny/tokenizer.json"))
        .args(["--port", "0", "--kv-cache-min-tokens", "4"])
        .arg("--kv-disk-dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ds4-server")
}

/// Waits for the `listening on <addr>` line; returns the address.
fn listening(child: &mut std::process::Child) -> String {
    use std::io::{BufRead, BufReader};
    let err = child.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    let addr = loop {
        let line = lines.next().expect("server exited").expect("stderr");
        if let Some(a) = line.split("ready on ").nth(1) {
            break a
                .split_whitespace()
                .next()
                .unwrap()
                .trim_end_matches('/')
                .to_string();
        }
    };
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    addr.trim_start_matches("http://").to_string()
}

// #18 item 6, the acceptance: kill -9 while requests trigger cache saves, several times;
// after the next start no temp file is left and every `.kv` file parses and verifies.
#[cfg(unix)]
#[test]
fn kill_9_during_saves_leaves_no_temp_and_no_bad_file() {
    use std::io::Write;
    let dir = temp_dir("kill9");
    std::fs::create_dir_all(&dir).unwrap();
    let lock = dir.with_extension("lock");
    for round in 0..6u64 {
        let mut child = spawn_server(&dir, &lock);
        let addr = listening(&mut child);
        let body = format!(
            "{{\"messages\":[{{\"role\":\"system\",\"content\":\"{}\"}},{{\"role\":\"user\",\"content\":\"q{round}\"}}],\"max_tokens\":3}}",
            "Be careful and brief. ".repeat(10 + round as usize)
        );
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        if round == 0 {
            // One complete request, so a cold save surely happened (it is written during
            // the prefill, before the answer): the checks below then see a real file.
            use std::io::Read;
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let _ = s.read(&mut [0u8; 1]).unwrap();
        }
        // Kill at a different point of the request each round (upper bound 60 ms).
        std::thread::sleep(Duration::from_millis(round * 12));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    // A torn temp file of the last killed server, in case the kills missed the window.
    std::fs::write(
        dir.join(format!("{}.kv.tmp.{}", "a".repeat(40), dead_pid())),
        b"KVC",
    )
    .unwrap();
    let mut child = spawn_server(&dir, &lock);
    let _ = listening(&mut child);
    assert!(temp_files(&dir).is_empty(), "{:?}", temp_files(&dir));
    let kv: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "kv"))
        .collect();
    assert!(!kv.is_empty(), "the first round's cold save is missing");
    for f in kv {
        let b = std::fs::read(&f).unwrap();
        let parsed = parse_file(&b).unwrap_or_else(|e| panic!("{f:?}: {e}"));
        assert_eq!(
            parsed
                .integrity
                .expect("our files carry the section")
                .fingerprint,
            FAKE_FINGERPRINT
        );
    }
    common::stop(child);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&lock);
}
