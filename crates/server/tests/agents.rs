//! Claude Code and Codex CLI (npm packages) complete a one-shot prompt against the server
//! on the fake engine. The packages are not installed by the test (that needs the
//! network): install them with
//! `npm install --prefix $DS4_AGENTS_DIR @anthropic-ai/claude-code @openai/codex`
//! (default `DS4_AGENTS_DIR=/tmp/ds4-agents`); each test is skipped with a message when its
//! binary is missing.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use ds4_server::ServerConfig;

fn bin(name: &str) -> Option<PathBuf> {
    let dir = std::env::var("DS4_AGENTS_DIR").unwrap_or_else(|_| "/tmp/ds4-agents".into());
    let p = PathBuf::from(dir).join("node_modules/.bin").join(name);
    if p.exists() {
        Some(p)
    } else {
        record_skip(&format!(
            "{} not found (npm install --prefix $DS4_AGENTS_DIR the agent package)",
            p.display()
        ));
        None
    }
}

fn run_with_timeout(mut cmd: Command, secs: u64) -> (bool, String) {
    let home = std::env::temp_dir().join(format!("ds4-agent-home-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&home);
    cmd.env("HOME", &home).stdin(std::process::Stdio::null());
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn agent");
    let id = child.id();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        let _ = Command::new("kill").arg(id.to_string()).status();
    });
    let out = child.wait_with_output().expect("agent output");
    drop(killer);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn claude_code_one_shot() {
    let Some(claude) = bin("claude") else { return };
    let s = fake_server(ServerConfig::for_tests(200_000));
    let mut cmd = Command::new(claude);
    cmd.args(["-p", "say hi", "--model", "deepseek-v4-flash"])
        .env("ANTHROPIC_BASE_URL", s.url())
        .env("ANTHROPIC_API_KEY", "dummy");
    let (ok, text) = run_with_timeout(cmd, 120);
    eprintln!("{text}");
    assert!(
        ok && text.contains("Hello! I am a tiny fake model."),
        "{text}"
    );
}

#[test]
fn codex_one_shot() {
    let Some(codex) = bin("codex") else { return };
    let s = fake_server(ServerConfig::for_tests(200_000));
    let mut cmd = Command::new(codex);
    cmd.args([
        "exec",
        "--skip-git-repo-check",
        "-c",
        "model_provider=\"ds4\"",
        "-c",
        "model=\"deepseek-v4-flash\"",
        "-c",
        &format!(
            "model_providers.ds4={{name=\"ds4\",base_url=\"{}/v1\",wire_api=\"responses\"}}",
            s.url()
        ),
        "say hi",
    ]);
    let (ok, text) = run_with_timeout(cmd, 120);
    eprintln!("{text}");
    assert!(
        ok && text.contains("Hello! I am a tiny fake model."),
        "{text}"
    );
}
