// Drives the protocol's reference TypeScript client (compiled by the Rust test into
// SBP_CLIENT_DIST) against a real gateway, through the client's public API only: attach to the
// session SBP_SESSION_ID, take the tethered turns the gateway drains (with the README's own
// handler, which reads `turn.content`), answer a TOOL_CALL with the client's MCPBridge, and see a
// turn stream (chunks, then TURN_COMPLETE) after it asks for one with SBP_PROMPT. Then the two
// refusals (an unknown session, a wrong token) as the client reports them.
// Prints one `RESULT <json>` line of everything the client's handlers saw and exits 0; exits 1
// on a failure or when it runs out of time. The Rust test checks the RESULT against the gateway.

import { randomUUID } from 'node:crypto';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const env = (name) => {
  const v = process.env[name];
  if (!v) {
    console.error(`${name} is not set`);
    process.exit(2);
  }
  return v;
};
const DIST = env('SBP_CLIENT_DIST');
const GATEWAY = env('SBP_GATEWAY_URL'); // http://127.0.0.1:PORT
const SESSION = env('SBP_SESSION_ID');
const TOKEN = env('SBP_SESSION_TOKEN');
const PROMPT = env('SBP_PROMPT');
const MODEL = env('SBP_MODEL');
/** Longest wait for any one expected event. */
const WAIT = 20000;

const limit = setTimeout(() => {
  console.error('drive.mjs: still running after 60 s');
  process.exit(1);
}, 60000);

if (typeof WebSocket !== 'function') {
  console.error('this node has no global WebSocket (node >= 22, or --experimental-websocket)');
  process.exit(2);
}

const { SBPClient, MCPBridge } = await import(pathToFileURL(join(DIST, 'index.js')).href);

/** A field as the handler saw it: `undefined` kept visible (JSON would drop it). */
const seen = (v) => (v === undefined ? '<undefined>' : v);

/** Resolves once `test()` holds, checked after every event; fails after WAIT ms. */
const waiters = [];
function until(what, test) {
  if (test()) return Promise.resolve();
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), WAIT);
    waiters.push(() => {
      if (!test()) return false;
      clearTimeout(timer);
      resolve();
      return true;
    });
  });
}
function changed() {
  for (let i = waiters.length - 1; i >= 0; i--) if (waiters[i]()) waiters.splice(i, 1);
}

const result = {
  attached: null,
  tether_turns: [],
  chunks: [],
  completes: [],
  tool_calls: [],
  errors: [],
  readies: 0,
};

const bridge = new MCPBridge().register('gps', async (input) => {
  result.tool_calls.push({ name: 'gps', input });
  changed();
  return { lat: 35.68, lon: 139.76, accuracy: input.accuracy ?? null };
});

const client = new SBPClient({
  serverUrl: GATEWAY.replace(/^http/, 'ws') + '/v1/sbp/ws',
  sessionId: SESSION,
  sessionToken: TOKEN,
  surface: { device_type: 'desktop', ui_capabilities: ['markdown', 'tables'], locale: 'en-US' },
  mcpBridge: bridge,
  autoReconnect: false,
});

client.on('attached', (frame) => {
  result.attached = { queued_turns: seen(frame.queued_turns), mcp_tools_registered: seen(frame.mcp_tools_registered) };
  changed();
});
// The README's handler, as written there: it throws if the client hands it `undefined`.
client.on('tether_turn', (turn) => {
  console.error('[buffered]', turn.content);
  result.tether_turns.push({ role: seen(turn.role), content: seen(turn.content), model_used: seen(turn.model_used) });
  changed();
});
client.on('chunk', ({ chunk, step, model }) => {
  result.chunks.push({ chunk: seen(chunk), step: seen(step), model: seen(model) });
  changed();
});
client.on('turn_complete', ({ step, model, cost_usd }) => {
  result.completes.push({ step: seen(step), model: seen(model), cost_usd: seen(cost_usd) });
  changed();
});
client.on('ready', () => {
  result.readies += 1;
  changed();
});
client.on('error', (err) => {
  result.errors.push(String(err && err.message));
  changed();
});

try {
  await client.connect();
  await until('SESSION_ATTACHED', () => result.attached !== null);
  const queued = result.attached.queued_turns;
  await until(`${queued} tethered turns`, () => result.tether_turns.length >= queued);

  // A turn of the session that calls the surface's tool: the bridge answers it, the reply streams.
  const reply = fetch(`${GATEWAY}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', 'x-session-token': TOKEN },
    body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: PROMPT }] }),
  }).then(async (r) => ({ status: r.status, body: await r.json() }));
  await until('TURN_COMPLETE', () => result.completes.length > 0);
  result.completion = await reply;
  await client.disconnect();

  // The refusals, as the client reports them: connect() rejects with the frame's fields.
  const refusal = async (sessionId, sessionToken) => {
    const c = new SBPClient({ serverUrl: GATEWAY.replace(/^http/, 'ws') + '/v1/sbp/ws', sessionId, sessionToken, autoReconnect: false });
    c.on('error', () => {});
    try {
      await c.connect();
      return 'connected';
    } catch (err) {
      return String(err && err.message);
    } finally {
      await c.disconnect();
    }
  };
  const unknown = randomUUID();
  result.not_found = { session_id: unknown, message: await refusal(unknown, TOKEN) };
  result.forbidden = { message: await refusal(SESSION, 'not-the-token') };
} catch (err) {
  console.error('drive.mjs failed:', err);
  console.error('seen so far:', JSON.stringify(result));
  process.exit(1);
}

clearTimeout(limit);
console.log('RESULT ' + JSON.stringify(result));
process.exit(0);
