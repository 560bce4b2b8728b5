//! Line-level Markdown: what kind of block a line starts (heading, list item, rule, fence, table row),
//! decided from the line alone (for paragraph text, from its first word) so the adapter can stream.

/// The kind of a line outside code and tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Heading,
    Bullet,
    /// A numbered item; `Block::marker` holds its "1." or "1)".
    Ordered,
    /// A horizontal rule or setext underline: decoration only.
    Rule,
    Para,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Block<'a> {
    /// Leading whitespace, kept so nested lists stay nested in plain text.
    pub indent: &'a str,
    pub kind: Kind,
    pub marker: &'a str,
    /// The inline content after every block marker.
    pub rest: &'a str,
}

/// Classifies a line (without its line ending). Blockquote markers are peeled off first, so a quoted
/// heading or list item is treated like an unquoted one.
pub(crate) fn classify(line: &str) -> Block<'_> {
    let rest = line.trim_start();
    let indent = &line[..line.len() - rest.len()];
    let mut rest = rest;
    while let Some(quoted) = rest.strip_prefix('>') {
        rest = quoted.trim_start();
    }
    let block = |kind, marker, rest| Block {
        indent,
        kind,
        marker,
        rest,
    };
    if is_rule(rest) {
        return block(Kind::Rule, "", "");
    }
    if heading_level(rest).is_some() {
        return block(Kind::Heading, "", strip_headings(rest));
    }
    if let Some(item) = bullet_item(rest) {
        return block(Kind::Bullet, "", item);
    }
    if let Some((marker, item)) = ordered_item(rest) {
        return block(Kind::Ordered, marker, item);
    }
    block(Kind::Para, "", rest)
}

/// What the first bytes of a line (all of it, or only what has arrived) tell about its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Start {
    /// Not known yet: more of the line is needed.
    #[default]
    Undecided,
    /// A heading, list item, fence or anything else that is not paragraph text.
    Other,
    /// Paragraph text ([`Kind::Para`]) whose inline content starts at byte `rest`, for every
    /// prefix of the line that reaches past byte `from`, whatever follows.
    Para { rest: usize, from: usize },
}

/// Decides from a prefix of a line whether the line is paragraph text. Only the first word of its
/// content (and the whitespace after it) matters, except for a line made of `-`, `*`, `_` or `=`,
/// which could still become a rule until another character shows up.
pub(crate) fn start(prefix: &str) -> Start {
    let trimmed = prefix.trim_start();
    let mut rest = trimmed;
    while let Some(quoted) = rest.strip_prefix('>') {
        rest = quoted.trim_start();
    }
    let rest_at = prefix.len() - rest.len();
    // The first word and the whitespace after it decide headings, list markers and fences.
    if rest.find(char::is_whitespace).is_none() {
        return Start::Undecided;
    }
    if heading_level(rest).is_some()
        || bullet_item(rest).is_some()
        || ordered_item(rest).is_some()
        || trimmed.starts_with("```")
        || trimmed.starts_with("~~~")
    {
        return Start::Other;
    }
    let Some(first) = rest.chars().next() else {
        return Start::Undecided;
    };
    if !matches!(first, '-' | '*' | '_' | '=') {
        return Start::Para {
            rest: rest_at,
            from: rest_at + 1,
        };
    }
    // A rule until some other visible character says otherwise (trailing whitespace is trimmed).
    match rest
        .char_indices()
        .find(|&(_, c)| c != first && !c.is_whitespace())
    {
        Some((at, c)) => Start::Para {
            rest: rest_at,
            from: rest_at + at + c.len_utf8(),
        },
        None => Start::Undecided,
    }
}

/// `#` to `######` followed by whitespace or the end of the line: an ATX heading marker.
pub(crate) fn heading_level(s: &str) -> Option<usize> {
    let level = s.bytes().take_while(|&b| b == b'#').count();
    let after = s.as_bytes().get(level);
    ((1..=6).contains(&level) && matches!(after, None | Some(b' ' | b'\t'))).then_some(level)
}

/// Removes ATX heading markers (opening and closing) until the text no longer starts like a heading,
/// so "## # x" cannot leave a heading behind.
pub(crate) fn strip_headings(mut s: &str) -> &str {
    while let Some(level) = heading_level(s) {
        let text = s[level..].trim();
        let without_closing = text.trim_end_matches('#');
        s = if without_closing.is_empty() {
            ""
        } else if without_closing.ends_with([' ', '\t']) {
            without_closing.trim_end()
        } else {
            text
        };
    }
    s
}

/// Three or more `-`, `*` or `_` (spaces allowed between), or a setext `===` underline.
fn is_rule(s: &str) -> bool {
    let t = s.trim_end();
    let Some(first) = t.chars().next() else {
        return false;
    };
    if !matches!(first, '-' | '*' | '_' | '=') {
        return false;
    }
    let mut count = 0;
    for c in t.chars() {
        if c == first {
            count += 1;
        } else if first == '=' || !matches!(c, ' ' | '\t') {
            return false;
        }
    }
    count >= 3
}

fn bullet_item(s: &str) -> Option<&str> {
    let mut chars = s.chars();
    let marker = chars.next()?;
    let space = chars.next()?;
    (matches!(marker, '-' | '*' | '+') && matches!(space, ' ' | '\t')).then(|| s[2..].trim_start())
}

fn ordered_item(s: &str) -> Option<(&str, &str)> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if !(1..=9).contains(&digits) {
        return None;
    }
    let bytes = s.as_bytes();
    if !matches!(bytes.get(digits), Some(b'.' | b')'))
        || !matches!(bytes.get(digits + 1), Some(b' ' | b'\t'))
    {
        return None;
    }
    Some((&s[..=digits], s[digits + 1..].trim_start()))
}

/// An open code fence: its character and length, which the closing fence must match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fence {
    ch: u8,
    len: usize,
}

/// A line opening a fenced code block. Any indentation is accepted, because models indent fences
/// inside list items by however much they like.
pub(crate) fn fence_open(line: &str) -> Option<Fence> {
    let t = line.trim_start();
    let ch = *t.as_bytes().first()?;
    if ch != b'`' && ch != b'~' {
        return None;
    }
    let len = t.bytes().take_while(|&b| b == ch).count();
    // A backtick info string cannot hold a backtick: "```js```" is inline code, not a fence.
    (len >= 3 && !(ch == b'`' && t[len..].contains('`'))).then_some(Fence { ch, len })
}

pub(crate) fn fence_close(line: &str, fence: Fence) -> bool {
    let t = line.trim();
    t.len() >= fence.len && t.bytes().all(|b| b == fence.ch)
}

/// The cells of a table row: outer pipes optional, `\|` is a literal pipe inside a cell.
pub(crate) fn split_cells(line: &str) -> Vec<String> {
    let mut t = line.trim();
    t = t.strip_prefix('|').unwrap_or(t);
    if t.ends_with('|') && !t.ends_with("\\|") {
        t = &t[..t.len() - 1];
    }
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut chars = t.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push('|');
                chars.next();
            }
            '|' => cells.push(std::mem::take(&mut cell).trim().to_owned()),
            _ => cell.push(c),
        }
    }
    cells.push(cell.trim().to_owned());
    cells
}

/// The header cells when `header` followed by `separator` start a GFM table: the separator holds a pipe,
/// only `-`/`:` cells, and as many cells as the header.
pub(crate) fn table_header(header: &str, separator: &str) -> Option<Vec<String>> {
    let sep = separator.trim();
    if !sep.contains('|')
        || !sep.contains('-')
        || !sep
            .bytes()
            .all(|b| matches!(b, b'|' | b'-' | b':' | b' ' | b'\t'))
    {
        return None;
    }
    let sep_cells = split_cells(sep);
    let well_formed = sep_cells.iter().all(|c| {
        let inner = c.trim_start_matches(':').trim_end_matches(':');
        !inner.is_empty() && inner.bytes().all(|b| b == b'-')
    });
    let headers = split_cells(header);
    (well_formed && headers.len() == sep_cells.len()).then_some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_lines() {
        for (line, kind, rest) in [
            ("# Title", Kind::Heading, "Title"),
            ("## Title ##", Kind::Heading, "Title"),
            ("## # x", Kind::Heading, "x"),
            ("#", Kind::Heading, ""),
            ("#hashtag", Kind::Para, "#hashtag"),
            ("####### seven", Kind::Para, "####### seven"),
            ("> > - quoted item", Kind::Bullet, "quoted item"),
            ("  * nested", Kind::Bullet, "nested"),
            ("+ plus", Kind::Bullet, "plus"),
            ("-5 degrees", Kind::Para, "-5 degrees"),
            ("**bold** start", Kind::Para, "**bold** start"),
            ("12. twelfth", Kind::Ordered, "twelfth"),
            ("3) third", Kind::Ordered, "third"),
            ("2024.", Kind::Para, "2024."),
            ("---", Kind::Rule, ""),
            ("* * *", Kind::Rule, ""),
            ("___", Kind::Rule, ""),
            ("=====", Kind::Rule, ""),
            ("--", Kind::Para, "--"),
            ("- - -", Kind::Rule, ""),
        ] {
            let b = classify(line);
            assert_eq!((b.kind, b.rest), (kind, rest), "{line:?}");
        }
        assert_eq!(classify("  - x").indent, "  ");
        assert_eq!(classify("7. x").marker, "7.");
    }

    #[test]
    fn starts() {
        let para = |rest, from| Start::Para { rest, from };
        for (prefix, expected) in [
            ("Hello", Start::Undecided),
            ("Hello wor", para(0, 1)),
            ("  > > Hello ", para(6, 7)),
            ("> ", Start::Undecided),
            ("# Title ", Start::Other),
            ("#hashtag ", para(0, 1)),
            ("- item ", Start::Other),
            ("12. item ", Start::Other),
            ("12.5 kg ", para(0, 1)),
            ("``` x", Start::Other),
            ("`` x", para(0, 1)),
            ("** * ", Start::Undecided),
            ("** *x", para(0, 5)),
            ("**bold** x", para(0, 3)),
            ("-5 degrees", para(0, 2)),
        ] {
            assert_eq!(start(prefix), expected, "{prefix:?}");
        }
    }

    #[test]
    fn fences_and_tables() {
        assert!(fence_open("```rust").is_some());
        assert!(fence_open("   ~~~~").is_some());
        assert!(fence_open("``").is_none());
        assert!(fence_open("```js```").is_none());
        let f = fence_open("````").expect("fence");
        assert!(!fence_close("```", f));
        assert!(fence_close("`````  ", f));
        assert!(!fence_close("~~~~", f));

        assert_eq!(split_cells("| a | b\\|c |"), ["a", "b|c"]);
        assert_eq!(split_cells("a|b"), ["a", "b"]);
        assert_eq!(split_cells("|"), [""]);
        assert_eq!(
            table_header("| A | B |", "|:--|--:|"),
            Some(vec!["A".to_owned(), "B".to_owned()])
        );
        assert_eq!(table_header("A | B", "--- | ---").map(|h| h.len()), Some(2));
        assert_eq!(table_header("| A | B |", "|---|"), None);
        assert_eq!(table_header("| A |", "---"), None);
        assert_eq!(table_header("| A |", "| x |"), None);
    }
}
