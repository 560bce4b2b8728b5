// Markdown for the browser surface, safely: a small block and inline parser that builds DOM
// nodes. Model output is untrusted, so it only ever becomes text nodes (createTextNode,
// textContent); the only attribute taken from it is a link's href, and only for http(s) and
// mailto URLs. No HTML parser is involved anywhere: `<script>` in a reply is text. Anything this
// parser does not recognise stays literal text.
//
// Supported: paragraphs (single newlines kept as line breaks), ATX headings, fenced code,
// bullet and numbered lists (nested by indentation), block quotes, rules, GFM tables, and inline
// code, links, autolinks, bare http(s) URLs, *em*, **strong**, ***both***, ~~del~~ and escapes.

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  node.append(...children);
  return node;
}

const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]|$)/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])[ \t]+(.*)$/;
const TABLE_SEP = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
const PUNCT = '\\`*_{}[]()#+-.!|~<>"\'';
const AUTOLINK = /<((?:https?:\/\/|mailto:)[^\s<>]+)>/iy;
const BARE_URL = /https?:\/\/[^\s<>]*[^\s<>.,:;!?"')\]]/y;
const MAX_DEPTH = 8;

/** The DOM of `text` rendered as Markdown, as a DocumentFragment. */
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  blocks(String(text).replace(/\r\n?/g, '\n').split('\n'), frag, 0);
  return frag;
}

function indentOf(line) {
  let n = 0;
  for (const c of line) {
    if (c === ' ') n += 1;
    else if (c === '\t') n += 4;
    else break;
  }
  return n;
}

function startsBlock(lines, i) {
  const l = lines[i];
  return FENCE.test(l) || HEADING.test(l) || RULE.test(l) || QUOTE.test(l) || ITEM.test(l);
}

function isTableStart(lines, i) {
  return lines[i].includes('|') && i + 1 < lines.length && lines[i + 1].includes('|')
    && lines[i + 1].includes('-') && TABLE_SEP.test(lines[i + 1]);
}

function blocks(lines, parent, depth) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length) {
        const t = lines[i].trim();
        if (t.length >= fence.length && t === fence[0].repeat(t.length)) break;
        body.push(lines[i]);
        i += 1;
      }
      i += 1;
      const code = el('code', null, body.join('\n'));
      if (m[2]) code.dataset.lang = m[2].slice(0, 32);
      parent.append(el('pre', null, code));
    } else if ((m = HEADING.exec(line))) {
      const h = el(`h${Math.min(6, m[1].length + 2)}`);
      inline(headingText(line.slice(m[0].length)), h, inlineState());
      parent.append(h);
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(el('hr'));
      i += 1;
    } else if (depth < MAX_DEPTH && QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i += 1;
      }
      const q = el('blockquote');
      blocks(inner, q, depth + 1);
      parent.append(q);
    } else if (depth < MAX_DEPTH && ITEM.test(line)) {
      i = list(lines, i, parent, depth);
    } else if (isTableStart(lines, i)) {
      i = table(lines, i, parent);
    } else {
      const para = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines, i) && !isTableStart(lines, i)) {
        para.push(lines[i]);
        i += 1;
      }
      const p = el('p');
      inlineLines(para.map((l) => l.trim()), p);
      parent.append(p);
    }
  }
}

// A heading's text without its optional closing `#`s (no regex: long blank runs stay linear).
function headingText(rest) {
  let s = rest.trim();
  let k = s.length;
  while (k > 0 && s[k - 1] === '#') k -= 1;
  if (k < s.length && (k === 0 || s[k - 1] === ' ' || s[k - 1] === '\t')) s = s.slice(0, k).trim();
  return s;
}

function list(lines, start, parent, depth) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const indent = first[1].length;
  const node = el(ordered ? 'ol' : 'ul');
  if (ordered && parseInt(first[2], 10) !== 1) node.setAttribute('start', String(parseInt(first[2], 10)));
  let i = start;
  for (;;) {
    const m = i < lines.length ? ITEM.exec(lines[i]) : null;
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const width = indent + m[2].length + 1;
    const content = [m[3]];
    i += 1;
    while (i < lines.length) {
      const l = lines[i];
      if (!l.trim()) {
        if (i + 1 < lines.length && lines[i + 1].trim() && indentOf(lines[i + 1]) > indent) {
          content.push('');
          i += 1;
          continue;
        }
        break;
      }
      const n = indentOf(l);
      if (n > indent) {
        // Nested content keeps its indentation relative to the item's text.
        const expanded = l.replace(/^[ \t]+/, (lead) => lead.replace(/\t/g, '    '));
        content.push(expanded.slice(Math.min(n, width)));
      } else if (ITEM.test(l) || startsBlock(lines, i)) {
        break;
      } else {
        content.push(l.trim());
      }
      i += 1;
    }
    const li = el('li');
    const tight = content.every((c) => c.trim()) && !content.some((_, k) => k > 0 && startsBlock(content, k));
    if (tight) inlineLines(content.map((c) => c.trim()), li);
    else blocks(content, li, depth + 1);
    node.append(li);
    // A blank line between two items of the same list does not end it.
    let j = i;
    while (j < lines.length && !lines[j].trim()) j += 1;
    const next = j < lines.length ? ITEM.exec(lines[j]) : null;
    if (j > i && next && next[1].length === indent && /\d/.test(next[2]) === ordered) i = j;
  }
  parent.append(node);
  return i;
}

function tableCells(line) {
  let s = line.trim();
  if (s.startsWith('|')) s = s.slice(1);
  if (s.endsWith('|') && !s.endsWith('\\|')) s = s.slice(0, -1);
  const cells = [];
  let cur = '';
  for (let k = 0; k < s.length; k += 1) {
    if (s[k] === '\\' && s[k + 1] === '|') {
      cur += '|';
      k += 1;
    } else if (s[k] === '|') {
      cells.push(cur.trim());
      cur = '';
    } else {
      cur += s[k];
    }
  }
  cells.push(cur.trim());
  return cells;
}

function table(lines, start, parent) {
  const head = tableCells(lines[start]);
  const aligns = tableCells(lines[start + 1]).map((c) => {
    if (c.startsWith(':') && c.endsWith(':')) return 'center';
    if (c.endsWith(':')) return 'right';
    return c.startsWith(':') ? 'left' : '';
  });
  const cell = (tag, text, k) => {
    const c = el(tag, aligns[k] ? { class: `align-${aligns[k]}` } : null);
    inline(text, c, inlineState());
    return c;
  };
  const thead = el('thead', null, el('tr', null, ...head.map((t, k) => cell('th', t, k))));
  const tbody = el('tbody');
  let i = start + 2;
  while (i < lines.length && lines[i].trim() && lines[i].includes('|')) {
    const cells = tableCells(lines[i]);
    tbody.append(el('tr', null, ...head.map((_, k) => cell('td', cells[k] || '', k))));
    i += 1;
  }
  parent.append(el('div', { class: 'table-wrap' }, el('table', null, thead, tbody)));
  return i;
}

function inlineLines(lines, parent) {
  lines.forEach((line, k) => {
    if (k > 0) parent.append(el('br'));
    inline(line, parent, inlineState());
  });
}

// Per top-level text: its nesting depth, and the delimiters known to have no closing from some
// position on (so text full of unmatched `*` or backticks is parsed in linear time).
function inlineState() {
  return { depth: 0, noClose: new Map() };
}

function deeper(st) {
  return { depth: st.depth + 1, noClose: new Map() };
}

function safeUrl(raw) {
  let url;
  try {
    url = new URL(String(raw).trim());
  } catch {
    return null;
  }
  return ['http:', 'https:', 'mailto:'].includes(url.protocol) ? url.href : null;
}

function anchor(href, label, st) {
  const a = el('a', { href, rel: 'noopener noreferrer', target: '_blank' });
  inline(label, a, st);
  return a;
}

// `[label](destination "title")` starting at `i`, or null.
function parseLink(text, i) {
  let depth = 0;
  let j = i;
  for (; j < text.length && j - i < 1000; j += 1) {
    if (text[j] === '\\') j += 1;
    else if (text[j] === '[') depth += 1;
    else if (text[j] === ']' && --depth === 0) break;
  }
  if (text[j] !== ']' || text[j + 1] !== '(') return null;
  let k = j + 2;
  let parens = 0;
  for (; k < text.length && k - j < 1000; k += 1) {
    const c = text[k];
    if (c === '\\') k += 1;
    else if (c === '(') parens += 1;
    else if (c === ')' && parens-- === 0) break;
  }
  if (text[k] !== ')') return null;
  let dest = text.slice(j + 2, k).trim();
  const titled = /^(\S+)\s+(?:".*"|'.*'|\(.*\))$/.exec(dest);
  if (titled) [, dest] = titled;
  if (dest.startsWith('<') && dest.endsWith('>')) dest = dest.slice(1, -1);
  return { label: text.slice(i + 1, j), url: dest, end: k + 1 };
}

// `*em*`, `**strong**`, `***both***`, the same with `_`, and `~~del~~` starting at `i`, or null.
function parseEmphasis(text, i, st) {
  const ch = text[i];
  let n = 1;
  while (text[i + n] === ch) n += 1;
  if (ch === '~' ? n !== 2 : n > 3) return null;
  const word = /[\p{L}\p{N}]/u;
  const after = text[i + n];
  if (!after || /\s/.test(after)) return null;
  if (ch === '_' && i > 0 && word.test(text[i - 1])) return null;
  const delim = ch.repeat(n);
  const from = i + n + 1;
  if (st.noClose.get(delim) <= from) return null;
  let j = from;
  while ((j = text.indexOf(delim, j)) !== -1) {
    const before = text[j - 1];
    const next = text[j + n];
    const closes = before !== ch && !/\s/.test(before) && next !== ch
      && !(ch === '_' && next && word.test(next));
    if (closes) return { ch, n, inner: text.slice(i + n, j), end: j + n };
    j += 1;
  }
  st.noClose.set(delim, from);
  return null;
}

function inline(text, parent, st) {
  let buf = '';
  const flush = () => {
    if (buf) parent.append(document.createTextNode(buf));
    buf = '';
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === '\\' && i + 1 < text.length && PUNCT.includes(text[i + 1])) {
      buf += text[i + 1];
      i += 2;
      continue;
    }
    if (c === '`') {
      let n = 1;
      while (text[i + n] === '`') n += 1;
      const close = closingTicks(text, i + n, n, st);
      if (close >= 0) {
        flush();
        let code = text.slice(i + n, close);
        if (code.length > 2 && code.startsWith(' ') && code.endsWith(' ') && code.trim()) code = code.slice(1, -1);
        parent.append(el('code', null, code));
        i = close + n;
      } else {
        buf += '`'.repeat(n);
        i += n;
      }
      continue;
    }
    if (st.depth < MAX_DEPTH) {
      if (c === '[') {
        const link = parseLink(text, i);
        if (link) {
          flush();
          const href = safeUrl(link.url);
          // Any other scheme (javascript:, data:, relative paths) stays visible as the text it was.
          parent.append(href ? anchor(href, link.label, deeper(st)) : document.createTextNode(text.slice(i, link.end)));
          i = link.end;
          continue;
        }
      }
      if (c === '<') {
        AUTOLINK.lastIndex = i;
        const m = AUTOLINK.exec(text);
        const href = m && safeUrl(m[1]);
        if (href) {
          flush();
          parent.append(anchor(href, m[1], { depth: MAX_DEPTH, noClose: new Map() }));
          i += m[0].length;
          continue;
        }
      }
      if (c === 'h' && (i === 0 || /[\s(]/.test(text[i - 1]))) {
        BARE_URL.lastIndex = i;
        const m = BARE_URL.exec(text);
        const href = m && safeUrl(m[0]);
        if (href) {
          flush();
          parent.append(anchor(href, m[0], { depth: MAX_DEPTH, noClose: new Map() }));
          i += m[0].length;
          continue;
        }
      }
      if (c === '*' || c === '_' || c === '~') {
        const span = parseEmphasis(text, i, st);
        if (span) {
          flush();
          let outer;
          let inner;
          if (span.ch === '~') outer = inner = el('del');
          else if (span.n === 1) outer = inner = el('em');
          else if (span.n === 2) outer = inner = el('strong');
          else {
            inner = el('em');
            outer = el('strong', null, inner);
          }
          inline(span.inner, inner, deeper(st));
          parent.append(outer);
          i = span.end;
          continue;
        }
      }
    }
    buf += c;
    i += 1;
  }
  flush();
}

function closingTicks(text, from, n, st) {
  const key = `tick${n}`;
  if (st.noClose.get(key) <= from) return -1;
  let j = from;
  while ((j = text.indexOf('`'.repeat(n), j)) !== -1) {
    if (text[j + n] !== '`' && text[j - 1] !== '`') return j;
    while (text[j] === '`') j += 1;
  }
  st.noClose.set(key, from);
  return -1;
}
