// Scenario: create a session in the page, send a message, and watch the reply stream in over the
// WebSocket (several TURN_CHUNKs before TURN_COMPLETE), shown once, with the right text.

import assert from 'node:assert/strict';
import {
  GATEWAY, api, completedReply, createSession, eventually, occurrences, scenario, sendMessage, shot,
  until,
} from './lib.mjs';

await scenario('chat', async ({ newPage }) => {
  const page = await newPage();
  await page.goto(GATEWAY + '/');
  await shot(page, '1-setup');
  const session = await createSession(page);

  // The attach declared a browser with Markdown and the three tools, as the gateway stored it.
  const view = await api('GET', `/v1/sessions/${session.id}`, undefined, { 'x-session-token': session.token });
  assert.equal(view.status, 200, view.text);
  assert.equal(view.json.surface_attached, true, view.text);
  assert.equal(view.json.surface.device_type, 'browser', view.text);
  assert.deepEqual(view.json.surface.mcp_tools, ['geolocation', 'page_info', 'notify'], view.text);
  assert.ok(view.json.surface.ui_capabilities.includes('markdown'), view.text);

  const message = 'Plan a three-day trip to Lisbon with museums and good coffee';
  await sendMessage(page, message);
  // The user's message is shown at once, before any reply.
  await until(page, 'the user message', (t) => [...document.querySelectorAll('#log .msg-user')]
    .some((m) => m.innerText.includes(t)), message);

  const reply = `Echo: ${message}`;
  const done = await completedReply(page, reply);
  const stats = await page.evaluate(() => ({ ...window.__sbpStats }));
  assert.ok(done.chunks >= 2, `the reply streamed in several chunks: ${JSON.stringify(done)}`);
  assert.ok(stats.chunks >= 2 && stats.completes === 1, JSON.stringify(stats));
  assert.ok(done.seq >= 1, `TURN_COMPLETE carried the tether seq: ${JSON.stringify(done)}`);
  // Shown once (the HTTP response's copy of the reply is not rendered).
  assert.equal(await occurrences(page, reply), 1);
  // The page ACKed what it showed, so the gateway's tether is empty.
  await until(page, 'the ACK', (seq) => window.__sbpStats.acked >= seq, done.seq);
  await eventually('the gateway applied the ACK', async () => {
    const v = await api('GET', `/v1/sessions/${session.id}`, undefined, { 'x-session-token': session.token });
    return v.status === 200 && v.json.tether_turns_pending === 0;
  });
  await until(page, 'the HTTP send settled', () => document.querySelector('#log .msg-user')?.dataset.state === 'sent');
  await shot(page, '2-streamed-reply');
  // The same conversation on a phone-sized screen.
  await page.setViewportSize({ width: 390, height: 700 });
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow <= 0, `no horizontal scrolling on a small screen (${overflow}px too wide)`);
  await shot(page, '3-small-screen');
  return { session_id: session.id, session_token: session.token, chunks: done.chunks, seq: done.seq };
});
