// #19 item 2: the web chat page in a real headless Chromium (Debian's), driven by
// Playwright. Starts ds4-server ($DS4_SERVER_BIN) on the scripted fake engine with an API
// key, then: the key prompt, a streamed reply with its reasoning block, the stop button
// (the server counts the cancellation), a tool call and its result, phone width, and no
// request to anything but the server. Run by tests/web_chat.rs and .ci/run.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const ROOT = fileURLToPath(new URL("../../../../", import.meta.url));
const BIN = process.env.DS4_SERVER_BIN;
const CHROMIUM = process.env.DS4_CHROMIUM || "/usr/bin/chromium";
const KEY = "web-test-key";
// An upper bound for every wait (the fake engine answers in a few seconds).
const LIMIT = 60_000;
// Chromium as root in a closed network: no sandbox, no GPU, and none of the background
// connections it makes on its own (they would be refused, and are no part of the page).
const ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"];
const TOOLS = [{ type: "function", function: { name: "get_weather",
  parameters: { type: "object", properties: { city: { type: "string" } } } } }];

let server, url, browser;

/// Starts the binary on a free port and resolves with its URL from the log line.
function startServer() {
  assert.ok(BIN, "DS4_SERVER_BIN must name the ds4-server binary");
  const proc = spawn(BIN, [
    "--fake-engine", join(ROOT, "fixtures/tiny/tokenizer.json"), "--port", "0",
    "--ctx", "4096", "--api-key", KEY, "--fake-delay-ms", "25",
  ], {
    env: { ...process.env, DS4_LOCK_FILE: join(tmpdir(), `ds4-web-${process.pid}.lock`) },
    stdio: ["ignore", "ignore", "pipe"],
  });
  return new Promise((resolve, reject) => {
    createInterface({ input: proc.stderr }).on("line", (line) => {
      process.stderr.write(`server: ${line}\n`);
      const m = line.match(/listening on (\S+)/);
      if (m) resolve({ proc, url: m[1] });
    });
    proc.on("exit", (code) => reject(new Error(`ds4-server exited (${code}) before listening`)));
  });
}

async function cancelledTotal() {
  const text = await (await fetch(`${url}/metrics`)).text();
  return Number(text.match(/^ds4_cancelled_total (\d+)/m)?.[1] ?? NaN);
}

before(async () => {
  ({ proc: server, url } = await startServer());
  browser = await chromium.launch({ executablePath: CHROMIUM, args: ARGS, timeout: LIMIT });
});

after(async () => {
  await browser?.close();
  server?.kill("SIGTERM");
});

test("chat page: key prompt, streaming, reasoning, stop, tools, phone width, localhost only", async () => {
  // A phone-sized viewport: the page must work without horizontal scrolling.
  const context = await browser.newContext({ viewport: { width: 390, height: 844 } });
  context.setDefaultTimeout(LIMIT);
  const requests = [];
  const external = [];
  await context.route("**/*", (route) => {
    const u = new URL(route.request().url());
    requests.push(u.href);
    if (u.origin !== url) {
      external.push(u.href);
      return route.abort();
    }
    return route.continue();
  });
  // The first /v1/models answers 503 as a server still loading its model does: the
  // page says so and asks again.
  let loading = true;
  await context.route("**/v1/models", (route) => {
    if (!loading) return route.fallback();
    loading = false;
    return route.fulfill({ status: 503, contentType: "application/json",
      body: JSON.stringify({ error: { message: "loading", type: "server_error" } }) });
  });
  const page = await context.newPage();
  const problems = [];
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  page.on("console", (m) => {
    // The browser logs each 401 and 503 answer: the key prompt's and the retry's triggers.
    if (m.type() === "error" && !/status of (401|503)/.test(m.text())) problems.push(m.text());
  });

  // 1. The page loads without the key; the API's 401 brings up the key form.
  const resp = await page.goto(url);
  assert.equal(resp.status(), 200);
  assert.match(resp.headers()["content-security-policy"], /default-src 'none'/);
  await page.locator("#status", { hasText: "not ready yet" }).waitFor();
  await page.locator("#key-form").waitFor({ state: "visible" });
  await page.fill("#key", KEY);
  await page.click("#key-form button[type=submit]");
  await page.locator("#ctx", { hasText: "context 0 / 4096 tokens" }).waitFor();
  assert.equal(await page.evaluate(() => localStorage.getItem("ds4.apiKey")), KEY);

  // 2. A reply streams in pieces, reasoning first, in a block that folds once the
  // answer starts. A MutationObserver records every text the answer showed.
  await page.evaluate(() => {
    window.seen = new Set();
    new MutationObserver(() => {
      const c = document.querySelector(".msg.assistant:last-child .content");
      if (c) window.seen.add(c.textContent);
    }).observe(document.getElementById("log"), { subtree: true, childList: true, characterData: true });
  });
  await page.fill("#input", "hi");
  await page.press("#input", "Enter");
  const reply = page.locator(".msg.assistant").last();
  await reply.locator(".content", { hasText: "Hello! I am a tiny fake model." }).waitFor();
  await page.locator("#status", { hasText: "Done." }).waitFor();
  const partial = await page.evaluate(() => [...window.seen]);
  assert.ok(partial.length > 5, `the answer arrived in pieces: ${JSON.stringify(partial)}`);
  const think = reply.locator("details.reasoning");
  assert.equal(await think.locator(".text").textContent(), "The user wants an answer. Let me think.");
  assert.equal(await think.evaluate((d) => d.open), false, "reasoning folds when the answer starts");
  await think.locator("summary").click();
  assert.equal(await think.evaluate((d) => d.open), true, "reasoning opens on a click");
  const used = Number((await page.textContent("#ctx")).match(/context (\d+) \//)[1]);
  assert.ok(used > 0, "the final usage chunk updates the context meter");

  // 3. Stop mid-stream: the page stops, the server cancels the generation.
  const before = await cancelledTotal();
  await page.fill("#input", "please give a long answer");
  await page.click("#send");
  const long = page.locator(".msg.assistant").last();
  await long.locator(".content", { hasText: "word2 " }).waitFor();
  await page.click("#stop");
  await long.locator(".footer", { hasText: "Stopped." }).waitFor();
  assert.ok(!(await long.locator(".content").textContent()).includes("word39"));
  assert.ok(await page.isVisible("#send"), "send is back after stop");
  for (let t0 = Date.now(); (await cancelledTotal()) <= before;) {
    assert.ok(Date.now() - t0 < LIMIT, "the server never cancelled the stopped generation");
    await new Promise((r) => setTimeout(r, 100));
  }

  // 4. A tool call is shown with its arguments; its result continues the chat.
  await page.click("#settings-toggle");
  await page.fill("#tools", JSON.stringify(TOOLS));
  await page.fill("#input", "what is the weather?");
  await page.click("#send");
  const call = page.locator(".msg.assistant").last().locator(".tool-call");
  await call.locator(".tool-name", { hasText: "Tool call: get_weather" }).waitFor();
  await call.locator(".tool-result input").waitFor(); // shown once the turn is complete
  assert.match(await call.locator(".tool-args").textContent(), /Paris & \\"Lyon\\"/);
  await call.locator(".tool-result input").fill("sunny, 21 °C");
  await call.locator(".tool-result button").click();
  await page.locator(".msg.assistant").last()
    .locator(".content", { hasText: "It is sunny in Paris." }).waitFor();
  await page.locator("#status", { hasText: "Done." }).waitFor();

  // 5. Bad settings are reported on the page, nothing is sent; thinking off gives a
  // reply without a reasoning block; settings survive a reload.
  await page.fill("#tools", "[not json");
  await page.fill("#input", "hi");
  await page.click("#send");
  await page.locator(".msg.assistant").last()
    .locator(".footer.error", { hasText: "the tools setting is not valid JSON" }).waitFor();
  await page.click("#new-chat");
  await page.locator("#ctx", { hasText: "context 0 / 4096 tokens" }).waitFor();
  await page.fill("#tools", "");
  await page.selectOption("#think", "off");
  await page.reload();
  await page.locator("#ctx", { hasText: "context 0 / 4096 tokens" }).waitFor();
  assert.equal(await page.inputValue("#think"), "off");
  await page.fill("#input", "hi");
  await page.click("#send");
  const plain = page.locator(".msg.assistant").last();
  await plain.locator(".content", { hasText: "Hello! I am a tiny fake model." }).waitFor();
  assert.equal(await plain.locator("details.reasoning").count(), 0);
  await page.locator("#status", { hasText: "Done." }).waitFor();

  // 6. A stream that breaks off (no finish reason, no [DONE]) is marked incomplete.
  await page.route("**/v1/chat/completions", (route) => route.fulfill({
    status: 200, contentType: "text/event-stream",
    body: `data: ${JSON.stringify({ choices: [{ index: 0, delta: { content: "partial" } }] })}\n\n`,
  }), { times: 1 });
  await page.fill("#input", "hi");
  await page.click("#send");
  await page.locator(".msg.assistant").last()
    .locator(".footer.error", { hasText: "ended without a finish reason" }).waitFor();

  // 7. Phone width: nothing wider than the viewport.
  const [sw, cw] = await page.evaluate(() =>
    [document.documentElement.scrollWidth, document.documentElement.clientWidth]);
  assert.ok(sw <= cw, `no horizontal scroll at 390 px (${sw} > ${cw})`);
  if (process.env.DS4_WEB_SCREENSHOT) await page.screenshot({ path: process.env.DS4_WEB_SCREENSHOT, fullPage: true });

  assert.deepEqual(external, [], "no request leaves the server");
  assert.ok(requests.some((r) => r.endsWith("/ui/app.js")), "the page's script was loaded");
  assert.deepEqual(problems, [], "no script or CSP errors");
  await context.close();
});
