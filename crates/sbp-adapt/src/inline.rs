//! Inline Markdown (emphasis, code spans, links, images, URLs) rendered as plain text or spoken prose.
//!
//! Hand-written scanning in linear time: code-span closers, brackets and parentheses are matched up
//! front, and emphasis uses CommonMark's delimiter-stack algorithm with its "openers bottom" shortcut,
//! so no input (thousands of `*`, `[` or backticks on one line) makes a line quadratic.

use std::collections::HashMap;

use crate::budget::is_closer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Style {
    /// Plain text: links keep their URL as "text (url)".
    Plain,
    /// Spoken prose: links become their text, URLs become "(link)".
    Prose,
}

/// Renders one line's inline content.
pub(crate) fn render(text: &str, style: Style) -> String {
    render_inner(text, style, true, None)
}

/// A place where a line's inline content may be split: a whitespace run starting at byte `raw`,
/// before which every construct is closed (no unmatched emphasis opener, backtick run, `[` or link
/// `(`), followed by a non-whitespace character at byte `next`. Rendering the text before it gives
/// the first `out` bytes of the whole rendering: `render(&text[..raw])` is `rendered[..out]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Break {
    pub raw: usize,
    pub next: usize,
    pub out: usize,
}

/// [`render`], plus every [`Break`] of `text` in order, in one linear pass.
pub(crate) fn render_breaks(text: &str, style: Style) -> (String, Vec<Break>) {
    let mut breaks = Vec::new();
    let out = render_inner(text, style, true, Some(&mut breaks));
    (out, breaks)
}

/// Makes `text` a sentence: ends it with `.`, `!` or `?` (a trailing `:`, `;` or `,` becomes `.`).
pub(crate) fn ensure_sentence(text: &str) -> String {
    let t = text.trim();
    if t.is_empty() {
        return String::new();
    }
    let core = t.trim_end_matches(is_closer);
    if core.ends_with(crate::budget::is_terminal) {
        return t.to_owned();
    }
    if let Some(stripped) = t.strip_suffix([':', ';', ',']) {
        return format!("{}.", stripped.trim_end());
    }
    format!("{t}.")
}

enum Tok {
    Text(String),
    Code(String),
    Delim(usize),
}

struct Delim {
    ch: u8,
    len: usize,
    remaining: usize,
    can_open: bool,
    can_close: bool,
}

/// Where the scan stood at a whitespace boundary: what came before it is settled unless an emphasis
/// opener, a `[` or a link's `(` is still open there.
struct Mark {
    raw: usize,
    /// Tokens and delimiters before the boundary.
    toks: usize,
    delims: usize,
}

/// `links` is false inside a link's text, so link texts never nest and each byte is scanned at most
/// twice. With `breaks`, whitespace boundaries that no construct spans are reported (see [`Break`]).
fn render_inner(text: &str, style: Style, links: bool, breaks: Option<&mut Vec<Break>>) -> String {
    let bytes = text.as_bytes();
    let ticks = BacktickRuns::new(bytes);
    let (brackets, parens) = if links {
        (
            match_pairs(bytes, b'[', b']'),
            match_pairs(bytes, b'(', b')'),
        )
    } else {
        (HashMap::new(), HashMap::new())
    };
    let mut toks: Vec<Tok> = Vec::new();
    let mut delims: Vec<Delim> = Vec::new();
    let mut lit = String::new();
    let track = breaks.is_some();
    let mut marks: Vec<Mark> = Vec::new();
    // After an unmatched backtick run nothing is settled: a later run could still close it.
    let mut stray_tick = false;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\\' if bytes.get(i + 1).is_some_and(u8::is_ascii_punctuation) => {
                lit.push(char::from(bytes[i + 1]));
                i += 2;
            }
            b'`' => {
                let end = run_end(bytes, i);
                let len = end - i;
                match ticks.closer(i, len) {
                    Some(close) => {
                        flush(&mut lit, &mut toks);
                        toks.push(Tok::Code(code_content(slice(text, end, close))));
                        i = close + len;
                    }
                    // An unmatched backtick run is a stray delimiter (often a reply cut mid-span).
                    None => {
                        stray_tick = true;
                        i = end;
                    }
                }
            }
            b'!' | b'[' if links => {
                let image = b == b'!';
                let open = if image { i + 1 } else { i };
                match link_at(text, open, &brackets, &parens) {
                    Some((label, dest, next)) if !image || bytes.get(open) == Some(&b'[') => {
                        let label = render_inner(label, style, false, None);
                        lit.push_str(&render_link(&label, dest, image, style));
                        i = next;
                    }
                    _ => {
                        lit.push(char::from(b));
                        i += 1;
                    }
                }
            }
            b'<' => match autolink(text, i) {
                Some((url, next)) => {
                    lit.push_str(match style {
                        Style::Plain => url,
                        Style::Prose => "(link)",
                    });
                    i = next;
                }
                None => {
                    lit.push('<');
                    i += 1;
                }
            },
            b'h' => match bare_url(text, i) {
                Some(end) => {
                    lit.push_str(match style {
                        Style::Plain => slice(text, i, end),
                        Style::Prose => "(link)",
                    });
                    i = end;
                }
                None => {
                    lit.push('h');
                    i += 1;
                }
            },
            b'*' | b'_' | b'~' => {
                let end = run_end(bytes, i);
                match delimiter(text, i, end) {
                    Some(d) => {
                        flush(&mut lit, &mut toks);
                        toks.push(Tok::Delim(delims.len()));
                        delims.push(d);
                    }
                    None => lit.push_str(slice(text, i, end)),
                }
                i = end;
            }
            _ => {
                let next = bytes[i + 1..]
                    .iter()
                    .position(|&c| is_special(c))
                    .map_or(bytes.len(), |p| i + 1 + p);
                // Whitespace is only ever copied here, so this is where boundaries are seen.
                let mut from = i;
                if track && !stray_tick {
                    let mut prev = text[..i].chars().next_back();
                    for (off, c) in slice(text, i, next).char_indices() {
                        if c.is_whitespace() && prev.is_some_and(|p| !p.is_whitespace()) {
                            lit.push_str(slice(text, from, i + off));
                            from = i + off;
                            flush(&mut lit, &mut toks);
                            marks.push(Mark {
                                raw: i + off,
                                toks: toks.len(),
                                delims: delims.len(),
                            });
                        }
                        prev = Some(c);
                    }
                }
                lit.push_str(slice(text, from, next));
                i = next;
            }
        }
    }
    flush(&mut lit, &mut toks);
    let opener_left = match_emphasis(&mut delims);

    // Matched delimiters vanish; unmatched ones stay as literal text, except that a leftover run of two
    // or more asterisks is dropped: in plain text it is never meant literally (a bold cut off by the
    // end of a line or of the reply). Code spans are exempt: `**kwargs` is code.
    let mut out = String::with_capacity(text.len());
    let mut plain = String::new();
    // Output length at each mark; star runs never span the whitespace at a mark.
    let mut mark_out = Vec::with_capacity(marks.len());
    for (t, tok) in toks.iter().enumerate() {
        while marks.get(mark_out.len()).is_some_and(|m| m.toks == t) {
            drop_star_runs(&plain, &mut out);
            plain.clear();
            mark_out.push(out.len());
        }
        match tok {
            Tok::Text(s) => plain.push_str(s),
            Tok::Delim(ix) => {
                if let Some(d) = delims.get(*ix) {
                    plain.extend(std::iter::repeat_n(char::from(d.ch), d.remaining));
                }
            }
            Tok::Code(s) => {
                drop_star_runs(&plain, &mut out);
                plain.clear();
                out.push_str(s);
            }
        }
    }
    drop_star_runs(&plain, &mut out);
    if let Some(breaks) = breaks {
        mark_out.resize(marks.len(), out.len());
        let raw_open = raw_open_at(bytes, &marks);
        for ((m, out_len), raw_open) in marks.iter().zip(mark_out).zip(raw_open) {
            let emphasis_open = m.delims > 0 && opener_left.get(m.delims - 1) == Some(&true);
            let next = text[m.raw..]
                .char_indices()
                .find(|(_, c)| !c.is_whitespace())
                .map(|(off, _)| m.raw + off);
            if let (false, false, Some(next)) = (emphasis_open, raw_open, next) {
                breaks.push(Break {
                    raw: m.raw,
                    next,
                    out: out_len,
                });
            }
        }
    }
    out
}

/// For each mark, whether a `[` or a `](` (a link's destination) is still open there, counted on raw
/// bytes like [`match_pairs`], which decides what links are.
fn raw_open_at(bytes: &[u8], marks: &[Mark]) -> Vec<bool> {
    let mut open = Vec::with_capacity(marks.len());
    let mut brackets = 0usize;
    // Open parens, and how many of them follow a `]`.
    let mut parens: Vec<bool> = Vec::new();
    let mut link_parens = 0usize;
    let mut i = 0;
    for m in marks {
        while i < m.raw.min(bytes.len()) {
            match bytes[i] {
                b'\\' if bytes.get(i + 1).is_some_and(u8::is_ascii_punctuation) => i += 1,
                b'[' => brackets += 1,
                b']' => brackets = brackets.saturating_sub(1),
                b'(' => {
                    let link = i > 0 && bytes[i - 1] == b']';
                    link_parens += usize::from(link);
                    parens.push(link);
                }
                b')' => link_parens -= usize::from(parens.pop() == Some(true)),
                _ => {}
            }
            i += 1;
        }
        open.push(brackets > 0 || link_parens > 0);
    }
    open
}

fn flush(lit: &mut String, toks: &mut Vec<Tok>) {
    if !lit.is_empty() {
        toks.push(Tok::Text(std::mem::take(lit)));
    }
}

/// Bytes that may start inline syntax; everything else is copied in bulk. All are ASCII, so every
/// index the scanner stops at is a char boundary.
fn is_special(b: u8) -> bool {
    matches!(
        b,
        b'\\' | b'`' | b'!' | b'[' | b'<' | b'h' | b'*' | b'_' | b'~'
    )
}

/// `text[a..b]`, or "" should the bounds ever miss a char boundary: rendering must never panic.
fn slice(text: &str, a: usize, b: usize) -> &str {
    text.get(a..b).unwrap_or_default()
}

fn run_end(bytes: &[u8], start: usize) -> usize {
    let ch = bytes[start];
    start + bytes[start..].iter().take_while(|&&b| b == ch).count()
}

fn code_content(s: &str) -> String {
    // CommonMark strips one space on each side so "`` `x` ``" can show backticks.
    match s.strip_prefix(' ').and_then(|t| t.strip_suffix(' ')) {
        Some(inner) if !s.trim().is_empty() => inner.to_owned(),
        _ => s.to_owned(),
    }
}

/// Backtick runs by length, to find a code span's closer in O(log n).
struct BacktickRuns {
    by_len: HashMap<usize, Vec<usize>>,
}

impl BacktickRuns {
    fn new(bytes: &[u8]) -> Self {
        let mut by_len: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' if bytes.get(i + 1).is_some_and(u8::is_ascii_punctuation) => i += 2,
                b'`' => {
                    let end = run_end(bytes, i);
                    by_len.entry(end - i).or_default().push(i);
                    i = end;
                }
                _ => i += 1,
            }
        }
        Self { by_len }
    }

    /// The start of the first run of exactly `len` backticks after the run starting at `start`.
    fn closer(&self, start: usize, len: usize) -> Option<usize> {
        let runs = self.by_len.get(&len)?;
        runs.get(runs.partition_point(|&s| s <= start)).copied()
    }
}

/// Matching `open`/`close` pairs (by position), honouring nesting and backslash escapes.
fn match_pairs(bytes: &[u8], open: u8, close: u8) -> HashMap<usize, usize> {
    let mut pairs = HashMap::new();
    let mut stack = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'\\' && bytes.get(i + 1).is_some_and(u8::is_ascii_punctuation) {
            i += 2;
            continue;
        }
        if b == open {
            stack.push(i);
        } else if b == close
            && let Some(o) = stack.pop()
        {
            pairs.insert(o, i);
        }
        i += 1;
    }
    pairs
}

/// `[label](dest)` starting at `open`: the label, the destination URL and the index after `)`.
fn link_at<'a>(
    text: &'a str,
    open: usize,
    brackets: &HashMap<usize, usize>,
    parens: &HashMap<usize, usize>,
) -> Option<(&'a str, &'a str, usize)> {
    let close = *brackets.get(&open)?;
    if text.as_bytes().get(close + 1) != Some(&b'(') {
        return None;
    }
    let paren_close = *parens.get(&(close + 1))?;
    let label = text.get(open + 1..close)?;
    let raw = text.get(close + 2..paren_close)?.trim();
    // The destination, without an optional "title".
    let dest = match raw.strip_prefix('<') {
        Some(rest) => rest.split('>').next().unwrap_or_default(),
        None => raw.split_whitespace().next().unwrap_or_default(),
    };
    Some((label, dest, paren_close + 1))
}

fn render_link(label: &str, dest: &str, image: bool, style: Style) -> String {
    let label = label.trim();
    if image {
        return label.to_owned();
    }
    match style {
        Style::Prose if label.is_empty() => "(link)".to_owned(),
        Style::Prose => label.to_owned(),
        Style::Plain if dest.is_empty() || label == dest => label.to_owned(),
        Style::Plain if label.is_empty() => dest.to_owned(),
        Style::Plain => format!("{label} ({dest})"),
    }
}

const SCHEMES: [&str; 3] = ["http://", "https://", "mailto:"];

/// `<https://…>`: the URL and the index after `>`.
fn autolink(text: &str, at: usize) -> Option<(&str, usize)> {
    let rest = text.get(at + 1..)?;
    if !SCHEMES.iter().any(|s| rest.starts_with(s)) {
        return None;
    }
    let end = rest.find(|c: char| c == '>' || c == '<' || c.is_whitespace())?;
    rest[end..]
        .starts_with('>')
        .then(|| (&rest[..end], at + 1 + end + 1))
}

/// A bare `http(s)://` URL starting a word at `at`: the index just past it, leaving trailing
/// punctuation (". ", ")", "**") to the surrounding text.
fn bare_url(text: &str, at: usize) -> Option<usize> {
    let rest = text.get(at..)?;
    if !(rest.starts_with("http://") || rest.starts_with("https://")) {
        return None;
    }
    let prev = text[..at].chars().next_back();
    if prev.is_some_and(|c| !(c.is_whitespace() || matches!(c, '(' | '[' | '"' | '\''))) {
        return None;
    }
    let word = rest.find(char::is_whitespace).unwrap_or(rest.len());
    let url = rest[..word].trim_end_matches(|c: char| {
        matches!(
            c,
            '.' | ',' | ';' | ':' | '!' | '?' | ')' | ']' | '\'' | '"' | '*' | '_' | '~' | '>'
        )
    });
    // "https://" alone is not a link.
    (url.len() > url.find("//").map_or(0, |p| p + 2)).then_some(at + url.len())
}

fn is_punct(c: char) -> bool {
    c.is_ascii_punctuation() || !(c.is_alphanumeric() || c.is_whitespace())
}

/// The delimiter run `text[start..end]` of `*`, `_` or `~`, or None when it cannot open or close
/// emphasis (then it is literal text).
fn delimiter(text: &str, start: usize, end: usize) -> Option<Delim> {
    let ch = *text.as_bytes().get(start)?;
    let len = end - start;
    let prev = text[..start].chars().next_back();
    let next = text[end..].chars().next();
    // Start and end of line count as whitespace.
    let ws = |c: Option<char>| c.is_none_or(char::is_whitespace);
    let punct = |c: Option<char>| c.is_some_and(is_punct);
    let left = !ws(next) && (!punct(next) || ws(prev) || punct(prev));
    let right = !ws(prev) && (!punct(prev) || ws(next) || punct(next));
    let alnum = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    let (can_open, can_close) = match ch {
        // Beyond CommonMark: a lone `*` between letters or digits is arithmetic or a wildcard
        // (`2*3*4`, `*.rs`-like names), not emphasis.
        b'*' if len == 1 && alnum(prev) && alnum(next) => (false, false),
        b'*' => (left, right),
        b'_' => (
            left && (!right || punct(prev)),
            right && (!left || punct(next)),
        ),
        // Only `~~` strikes through; a single `~` means "about".
        b'~' if len == 2 => (left, right),
        _ => (false, false),
    };
    (can_open || can_close).then_some(Delim {
        ch,
        len,
        remaining: len,
        can_open,
        can_close,
    })
}

/// CommonMark's "process emphasis", reduced to what plain text needs: how many characters of each
/// delimiter run are left unmatched. Returns, for each delimiter, whether an opener that a later
/// closer could still match is left once it has been processed (the algorithm is online: closers
/// only look back).
fn match_emphasis(delims: &mut [Delim]) -> Vec<bool> {
    let mut opener_left = Vec::with_capacity(delims.len());
    // Stack of delimiter indexes that may still open; entries always have `remaining > 0`.
    let mut stack: Vec<usize> = Vec::new();
    // For each closer class, the stack height below which no opener can match it (see CommonMark's
    // "openers_bottom"): keeps the algorithm linear.
    let mut bottom = [0usize; 18];
    for c in 0..delims.len() {
        if delims[c].can_close {
            let class = closer_class(&delims[c]);
            while delims[c].remaining > 0 {
                let lo = bottom[class].min(stack.len());
                let found = (lo..stack.len())
                    .rev()
                    .find(|&p| matches_opener(&delims[stack[p]], &delims[c]));
                let Some(p) = found else {
                    bottom[class] = stack.len();
                    break;
                };
                let o = stack[p];
                let used = if delims[o].ch == b'~'
                    || (delims[o].remaining >= 2 && delims[c].remaining >= 2)
                {
                    2
                } else {
                    1
                };
                let used = used.min(delims[o].remaining).min(delims[c].remaining);
                delims[o].remaining -= used;
                delims[c].remaining -= used;
                // Delimiters between the pair can no longer open anything.
                stack.truncate(if delims[o].remaining == 0 { p } else { p + 1 });
                for b in &mut bottom {
                    *b = (*b).min(stack.len());
                }
            }
        }
        if delims[c].remaining > 0 && delims[c].can_open {
            stack.push(c);
        }
        opener_left.push(!stack.is_empty());
    }
    opener_left
}

fn closer_class(d: &Delim) -> usize {
    let ch = match d.ch {
        b'*' => 0,
        b'_' => 1,
        _ => 2,
    };
    ch * 6 + usize::from(d.can_open) * 3 + d.len % 3
}

fn matches_opener(o: &Delim, c: &Delim) -> bool {
    if o.ch != c.ch || !o.can_open || o.remaining == 0 {
        return false;
    }
    // CommonMark's "rule of 3", so `*a**b*` pairs the single stars.
    let both_ways = o.can_close || c.can_open;
    !(both_ways
        && (o.len + c.len).is_multiple_of(3)
        && !(o.len.is_multiple_of(3) && c.len.is_multiple_of(3)))
}

fn drop_star_runs(s: &str, out: &mut String) {
    let mut stars = 0;
    for c in s.chars() {
        if c == '*' {
            stars += 1;
            continue;
        }
        if stars == 1 {
            out.push('*');
        }
        stars = 0;
        out.push(c);
    }
    if stars == 1 {
        out.push('*');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_rendering() {
        for (input, expected) in [
            ("**bold** and __strong__", "bold and strong"),
            ("*it* and _it_ and ~~gone~~", "it and it and gone"),
            ("***both***", "both"),
            ("snake_case_name and __init__", "snake_case_name and init"),
            ("2*3*4 and 2 * 3 and a*b", "2*3*4 and 2 * 3 and a*b"),
            ("unclosed **bold", "unclosed bold"),
            ("_private and *lonely", "_private and *lonely"),
            ("use `x**2` here", "use x**2 here"),
            ("`` a`b ``", "a`b"),
            ("stray ``` ticks", "stray  ticks"),
            ("[text](https://a.b/c)", "text (https://a.b/c)"),
            ("[**b**](u \"title\")", "b (u)"),
            ("[https://a.b](https://a.b)", "https://a.b"),
            ("![alt *x*](img.png)", "alt x"),
            ("[not a link] (x)", "[not a link] (x)"),
            ("see <https://a.b/c> now", "see https://a.b/c now"),
            ("<b>html</b> stays", "<b>html</b> stays"),
            ("https://x.y/a_b_c_ ok", "https://x.y/a_b_c_ ok"),
            ("\\*not em\\*", "*not em*"),
            ("a ~ b ~~~ c", "a ~ b ~~~ c"),
            (
                "wiki [A (b)](https://w/A_(b)) end",
                "wiki A (b) (https://w/A_(b)) end",
            ),
            ("é**ü**日本", "éü日本"),
        ] {
            assert_eq!(render(input, Style::Plain), expected, "{input:?}");
        }
    }

    #[test]
    fn prose_rendering() {
        for (input, expected) in [
            ("see [the docs](https://d.rs) now", "see the docs now"),
            ("visit https://example.com.", "visit (link)."),
            ("(https://example.com)", "((link))"),
            ("<https://a.b>", "(link)"),
            ("[](https://a.b)", "(link)"),
            ("**Note:** `cargo`", "Note: cargo"),
        ] {
            assert_eq!(render(input, Style::Prose), expected, "{input:?}");
        }
    }

    #[test]
    fn sentences() {
        for (input, expected) in [
            ("Item", "Item."),
            ("Done!", "Done!"),
            ("Steps:", "Steps."),
            ("(quoted.)", "(quoted.)"),
            ("  ", ""),
        ] {
            assert_eq!(ensure_sentence(input), expected);
        }
    }
}
