// The browser surface of the SBP gateway: creates or joins a session, shows its earlier
// conversation from the stored transcript, attaches over the WebSocket as device_type "browser",
// streams replies, shows turns drained from the Tether, reconnects with `last_seq`, and answers the
// agent's TOOL_CALLs after the user allows each one. With federation, a session that moved to
// another gateway is shown as such, with a link to this page there.
//
// Model output is untrusted: every piece of it reaches the page through createElement and
// textContent (markdown.js), never through an HTML parser.

import { renderMarkdown } from './markdown.js';

const $ = (id) => document.getElementById(id);

const SESSION_KEY = 'sbp.session'; // {id, token, lastSeq}
const OPERATOR_KEY = 'sbp.operatorKey';
const MODEL_KEY = 'sbp.model';
const SURFACE_KEY = 'sbp.surfaceId';
// + session id: what earlier versions of this page kept of a conversation; the transcript
// replaces it, and it is removed when seen.
const OLD_HISTORY_PREFIX = 'sbp.history.';
// The earlier conversation shown when the page opens a session: its last messages, read a page at
// a time from GET /v1/sessions/{id}/messages (whose seqs count the messages from 0).
const TRANSCRIPT_MAX = 200;
const TRANSCRIPT_PAGES = 4;

// As the Rust SDK: 250 ms doubling to a 5 s cap, minus up to 30% jitter; a connection that stayed
// up 5 s starts over. These closes mean reconnecting would be wrong.
const BACKOFF = { initial: 250, max: 5000, jitter: 0.3, resetAfter: 5000 };
const TERMINAL = { 1003: 'protocol error', 4003: 'forbidden', 4004: 'session not found', 4409: 'displaced' };
// 1013, try again later: with federation, this gateway could not take the session over from the
// one holding it just now (a turn running there). Retried with the backoff, whatever error frame
// came before it.
const TRY_AGAIN = 1013;
const ATTACH_TIMEOUT = 10000;
// The gateway PINGs every 25 s by default: a connection silent much longer than that is dead.
const IDLE_TIMEOUT = 75000;

// What the tests (and a curious user in the console) can read.
const stats = {
  attaches: 0, queued: 0, chunks: 0, completes: 0, tetherTurns: 0, repeats: 0, acked: 0, toolCalls: 0,
  transcript: 0, // messages shown from the stored transcript
  inTranscript: 0, // drained turns not shown again: the transcript had them
};
window.__sbpStats = stats;

const storage = {
  get(key) {
    try { return JSON.parse(localStorage.getItem(key)); } catch { return null; }
  },
  set(key, value) {
    // A full or disabled storage costs the reload memory, not the session.
    try { localStorage.setItem(key, JSON.stringify(value)); } catch { /* ignored */ }
  },
  remove(key) {
    try { localStorage.removeItem(key); } catch { /* ignored */ }
  },
};

// ---------------------------------------------------------------------------------------------
// DOM helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === 'class') node.className = v;
    else if (k === 'data') Object.assign(node.dataset, v);
    else node.setAttribute(k, v);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function timeText(date) {
  return date.toLocaleTimeString(navigator.language, { hour: '2-digit', minute: '2-digit' });
}

// ---------------------------------------------------------------------------------------------
// The conversation log

const log = $('log');
let awayGroup = null; // the open "While you were away" group, if a drain is being shown
let earlier = null; // the section holding the conversation read from the transcript

const scroller = $('scroller');

// New output keeps the view at the bottom, unless the user scrolled up to read.
function nearBottom() {
  return scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 120;
}

function keepInView(wasNear) {
  if (wasNear) scroller.scrollTop = scroller.scrollHeight;
}

function openAway() {
  if (awayGroup) return awayGroup;
  const heading = el('h2', { class: 'away-title' }, 'While you were away');
  awayGroup = el('section', { class: 'away', 'data-testid': 'away' }, heading);
  log.append(awayGroup);
  return awayGroup;
}

function closeAway() {
  awayGroup = null;
}

const ROLE_NAMES = { user: 'You', assistant: 'Assistant', system: 'System', tool: 'Tool' };

// A message bubble; `text` is rendered as Markdown unless it is the user's own (shown as typed).
function addMessage(role, text, opts = {}) {
  const wasNear = nearBottom();
  const when = opts.time ? new Date(opts.time) : new Date();
  const body = el('div', { class: 'body' });
  const node = el('article', { class: `msg msg-${role}`, data: { role } },
    el('header', { class: 'meta' }, ROLE_NAMES[role] || role, ' · ',
      el('time', { datetime: Number.isNaN(when.getTime()) ? '' : when.toISOString() },
        Number.isNaN(when.getTime()) ? '' : timeText(when))),
    body);
  if (opts.seq) node.dataset.seq = String(opts.seq);
  setBody(node, text);
  (opts.into || (opts.away ? openAway() : log)).append(node);
  keepInView(wasNear);
  return node;
}

function setBody(node, text) {
  const body = node.querySelector('.body');
  if (node.dataset.role === 'user') body.textContent = text;
  else if (!text) body.replaceChildren(el('span', { class: 'empty' }, node.dataset.state === 'streaming' ? '…' : '(no text)'));
  else body.replaceChildren(renderMarkdown(text));
}

function addNote(text, kind = 'info', into = log) {
  const wasNear = nearBottom();
  const node = el('p', { class: `note note-${kind}`, role: kind === 'error' ? 'alert' : null }, text);
  into.append(node);
  keepInView(wasNear);
  return node;
}

// ---------------------------------------------------------------------------------------------
// The earlier conversation: the session's stored transcript, read when the page opens a session
// (joined, from a link, or after a reload) and shown before anything the WebSocket brings. It is
// read before the attach, so what the attach's drain brings is either in it (a turn tethered
// before the read: shown from the transcript, and only ACKed when it arrives) or newer; a live turn
// is always newer. A drained turn is matched to its stored message by role and creation time,
// which the gateway writes once for both.

const fromTranscript = new Map(); // `${role} ${ms}` -> message nodes not matched by a drain yet

function transcriptKey(role, time) {
  const ms = Date.parse(time);
  return Number.isNaN(ms) ? null : `${role} ${ms}`;
}

// The text of a stored message's content: a string, or the text of its parts.
function contentText(content) {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return '';
  return content.map((part) => {
    if (!part || typeof part !== 'object') return '';
    if (part.type === 'text' && typeof part.text === 'string') return part.text;
    return typeof part.type === 'string' ? `[${part.type}]` : '';
  }).filter(Boolean).join('\n');
}

async function readTranscript(id) {
  const base = `/v1/sessions/${encodeURIComponent(id)}/messages?limit=${TRANSCRIPT_MAX}`;
  let { data } = await api('GET', base, undefined, true);
  let messages = Array.isArray(data.messages) ? data.messages : [];
  const total = Number(data.message_count) || messages.length;
  // A long one: its last messages, from near its end.
  if (data.has_more && total > TRANSCRIPT_MAX) {
    ({ data } = await api('GET', `${base}&after=${total - TRANSCRIPT_MAX - 1}`, undefined, true));
    messages = Array.isArray(data.messages) ? data.messages : [];
  }
  // Messages stored since the count was read.
  for (let page = 0; data.has_more && Number.isInteger(data.next_after) && page < TRANSCRIPT_PAGES; page += 1) {
    ({ data } = await api('GET', `${base}&after=${data.next_after}`, undefined, true));
    if (Array.isArray(data.messages)) messages = messages.concat(data.messages);
  }
  return { messages: messages.slice(-TRANSCRIPT_MAX), total: Math.max(total, messages.length) };
}

function showTranscript({ messages, total }) {
  if (total > messages.length) {
    const hidden = total - messages.length;
    addNote(`${hidden} earlier message${hidden === 1 ? ' is' : 's are'} not shown.`, 'info', earlier);
  }
  for (const m of messages) {
    if (!m || typeof m !== 'object') continue;
    const role = typeof m.role === 'string' ? m.role : 'assistant';
    // A tool's answer went to the model; the call it answers is noted below.
    if (role === 'tool') continue;
    const text = contentText(m.content);
    if (text || !Array.isArray(m.tool_calls)) {
      const node = addMessage(role, text, { into: earlier, time: m.created_at });
      node.dataset.state = 'complete';
      node.dataset.restored = 'true';
      stats.transcript += 1;
      const key = transcriptKey(role, m.created_at);
      if (key) fromTranscript.set(key, (fromTranscript.get(key) || []).concat(node));
    }
    for (const call of Array.isArray(m.tool_calls) ? m.tool_calls : []) {
      const name = call && call.function && typeof call.function.name === 'string' ? call.function.name : 'a tool';
      addNote(`The agent used ${name}.`, 'info', earlier);
    }
  }
}

// The node showing a drained turn already, from the transcript (then taken off the map).
function shownFromTranscript(f) {
  const key = transcriptKey(typeof f.role === 'string' ? f.role : 'assistant', f.created_at);
  const nodes = key && fromTranscript.get(key);
  if (!nodes || !nodes.length) return null;
  const node = nodes.shift();
  if (!nodes.length) fromTranscript.delete(key);
  return node;
}

// ---------------------------------------------------------------------------------------------
// Session, REST calls and state

let session = null; // {id, token, lastSeq}

function saveSession() {
  if (session) storage.set(SESSION_KEY, session);
}

function operatorKey() {
  return $('operator-key').value.trim();
}

async function api(method, path, body, withToken, extra = {}) {
  const reading = method === 'GET';
  const headers = reading ? { ...extra } : { 'Content-Type': 'application/json', ...extra };
  if (withToken && session) headers['X-Session-Token'] = session.token;
  const key = operatorKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  let resp;
  try {
    resp = await fetch(path, {
      method, headers, body: reading ? undefined : JSON.stringify(body || {}), cache: 'no-store', credentials: 'omit',
    });
  } catch (e) {
    throw new Error(`cannot reach the gateway (${e.message})`);
  }
  let data = null;
  try { data = await resp.json(); } catch { /* not JSON */ }
  if (!resp.ok) {
    let message = (data && data.error && data.error.message) || `HTTP ${resp.status}`;
    if (resp.status === 401) {
      message += ' (enter the operator key under Settings)';
      $('settings').open = true;
    }
    const err = new Error(message);
    err.status = resp.status;
    err.code = data && data.error && data.error.code;
    err.detail = data && data.error && data.error.detail;
    throw err;
  }
  return { status: resp.status, data };
}

const STATE_TEXT = {
  idle: 'Not connected',
  connecting: 'Connecting…',
  attached: 'Attached',
  reconnecting: 'Reconnecting…',
  displaced: 'Displaced: another surface attached to this session',
  error: 'Error',
};
let state = 'idle';

function setState(next, detail) {
  state = next;
  const node = $('conn-state');
  node.dataset.state = next;
  node.textContent = detail ? `${STATE_TEXT[next]} ${detail}` : STATE_TEXT[next];
  $('reconnect').hidden = !(next === 'displaced' || next === 'error');
}

function showSetup(error) {
  $('setup').hidden = false;
  $('chat').hidden = true;
  $('composer-bar').hidden = true;
  $('leave').hidden = true;
  const e = $('setup-error');
  e.hidden = !error;
  e.textContent = error || '';
}

function showChat() {
  $('setup').hidden = true;
  $('chat').hidden = false;
  $('composer-bar').hidden = false;
  $('leave').hidden = false;
  $('session-id').textContent = session.id;
  $('session-token').value = session.token;
  const link = new URL('/', location.href);
  link.hash = new URLSearchParams({ session: session.id, token: session.token }).toString();
  $('share-link').value = link.href;
}

function begin(next) {
  if (ws) {
    const old = ws;
    ws = null;
    old.close(1000);
  }
  const same = session && session.id === next.id;
  session = { id: next.id, token: next.token, lastSeq: same ? session.lastSeq : (next.lastSeq || 0) };
  saveSession();
  storage.remove(OLD_HISTORY_PREFIX + session.id);
  log.replaceChildren();
  closeAway();
  fromTranscript.clear();
  earlier = el('section', { class: 'earlier', 'aria-label': 'Earlier conversation', 'data-testid': 'earlier' });
  log.append(earlier);
  showChat();
  received = session.lastSeq;
  acked = 0;
  attempt = 0;
  $('message').focus();
  if (next.created) {
    connect();
    return;
  }
  const opened = session;
  setState('connecting', '· reading the conversation');
  const reading = readTranscript(opened.id).then((t) => {
    if (session === opened) showTranscript(t);
  }, (e) => {
    if (session === opened) addNote(`The earlier conversation could not be read: ${e.message}`, 'error', earlier);
  }).finally(() => {
    if (session === opened && !ws) connect();
  });
  // A message typed meanwhile is sent once the read is done, so it is not read back as earlier.
  sending = reading;
}

// ---------------------------------------------------------------------------------------------
// The WebSocket: attach, frames, ACKs, reconnects

let ws = null;
let received = 0; // highest seq shown: anything at or below it is a repeat
let acked = 0; // highest seq ACKed (or sent as last_seq) on the current connection
let attempt = 0;
let attachedAt = 0;
let lastRx = 0;
let refusal = null;
let retryTimer = 0;
let attachTimer = 0;
let idleTimer = 0;
let drainLeft = 0; // TETHER_TURNs still to come in this attach's drain
const live = new Map(); // chunk_id -> {node, text, chunks}

function surfaceId() {
  let id = storage.get(SURFACE_KEY);
  if (typeof id !== 'string') {
    id = `browser-${crypto.getRandomValues(new Uint32Array(2)).join('')}`;
    storage.set(SURFACE_KEY, id);
  }
  return id;
}

function attachFrame() {
  return {
    type: 'ATTACH_SESSION',
    session_id: session.id,
    session_token: session.token,
    last_seq: received,
    surface_context: {
      device_type: 'browser',
      ui_capabilities: ['markdown', 'tables', 'streaming'],
      locale: navigator.language || null,
      surface_id: surfaceId(),
      mcp_tools: TOOLS.map((t) => t.name),
      mcp_tool_schemas: TOOLS.map((t) => ({ name: t.name, description: t.description, input_schema: t.schema })),
    },
  };
}

function send(socket, frame) {
  if (socket && socket === ws && socket.readyState === WebSocket.OPEN) {
    socket.send(JSON.stringify(frame));
    return true;
  }
  return false;
}

function connect() {
  clearTimeout(retryTimer);
  if (!session) return;
  const url = new URL(`/v1/sbp/ws/${encodeURIComponent(session.id)}`, location.href);
  url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
  const socket = new WebSocket(url.href);
  ws = socket;
  refusal = null;
  acked = received;
  setState(attempt ? 'reconnecting' : 'connecting');
  socket.onopen = () => {
    if (socket !== ws) return;
    socket.send(JSON.stringify(attachFrame()));
    attachTimer = setTimeout(() => dropped(socket, 0, 'no SESSION_ATTACHED in time'), ATTACH_TIMEOUT);
  };
  socket.onmessage = (ev) => {
    if (socket !== ws) return;
    lastRx = Date.now();
    let frame;
    try { frame = JSON.parse(ev.data); } catch { return; }
    if (frame && typeof frame.type === 'string') onFrame(socket, frame);
  };
  socket.onclose = (ev) => dropped(socket, ev.code, ev.reason);
}

function dropped(socket, code, reason) {
  if (socket !== ws) return;
  ws = null;
  clearTimeout(attachTimer);
  clearInterval(idleTimer);
  try { socket.close(); } catch { /* already closed */ }
  const upFor = attachedAt ? Date.now() - attachedAt : 0;
  attachedAt = 0;
  cutLive();
  cancelPrompts(socket);
  if (!session) return;
  const tryAgain = code === TRY_AGAIN;
  if (!tryAgain && (refusal || TERMINAL[code])) {
    const why = refusal ? refusal.detail || refusal.kind : TERMINAL[code];
    const hint = code === 4003 || code === 4004 ? ' Check the session id and token, or leave the session.' : '';
    if (code === 4409) setState('displaced');
    else setState('error', `(${why}).${hint}`);
    return;
  }
  if (upFor >= BACKOFF.resetAfter) attempt = 0;
  attempt += 1;
  const base = Math.min(BACKOFF.max, BACKOFF.initial * 2 ** (attempt - 1));
  const delay = base * (1 - BACKOFF.jitter * Math.random());
  const why = tryAgain ? ': the session is still held by another gateway' : (reason ? `: ${reason}` : '');
  setState('reconnecting', `in ${(delay / 1000).toFixed(1)} s (attempt ${attempt})${why}`);
  retryTimer = setTimeout(connect, delay);
}

function onFrame(socket, f) {
  switch (f.type) {
    case 'PING':
      send(socket, { type: 'PONG' });
      break;
    case 'SESSION_ATTACHED':
      onAttached(socket, f);
      break;
    case 'TURN_CHUNK':
      onChunk(socket, f);
      break;
    case 'TURN_COMPLETE':
      onComplete(f);
      break;
    case 'TETHER_TURN':
      onTether(f);
      break;
    case 'TOOL_CALL':
      onToolCall(socket, f);
      break;
    case 'FORBIDDEN':
    case 'SESSION_NOT_FOUND':
    case 'PROTOCOL_ERROR':
      refusal = { kind: f.type.toLowerCase().replace(/_/g, ' '), detail: f.detail };
      break;
    default:
      break; // the protocol says: ignore unknown types
  }
}

function onAttached(socket, f) {
  clearTimeout(attachTimer);
  stats.attaches += 1;
  attachedAt = Date.now();
  lastRx = attachedAt;
  closeAway();
  if (f.last_seq_reset) {
    // The gateway never issued our position (say, its database was restored): every turn it
    // sends is new, whatever its seq.
    received = 0;
    acked = 0;
    session.lastSeq = 0;
    saveSession();
  }
  const queued = f.queued_turns || 0;
  stats.queued = queued;
  drainLeft = queued;
  setState('attached', queued ? `· ${queued} turn${queued === 1 ? '' : 's'} waiting` : '');
  const tools = Array.isArray(f.mcp_tools_registered) ? f.mcp_tools_registered : [];
  $('tools-registered').textContent = tools.length ? tools.join(', ') : 'none (the operator allows none of them)';
  clearInterval(idleTimer);
  idleTimer = setInterval(() => {
    if (Date.now() - lastRx > IDLE_TIMEOUT) dropped(socket, 0, 'nothing heard from the gateway');
  }, 5000);
  flushAck();
}

// A seq-carrying turn has been shown: ACK it shortly, together with any others
// shown meanwhile, so a long drain costs a few ACK frames rather than one per turn (the gateway
// closes connections that send frames faster than its frame rate).
const ACK_DELAY_MS = 50;
let ackQueued = false;
function delivered(seq) {
  if (!seq || seq <= received) return;
  received = seq;
  session.lastSeq = seq;
  saveSession();
  if (!ackQueued) {
    ackQueued = true;
    setTimeout(() => {
      ackQueued = false;
      flushAck();
    }, ACK_DELAY_MS);
  }
}

function flushAck() {
  if (received > acked && send(ws, { type: 'ACK', seq: received })) {
    acked = received;
    stats.acked = received;
  }
}

function isRepeat(seq) {
  if (seq && seq <= received) {
    stats.repeats += 1;
    return true;
  }
  return false;
}

let renderQueued = new Set();
let renderFrame = 0;
function scheduleRender(turn) {
  renderQueued.add(turn);
  if (!renderFrame) {
    renderFrame = requestAnimationFrame(() => {
      renderFrame = 0;
      const wasNear = nearBottom();
      for (const t of renderQueued) setBody(t.node, t.text);
      renderQueued = new Set();
      keepInView(wasNear);
    });
  }
}

function onChunk(socket, f) {
  stats.chunks += 1;
  closeAway();
  let turn = live.get(f.chunk_id);
  if (!turn) {
    const node = addMessage('assistant', '');
    node.dataset.chunkId = f.chunk_id;
    node.setAttribute('aria-busy', 'true');
    turn = { node, text: '', chunks: 0, socket };
    live.set(f.chunk_id, turn);
  } else if (turn.socket !== socket) {
    // A turn cut off on an earlier connection that finishes on this one: the gateway sends this
    // connection the whole text, from the start.
    turn.text = '';
    turn.socket = socket;
  }
  turn.node.dataset.state = 'streaming';
  turn.text += typeof f.delta === 'string' ? f.delta : '';
  turn.chunks += 1;
  turn.node.dataset.chunks = String(turn.chunks);
  scheduleRender(turn);
}

function onComplete(f) {
  const turn = live.get(f.chunk_id);
  live.delete(f.chunk_id);
  if (isRepeat(f.seq)) {
    if (turn) turn.node.remove();
    return;
  }
  stats.completes += 1;
  closeAway();
  let node;
  if (turn) {
    node = turn.node;
    renderQueued.delete(turn);
  } else {
    node = addMessage('assistant', '');
    node.dataset.chunkId = f.chunk_id;
  }
  node.dataset.state = 'complete';
  node.removeAttribute('aria-busy');
  if (f.seq) node.dataset.seq = String(f.seq);
  const text = turn ? turn.text : '';
  setBody(node, text);
  delivered(f.seq);
}

function onTether(f) {
  drainLeft -= 1;
  if (drainLeft === 0 && state === 'attached') setState('attached');
  if (isRepeat(f.seq)) return;
  stats.tetherTurns += 1;
  const text = typeof f.content === 'string' ? f.content : '';
  const role = typeof f.role === 'string' ? f.role : 'assistant';
  // The rest of a reply that was streaming here when the connection dropped: the whole turn
  // replaces what was shown of it.
  const cut = f.chunk_id && live.get(f.chunk_id);
  if (cut) {
    live.delete(f.chunk_id);
    renderQueued.delete(cut);
    cut.node.dataset.state = 'complete';
    cut.node.removeAttribute('aria-busy');
    if (f.seq) cut.node.dataset.seq = String(f.seq);
    setBody(cut.node, text);
    delivered(f.seq);
    return;
  }
  const already = shownFromTranscript(f);
  if (already) {
    stats.inTranscript += 1;
    if (f.seq) already.dataset.seq = String(f.seq);
  } else {
    const node = addMessage(role, text, { away: true, time: f.created_at, seq: f.seq });
    node.dataset.state = 'complete';
    if (f.chunk_id) node.dataset.chunkId = f.chunk_id;
  }
  delivered(f.seq);
}

// The connection dropped: replies that were streaming are cut off. When they finish they come back
// whole, from the Tether (same chunk_id) or as the new connection's chunks.
function cutLive() {
  for (const turn of live.values()) {
    if (turn.node.dataset.state === 'streaming') {
      turn.node.dataset.state = 'cut';
      scheduleRender(turn);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sending messages: over HTTP, one at a time in the order typed; the reply arrives over the
// WebSocket (or from the Tether after a reconnect), never from the HTTP response, so it is shown
// once. Each message has an Idempotency-Key, so one whose request was lost on the way can be sent
// again: the gateway stores it once and runs its turn once.

const SEND_ATTEMPTS = 6;
let sending = Promise.resolve();

function randomKey() {
  return Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, '0')).join('');
}

function sendMessage(text) {
  closeAway();
  const node = addMessage('user', text);
  node.dataset.state = 'sending';
  const model = $('model').value.trim();
  const body = { messages: [{ role: 'user', content: text }], sbp: { resume: true } };
  if (model) body.model = model;
  const key = `sbp-page-${randomKey()}`;
  sending = sending.then(() => deliver(node, body, key));
}

async function deliver(node, body, key) {
  for (let attempt = 1; ; attempt += 1) {
    try {
      await api('POST', '/v1/chat/completions', body, true, { 'Idempotency-Key': key });
      node.dataset.state = 'sent';
      return;
    } catch (e) {
      if (e.code === 'SBP_SESSION_MOVED') {
        node.dataset.state = 'failed';
        showMoved(e.detail);
        return;
      }
      // Lost on the way (no status), or, after such a loss, still running from that attempt (409).
      const lost = e.status === undefined || (e.status === 409 && attempt > 1);
      if (!lost || attempt >= SEND_ATTEMPTS || !session) {
        node.dataset.state = 'failed';
        addNote(`Message not answered: ${e.message}`, 'error');
        return;
      }
      node.dataset.state = 'retrying';
      await new Promise((r) => { setTimeout(r, 500 * 2 ** (attempt - 1)); });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Federation: the session moved to another gateway (a surface attached there). This gateway no
// longer answers for it; the page can be opened there with the session, as a shared link does.

// This page at `gatewayUrl` with the session in the fragment, or null when the URL is not one to
// send the session token to (not http(s), or plain http from an https page).
function pageAt(gatewayUrl) {
  if (!session) return null;
  let url;
  try { url = new URL(String(gatewayUrl)); } catch { return null; }
  if (url.protocol !== 'https:' && !(url.protocol === 'http:' && location.protocol === 'http:')) return null;
  if (url.username || url.password) return null;
  const page = new URL('/', url);
  page.hash = new URLSearchParams({ session: session.id, token: session.token }).toString();
  return page;
}

function showMoved(detail) {
  const to = detail && typeof detail.gateway_url === 'string' ? detail.gateway_url : '';
  const wasNear = nearBottom();
  const page = to ? pageAt(to) : null;
  const note = el('p', { class: 'note note-moved', role: 'alert', 'data-testid': 'moved' },
    to ? `This session moved to ${to}. ` : 'This session moved to another gateway. ');
  if (page) {
    note.append(el('a', { href: page.href, rel: 'noopener noreferrer', 'data-testid': 'moved-link' }, 'Open it there'));
  }
  log.append(note);
  keepInView(wasNear);
  setState('error', to ? `(moved to ${to})` : '(moved to another gateway)');
}

// ---------------------------------------------------------------------------------------------
// Browser tools: declared at attach with JSON schemas; each call waits for the user's decision.

const TOOLS = [
  {
    name: 'geolocation',
    description: "The device's current position from the browser: latitude and longitude in degrees, accuracy in metres. The user is asked first.",
    schema: {
      type: 'object',
      properties: { high_accuracy: { type: 'boolean', description: 'Ask for the most precise position (slower).' } },
      additionalProperties: false,
    },
    what: 'It will receive this device\'s current position (latitude, longitude, accuracy).',
    run: geolocation,
  },
  {
    name: 'page_info',
    description: "Facts about the user's browser: page URL (without fragment), title, user agent, language, screen and viewport size, time zone, online state. The user is asked first.",
    schema: { type: 'object', properties: {}, additionalProperties: false },
    what: 'It will receive this page\'s address (without the part after #), your browser\'s user agent, language, screen and window size, time zone and online state.',
    run: pageInfo,
  },
  {
    name: 'notify',
    description: 'Shows the user a notification (a system notification when the browser allows it, else a message in the page). The user is asked first.',
    schema: {
      type: 'object',
      properties: {
        title: { type: 'string', description: 'Short title.' },
        body: { type: 'string', description: 'The text.' },
      },
      required: ['title'],
      additionalProperties: false,
    },
    what: 'It will show you a notification with this title and text.',
    run: notify,
  },
];

function geolocation(input, remainingMs) {
  return new Promise((resolve, reject) => {
    if (!window.isSecureContext) {
      reject(new Error('geolocation needs a secure page (https or localhost)'));
      return;
    }
    if (!navigator.geolocation) {
      reject(new Error('this browser has no geolocation'));
      return;
    }
    const reasons = { 1: 'the browser denied access to the location', 2: 'the position is unavailable', 3: 'no position in time' };
    navigator.geolocation.getCurrentPosition(
      (p) => resolve({
        latitude: p.coords.latitude,
        longitude: p.coords.longitude,
        accuracy: p.coords.accuracy,
        altitude: p.coords.altitude,
        timestamp: new Date(p.timestamp).toISOString(),
      }),
      (e) => reject(new Error(reasons[e.code] || e.message || 'geolocation failed')),
      { enableHighAccuracy: Boolean(input && input.high_accuracy), timeout: Math.max(1000, remainingMs - 500), maximumAge: 0 },
    );
  });
}

function pageInfo() {
  let timezone = null;
  try { timezone = Intl.DateTimeFormat().resolvedOptions().timeZone; } catch { /* unknown */ }
  return {
    // Never the fragment: a joined session's token may still be in it.
    url: location.origin + location.pathname + location.search,
    title: document.title,
    user_agent: navigator.userAgent,
    language: navigator.language,
    languages: Array.from(navigator.languages || []),
    timezone,
    screen: { width: screen.width, height: screen.height },
    viewport: { width: window.innerWidth, height: window.innerHeight },
    device_pixel_ratio: window.devicePixelRatio,
    online: navigator.onLine,
    color_scheme: matchMedia('(prefers-color-scheme: dark)').matches ? 'dark' : 'light',
  };
}

async function notify(input) {
  const title = String((input && input.title) || 'Notification').slice(0, 200);
  const body = String((input && input.body) || '').slice(0, 1000);
  if (window.isSecureContext && 'Notification' in window) {
    let permission = Notification.permission;
    if (permission === 'default') {
      // The Allow click is the user gesture the request needs; a browser that never answers
      // (headless) gets the in-page message instead.
      permission = await Promise.race([
        Notification.requestPermission().catch(() => 'denied'),
        new Promise((r) => { setTimeout(() => r('default'), 3000); }),
      ]);
    }
    if (permission === 'granted') {
      try {
        new Notification(title, { body });
        return { delivered: 'notification', title, body };
      } catch { /* some browsers only allow notifications from a service worker */ }
    }
  }
  toast(title, body);
  return { delivered: 'toast', title, body };
}

function toast(title, body) {
  const node = el('div', { class: 'toast', role: 'status', 'data-testid': 'toast' },
    el('strong', null, title), body ? el('p', null, body) : null,
    el('button', { type: 'button', class: 'toast-close', 'aria-label': 'Dismiss' }, '×'));
  node.querySelector('button').addEventListener('click', () => node.remove());
  $('toasts').append(node);
  setTimeout(() => node.remove(), 15000);
}

const prompts = []; // pending calls, the first one shown: {call, socket, tool, deadline, timer}

function onToolCall(socket, f) {
  stats.toolCalls += 1;
  const tool = TOOLS.find((t) => t.name === f.tool_name);
  if (!tool) {
    send(socket, { type: 'TOOL_RESULT', call_id: f.call_id, result: null, error: `this page has no tool '${f.tool_name}'` });
    return;
  }
  const timeout = Number.isFinite(f.timeout_ms) && f.timeout_ms > 0 ? f.timeout_ms : 30000;
  const entry = { call: f, socket, tool, deadline: Date.now() + timeout };
  entry.timer = setTimeout(() => {
    removePrompt(entry);
    addNote(`The agent's request to use ${tool.name} expired before you answered.`);
  }, timeout);
  prompts.push(entry);
  if (prompts.length === 1) showPrompt();
  else updateQueue();
}

function showPrompt() {
  const entry = prompts[0];
  const box = $('tool-prompt');
  if (!entry) {
    box.hidden = true;
    return;
  }
  $('tool-prompt-name').textContent = entry.tool.name;
  $('tool-prompt-what').textContent = entry.tool.what;
  $('tool-prompt-args').textContent = JSON.stringify(entry.call.tool_input ?? {}, null, 2);
  box.dataset.callId = entry.call.call_id;
  box.dataset.tool = entry.tool.name;
  updateQueue();
  box.hidden = false;
  box.focus();
}

function updateQueue() {
  const more = prompts.length - 1;
  const q = $('tool-prompt-queue');
  q.hidden = more <= 0;
  q.textContent = more > 0 ? `${more} more request${more === 1 ? '' : 's'} waiting` : '';
}

function removePrompt(entry) {
  clearTimeout(entry.timer);
  const k = prompts.indexOf(entry);
  if (k < 0) return;
  prompts.splice(k, 1);
  if (k === 0) showPrompt();
  else updateQueue();
}

// The gateway fails every call in flight on a connection that closes.
function cancelPrompts(socket) {
  for (const entry of prompts.slice()) {
    if (entry.socket === socket) {
      removePrompt(entry);
      addNote(`The agent's request to use ${entry.tool.name} was withdrawn: the connection dropped.`);
    }
  }
}

async function decide(allow) {
  const entry = prompts[0];
  if (!entry) return;
  removePrompt(entry);
  const { call, socket, tool } = entry;
  const reply = (result, error) => {
    if (!send(socket, { type: 'TOOL_RESULT', call_id: call.call_id, result, error })) {
      addNote(`The result of ${tool.name} could not be sent: the connection it was asked on is gone.`, 'error');
    }
  };
  if (!allow) {
    reply(null, 'denied by user');
    addNote(`You denied ${tool.name}.`);
    return;
  }
  try {
    const result = await tool.run(call.tool_input || {}, entry.deadline - Date.now());
    reply(result, null);
    addNote(`You allowed ${tool.name}; its result was sent to the agent.`);
  } catch (e) {
    reply(null, e.message || String(e));
    addNote(`${tool.name} failed: ${e.message || e}`, 'error');
  }
}

// ---------------------------------------------------------------------------------------------
// Wiring

function leave() {
  if (ws) {
    send(ws, { type: 'DETACH' });
    const socket = ws;
    ws = null;
    socket.close(1000);
  }
  clearTimeout(retryTimer);
  clearInterval(idleTimer);
  if (session) storage.remove(SESSION_KEY);
  session = null;
  fromTranscript.clear();
  for (const entry of prompts.slice()) removePrompt(entry);
  live.clear();
  log.replaceChildren();
  setState('idle');
  showSetup();
}

async function createSession() {
  const button = $('create');
  button.disabled = true;
  try {
    const { data } = await api('POST', '/v1/sbp/sessions', { metadata: { created_by: 'sbp browser page' } }, false);
    begin({ id: data.session_id, token: data.session_token, lastSeq: 0, created: true });
  } catch (e) {
    showSetup(`Could not create a session: ${e.message}`);
  } finally {
    button.disabled = false;
  }
}

// `#session=<id>&token=<token>`: a shared link. The fragment never reaches the server; it is
// removed from the address bar at once so it does not linger in screenshots or history.
function fromFragment() {
  if (!location.hash) return null;
  const params = new URLSearchParams(location.hash.slice(1));
  const id = params.get('session');
  const token = params.get('token');
  window.history.replaceState(null, '', location.pathname + location.search);
  return id && token ? { id, token } : null;
}

function init() {
  $('operator-key').value = storage.get(OPERATOR_KEY) || '';
  $('model').value = storage.get(MODEL_KEY) || '';
  $('operator-key').addEventListener('change', (e) => storage.set(OPERATOR_KEY, e.target.value.trim()));
  $('model').addEventListener('change', (e) => storage.set(MODEL_KEY, e.target.value.trim()));
  $('create').addEventListener('click', createSession);
  $('join-form').addEventListener('submit', (e) => {
    e.preventDefault();
    const id = $('join-session').value.trim();
    const token = $('join-token').value.trim();
    if (id && token) begin({ id, token, lastSeq: 0 });
  });
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = $('message').value;
    if (!text.trim() || !session) return;
    $('message').value = '';
    sendMessage(text);
  });
  $('message').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('tool-allow').addEventListener('click', () => decide(true));
  $('tool-deny').addEventListener('click', () => decide(false));
  $('tool-prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Escape') decide(false);
  });
  $('leave').addEventListener('click', leave);
  $('reconnect').addEventListener('click', () => {
    attempt = 0;
    connect();
  });
  $('copy-link').addEventListener('click', async () => {
    try {
      await navigator.clipboard.writeText($('share-link').value);
      toast('Link copied', 'Open it in another browser to continue this session there.');
    } catch {
      toast('Copy failed', 'Your browser did not allow copying; select the link and copy it by hand.');
    }
  });
  // Back online: try now rather than at the end of the backoff.
  window.addEventListener('online', () => {
    if (state === 'reconnecting' && !ws) connect();
  });

  const shared = fromFragment();
  const stored = storage.get(SESSION_KEY);
  if (shared) {
    session = stored && stored.id === shared.id ? stored : null;
    begin(shared);
  } else if (stored && typeof stored.id === 'string' && typeof stored.token === 'string') {
    session = { id: stored.id, token: stored.token, lastSeq: Number(stored.lastSeq) || 0 };
    begin(session);
  } else {
    showSetup();
  }
}

init();
