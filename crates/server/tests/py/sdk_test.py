"""Drives ds4-server with the official OpenAI and Anthropic Python SDKs.

Every endpoint streaming and not, thinking on/off, a full tool round trip per API, and
the KV cache file header read with an independent parser. Exits non-zero on failure.
"""
import argparse
import glob
import hashlib
import json
import os
import struct
import sys

import anthropic
import openai

p = argparse.ArgumentParser()
p.add_argument("--base-url", required=True)
p.add_argument("--kv-dir")
p.add_argument("--no-tools", action="store_true", help="real tiny model: random output, no scripted tool calls")
args = p.parse_args()

oa = openai.OpenAI(base_url=args.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
an = anthropic.Anthropic(base_url=args.base_url, api_key="k", max_retries=0, timeout=120)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
checks = 0


def ok(cond, what):
    global checks
    if not cond:
        print("FAIL:", what, file=sys.stderr)
        sys.exit(1)
    checks += 1


# models
ok(oa.models.list().data[0].id == "deepseek-v4-flash", "models.list")
ok(oa.models.retrieve("deepseek-v4-flash").id == "deepseek-v4-flash", "models.retrieve")
try:
    oa.models.retrieve("nope")
    ok(False, "unknown model must 404")
except openai.NotFoundError:
    ok(True, "404")

# chat, thinking on and off, streaming and not
for model in ["deepseek-reasoner", "deepseek-chat"]:
    r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=20)
    ok(r.choices[0].finish_reason in ("stop", "length"), f"chat {model}")
    ok(r.usage.prompt_tokens > 0, "usage")
    s = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                   stream=True, stream_options={"include_usage": True})
    chunks = list(s)
    ok(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0, "stream usage")

# completions
r = oa.completions.create(model="deepseek-v4-flash", prompt="hi", max_tokens=10)
ok(r.choices[0].text is not None, "completions")
ok(len(list(oa.completions.create(model="x", prompt="hi", max_tokens=10, stream=True))) > 1, "completions stream")

# responses
r = oa.responses.create(model="gpt-5", input="hi", max_output_tokens=20)
ok(r.status in ("completed", "incomplete"), "responses")
events = list(oa.responses.create(model="gpt-5", input="hi", max_output_tokens=20, stream=True,
                                  reasoning={"effort": "high", "summary": "auto"}))
ok(events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete"), "responses stream")

# anthropic
m = an.messages.create(model="claude-x", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
ok(m.type == "message" and m.stop_reason in ("end_turn", "max_tokens"), "messages")
with an.messages.stream(model="claude-x", max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                        thinking={"type": "enabled", "budget_tokens": 1024}) as st:
    fm = st.get_final_message()
ok(fm.content, "messages stream")
ok(an.messages.count_tokens(model="c", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0, "count_tokens")
try:
    an.messages.create(model="c", max_tokens=5, messages=[{"role": "user", "content": "x " * 100000}])
    ok(False, "context error expected")
except anthropic.BadRequestError:
    ok(True, "context error")

if not args.no_tools:
    # OpenAI chat tool round trip (streamed call, then result, then continuation).
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    s = oa.chat.completions.create(model="deepseek-v4-flash", messages=msgs, tools=TOOLS, stream=True,
                                   stream_options={"include_usage": True})
    call_id, name, argstr, finish, usage1 = None, None, "", None, None
    for c in s:
        if c.usage:
            usage1 = c.usage
        if not c.choices:
            continue
        d = c.choices[0].delta
        for tc in d.tool_calls or []:
            call_id = tc.id or call_id
            name = (tc.function.name if tc.function and tc.function.name else name)
            argstr += (tc.function.arguments or "") if tc.function else ""
        finish = c.choices[0].finish_reason or finish
    ok(finish == "tool_calls" and name == "get_weather" and json.loads(argstr)["city"], "chat tool call")
    msgs.append({"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants an answer. Let me think.",
                 "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": argstr}}]})
    msgs.append({"role": "tool", "tool_call_id": call_id, "content": "sunny"})
    r = oa.chat.completions.create(model="deepseek-v4-flash", messages=msgs, tools=TOOLS)
    ok(r.choices[0].message.content == "It is sunny in Paris.", "chat continuation")
    ok(r.usage.prompt_tokens_details.cached_tokens == usage1.prompt_tokens + usage1.completion_tokens,
       f"second turn reuses the first: {r.usage}")

    # Responses tool round trip.
    rtools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    r = oa.responses.create(model="gpt-5", input="weather in Paris?", tools=rtools)
    fc = [o for o in r.output if o.type == "function_call"][0]
    r2 = oa.responses.create(model="gpt-5", tools=rtools, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
    ok(r2.output_text == "It is sunny in Paris.", "responses continuation")
    ev = list(oa.responses.create(model="gpt-5", input="weather in Paris?", tools=rtools, stream=True))
    ok(any(e.type == "response.function_call_arguments.done" for e in ev), "responses stream tool")

    # Anthropic tool round trip with the streaming helper.
    atools = [{"name": "get_weather", "description": "w", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    with an.messages.stream(model="claude-x", max_tokens=500, tools=atools,
                            messages=[{"role": "user", "content": "weather?"}]) as st:
        fm = st.get_final_message()
    tu = [b for b in fm.content if b.type == "tool_use"][0]
    ok(fm.stop_reason == "tool_use" and tu.input.get("city"), "anthropic tool_use")
    m = an.messages.create(model="claude-x", max_tokens=500, tools=atools, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in fm.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "sunny"}]}])
    ok([b.text for b in m.content if b.type == "text"] == ["It is sunny in Paris."], "anthropic continuation")
    ok(m.usage.cache_read_input_tokens > 0, "anthropic cached tokens")

if args.kv_dir:
    files = glob.glob(os.path.join(args.kv_dir, "*.kv"))
    ok(files, "cache files exist")
    for f in files:
        b = open(f, "rb").read()
        magic, ver, quant, reason, ext, _r, ntok, hits, ctx, _r2, created, used, plen, klen = struct.unpack_from("<3sBBBBBIIIIQQQI", b, 0)
        ok(magic == b"KVC" and ver == 1 and quant in (2, 4) and ntok > 0, f"header of {f}")
        key = b[52:52 + klen]
        ok(hashlib.sha1(key).hexdigest() + ".kv" == os.path.basename(f), "file name is sha1(key)")
        ok(len(b) >= 52 + klen + plen, "file size")

print(f"sdk_test: {checks} checks passed (openai {openai.__version__}, anthropic {anthropic.__version__})")
