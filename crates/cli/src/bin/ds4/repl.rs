//! Interactive chat: a token transcript plus one live session whose KV state is
//! extended turn by turn (only the new suffix is prefilled).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Result;
use ds4_engine::{Sampler, Session, Speculator};
use ds4_tokenizer::chat::THINK_MAX_MIN_CONTEXT;
use rustyline::config::Config;
use rustyline::error::ReadlineError;
use rustyline::history::DefaultHistory;
use rustyline::Editor;

use crate::args::{Args, Think};
use crate::engine::Engine;
use crate::generate::{budget, generate, mtp_summary, prefill, timing_line};
use crate::oneshot::sampler_config;
use crate::render::{head_tokens, turn_tokens, TokenPrinter};

/// Raised by SIGINT while a turn runs (at the prompt the line editor reads Ctrl+C
/// as a key, so it never gets here).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

const HISTORY_MAX: usize = 512;

const HELP: &str = "\
Commands:
  /help          this help
  /think         reason before answering (default)
  /think-max     maximum reasoning effort (needs a context of at least 393216)
  /nothink       answer directly, without reasoning
  /ctx N         recreate the session with a context of N tokens (the chat is kept)
  /read FILE     send the content of FILE as the next message
  /quit, /exit   leave (Ctrl+D too)
Ctrl+C stops a generation and returns to the prompt.";

struct Chat<'e> {
    engine: &'e Engine,
    args: &'e Args,
    system: String,
    think: Think,
    ctx: usize,
    /// Every turn after the head: user turns, assistant prefixes, all generated
    /// tokens (reasoning included) and the EOS that ends each answer.
    body: Vec<u32>,
    /// The live session; `None` after /ctx or a failure, rebuilt on the next turn.
    session: Option<Session>,
    sampler: Sampler,
    max_tokens: usize,
    /// The speculative loop of `--mtp`.
    spec: Option<Speculator>,
}

impl Chat<'_> {
    fn transcript(&self) -> Vec<u32> {
        let sp = self.engine.specials();
        let mut v = head_tokens(
            &self.engine.tok,
            sp,
            &self.system,
            self.think.effective(self.ctx),
        );
        v.extend_from_slice(&self.body);
        v
    }

    /// Brings the session to exactly `target`, reusing its state when `target`
    /// extends it. Returns the tokens prefilled, `None` when interrupted.
    fn sync(&mut self, target: &[u32]) -> Result<Option<usize>> {
        let session = match &mut self.session {
            Some(s) => s,
            None => self.session.insert(self.engine.session(self.ctx)?),
        };
        if !target.starts_with(session.tokens()) {
            session.reset();
        }
        let have = session.n_tokens();
        let done = prefill(session, &target[have..], Some(&INTERRUPTED))?;
        Ok(done.then_some(target.len() - have))
    }

    fn turn(&mut self, text: &str) -> Result<()> {
        let sp = self.engine.specials();
        let think = self.think.effective(self.ctx);
        let suffix = turn_tokens(&self.engine.tok, sp, text, think);
        let mut target = self.transcript();
        target.extend_from_slice(&suffix);
        if target.len() + 1 >= self.ctx {
            eprintln!(
                "ds4: the chat would need {} tokens but the context holds {}; use /ctx N",
                target.len() + 1,
                self.ctx
            );
            return Ok(());
        }
        INTERRUPTED.store(false, Ordering::SeqCst);
        let t0 = Instant::now();
        let prefilled = match self.sync(&target) {
            Ok(Some(n)) => n,
            Ok(None) => {
                eprintln!("\nds4: interrupted before the answer; the turn was dropped");
                return Ok(());
            }
            Err(e) => {
                // Roll the turn back; the session no longer matches the transcript.
                self.session = None;
                return Err(e);
            }
        };
        let prefill_time = t0.elapsed();
        let session = self.session.as_mut().expect("synced");
        let stdout = std::io::stdout();
        let color = stdout.is_terminal() && std::env::var_os("NO_COLOR").is_none();
        let mut printer = TokenPrinter::new(stdout.lock(), think.enabled(), color);
        let max = budget(self.max_tokens, self.ctx, session.n_tokens());
        let g = generate(
            session,
            &mut self.sampler,
            &self.engine.tok,
            sp.eos,
            max,
            &mut printer,
            Some(&INTERRUPTED),
            self.spec.as_mut(),
        )?;
        INTERRUPTED.store(false, Ordering::SeqCst);
        if g.interrupted && g.tokens.is_empty() {
            eprintln!("ds4: interrupted before the answer; the turn was dropped");
            return Ok(());
        }
        // Keep the answer (partial if interrupted) and close it with EOS; the next
        // turn's sync prefills those tokens together with the new user text.
        self.body.extend_from_slice(&suffix);
        self.body.extend_from_slice(&g.tokens);
        self.body.push(sp.eos);
        if g.interrupted {
            eprintln!("ds4: interrupted after {} tokens", g.tokens.len());
        }
        eprintln!(
            "{}{}",
            timing_line(prefilled, prefill_time, g.tokens.len(), g.elapsed),
            mtp_summary(g.mtp.as_ref())
        );
        // The tokens reused from the session, then the ones this turn prefilled.
        let cached = target.len() - prefilled;
        self.engine.trace(
            self.args,
            crate::trace::Run {
                mode: "chat",
                think,
                prompt: &target[cached..],
                cached,
                prefill: prefill_time,
                generated: &g,
                max,
                backend: self.engine.backend_name(),
                steering: self.engine.steering(),
            },
        )
    }

    /// Handles a `/command`; false means quit.
    fn command(&mut self, line: &str) -> Result<bool> {
        let (cmd, rest) = match line.split_once(char::is_whitespace) {
            Some((c, r)) => (c, r.trim()),
            None => (line, ""),
        };
        match cmd {
            "/help" => println!("{HELP}"),
            "/quit" | "/exit" => return Ok(false),
            "/think" => {
                self.think = Think::High;
                println!("thinking: high");
            }
            "/nothink" => {
                self.think = Think::None;
                println!("thinking: off");
            }
            "/think-max" => {
                // The Think Max paragraph sits after BOS: the next turn re-prefills.
                self.think = Think::Max;
                if self.ctx < THINK_MAX_MIN_CONTEXT {
                    println!("thinking: high (ctx below {THINK_MAX_MIN_CONTEXT})");
                } else {
                    println!("thinking: max");
                }
            }
            "/ctx" => match rest.parse::<usize>() {
                Ok(n) if n > 0 => {
                    let need = self.transcript().len() + 1;
                    if need >= n {
                        eprintln!("ds4: the chat already has {need} tokens; /ctx must be larger");
                    } else {
                        self.ctx = n;
                        self.session = None;
                        println!("context: {n} tokens");
                    }
                }
                _ => eprintln!("ds4: usage: /ctx N (a positive number of tokens)"),
            },
            "/read" => {
                if rest.is_empty() {
                    eprintln!("ds4: usage: /read FILE");
                } else {
                    match std::fs::read_to_string(rest) {
                        Ok(text) => self.turn(&text)?,
                        Err(e) => eprintln!("ds4: cannot read {rest}: {e}"),
                    }
                }
            }
            other => eprintln!("ds4: unknown command {other} (try /help)"),
        }
        Ok(true)
    }
}

fn history_path() -> PathBuf {
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".ds4_history")
}

pub fn run(engine: &Engine, args: &Args) -> Result<()> {
    ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst))?;
    if args.think_mode() == Think::Max && args.ctx < THINK_MAX_MIN_CONTEXT {
        eprintln!(
            "ds4: warning: --think-max needs --ctx >= {THINK_MAX_MIN_CONTEXT}; ctx={} uses normal thinking instead",
            args.ctx
        );
    }
    let mut chat = Chat {
        engine,
        args,
        system: args.system.clone(),
        think: args.think_mode(),
        ctx: args.ctx,
        body: Vec::new(),
        session: None,
        sampler: Sampler::new(sampler_config(args)),
        max_tokens: args.tokens,
        spec: engine.speculator(args)?,
    };
    let config = Config::builder()
        .max_history_size(HISTORY_MAX)?
        .auto_add_history(false)
        .build();
    let mut rl: Editor<(), DefaultHistory> = Editor::with_config(config)?;
    let history = history_path();
    let _ = rl.load_history(&history);
    println!(
        "ds4 interactive chat (backend {}, ctx {}, thinking {}).\n{HELP}",
        engine.backend_name(),
        args.ctx,
        chat.think.effective(args.ctx).name()
    );
    loop {
        let line = match rl.readline("ds4> ") {
            Ok(l) => l,
            // Ctrl+C at the prompt is ignored.
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let _ = rl.add_history_entry(text);
        let _ = rl.save_history(&history);
        let result = if text.starts_with('/') {
            match chat.command(text) {
                Ok(false) => break,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            }
        } else {
            chat.turn(&line)
        };
        if let Err(e) = result {
            eprintln!("ds4: {e:#}");
        }
    }
    Ok(())
}
