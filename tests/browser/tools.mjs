// Scenario: the agent's side calls the page's browser tools through the backend endpoint
// POST /v1/sbp/sessions/{id}/tool_calls, and the model calls one inside a turn. Each call shows a permission prompt; Allow on
// geolocation answers with the position the browser context was given, Deny answers "denied by
// user", page_info never includes the URL fragment (which carried the token of the joined
// session), notify shows a message, and a browser that refuses the location gives an error.

import assert from 'node:assert/strict';
import { GATEWAY, api, connState, scenario, sendMessage, shot, until } from './lib.mjs';

const EIFFEL = { latitude: 48.8584, longitude: 2.2945 };

await scenario('tools', async ({ newPage }) => {
  // The session is made by a backend and opened with a shared link: its token in the fragment.
  const made = await api('POST', '/v1/sbp/sessions', {});
  assert.equal(made.status, 201, made.text);
  const { session_id: id, session_token: token } = made.json;
  const auth = { 'x-session-token': token };
  const link = `${GATEWAY}/#session=${encodeURIComponent(id)}&token=${encodeURIComponent(token)}`;

  const page = await newPage({ permissions: ['geolocation'], geolocation: { ...EIFFEL, accuracy: 12 } });
  await page.goto(link);
  await connState(page, 'attached');
  assert.equal(await page.evaluate(() => location.hash), '', 'the token left the address bar');
  const attached = await api('GET', `/v1/sessions/${id}`, undefined, auth);
  assert.deepEqual(attached.json.surface.mcp_tool_schemas.map((t) => t.name), ['geolocation', 'page_info', 'notify']);

  // Starts a backend call, waits for the prompt it raises, and returns the pending response
  // (wrapped: an async function returning a promise would wait for it).
  const call = async (tool, input) => {
    const before = await page.evaluate(() => window.__sbpStats.toolCalls);
    const response = api('POST', `/v1/sbp/sessions/${id}/tool_calls`, { tool_name: tool, tool_input: input, timeout_ms: 20000 }, auth);
    await until(page, `the prompt for ${tool}`, ([n, name]) => window.__sbpStats.toolCalls > n
      && !document.getElementById('tool-prompt').hidden
      && document.getElementById('tool-prompt-name').textContent === name, [before, tool]);
    const args = JSON.parse(await page.getByTestId('tool-prompt-args').textContent());
    assert.deepEqual(args, input, 'the prompt shows the arguments');
    return { response };
  };
  const answered = async (pending) => {
    const r = await pending.response;
    assert.equal(r.status, 200, r.text);
    await until(page, 'the prompt closed', () => document.getElementById('tool-prompt').hidden);
    return r.json;
  };

  let pending = await call('geolocation', { high_accuracy: true });
  await shot(page, '1-geolocation-prompt');
  await page.getByTestId('tool-allow').click();
  let r = await answered(pending);
  assert.equal(r.status, 'ok', JSON.stringify(r));
  assert.equal(r.result.latitude, EIFFEL.latitude);
  assert.equal(r.result.longitude, EIFFEL.longitude);
  assert.equal(r.result.accuracy, 12);

  pending = await call('geolocation', {});
  await page.getByTestId('tool-deny').click();
  r = await answered(pending);
  assert.equal(r.status, 'error', JSON.stringify(r));
  assert.equal(r.error, 'denied by user');
  assert.equal(r.result, null);

  pending = await call('page_info', {});
  await page.getByTestId('tool-allow').click();
  r = await answered(pending);
  assert.equal(r.status, 'ok', JSON.stringify(r));
  assert.equal(r.result.url, `${GATEWAY}/`, 'no fragment, so no token');
  assert.ok(!JSON.stringify(r.result).includes(token), 'the token is nowhere in page_info');
  assert.ok(r.result.user_agent.includes('Chrome'), r.result.user_agent);
  assert.deepEqual(r.result.viewport, { width: 1000, height: 760 });
  assert.equal(r.result.online, true);
  assert.equal(typeof r.result.timezone, 'string');
  assert.equal(r.result.title, 'SBP surface');

  pending = await call('notify', { title: 'Boarding soon', body: 'Gate B12 closes at 9:20' });
  await page.getByTestId('tool-allow').click();
  r = await answered(pending);
  assert.equal(r.status, 'ok', JSON.stringify(r));
  assert.ok(['toast', 'notification'].includes(r.result.delivered), JSON.stringify(r));
  if (r.result.delivered === 'toast') {
    await until(page, 'the toast', () => [...document.querySelectorAll('[data-testid="toast"]')]
      .some((t) => t.innerText.includes('Boarding soon') && t.innerText.includes('Gate B12')));
  }
  await shot(page, '2-after-the-calls');

  // The model itself calls the page's tool inside a turn (sbp/echo turns `[call geolocation]` into
  // a call of `surface_geolocation`): the same prompt, and the result reaches the model, whose
  // reply streams back into the page.
  const beforeTurn = await page.evaluate(() => window.__sbpStats.toolCalls);
  await sendMessage(page, 'Where am I? [call geolocation]');
  await until(page, 'the prompt for the model\'s call', (n) => window.__sbpStats.toolCalls > n
    && !document.getElementById('tool-prompt').hidden
    && document.getElementById('tool-prompt-name').textContent === 'geolocation', beforeTurn);
  await page.getByTestId('tool-allow').click();
  const reply = await until(page, 'the reply carrying the position', () => {
    const done = [...document.querySelectorAll('#log .msg-assistant[data-state="complete"]')];
    const hit = done.find((m) => m.querySelector('.body').innerText.includes('surface_geolocation returned'));
    return hit ? hit.querySelector('.body').innerText : null;
  });
  assert.ok(reply.includes(String(EIFFEL.latitude)) && reply.includes(String(EIFFEL.longitude)), reply);
  await shot(page, '2b-model-called-geolocation');

  // A second browser without the location permission attaches: the first page is displaced, and
  // the browser's refusal comes back as the tool's error.
  const other = await newPage({ permissions: [] });
  await other.goto(link);
  await connState(other, 'attached');
  await connState(page, 'displaced');
  await shot(page, '3-displaced');
  const before = await other.evaluate(() => window.__sbpStats.toolCalls);
  pending = api('POST', `/v1/sbp/sessions/${id}/tool_calls`, { tool_name: 'geolocation', tool_input: {}, timeout_ms: 20000 }, auth);
  await until(other, 'the prompt in the second browser', (n) => window.__sbpStats.toolCalls > n
    && !document.getElementById('tool-prompt').hidden, before);
  await other.getByTestId('tool-allow').click();
  r = (await pending).json;
  assert.equal(r.status, 'error', JSON.stringify(r));
  assert.match(r.error, /denied|unavailable|position/, JSON.stringify(r));
  // The displaced page stays displaced (no automatic reconnect that would steal the session back).
  assert.equal(await page.evaluate(() => document.getElementById('conn-state').dataset.state), 'displaced');
  return { session_id: id, session_token: token, geo_error: r.error };
});
