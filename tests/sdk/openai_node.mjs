// OpenAI's official Node SDK against the gateway, as its users write it: only `baseURL` changes.
//
// Run by crates/sbp-cli/tests/binary/openai_sdks.rs with the gateway's URL (its upstream is the
// fake LLM) as the first argument; prints `ok <scenario>` for each scenario that held and exits
// non-zero (with the error) at the first that did not.

import assert from "node:assert/strict";
import OpenAI from "openai";

const BASE = process.argv[2].replace(/\/$/, "");
const MODEL = "gpt-4o-mini";

function client(options = {}) {
  return new OpenAI({ apiKey: "sk-not-used-by-the-gateway", baseURL: `${BASE}/v1`, ...options });
}

/** A client whose HTTP requests (retries included) are counted in `counter.n`. */
function countingClient(counter, options = {}) {
  const counted = (url, init) => {
    counter.n += 1;
    return fetch(url, init);
  };
  return client({ fetch: counted, ...options });
}

const user = (text) => [{ role: "user", content: text }];

async function newSession() {
  const { data, response } = await client()
    .chat.completions.create({ model: MODEL, messages: user("hello") })
    .withResponse();
  const token = response.headers.get("x-session-token");
  assert.ok(token?.startsWith("sbp_"), `token: ${token}`);
  return { completion: data, token };
}

async function suspend(sessionId, token) {
  const resp = await fetch(`${BASE}/v1/sbp/sessions/${sessionId}/status`, {
    method: "PATCH",
    headers: { "content-type": "application/json", "x-session-token": token },
    body: JSON.stringify({ status: "suspended" }),
  });
  assert.equal(resp.status, 200);
}

async function streamLoop() {
  // The loop of OpenAI's own docs: every chunk has choices[0].
  const stream = await client().chat.completions.create({
    model: MODEL,
    messages: user("[[fake:chunks=3]] one two three"),
    stream: true,
  });
  let text = "";
  for await (const chunk of stream) {
    text += chunk.choices[0].delta.content ?? "";
  }
  assert.equal(text, "echo: one two three");
}

async function streamUsage() {
  const runner = client().chat.completions.stream({
    model: MODEL,
    messages: user("[[fake:chunks=2]] count me"),
    stream_options: { include_usage: true },
  });
  const final = await runner.finalChatCompletion();
  assert.ok(final.usage && final.usage.total_tokens > 0, JSON.stringify(final));
  assert.equal(final.choices[0].message.content, "echo: count me");
}

async function sessionTokenAsApiKey() {
  const { completion, token } = await newSession();
  const again = await client({ apiKey: token }).chat.completions.create({
    model: MODEL,
    messages: user("me again"),
  });
  assert.equal(again.sbp.session_id, completion.sbp.session_id);
  assert.equal(again.sbp.step_count, 2);
}

async function suspendedSession() {
  const { completion, token } = await newSession();
  await suspend(completion.sbp.session_id, token);
  const counter = { n: 0 };
  await assert.rejects(
    countingClient(counter, { apiKey: token, maxRetries: 2 }).chat.completions.create({
      model: MODEL,
      messages: user("are you there?"),
    }),
    (e) => {
      assert.ok(e instanceof OpenAI.APIError, String(e));
      assert.equal(e.status, 423);
      assert.equal(e.code, "SBP_SESSION_SUSPENDED");
      return true;
    },
  );
  assert.equal(counter.n, 1, `retried: ${counter.n} requests`);
  const resumed = client({ apiKey: token, defaultHeaders: { "X-SBP-Auto-Resume": "true" } });
  const back = await resumed.chat.completions.create({ model: MODEL, messages: user("back") });
  assert.equal(back.choices[0].message.content, "echo: back");
}

async function upstreamError() {
  await assert.rejects(
    client().chat.completions.create({ model: "fake-error-404", messages: user("hi") }),
    (e) => {
      assert.ok(e instanceof OpenAI.NotFoundError, String(e));
      assert.equal(e.code, "SBP_UPSTREAM_ERROR");
      assert.equal(e.type, "invalid_request_error");
      assert.equal(e.error.upstream_code, "model_not_found");
      assert.match(e.message, /fake error/);
      return true;
    },
  );
}

async function models() {
  const ids = [];
  for await (const m of client().models.list()) ids.push(m.id);
  assert.ok(ids.includes("fake"), ids.join(","));
}

const scenarios = { streamLoop, streamUsage, sessionTokenAsApiKey, suspendedSession, upstreamError, models };
const wanted = process.argv.slice(3);
for (const [name, run] of Object.entries(scenarios)) {
  if (wanted.length && !wanted.includes(name)) continue;
  await run();
  console.log(`ok ${name}`);
}
