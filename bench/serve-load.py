#!/usr/bin/env python3
"""Load generator for ds4-server (issue #21): N concurrent streaming agent clients.

Each client sends OpenAI chat completions with stream=true: a system prompt and tool
schemas shared by all clients (what an agent harness resends every turn) followed by a
history of its own (distinct per client and request), and reads the SSE stream.

Reports aggregate generated tokens per second over the run's wall time, per-stream
tokens per second, time to first token (TTFT) and inter-token latency (ITL) p50/p99:
a human summary on stderr and one CSV line on stdout (--csv-header adds the header).
Token counts come from the stream's final usage chunk (stream_options.include_usage);
TTFT is the time from sending the request to the first chunk with generated text, and
ITL the gaps between consecutive such chunks (a chunk is one token unless the server
held text back for a stop string or a tool call).

Standard library only (no pip). Example:
    python3 bench/serve-load.py --url http://127.0.0.1:8000 --clients 8 --requests 2 \\
        --max-tokens 256 --system-words 1500
Exit status: 0 when every request succeeded, 1 otherwise.
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": f"the {arg}"}},
                "required": [arg],
            },
        },
    }
    for name, desc, arg in [
        ("read_file", "Read a file of the repository.", "path"),
        ("run_shell", "Run a shell command in the sandbox.", "command"),
        ("search_code", "Search the repository for a pattern.", "pattern"),
    ]
]


def system_prompt(words):
    base = (
        "You are a coding agent working in a large Rust repository. Follow the "
        "repository conventions, keep changes small, run the tests you touch, and "
        "explain what you changed. "
    ).split()
    return " ".join(base[i % len(base)] for i in range(max(words, 1)))


def history(client, request, turns):
    """A distinct conversation per client and request (an agent's earlier turns)."""
    msgs = []
    for t in range(turns):
        msgs.append(
            {
                "role": "user",
                "content": f"Client {client} task {request} step {t}: look at module m{client}_{t}.",
            }
        )
        msgs.append(
            {
                "role": "assistant",
                "content": f"Module m{client}_{t} holds {3 + t} functions; step {t} is done.",
            }
        )
    msgs.append(
        {
            "role": "user",
            "content": f"Client {client} task {request}: summarise what you found in detail.",
        }
    )
    return msgs


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Result:
    def __init__(self):
        self.ok = False
        self.error = None
        self.tokens = 0
        self.ttft = None
        self.gaps = []
        self.start = 0.0
        self.end = 0.0


def one_request(url, body, timeout, api_key):
    r = Result()
    u = urllib.parse.urlparse(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    payload = json.dumps(body).encode()
    r.start = time.monotonic()
    last = None
    chunks = 0
    try:
        conn.request("POST", (u.path.rstrip("/") or "") + "/v1/chat/completions", payload, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return r
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                r.ok = True
                break
            ev = json.loads(data)
            if "error" in ev:
                r.error = json.dumps(ev["error"])[:200]
                break
            if ev.get("usage"):
                r.tokens = ev["usage"].get("completion_tokens", r.tokens)
            for ch in ev.get("choices", []):
                d = ch.get("delta", {})
                if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                    now = time.monotonic()
                    if last is None:
                        r.ttft = now - r.start
                    else:
                        r.gaps.append(now - last)
                    last = now
                    chunks += 1
        if r.ok and r.tokens == 0:
            r.tokens = chunks
        if not r.ok and r.error is None:
            r.error = "stream ended without [DONE]"
    except Exception as e:  # a network error is one failed request, not a crash
        r.error = f"{type(e).__name__}: {e}"
    finally:
        r.end = time.monotonic()
        conn.close()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--system-words", type=int, default=300, help="words of the shared system prompt")
    ap.add_argument("--turns", type=int, default=2, help="earlier turns in each client's history")
    ap.add_argument("--model", default="deepseek-chat", help="model name sent (deepseek-chat: no thinking)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    ap.add_argument("--no-tools", action="store_true", help="leave the tool schemas out")
    ap.add_argument("--timeout", type=float, default=600.0, help="socket timeout in seconds")
    ap.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    ap.add_argument("--csv-header", action="store_true", help="print the CSV header line first")
    ap.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="seconds to wait before sending (a late arrival beside another run's clients)",
    )
    a = ap.parse_args()
    if a.clients < 1 or a.requests < 1 or a.max_tokens < 1:
        ap.error("--clients, --requests and --max-tokens must be positive")

    if a.delay < 0:
        ap.error("--delay must be >= 0")
    time.sleep(a.delay)
    system = system_prompt(a.system_words)
    results = []
    lock = threading.Lock()

    def client(c):
        for i in range(a.requests):
            body = {
                "model": a.model,
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": a.max_tokens,
                "temperature": a.temperature,
                "messages": [{"role": "system", "content": system}] + history(c, i, a.turns),
            }
            if not a.no_tools:
                body["tools"] = TOOLS
            r = one_request(a.url, body, a.timeout, a.api_key)
            with lock:
                results.append(r)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0

    good = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.tokens for r in good)
    ttft = [r.ttft for r in good if r.ttft is not None]
    gaps = [g for r in good for g in r.gaps]
    per_stream = [
        r.tokens / (r.end - r.start - (r.ttft or 0.0))
        for r in good
        if r.tokens > 1 and r.end - r.start - (r.ttft or 0.0) > 0
    ]
    agg = tokens / wall if wall > 0 else 0.0
    stream = statistics.median(per_stream) if per_stream else float("nan")
    ms = lambda x: x * 1000.0
    print(
        f"serve-load: {a.clients} clients x {a.requests} requests, {len(good)} ok, "
        f"{len(errors)} failed, {tokens} tokens in {wall:.2f} s\n"
        f"  aggregate {agg:.1f} tok/s, per stream (median, after the first token) {stream:.1f} tok/s\n"
        f"  TTFT p50 {ms(percentile(ttft, 0.5)):.1f} ms  p99 {ms(percentile(ttft, 0.99)):.1f} ms\n"
        f"  inter-token p50 {ms(percentile(gaps, 0.5)):.2f} ms  p99 {ms(percentile(gaps, 0.99)):.2f} ms"
        f"  max {ms(max(gaps) if gaps else float('nan')):.2f} ms",
        file=sys.stderr,
    )
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    if a.csv_header:
        print(
            "clients,requests,ok,failed,wall_s,tokens,agg_tok_s,stream_tok_s,"
            "ttft_p50_ms,ttft_p99_ms,itl_p50_ms,itl_p99_ms,itl_max_ms"
        )
    print(
        f"{a.clients},{a.requests},{len(good)},{len(errors)},{wall:.3f},{tokens},{agg:.2f},"
        f"{stream:.2f},{ms(percentile(ttft, 0.5)):.2f},{ms(percentile(ttft, 0.99)):.2f},"
        f"{ms(percentile(gaps, 0.5)):.3f},{ms(percentile(gaps, 0.99)):.3f},"
        f"{ms(max(gaps) if gaps else float('nan')):.3f}"
    )
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
