//! After a turn: the live protocol bindings (server.md §4.2) and the canonical rebuild
//! (§4.3) that makes the live KV match what the client's next request renders.

use std::sync::atomic::Ordering::Relaxed;

use ds4_tokenizer::chat::{Message, ToolCall};
use ds4_tokenizer::MarkedText;

use super::{common_prefix, Worker};
use crate::bindings::{AnthropicBinding, Bindings, ResponsesBinding, ThinkingBinding};
use crate::error::ServerError;
use crate::job::{ApiKind, Finish, GenJob, GenResult};
use crate::log;
use crate::render::{render_visible, Conversation};

/// The assistant turn as the client replays it: content, the calls with the ids the
/// client saw (the tool memory maps them to the exact DSML), and the reasoning when the
/// client sends it back.
fn reply_message(r: &GenResult, with_reasoning: bool) -> Message {
    let mut m = Message::new("assistant", &r.content);
    if with_reasoning {
        m.reasoning_content = r.reasoning.clone().filter(|s| !s.is_empty());
    }
    if !r.tool_calls.is_empty() {
        m.tool_calls = Some(
            r.tool_calls
                .iter()
                .map(|c| ToolCall::new(Some(&c.id), &c.name, &c.arguments))
                .collect(),
        );
    }
    m
}

fn has_tool_history(conv: &Conversation) -> bool {
    conv.messages
        .iter()
        .any(|m| m.role == "tool" || m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()))
}

/// What to do to make the live tokens equal the canonical ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Already equal.
    Keep,
    /// The live tokens are a prefix: evaluate the rest.
    Extend,
    /// The live tokens diverge at `common` (rebuild iff common < live).
    Rebuild { common: usize },
}

pub(crate) fn rebuild_plan(live: &[u32], canonical: &[u32]) -> Plan {
    let common = common_prefix(live, canonical);
    if common < live.len() {
        Plan::Rebuild { common }
    } else if canonical.len() == live.len() {
        Plan::Keep
    } else {
        Plan::Extend
    }
}

impl Worker {
    fn visible(&self, job: &GenJob, conv: &Conversation, reply: Message) -> Option<MarkedText> {
        let mem = self
            .shared
            .cfg
            .exact_dsml_replay
            .then(|| self.shared.tool_memory());
        render_visible(conv, job.req.mode, mem.as_deref(), reply)
    }

    /// Sets the bindings that describe the live session after this turn (every other
    /// binding is cleared). Turns that failed, hit the length limit or a stop string,
    /// left reasoning open or returned a malformed call bind nothing: the live tokens
    /// then hold text the client never sees.
    pub(super) fn bind_turn(&self, job: &GenJob, r: &GenResult) {
        let mut b = Bindings::default();
        let pos = self.engine.tokens().len();
        let clean = !matches!(r.finish, Finish::Error | Finish::Length)
            && r.stop_sequence.is_none()
            && !r.malformed
            && (!job.req.mode.thinking() || r.reasoning_closed)
            && pos > 0;
        if let (Some(conv), true) = (job.req.conv.as_deref(), clean) {
            let ids: Vec<String> = r.tool_calls.iter().map(|c| c.id.clone()).collect();
            match job.req.kind {
                ApiKind::Responses => {
                    // Codex never replays reasoning; pi replays summaries on tool turns.
                    let with_reasoning = job.req.summary && !ids.is_empty();
                    if let Some(visible) = self.visible(job, conv, reply_message(r, with_reasoning))
                    {
                        b.responses = Some(ResponsesBinding { pos, ids, visible });
                    }
                }
                ApiKind::Anthropic if !ids.is_empty() => {
                    b.anthropic = Some(AnthropicBinding { pos, ids });
                }
                _ => {}
            }
            if matches!(job.req.kind, ApiKind::Chat | ApiKind::Anthropic)
                && job.req.mode.thinking()
                && !job.req.tools_active
                && r.tool_calls.is_empty()
                && !has_tool_history(conv)
            {
                if let Some(visible) = self.visible(job, conv, reply_message(r, false)) {
                    b.thinking = Some(ThinkingBinding { pos, visible });
                }
            }
        }
        *self.shared.bindings() = b;
    }

    /// The canonical transcript of a chat/Anthropic tool-call turn (the prompt plus the
    /// turn as the client replays it, reasoning included), when one may be needed.
    pub(super) fn needs_canonical(&self, job: &GenJob, r: &GenResult) -> Option<MarkedText> {
        if !matches!(job.req.kind, ApiKind::Chat | ApiKind::Anthropic)
            || r.finish != Finish::ToolCalls
        {
            return None;
        }
        let conv = job.req.conv.as_deref()?;
        self.visible(job, conv, reply_message(r, true))
    }

    /// §4.3 canonicalization: when the live tokens are not the tokens of `canon` (the
    /// model's DSML differs from the canonical rendering the client's replay produces,
    /// e.g. with exact replay disabled), extend them or rebuild from the snapshot (or
    /// the best disk checkpoint, or nothing), so the next request is a memory-token hit.
    /// The turn-ending EOS stays out, like after any turn.
    pub(super) fn canonicalize(&mut self, job: &GenJob, eff: &[u32], marked: &MarkedText) {
        let tok = self.shared.tok.clone();
        let live_len = self.engine.tokens().len();
        let (canon, plain) = (marked.text(), marked.plain_ranges());
        // Only when the live prompt is the request's own rendering (not a visible or
        // tool-tail continuation, whose history differs from the live tokens on purpose),
        // with the same client-text marks.
        let prompt =
            MarkedText::from_parts(job.req.prompt_text.clone(), job.req.prompt_plain.clone());
        if !marked.starts_with_marked(&prompt)
            || !self.engine.tokens().starts_with(eff)
            || tok.decode(eff, false) != job.req.prompt_text
        {
            return;
        }
        let mut target = eff.to_vec();
        tok.encode_marked_tail(canon, plain, job.req.prompt_text.len(), &mut target);
        // The live tokens already spell the canonical text with control tokens where it
        // has them (BPE may differ): nothing to do, as before this check compared text.
        if tok.decode(self.engine.tokens(), false) == canon
            && tok.same_added_spans(self.engine.tokens(), &target)
        {
            return;
        }
        let plan = rebuild_plan(self.engine.tokens(), &target);
        let t0 = std::time::Instant::now();
        let base = match plan {
            Plan::Keep => return,
            Plan::Extend => live_len,
            Plan::Rebuild { .. } => {
                let snap = self
                    .snap
                    .as_ref()
                    .filter(|s| target.starts_with(s.tokens()))
                    .map(|s| s.snapshot());
                if let Some(Err(e)) = &snap {
                    log!("request {}: cannot restore the snapshot: {e}", job.id);
                }
                if let Some(Ok(copy)) = snap {
                    self.engine = copy;
                } else if let Some(hit) = self.disk.as_ref().and_then(|d| {
                    d.lookup_fitting(canon, self.engine.as_mut(), |hit, cached| {
                        super::disk_hit_fits(&tok, hit, cached, canon, plain, &target)
                    })
                }) {
                    target = self.engine.tokens().to_vec();
                    tok.encode_marked_tail(canon, plain, hit.key_len, &mut target);
                } else {
                    self.engine.reset();
                }
                self.engine.tokens().len()
            }
        };
        if let Err(e) = self.prefill_plain(&target[base..]) {
            log!("request {}: canonical rebuild failed: {e}", job.id);
            self.engine.reset();
            self.snap = None;
            self.shared.bindings().clear();
            return;
        }
        let new_len = self.engine.tokens().len();
        self.shared.metrics.canonical_rebuilds.fetch_add(1, Relaxed);
        log!(
            "request {}: canonical rebuild live={live_len} canonical={} plan={plan:?} reused={base} in {} ms",
            job.id,
            target.len(),
            t0.elapsed().as_millis()
        );
        let mut b = self.shared.bindings();
        if let Some(a) = b.anthropic.as_mut().filter(|a| a.pos == live_len) {
            a.pos = new_len;
        }
        b.thinking = None;
        b.responses = None;
    }

    /// Prefill with no client attached (rebuilds); stops early at shutdown.
    fn prefill_plain(&mut self, toks: &[u32]) -> Result<(), ServerError> {
        for c in toks.chunks(self.prefill_step()) {
            if self.shared.stop_now.load(Relaxed) {
                return Err(ServerError::Shutdown);
            }
            self.engine.prefill(c)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebuild_iff_common_below_live() {
        assert_eq!(rebuild_plan(&[1, 2, 3], &[1, 2, 3]), Plan::Keep);
        assert_eq!(rebuild_plan(&[1, 2], &[1, 2, 3]), Plan::Extend);
        assert_eq!(
            rebuild_plan(&[1, 2, 4], &[1, 2, 3, 5]),
            Plan::Rebuild { common: 2 }
        );
        // Live longer than the canonical text (e.g. tokens past a cut): rebuild too.
        assert_eq!(
            rebuild_plan(&[1, 2, 3, 4], &[1, 2, 3]),
            Plan::Rebuild { common: 3 }
        );
    }
}
