// Scenario: a gateway started with --api-key. The page and its assets load without the key; its
// API calls are refused until the user enters the key under Settings, then it works as usual
// (the WebSocket needs only the session token).

import assert from 'node:assert/strict';
import { GATEWAY, api, completedReply, connState, scenario, sendMessage, shot, until } from './lib.mjs';

const KEY = process.env.SBP_API_KEY;

await scenario('operator', async ({ newPage }) => {
  assert.ok(KEY, 'SBP_API_KEY names the gateway\'s operator key');
  const page = await newPage();
  const responses = [];
  page.on('response', (r) => responses.push([new URL(r.url()).pathname, r.status()]));
  const loaded = await page.goto(GATEWAY + '/');
  assert.equal(loaded.status(), 200);
  // The script ran (so app.js loaded) and shows the start screen.
  await until(page, 'the start screen', () => window.__sbpStats && !document.getElementById('setup').hidden);
  for (const asset of ['/assets/app.js', '/assets/style.css']) {
    assert.ok(responses.some(([p, s]) => p === asset && s === 200), `${asset}: ${JSON.stringify(responses)}`);
  }
  const direct = await api('GET', '/v1/sessions/00000000-0000-7000-8000-000000000000');
  assert.equal(direct.status, 401, direct.text);

  // Without the key, creating a session is refused and the page says what to do.
  await page.getByTestId('create').click();
  await until(page, 'the refusal', () => !document.getElementById('setup-error').hidden);
  const error = await page.getByTestId('setup-error').textContent();
  assert.match(error, /operator key/i, error);
  assert.equal(await page.evaluate(() => localStorage.getItem('sbp.session')), null);
  await shot(page, '1-refused-without-key');

  // The refusal opened Settings, where the key goes.
  assert.equal(await page.evaluate(() => document.getElementById('settings').open), true);
  await page.getByTestId('operator-key').fill(KEY);
  await page.getByTestId('operator-key').blur();
  await page.getByTestId('create').click();
  await connState(page, 'attached');
  assert.equal(await page.evaluate(() => JSON.parse(localStorage.getItem('sbp.operatorKey'))), KEY);
  await sendMessage(page, 'hello with a key');
  const done = await completedReply(page, 'Echo: hello with a key');
  assert.ok(done.chunks >= 2, JSON.stringify(done));
  await shot(page, '2-with-key');
  const session = await page.evaluate(() => JSON.parse(localStorage.getItem('sbp.session')));
  return { session_id: session.id, session_token: session.token };
});
