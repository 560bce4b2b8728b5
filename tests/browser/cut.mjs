// Scenario: the connection drops in the middle of a streamed reply (a slow upstream, the page
// behind a TCP proxy that is cut). The reply is shown once, whole, in the bubble that was
// streaming: (a) when it finishes while the page is away, from the Tether (TETHER_TURN with the
// same chunk_id); (b) when the page is back before it finishes, from the new connection (which
// gets the whole text again).

import assert from 'node:assert/strict';
import { GATEWAY, api, connState, createSession, eventually, scenario, sendMessage, shot, until } from './lib.mjs';
import { startProxy } from './proxy.mjs';

const WORDS = Array.from({ length: 24 }, (_, k) => `word${k + 1}`).join(' ');

await scenario('cut', async ({ newPage }) => {
  const proxy = await startProxy(GATEWAY);
  try {
    const page = await newPage();
    await page.goto(proxy.url + '/');
    const session = await createSession(page);
    const auth = { 'x-session-token': session.token };
    const lastAssistant = async () => {
      const r = await api('GET', `/v1/sessions/${session.id}/messages?limit=1000`, undefined, auth);
      return r.json.messages.filter((m) => m.role === 'assistant').at(-1)?.content;
    };
    const streamingFor = (n) => until(page, `${n} chunks shown`, (k) => {
      const m = document.querySelector('#log .msg-assistant[data-state="streaming"]');
      return m && Number(m.dataset.chunks) >= k && m.querySelector('.body').innerText.includes('word');
    }, n);
    const shownOnce = async (text) => {
      await until(page, 'the whole reply, complete', (t) => [...document.querySelectorAll('#log .msg-assistant[data-state="complete"]')]
        .some((m) => m.querySelector('.body').innerText.trim() === t), text);
      const bubbles = await page.evaluate((t) => [...document.querySelectorAll('#log .msg-assistant')]
        .filter((m) => m.innerText.includes('word1 ')).map((m) => m.querySelector('.body').innerText.trim()), text);
      assert.deepEqual(bubbles.filter((b) => b.includes(text.slice(0, 30))), [text], 'one bubble, the whole text');
    };

    // (a) Cut mid-stream; the turn finishes while the page is away; back, the Tether completes it.
    await sendMessage(page, `first ${WORDS} [[fake:chunk_delay=60]]`);
    await streamingFor(3);
    proxy.cut();
    await connState(page, 'reconnecting');
    await until(page, 'the bubble marked cut off', () => document.querySelector('#log .msg-assistant[data-state="cut"]'));
    await shot(page, '1-cut-off');
    const first = await eventually('the turn stored', async () => {
      const v = await api('GET', `/v1/sessions/${session.id}`, undefined, auth);
      return v.json.tether_turns_pending >= 1 && (await lastAssistant());
    }, 20000);
    assert.ok(first.includes('word24'), first);
    proxy.open();
    await connState(page, 'attached');
    await shownOnce(first);
    assert.equal(await page.evaluate(() => document.querySelectorAll('#log .away').length), 0,
      'the rest of a reply that was on screen is not "while you were away"');
    await shot(page, '2-completed-from-the-tether');

    // (b) Cut mid-stream and back at once: the turn finishes on the new connection. A reload
    // first: the page would otherwise continue (a)'s backoff sequence, as a connection that
    // dropped within 5 s of attaching does, and be back only after the turn ended.
    await page.reload();
    await connState(page, 'attached');
    await shownOnce(first);
    await sendMessage(page, `second ${WORDS} [[fake:chunk_delay=150]]`);
    await streamingFor(3);
    proxy.cut();
    await connState(page, 'reconnecting');
    proxy.open();
    await until(page, 'back before the turn ends', () => window.__sbpStats.attaches === 2);
    const second = await eventually('the second turn stored', async () => {
      const text = await lastAssistant();
      return text && text.includes('second') && text;
    }, 20000);
    await shownOnce(second);
    const stats = await page.evaluate(() => ({ ...window.__sbpStats }));
    assert.deepEqual([stats.completes, stats.tetherTurns], [1, 0], `finished live: ${JSON.stringify(stats)}`);
    // The HTTP request of each message was cut too; the page sent it again with the same
    // Idempotency-Key, and the gateway stored each message and ran each turn once.
    await until(page, 'the messages confirmed', () => [...document.querySelectorAll('#log .msg-user')]
      .every((m) => m.dataset.state === 'sent' || m.dataset.restored === 'true'));
    const stored = await api('GET', `/v1/sessions/${session.id}/messages?limit=1000`, undefined, auth);
    assert.deepEqual(stored.json.messages.map((m) => m.role), ['user', 'assistant', 'user', 'assistant'], stored.text);
    // The page ACKed the reply it finished live; the gateway applied it before the page closes.
    await eventually('the tether is empty', async () => {
      const v = await api('GET', `/v1/sessions/${session.id}`, undefined, auth);
      return v.status === 200 && v.json.tether_turns_pending === 0;
    });
    await shot(page, '3-completed-on-the-new-connection');
    return { session_id: session.id, session_token: session.token, stats };
  } finally {
    proxy.close();
  }
});
