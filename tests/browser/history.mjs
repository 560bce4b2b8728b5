// Scenario: joining a session that already has a conversation. A backend makes the session and two
// turns over HTTP (no surface yet: they are stored, not tethered), then pushes a turn (tethered: it
// is both in the transcript and in the next attach's drain). The page joins with the session id
// and token: it shows the earlier conversation from GET /v1/sessions/{id}/messages, in order, the
// pushed turn once (its drained copy is matched to the stored message and ACKed, not shown again),
// and the replies' Markdown rendered. A message sent from the page is answered live, once; a second
// browser opening the shared link shows the whole conversation, each message once. A long
// conversation shows its last 200 messages and says how many are not shown.

import assert from 'node:assert/strict';
import {
  GATEWAY, api, completedReply, connState, eventually, occurrences, scenario, sendMessage, shot, until,
} from './lib.mjs';

const FIRST = 'Which museums open on Monday?';
const SECOND = 'And **where** should we get coffee?';
const PUSHED = 'Reminder: the **Gulbenkian** closes at 18:00.';

/** The log's bubbles as [role, text shown], in order. */
function bubbles(page) {
  return page.evaluate(() => [...document.querySelectorAll('#log .msg')]
    .map((m) => [m.dataset.role, m.querySelector('.body').innerText.trim()]));
}

await scenario('history', async ({ newPage }) => {
  const made = await api('POST', '/v1/sbp/sessions', {});
  assert.equal(made.status, 201, made.text);
  const { session_id: id, session_token: token } = made.json;
  const auth = { 'x-session-token': token };
  for (const text of [FIRST, SECOND]) {
    const r = await api('POST', '/v1/chat/completions',
      { messages: [{ role: 'user', content: text }], sbp: { resume: true } }, auth);
    assert.equal(r.status, 200, r.text);
  }
  const pushed = await api('POST', `/v1/sbp/sessions/${id}/turns`, { content: PUSHED }, auth);
  assert.equal(pushed.status, 201, pushed.text);
  assert.equal(pushed.json.delivery, 'tethered', pushed.text);

  // Join with the id and token.
  const page = await newPage();
  await page.goto(GATEWAY + '/');
  await page.locator('#join-session').fill(id);
  await page.locator('#join-token').fill(token);
  await page.getByTestId('join').click();
  await connState(page, 'attached');
  await until(page, 'the drained turn matched to the transcript',
    () => window.__sbpStats.inTranscript === 1 && window.__sbpStats.queued === 1);
  const earlier = [
    ['user', FIRST],
    ['assistant', `Echo: ${FIRST}`],
    ['user', SECOND],
    ['assistant', 'Echo: And where should we get coffee?'],
    ['assistant', 'Reminder: the Gulbenkian closes at 18:00.'],
  ];
  assert.deepEqual(await bubbles(page), earlier, 'the earlier conversation, in order, each message once');
  const stats = await page.evaluate(() => ({ ...window.__sbpStats }));
  assert.equal(stats.transcript, 5, JSON.stringify(stats));
  assert.equal(stats.tetherTurns, 1, `one turn drained (and matched, not shown again): ${JSON.stringify(stats)}`);
  assert.equal(await page.evaluate(() => document.querySelectorAll('#log .away').length), 0);
  // Replies are Markdown; the user's own text is shown as typed.
  const strong = await page.evaluate(() => [...document.querySelectorAll('#log .msg-assistant .body strong')]
    .map((s) => s.textContent));
  assert.deepEqual(strong, ['where', 'Gulbenkian'], 'bold rendered as <strong>');
  assert.equal(await occurrences(page, SECOND), 1, 'the user message as typed');
  // The drained copy was ACKed: the Tether is empty, and the bubble carries its seq.
  await eventually('the tether is empty', async () => {
    const v = await api('GET', `/v1/sessions/${id}`, undefined, auth);
    return v.status === 200 && v.json.tether_turns_pending === 0 && v.json.surface_attached;
  });
  const seq = await page.evaluate(() => [...document.querySelectorAll('#log .msg-assistant')].at(-1).dataset.seq);
  assert.equal(Number(seq), pushed.json.seq);
  await shot(page, '1-joined-with-the-earlier-conversation');

  // The conversation goes on, live, after the earlier part.
  await sendMessage(page, 'Thanks!');
  await completedReply(page, 'Echo: Thanks!');
  assert.equal(await occurrences(page, 'Echo: Thanks!'), 1);
  await until(page, 'the message confirmed', () => [...document.querySelectorAll('#log .msg-user')].at(-1)?.dataset.state === 'sent');
  await shot(page, '2-after-a-live-turn');

  // A second browser with the shared link: everything, from the transcript, each once.
  const link = `${GATEWAY}/#session=${encodeURIComponent(id)}&token=${encodeURIComponent(token)}`;
  const other = await newPage();
  await other.goto(link);
  await connState(other, 'attached');
  await connState(page, 'displaced');
  await until(other, 'the whole conversation', () => window.__sbpStats.transcript === 7);
  assert.deepEqual(await bubbles(other),
    [...earlier, ['user', 'Thanks!'], ['assistant', 'Echo: Thanks!']]);
  const otherStats = await other.evaluate(() => ({ ...window.__sbpStats }));
  assert.equal(otherStats.queued, 0, `everything was ACKed by the first page: ${JSON.stringify(otherStats)}`);
  await shot(other, '3-shared-link');

  // A long conversation (252 messages, made by one completion): its last 200, after a note.
  const long = [];
  for (let k = 0; k < 125; k += 1) {
    long.push({ role: 'user', content: `question ${k}` }, { role: 'assistant', content: `answer ${k}` });
  }
  long.push({ role: 'user', content: 'last question' });
  const big = await api('POST', '/v1/chat/completions', { messages: long });
  assert.equal(big.status, 200, big.text);
  const { session_id: bigId, session_token: bigToken } = big.json.sbp;
  const third = await newPage();
  await third.goto(`${GATEWAY}/#session=${encodeURIComponent(bigId)}&token=${encodeURIComponent(bigToken)}`);
  await connState(third, 'attached');
  const shown = await bubbles(third);
  assert.equal(shown.length, 200);
  assert.deepEqual(shown[0], ['user', 'question 26']);
  assert.deepEqual(shown.at(-1), ['assistant', 'Echo: last question']);
  const note = await third.evaluate(() => document.querySelector('#log .earlier .note')?.textContent);
  assert.equal(note, '52 earlier messages are not shown.');
  await shot(third, '4-long-conversation');
  return { session_id: id, session_token: token, pushed_seq: pushed.json.seq };
});
