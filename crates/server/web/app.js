// The ds4-server chat page: plain JS over the server's own OpenAI-compatible API
// (/v1/models, /v1/chat/completions with stream: true). No framework, no build step and
// no request to any other origin (the server sends a strict Content-Security-Policy).

const $ = (id) => document.getElementById(id);
const KEY = "ds4.apiKey";
const SETTINGS = "ds4.settings";
const FIELDS = ["think", "temperature", "max-tokens", "system", "tools"];

// The conversation as the API sees it; each assistant entry also keeps its DOM node.
let history = [];
let ctxSize = 0;
let modelId = "deepseek-v4-flash";
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function status(text) {
  $("status").textContent = text;
}

function needKey() {
  $("key-form").hidden = false;
  $("key").focus();
  status("The server answered 401: enter its API key.");
}

/// Reads the model id and context size; asks for the key when the API needs one.
async function loadModel() {
  let r;
  try {
    r = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    status(`Cannot reach the server: ${e.message}`);
    return;
  }
  if (r.status === 401) return needKey();
  if (r.status === 503) {
    // Still loading the model (or busy): ask again shortly.
    status("The server is not ready yet (loading the model?); retrying…");
    setTimeout(loadModel, 1000);
    return;
  }
  if (!r.ok) return status(`/v1/models answered ${r.status}`);
  status("");
  const m = (await r.json()).data[0];
  modelId = m.id;
  ctxSize = m.context_length;
  $("model").textContent = m.id;
  showUsage(0);
}

function showUsage(used) {
  $("ctx").textContent = `context ${used} / ${ctxSize} tokens`;
  $("ctx-meter").value = ctxSize ? used / ctxSize : 0;
}

// ---- rendering -------------------------------------------------------------------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function addBubble(role, text) {
  const b = el("article", `msg ${role}`);
  b.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  if (text !== undefined) b.append(el("div", "content", text));
  $("log").append(b);
  b.scrollIntoView({ block: "end" });
  return b;
}

/// The DOM of one streamed assistant turn: a collapsible reasoning block, the content,
/// the tool calls, and a footer for the finish state.
class Turn {
  constructor() {
    this.node = addBubble("assistant");
    this.node.setAttribute("aria-busy", "true");
    this.msg = { role: "assistant", content: "" };
    this.calls = [];
  }
  reasoning(text) {
    if (!this.think) {
      this.think = el("details", "reasoning");
      this.think.open = true;
      this.think.append(el("summary", "", "Thinking"), el("div", "text"));
      this.node.prepend(this.think);
    }
    this.think.lastChild.textContent += text;
  }
  content(text) {
    if (!this.body) {
      this.body = el("div", "content");
      this.node.append(this.body);
      if (this.think) {
        this.think.open = false; // the answer started: fold the reasoning away
        this.think.firstChild.textContent = "Thinking (done)";
      }
    }
    this.msg.content += text;
    this.body.textContent = this.msg.content;
  }
  toolDelta(d) {
    let c = this.calls[d.index];
    if (!c) {
      c = { id: d.id, type: "function", function: { name: "", arguments: "" } };
      c.node = el("div", "tool-call");
      c.node.append(el("div", "tool-name"), el("pre", "tool-args"));
      this.node.append(c.node);
      this.calls[d.index] = c;
    }
    if (d.id) c.id = d.id;
    if (d.function?.name) c.function.name += d.function.name;
    if (d.function?.arguments) c.function.arguments += d.function.arguments;
    c.node.firstChild.textContent = `Tool call: ${c.function.name}`;
    c.node.lastChild.textContent = c.function.arguments;
  }
  finish(text, cls) {
    this.node.removeAttribute("aria-busy");
    if (text) this.node.append(el("div", `footer ${cls || ""}`, text));
    this.node.scrollIntoView({ block: "end" });
  }
  /// The message for the history, with a result form under each tool call.
  done() {
    if (this.calls.length) {
      this.msg.tool_calls = this.calls.map(({ id, type, function: f }) => ({ id, type, function: f }));
      this.calls.forEach((c) => c.node.append(resultForm(c)));
    }
    return this.msg;
  }
}

/// A small form that sends the result of a tool call back as a `tool` message.
function resultForm(call) {
  const f = el("form", "tool-result");
  const label = el("label", "", `Result of ${call.function.name}`);
  const input = el("input");
  input.required = true;
  label.append(input);
  f.append(label, el("button", "", "Send result"));
  f.addEventListener("submit", (e) => {
    e.preventDefault();
    if (controller) return;
    f.replaceWith(el("div", "tool-output", `Result: ${input.value}`));
    history.push({ role: "tool", tool_call_id: call.id, content: input.value });
    generate();
  });
  return f;
}

// ---- the request -----------------------------------------------------------------

function requestBody() {
  const think = $("think").value;
  const body = {
    model: modelId,
    messages: history.map(({ role, content, tool_calls, tool_call_id }) =>
      ({ role, content, tool_calls, tool_call_id })),
    stream: true,
    stream_options: { include_usage: true },
    thinking: { type: think === "off" ? "disabled" : "enabled" },
    temperature: Number($("temperature").value),
  };
  if (think === "max") body.reasoning_effort = "max";
  const max = $("max-tokens").value;
  if (max) body.max_tokens = Number(max);
  const system = $("system").value.trim();
  if (system) body.messages.unshift({ role: "system", content: system });
  const tools = $("tools").value.trim();
  if (tools) {
    try {
      body.tools = JSON.parse(tools);
    } catch (e) {
      throw new Error(`the tools setting is not valid JSON (${e.message})`);
    }
  }
  return body;
}

/// Yields the JSON payload of each `data:` line of an SSE body until `[DONE]`.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    const frames = buf.split(/\r?\n\r?\n/);
    buf = frames.pop();
    for (const frame of frames) {
      for (const line of frame.split(/\r?\n/)) {
        if (!line.startsWith("data:")) continue; // comments are keepalives
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("new-chat").disabled = on;
}

/// Streams one assistant turn for the current history into a new bubble.
async function generate() {
  const turn = new Turn();
  controller = new AbortController();
  busy(true);
  status("Generating…");
  let finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (r.status === 401) {
      // Nothing was generated: give the message back to the composer for a retry.
      turn.node.remove();
      if (history.at(-1)?.role === "user") {
        $("input").value = history.pop().content;
        $("log").lastChild?.remove();
      }
      needKey();
      return;
    }
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error(e.error?.message || `HTTP ${r.status}`);
    }
    for await (const ev of events(r)) {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) showUsage(ev.usage.total_tokens);
      const ch = ev.choices?.[0];
      if (!ch) continue;
      const d = ch.delta || {};
      if (d.reasoning_content) turn.reasoning(d.reasoning_content);
      if (d.content) turn.content(d.content);
      (d.tool_calls || []).forEach((t) => turn.toolDelta(t));
      if (ch.finish_reason) finish = ch.finish_reason;
    }
    history.push(turn.done());
    if (finish === null) {
      turn.finish("The stream ended without a finish reason (did the server stop?).", "error");
      status("Incomplete answer.");
      return;
    }
    turn.finish(finish === "length" ? "Stopped at the token limit." : "");
    status(finish === "tool_calls" ? "The model called a tool: send its result." : "Done.");
  } catch (e) {
    if (e.name === "AbortError") {
      history.push(turn.done());
      turn.finish("Stopped.", "stopped");
      status("Stopped.");
    } else {
      turn.finish(`Error: ${e.message}`, "error");
      status(`Error: ${e.message}`);
    }
  } finally {
    controller = null;
    busy(false);
  }
}

// ---- wiring ----------------------------------------------------------------------

function saveSettings() {
  const s = Object.fromEntries(FIELDS.map((f) => [f, $(f).value]));
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

function loadSettings() {
  let s = {};
  try {
    s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  } catch {
    localStorage.removeItem(SETTINGS);
  }
  FIELDS.forEach((f) => { if (typeof s[f] === "string") $(f).value = s[f]; });
}

function send(e) {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  history.push({ role: "user", content: text });
  addBubble("user", text);
  generate();
}

function init() {
  loadSettings();
  FIELDS.forEach((f) => $(f).addEventListener("change", saveSettings));
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => {
    history = [];
    $("log").replaceChildren();
    showUsage(0);
    status("");
  });
  $("settings-toggle").addEventListener("click", (e) => {
    const open = $("settings").hidden;
    $("settings").hidden = !open;
    e.target.setAttribute("aria-expanded", String(open));
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    $("key-form").hidden = true;
    status("Key saved.");
    loadModel();
  });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY);
    status("Key forgotten.");
  });
  loadModel();
  $("input").focus();
}

init();
