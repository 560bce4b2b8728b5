// Shared harness of the browser scenarios: launches Debian's Chromium through playwright-core
// (never a downloaded browser), gives each scenario a page on the gateway named by
// SBP_GATEWAY_URL, keeps screenshots in SBP_ARTIFACT_DIR, and exits non-zero on any failure,
// with a screenshot and the browser's console saved for the post-mortem.

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

export const GATEWAY = process.env.SBP_GATEWAY_URL;
export const ARTIFACTS = process.env.SBP_ARTIFACT_DIR || join(process.cwd(), 'browser-artifacts');
const CHROMIUM = process.env.SBP_CHROMIUM || '/usr/bin/chromium';
/** Longest wait for any one expected thing on the page. */
export const WAIT = 15000;
/** The whole scenario, however it goes. */
const SCENARIO_LIMIT = 120000;

const LAUNCH_ARGS = [
  '--no-sandbox', // running as root
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  // The machine has no network: without these Chromium keeps trying to reach its services.
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--no-proxy-server',
];

/**
 * Runs `body({ browser, newPage, log })` and exits: 0 when it returned, 1 when it threw or ran out
 * of time. `newPage(contextOptions)` opens a page in a fresh context whose console and errors are
 * recorded; an uncaught page error or a Content-Security-Policy violation fails the scenario.
 */
export async function scenario(name, body) {
  if (!GATEWAY) {
    console.error('SBP_GATEWAY_URL is not set');
    process.exit(2);
  }
  mkdirSync(ARTIFACTS, { recursive: true });
  const consoleLines = [];
  const problems = [];
  const pages = [];
  let browser;
  const limit = setTimeout(() => {
    console.error(`${name}: still running after ${SCENARIO_LIMIT} ms`);
    finish(1);
  }, SCENARIO_LIMIT);

  async function finish(code) {
    clearTimeout(limit);
    writeFileSync(join(ARTIFACTS, 'console.log'), consoleLines.join('\n') + '\n');
    if (browser) await browser.close().catch(() => {});
    process.exit(code);
  }

  const newPage = async (options = {}) => {
    const context = await browser.newContext({ viewport: { width: 1000, height: 760 }, ...options });
    const page = await context.newPage();
    page.setDefaultTimeout(WAIT);
    const tag = `page${pages.length + 1}`;
    page.on('console', (m) => {
      const line = `[${tag}] ${m.type()}: ${m.text()}`;
      consoleLines.push(line);
      if (m.type() === 'error' && /Content.Security.Policy/i.test(m.text())) problems.push(line);
    });
    page.on('pageerror', (e) => {
      const line = `[${tag}] uncaught: ${e.stack || e}`;
      consoleLines.push(line);
      problems.push(line);
    });
    pages.push(page);
    return page;
  };

  try {
    browser = await chromium.launch({ executablePath: CHROMIUM, args: LAUNCH_ARGS });
    const result = await body({ browser, newPage });
    if (problems.length) throw new Error(`the page reported problems:\n${problems.join('\n')}`);
    console.log(`RESULT ${JSON.stringify(result ?? {})}`);
    console.log(`${name}: ok`);
    await finish(0);
  } catch (e) {
    console.error(`${name}: FAILED: ${e && e.stack ? e.stack : e}`);
    for (const [k, page] of pages.entries()) {
      await page.screenshot({ path: join(ARTIFACTS, `failure-${k + 1}.png`), fullPage: true }).catch(() => {});
    }
    console.error(`artifacts (screenshots, console.log) in ${ARTIFACTS}`);
    await finish(1);
  }
}

/** Saves a full-page screenshot as `<name>.png` among the artifacts; returns its path. */
export async function shot(page, name) {
  const path = join(ARTIFACTS, `${name}.png`);
  await page.screenshot({ path, fullPage: true });
  return path;
}

/** Waits until `fn(arg)`, evaluated in the page, is truthy; fails with `what` after WAIT. */
export async function until(page, what, fn, arg, timeout = WAIT) {
  try {
    return await (await page.waitForFunction(fn, arg, { timeout, polling: 50 })).jsonValue();
  } catch (e) {
    const state = await page.evaluate(() => ({
      state: document.getElementById('conn-state')?.dataset.state,
      stats: window.__sbpStats,
      log: document.getElementById('log')?.innerText.slice(-1500),
    })).catch(() => null);
    throw new Error(`${what}: not within ${timeout} ms (${e.message.split('\n')[0]}); page: ${JSON.stringify(state)}`);
  }
}

/** Polls an async check (something outside the page) until it returns a truthy value. */
export async function eventually(what, check, timeout = WAIT) {
  const deadline = Date.now() + timeout;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${timeout} ms`);
    await new Promise((r) => { setTimeout(r, 50); });
  }
}

/** Waits until the page's connection indicator says `state`. */
export function connState(page, state, timeout = WAIT) {
  return until(page, `connection state ${state}`,
    (s) => document.getElementById('conn-state')?.dataset.state === s, state, timeout);
}

/** A REST call straight to the gateway (not through the page). */
export async function api(method, path, body, headers = {}) {
  const resp = await fetch(GATEWAY + path, {
    method,
    headers: { 'content-type': 'application/json', ...headers },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: resp.status, headers: resp.headers, json, text };
}

/** The session the page is attached to, from its localStorage. */
export async function pageSession(page) {
  const s = await page.evaluate(() => JSON.parse(localStorage.getItem('sbp.session') || 'null'));
  if (!s || !s.id || !s.token) throw new Error(`the page holds no session: ${JSON.stringify(s)}`);
  return s;
}

/** Clicks "New session" and waits until the page is attached to it. */
export async function createSession(page) {
  await page.getByTestId('create').click();
  await connState(page, 'attached');
  return pageSession(page);
}

/** Types `text` into the composer and sends it. */
export async function sendMessage(page, text) {
  await page.getByTestId('message').fill(text);
  await page.getByTestId('send').click();
}

/** Waits for the assistant bubble that completes with exactly `text` (as rendered text). */
export async function completedReply(page, text) {
  return until(page, `a completed reply "${text.slice(0, 60)}"`, (t) => {
    const done = [...document.querySelectorAll('#log .msg-assistant[data-state="complete"]')];
    const hit = done.find((m) => m.querySelector('.body').innerText.trim() === t);
    return hit ? { chunks: Number(hit.dataset.chunks || 0), seq: Number(hit.dataset.seq || 0) } : null;
  }, text);
}

/** How many message bubbles in the log contain `text`. */
export function occurrences(page, text) {
  return page.evaluate((t) => [...document.querySelectorAll('#log .msg')]
    .filter((m) => m.innerText.includes(t)).length, text);
}
