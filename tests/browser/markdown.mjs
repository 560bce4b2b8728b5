// Scenario: model output is Markdown, never HTML. A reply (the echo of the message) carrying an
// <img onerror>, a <script>, a javascript: link and real Markdown shows the tags as literal text,
// runs nothing, links only http(s), and renders bold, a list, a code block and a table as
// elements.

import assert from 'node:assert/strict';
import { GATEWAY, createSession, scenario, sendMessage, shot, until } from './lib.mjs';

const IMG = '<img src=x onerror="window.__pwned=1">';
const SCRIPT = '<script>window.__pwned=1</script>';
const JS_LINK = '[click me](javascript:window.__pwned=1)';
const MESSAGE = [
  `${IMG} and ${SCRIPT}`,
  `${JS_LINK} and [the docs](https://example.com/docs) and <javascript:alert(1)>`,
  '',
  '## A heading',
  '',
  '**bold** and *emphasis* and `inline <code>`',
  '',
  '- first item',
  '- second item with **strong** text',
  '',
  '```js',
  'const x = "<b>not bold</b>";',
  '```',
  '',
  '| name | value |',
  '|------|------:|',
  '| a    | 1     |',
].join('\n');

await scenario('markdown', async ({ newPage }) => {
  const page = await newPage();
  await page.goto(GATEWAY + '/');
  await createSession(page);
  await sendMessage(page, MESSAGE);
  await until(page, 'the completed reply', () => document.querySelector('#log .msg-assistant[data-state="complete"]'));

  const seen = await page.evaluate(() => {
    const body = document.querySelector('#log .msg-assistant .body');
    const q = (sel) => [...body.querySelectorAll(sel)];
    return {
      pwned: typeof window.__pwned,
      text: body.innerText,
      imgs: document.querySelectorAll('#log img').length,
      scripts: document.querySelectorAll('#log script, #log iframe, #log object, #log embed').length,
      bold: q('strong').map((n) => n.textContent),
      em: q('em').map((n) => n.textContent),
      code: q('p code').map((n) => n.textContent),
      heading: q('h4').map((n) => n.textContent),
      items: q('ul > li').map((n) => n.textContent),
      listStrong: q('ul > li strong').map((n) => n.textContent),
      pre: q('pre > code').map((n) => ({ text: n.textContent, lang: n.dataset.lang })),
      bTags: q('b').length,
      links: q('a').map((a) => ({ href: a.getAttribute('href'), rel: a.rel, target: a.target, text: a.textContent })),
      cells: q('table th, table td').map((n) => [n.tagName, n.textContent, n.className]),
      attrs: q('*').flatMap((n) => [...n.attributes].map((a) => a.name)).filter((a) => a.startsWith('on') || a === 'style'),
    };
  });
  assert.equal(seen.pwned, 'undefined', 'no script ran');
  assert.equal(seen.imgs, 0, 'no <img> element was made from the text');
  assert.equal(seen.scripts, 0);
  assert.deepEqual(seen.attrs, [], 'no event-handler or style attribute');
  assert.ok(seen.text.includes(`Echo: ${IMG} and ${SCRIPT}`), `tags shown literally: ${seen.text}`);
  assert.ok(seen.text.includes(JS_LINK), `the javascript: link stays text: ${seen.text}`);
  assert.ok(seen.text.includes('<javascript:alert(1)>'), seen.text);
  assert.deepEqual(seen.links, [{ href: 'https://example.com/docs', rel: 'noopener noreferrer', target: '_blank', text: 'the docs' }]);
  assert.deepEqual(seen.bold, ['bold', 'strong']);
  assert.deepEqual(seen.em, ['emphasis']);
  assert.deepEqual(seen.code, ['inline <code>']);
  assert.deepEqual(seen.heading, ['A heading']);
  assert.deepEqual(seen.items, ['first item', 'second item with strong text']);
  assert.deepEqual(seen.listStrong, ['strong']);
  assert.deepEqual(seen.pre, [{ text: 'const x = "<b>not bold</b>";', lang: 'js' }]);
  assert.equal(seen.bTags, 0);
  assert.deepEqual(seen.cells, [['TH', 'name', ''], ['TH', 'value', 'align-right'], ['TD', 'a', ''], ['TD', '1', 'align-right']]);
  // The user's own copy of the message is plain text too.
  const userText = await page.evaluate(() => document.querySelector('#log .msg-user .body').textContent);
  assert.equal(userText, MESSAGE);

  // Even clicking where the javascript: link would have been does nothing.
  await page.locator('#log .msg-assistant p', { hasText: '[click me]' }).click();
  assert.equal(await page.evaluate(() => typeof window.__pwned), 'undefined');
  await shot(page, 'markdown');
  await page.emulateMedia({ colorScheme: 'dark' });
  assert.equal(await page.evaluate(() => getComputedStyle(document.body).backgroundColor), 'rgb(18, 22, 29)', 'dark colours');
  await shot(page, 'markdown-dark');
  return { links: seen.links.length };
});
