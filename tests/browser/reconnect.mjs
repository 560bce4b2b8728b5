// Scenario: the connection is lost while the backend pushes a turn. The page is loaded through a
// TCP proxy (proxy.mjs) that is then cut: every proxied connection is closed and new ones
// are refused. The turn, pushed straight to the gateway meanwhile, is tethered; when the proxy
// opens again the page reconnects with last_seq and shows it under "While you were away", exactly
// once, and a reload does not show it again.

import assert from 'node:assert/strict';
import {
  GATEWAY, api, completedReply, connState, createSession, eventually, occurrences, scenario,
  sendMessage, shot, until,
} from './lib.mjs';
import { startProxy } from './proxy.mjs';

const PUSHED = 'Your flight to Lisbon was moved to 9:40; gate B12.';

await scenario('reconnect', async ({ newPage }) => {
  const proxy = await startProxy(GATEWAY);
  try {
    const page = await newPage();
    await page.goto(proxy.url + '/');
    const session = await createSession(page);
    const auth = { 'x-session-token': session.token };
    await sendMessage(page, 'before the cut');
    const first = await completedReply(page, 'Echo: before the cut');

    proxy.cut();
    await connState(page, 'reconnecting');
    // The gateway has seen the surface go (so the push cannot go to the dead connection).
    await eventually('the gateway saw the surface detach', async () => {
      const v = await api('GET', `/v1/sessions/${session.id}`, undefined, auth);
      return v.status === 200 && v.json.surface_attached === false;
    });
    const pushed = await api('POST', `/v1/sbp/sessions/${session.id}/turns`, { content: PUSHED }, auth);
    assert.equal(pushed.status, 201, pushed.text);
    assert.equal(pushed.json.delivery, 'tethered', pushed.text);
    assert.ok(pushed.json.seq > first.seq, pushed.text);
    // The page keeps trying through the closed proxy and fails.
    await until(page, 'a failed reconnect attempt', () => /attempt [2-9]/.test(document.getElementById('conn-state').textContent));
    assert.equal(await occurrences(page, PUSHED), 0);
    await shot(page, '1-reconnecting');

    proxy.open();
    await until(page, 'the second attach', () => window.__sbpStats.attaches >= 2);
    await connState(page, 'attached');
    await until(page, 'the pushed turn under "While you were away"', (t) => [...document.querySelectorAll('#log .away')]
      .some((g) => g.querySelector('h2')?.textContent === 'While you were away'
        && [...g.querySelectorAll('.msg')].some((m) => m.innerText.includes(t))), PUSHED);
    await until(page, 'the ACK of the pushed turn', (seq) => window.__sbpStats.acked >= seq, pushed.json.seq);
    await eventually('the tether is empty', async () => {
      const v = await api('GET', `/v1/sessions/${session.id}`, undefined, auth);
      return v.status === 200 && v.json.tether_turns_pending === 0 && v.json.surface_attached;
    });
    assert.equal(await occurrences(page, PUSHED), 1, 'shown exactly once');
    assert.equal(await occurrences(page, 'Echo: before the cut'), 1);
    const stats = await page.evaluate(() => ({ ...window.__sbpStats }));
    assert.equal(stats.tetherTurns, 1, JSON.stringify(stats));
    assert.equal(stats.queued, 1, JSON.stringify(stats));
    await shot(page, '2-back-with-the-turn');

    // A reload rejoins from localStorage with last_seq: nothing is drained again.
    await page.reload();
    await connState(page, 'attached');
    const after = await page.evaluate(() => ({ ...window.__sbpStats }));
    assert.equal(after.queued, 0, `nothing left to drain: ${JSON.stringify(after)}`);
    assert.equal(after.tetherTurns, 0, JSON.stringify(after));
    assert.equal(await occurrences(page, PUSHED), 1, 'still once after the reload');
    assert.equal(await occurrences(page, 'Echo: before the cut'), 1);
    // The session goes on through the proxy.
    await sendMessage(page, 'after the reload');
    const last = await completedReply(page, 'Echo: after the reload');
    assert.equal(await occurrences(page, PUSHED), 1);
    // The page ACKs the live reply too, and the gateway has applied it before the page closes.
    await until(page, 'the ACK of the last reply', (seq) => window.__sbpStats.acked >= seq, last.seq);
    await eventually('the tether is empty again', async () => {
      const v = await api('GET', `/v1/sessions/${session.id}`, undefined, auth);
      return v.status === 200 && v.json.tether_turns_pending === 0;
    });
    await shot(page, '3-after-reload');
    return { session_id: session.id, session_token: session.token, pushed_seq: pushed.json.seq };
  } finally {
    proxy.close();
  }
});
