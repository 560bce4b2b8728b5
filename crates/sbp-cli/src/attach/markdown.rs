//! Markdown for the terminal: `sbp attach` shows replies on a terminal with their Markdown rendered
//! (bold, italics, code, headings, lists, quotes, rules, tables) instead of its markers. The
//! rendering is lines of text with ANSI styles (none without colour: then only the layout
//! remains); a reply that streams is rendered a block at a time ([`Stream`]), so what is shown is
//! never taken back.

use pulldown_cmark::{CodeBlockKind, Event, HeadingLevel, Options, Parser, Tag, TagEnd};

const RESET: &str = "\x1b[0m";
const BOLD: &str = "\x1b[1m";
const DIM: &str = "\x1b[2m";
const ITALIC: &str = "\x1b[3m";
const UNDERLINE: &str = "\x1b[4m";
const STRIKE: &str = "\x1b[9m";
const CODE: &str = "\x1b[33m";

/// Code block lines are indented this much beyond their block.
const CODE_INDENT: &str = "    ";
/// A thematic break (`---`).
const RULE_WIDTH: usize = 40;
/// Bullets by nesting depth.
const BULLETS: [&str; 3] = ["•", "◦", "▪"];

/// `text` rendered as lines (without their newlines), no blank line first or last.
pub fn render(text: &str, colour: bool) -> Vec<String> {
    let options = Options::ENABLE_TABLES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_FOOTNOTES;
    let mut w = Writer::new(colour);
    for event in Parser::new_ext(text, options) {
        w.event(event);
    }
    w.finish()
}

/// A reply rendered while it streams in: each block (the text up to a blank line followed by a
/// line that starts at the margin, outside a fenced code block) is rendered once it is complete,
/// the rest by [`Stream::finish`]. Rendering block by block keeps lists, quotes and fenced code
/// whole, while earlier blocks never need redrawing. A heading is a block of its own line, and so
/// is each item of a list of one-line items, so that these show as soon as they are written.
#[derive(Debug)]
pub struct Stream {
    colour: bool,
    /// The source of the block being collected, whole lines.
    block: String,
    /// The current source line, until its newline arrives.
    line: String,
    /// Inside a fenced code block: its fence character and length.
    fence: Option<(char, usize)>,
    /// The last whole line was blank (outside a fence).
    after_blank: bool,
    /// What the last whole line was, when it started at the margin outside a fence.
    last: Line,
    /// The block being collected is separated by a blank line from the one before it (not so the
    /// next item of a list).
    gap: bool,
    /// Lines were emitted already (the next block is separated by a blank line).
    emitted: bool,
}

impl Stream {
    pub fn new(colour: bool) -> Self {
        Self {
            colour,
            block: String::new(),
            line: String::new(),
            fence: None,
            after_blank: false,
            last: Line::Other,
            gap: true,
            emitted: false,
        }
    }

    /// Takes more of the reply; returns the lines of the blocks it completed.
    pub fn push(&mut self, delta: &str) -> Vec<String> {
        let mut out = Vec::new();
        for piece in delta.split_inclusive('\n') {
            self.line.push_str(piece);
            if self.line.ends_with('\n') {
                let line = std::mem::take(&mut self.line);
                self.source_line(line, &mut out);
            }
        }
        out
    }

    /// The end of the reply: the lines of what was not rendered yet.
    pub fn finish(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.line);
        self.block.push_str(&rest);
        self.emit(&mut out);
        self.fence = None;
        self.after_blank = false;
        self.last = Line::Other;
        self.gap = true;
        out
    }

    fn source_line(&mut self, line: String, out: &mut Vec<String>) {
        let text = line.trim_end_matches(['\n', '\r']);
        let blank = text.trim().is_empty();
        let at_margin = !text.starts_with([' ', '\t']);
        let kind = Line::of(text);
        if self.fence.is_none() && !blank && at_margin {
            if self.after_blank || self.last == Line::Heading {
                self.emit(out);
                self.gap = true;
            } else if self.last == Line::Item && kind == Line::Item {
                self.emit(out);
                // The next item of the same list.
                self.gap = false;
            }
        }
        let outside = self.fence.is_none();
        self.fence = match self.fence {
            None => opening_fence(text),
            Some(open) if closes_fence(text, open) => None,
            inside => inside,
        };
        self.after_blank = blank && self.fence.is_none();
        self.last = if outside && self.fence.is_none() && at_margin {
            kind
        } else {
            Line::Other
        };
        self.block.push_str(&line);
    }

    /// Renders the block collected.
    fn emit(&mut self, out: &mut Vec<String>) {
        let block = std::mem::take(&mut self.block);
        if block.trim().is_empty() {
            return;
        }
        let lines = render(&block, self.colour);
        if lines.is_empty() {
            return;
        }
        if self.emitted && self.gap {
            out.push(String::new());
        }
        out.extend(lines);
        self.emitted = true;
    }
}

/// What a source line starting at the margin begins, for where blocks end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// An ATX heading (`# Title`).
    Heading,
    /// A list item (`- x`, `* x`, `+ x`, `1. x`, `1) x`).
    Item,
    Other,
}

impl Line {
    fn of(text: &str) -> Self {
        let hashes = text.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes)
            && text[hashes..]
                .chars()
                .next()
                .is_none_or(|c| c == ' ' || c == '\t')
        {
            return Self::Heading;
        }
        let digits = text.chars().take_while(char::is_ascii_digit).count();
        let marker = match text[digits..].chars().next() {
            Some('.' | ')') if (1..=9).contains(&digits) => digits + 1,
            Some('-' | '*' | '+') if digits == 0 => 1,
            _ => return Self::Other,
        };
        match text[marker..].chars().next() {
            Some(' ' | '\t') => Self::Item,
            _ => Self::Other,
        }
    }
}

/// A line that opens a fenced code block (up to three spaces, then three or more ` or ~).
fn opening_fence(line: &str) -> Option<(char, usize)> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let rest = &line[indent..];
    let c = rest.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let n = rest.chars().take_while(|x| *x == c).count();
    // A backtick fence's info string may not contain a backtick.
    let info = &rest[n..];
    (n >= 3 && !(c == '`' && info.contains('`'))).then_some((c, n))
}

fn closes_fence(line: &str, (c, n): (char, usize)) -> bool {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return false;
    }
    let rest = &line[indent..];
    let run = rest.chars().take_while(|x| *x == c).count();
    run >= n && rest[run * c.len_utf8()..].trim().is_empty()
}

/// Characters a line shows, without its escape sequences (for table columns).
fn visible_width(s: &str) -> usize {
    let mut width = 0;
    let mut in_escape = false;
    for ch in s.chars() {
        match (in_escape, ch) {
            (false, '\x1b') => in_escape = true,
            (true, c) if c.is_ascii_alphabetic() => in_escape = false,
            (true, _) => {}
            (false, _) => width += 1,
        }
    }
    width
}

/// A table being collected: rows of rendered cells, the header first.
#[derive(Default)]
struct Table {
    rows: Vec<Vec<String>>,
    row: Vec<String>,
    cell: Option<String>,
    head_rows: usize,
}

/// The state of one rendering: the lines so far, the current line, and the open containers.
struct Writer {
    colour: bool,
    lines: Vec<String>,
    line: String,
    /// Nothing written on the current line yet (its prefix comes with its first text).
    at_line_start: bool,
    /// A block ended: the next one is separated by a blank line.
    blank_before_next: bool,
    quote_depth: usize,
    /// Ordered lists' next numbers (`None` for bullets), innermost last.
    lists: Vec<Option<u64>>,
    /// Widths of the open items' markers: continuation lines are indented by their sum.
    items: Vec<usize>,
    /// The marker of an item whose first line is not written yet.
    marker: Option<String>,
    in_code_block: bool,
    styles: Vec<&'static str>,
    /// Open links: their destination and the text shown for them so far.
    links: Vec<(String, String)>,
    table: Option<Table>,
}

impl Writer {
    fn new(colour: bool) -> Self {
        Self {
            colour,
            lines: Vec::new(),
            line: String::new(),
            at_line_start: true,
            blank_before_next: false,
            quote_depth: 0,
            lists: Vec::new(),
            items: Vec::new(),
            marker: None,
            in_code_block: false,
            styles: Vec::new(),
            links: Vec::new(),
            table: None,
        }
    }

    fn event(&mut self, event: Event<'_>) {
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Text(t) | Event::InlineMath(t) | Event::DisplayMath(t) => self.text(&t),
            // HTML in a reply is shown as the text it is; nothing interprets it.
            Event::Html(t) | Event::InlineHtml(t) => self.text(&t),
            Event::Code(t) => self.inline_code(&t),
            Event::SoftBreak | Event::HardBreak => self.new_line(),
            Event::Rule => {
                self.start_block();
                let rule = "─".repeat(RULE_WIDTH);
                self.styled(DIM, &rule);
                self.end_block();
            }
            Event::TaskListMarker(done) => self.text(if done { "[x] " } else { "[ ] " }),
            Event::FootnoteReference(name) => self.text(&format!("[^{name}]")),
        }
    }

    fn start(&mut self, tag: Tag<'_>) {
        match tag {
            Tag::Paragraph | Tag::HtmlBlock | Tag::MetadataBlock(_) => self.start_block(),
            Tag::Heading { level, .. } => {
                self.start_block();
                self.push_style(BOLD);
                if matches!(level, HeadingLevel::H1 | HeadingLevel::H2) {
                    self.push_style(UNDERLINE);
                }
            }
            Tag::BlockQuote(_) => {
                self.start_block();
                self.quote_depth += 1;
            }
            Tag::CodeBlock(kind) => {
                self.start_block();
                if let CodeBlockKind::Fenced(lang) = kind
                    && !lang.is_empty()
                {
                    self.styled(DIM, &lang);
                    self.new_line();
                }
                self.in_code_block = true;
                self.push_style(CODE);
            }
            Tag::List(start) => {
                if self.lists.is_empty() {
                    self.start_block();
                } else {
                    self.close_line();
                }
                self.lists.push(start);
            }
            Tag::Item => {
                if self.blank_before_next {
                    self.start_block();
                }
                self.close_line();
                let depth = self.lists.len().saturating_sub(1);
                let marker = match self.lists.last_mut() {
                    Some(Some(n)) => {
                        let m = format!("{n}. ");
                        *n += 1;
                        m
                    }
                    _ => format!("{} ", BULLETS[depth % BULLETS.len()]),
                };
                self.items.push(marker.chars().count());
                self.marker = Some(marker);
            }
            Tag::FootnoteDefinition(name) => {
                self.start_block();
                self.text(&format!("[^{name}]: "));
            }
            Tag::DefinitionList | Tag::DefinitionListTitle => self.start_block(),
            Tag::DefinitionListDefinition => {
                self.close_line();
                self.text("  ");
            }
            Tag::Table(_) => {
                self.start_block();
                self.table = Some(Table::default());
            }
            Tag::TableHead | Tag::TableRow => {}
            Tag::TableCell => {
                if let Some(t) = &mut self.table {
                    t.cell = Some(String::new());
                }
            }
            Tag::Emphasis => self.push_style(ITALIC),
            Tag::Strong => self.push_style(BOLD),
            Tag::Strikethrough => self.push_style(STRIKE),
            Tag::Superscript | Tag::Subscript => {}
            Tag::Link { dest_url, .. } => {
                self.links.push((dest_url.to_string(), String::new()));
                self.push_style(UNDERLINE);
            }
            Tag::Image { dest_url, .. } => {
                self.text("[image: ");
                self.links.push((dest_url.to_string(), String::new()));
            }
        }
    }

    fn end(&mut self, tag: TagEnd) {
        match tag {
            TagEnd::Paragraph
            | TagEnd::HtmlBlock
            | TagEnd::MetadataBlock(_)
            | TagEnd::FootnoteDefinition
            | TagEnd::DefinitionList
            | TagEnd::DefinitionListTitle => self.end_block(),
            TagEnd::DefinitionListDefinition => self.close_line(),
            TagEnd::Heading(level) => {
                if matches!(level, HeadingLevel::H1 | HeadingLevel::H2) {
                    self.pop_style();
                }
                self.pop_style();
                self.end_block();
            }
            TagEnd::BlockQuote(_) => {
                self.close_line();
                self.quote_depth = self.quote_depth.saturating_sub(1);
                self.blank_before_next = true;
            }
            TagEnd::CodeBlock => {
                // A code block's text ends with its last newline: no empty line follows it.
                self.pop_style();
                self.in_code_block = false;
                self.end_block();
            }
            TagEnd::List(_) => {
                self.close_line();
                self.lists.pop();
                if self.lists.is_empty() {
                    self.blank_before_next = true;
                }
            }
            TagEnd::Item => {
                // An item with nothing in it still shows its marker.
                if self.marker.is_some() {
                    self.begin_line();
                }
                self.close_line();
                self.items.pop();
            }
            TagEnd::Table => self.end_table(),
            TagEnd::TableHead => {
                if let Some(t) = &mut self.table {
                    let row = std::mem::take(&mut t.row);
                    t.rows.push(row);
                    t.head_rows = t.rows.len();
                }
            }
            TagEnd::TableRow => {
                if let Some(t) = &mut self.table {
                    let row = std::mem::take(&mut t.row);
                    t.rows.push(row);
                }
            }
            TagEnd::TableCell => {
                if let Some(t) = &mut self.table
                    && let Some(cell) = t.cell.take()
                {
                    t.row.push(cell);
                }
            }
            TagEnd::Emphasis | TagEnd::Strong | TagEnd::Strikethrough => self.pop_style(),
            TagEnd::Superscript | TagEnd::Subscript => {}
            TagEnd::Link => {
                self.pop_style();
                self.link_target();
            }
            TagEnd::Image => {
                self.text("]");
                self.link_target();
            }
        }
    }

    /// After a link's text: its destination, unless the text already says it.
    fn link_target(&mut self) {
        if let Some((url, shown)) = self.links.pop() {
            let bare = url.strip_prefix("mailto:").unwrap_or(&url);
            if !url.is_empty() && shown != url && shown != bare {
                self.styled(DIM, &format!(" ({url})"));
            }
        }
    }

    fn start_block(&mut self) {
        self.close_line();
        if self.blank_before_next && !self.lines.is_empty() {
            let bars = self.quote_bars();
            self.lines.push(bars.trim_end().to_owned());
        }
        self.blank_before_next = false;
    }

    fn end_block(&mut self) {
        self.close_line();
        self.blank_before_next = true;
    }

    /// Ends the current line if anything is on it.
    fn close_line(&mut self) {
        if !self.at_line_start {
            self.new_line();
        }
    }

    fn new_line(&mut self) {
        if let Some(t) = &mut self.table {
            // A table cell is one line.
            if let Some(cell) = &mut t.cell {
                cell.push(' ');
            }
            return;
        }
        if self.at_line_start {
            self.begin_line();
        }
        if self.colour && !self.styles.is_empty() {
            self.line.push_str(RESET);
        }
        self.lines.push(std::mem::take(&mut self.line));
        self.at_line_start = true;
    }

    fn quote_bars(&self) -> String {
        let bar = if self.colour {
            format!("{DIM}│{RESET} ")
        } else {
            "│ ".to_owned()
        };
        bar.repeat(self.quote_depth)
    }

    /// The prefix of a new line (quote bars, list indentation or the item's marker, code
    /// indentation) and the styles open at this point.
    fn begin_line(&mut self) {
        let mut prefix = self.quote_bars();
        let indent: usize = match self.marker.take() {
            Some(marker) => {
                let outer: usize = self.items.iter().rev().skip(1).sum();
                prefix.push_str(&" ".repeat(outer));
                prefix.push_str(&marker);
                0
            }
            None => self.items.iter().sum(),
        };
        prefix.push_str(&" ".repeat(indent));
        if self.in_code_block {
            prefix.push_str(CODE_INDENT);
        }
        if self.colour {
            for s in &self.styles {
                prefix.push_str(s);
            }
        }
        self.line = prefix;
        self.at_line_start = false;
    }

    /// Text, whose newlines (in code blocks and HTML) end lines.
    fn text(&mut self, text: &str) {
        for (i, part) in text.split('\n').enumerate() {
            if i > 0 {
                self.new_line();
            }
            if part.is_empty() {
                continue;
            }
            for (_, shown) in &mut self.links {
                shown.push_str(part);
            }
            if let Some(t) = &mut self.table {
                if let Some(cell) = &mut t.cell {
                    cell.push_str(part);
                }
                continue;
            }
            if self.at_line_start {
                self.begin_line();
            }
            self.line.push_str(part);
        }
    }

    /// Text in one style, not nested in the others.
    fn styled(&mut self, style: &'static str, text: &str) {
        self.push_style(style);
        // Written as text, so it is not taken for a link's shown text.
        let links = std::mem::take(&mut self.links);
        self.text(text);
        self.links = links;
        self.pop_style();
    }

    fn inline_code(&mut self, code: &str) {
        if self.colour {
            self.push_style(CODE);
            self.text(code);
            self.pop_style();
        } else {
            self.text(&format!("`{code}`"));
        }
    }

    fn push_style(&mut self, style: &'static str) {
        self.styles.push(style);
        if self.colour {
            self.raw(style);
        }
    }

    fn pop_style(&mut self) {
        self.styles.pop();
        if self.colour {
            let mut codes = RESET.to_owned();
            for s in &self.styles {
                codes.push_str(s);
            }
            self.raw(&codes);
        }
    }

    /// Escape sequences: written where text would go, without starting a line for them.
    fn raw(&mut self, codes: &str) {
        if let Some(t) = &mut self.table {
            if let Some(cell) = &mut t.cell {
                cell.push_str(codes);
            }
            return;
        }
        if !self.at_line_start {
            self.line.push_str(codes);
        }
    }

    fn end_table(&mut self) {
        let Some(table) = self.table.take() else {
            return;
        };
        let columns = table.rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0; columns];
        for row in &table.rows {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(visible_width(cell));
            }
        }
        let sep = if self.colour {
            format!("{DIM}│{RESET}")
        } else {
            "│".to_owned()
        };
        for (r, row) in table.rows.iter().enumerate() {
            let mut cells = Vec::with_capacity(columns);
            for (i, width) in widths.iter().enumerate() {
                let cell = row.get(i).map_or("", String::as_str);
                let pad = width.saturating_sub(visible_width(cell));
                cells.push(format!("{cell}{}", " ".repeat(pad)));
            }
            self.text(cells.join(&format!(" {sep} ")).trim_end());
            self.new_line();
            if r + 1 == table.head_rows {
                let rule: Vec<String> = widths.iter().map(|w| "─".repeat(*w)).collect();
                let rule = rule.join("─┼─");
                self.styled(DIM, &rule);
                self.new_line();
            }
        }
        self.blank_before_next = true;
    }

    fn finish(mut self) -> Vec<String> {
        self.close_line();
        while self.lines.last().is_some_and(|l| l.trim().is_empty()) {
            self.lines.pop();
        }
        self.lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(text: &str) -> Vec<String> {
        render(text, false)
    }

    #[test]
    fn inline_markers_become_styles() {
        assert_eq!(
            render("Go to **gate B12** *now*, `seat 3A`.", true),
            ["Go to \x1b[1mgate B12\x1b[0m \x1b[3mnow\x1b[0m, \x1b[33mseat 3A\x1b[0m."]
        );
        assert_eq!(
            plain("Go to **gate B12** *now*, `seat 3A`."),
            ["Go to gate B12 now, `seat 3A`."]
        );
    }

    #[test]
    fn nested_styles_are_restored_after_the_inner_one() {
        assert_eq!(
            render("**bold *both* bold**", true),
            ["\x1b[1mbold \x1b[3mboth\x1b[0m\x1b[1m bold\x1b[0m"]
        );
    }

    #[test]
    fn blocks_headings_lists_quotes_code_and_rules() {
        let text = "# Plan\n\nIntro line\nsecond line\n\n- one\n- two\n  - nested\n\n1. first\n2. second\n\n> quoted\n> more\n\n```rust\nlet x = 1;\n\nlet y = 2;\n```\n\n---\nend";
        assert_eq!(
            plain(text),
            [
                "Plan",
                "",
                "Intro line",
                "second line",
                "",
                "• one",
                "• two",
                "  ◦ nested",
                "",
                "1. first",
                "2. second",
                "",
                "│ quoted",
                "│ more",
                "",
                "rust",
                "    let x = 1;",
                "    ",
                "    let y = 2;",
                "",
                &"─".repeat(RULE_WIDTH),
                "",
                "end",
            ]
        );
    }

    #[test]
    fn styles_end_with_each_line_and_start_again_on_the_next() {
        let lines = render("**one\ntwo**", true);
        assert_eq!(lines, ["\x1b[1mone\x1b[0m", "\x1b[1mtwo\x1b[0m"]);
    }

    #[test]
    fn links_show_their_target_and_html_stays_text() {
        assert_eq!(
            plain("See [the docs](https://example.com/d) or <https://example.com>."),
            ["See the docs (https://example.com/d) or https://example.com."]
        );
        assert_eq!(
            plain("<script>alert(1)</script> & <b>x</b>"),
            ["<script>alert(1)</script> & <b>x</b>"]
        );
    }

    #[test]
    fn tables_are_aligned() {
        assert_eq!(
            plain("| day | city |\n|---|---|\n| 1 | Lisbon |\n| 2 | Porto |"),
            ["day │ city", "────┼───────", "1   │ Lisbon", "2   │ Porto",]
        );
    }

    #[test]
    fn loose_list_items_keep_their_paragraphs_together() {
        assert_eq!(
            plain("- first\n\n  more of first\n- second"),
            ["• first", "", "  more of first", "", "• second"]
        );
    }

    #[test]
    fn a_stream_renders_each_block_once_whole() {
        let text = "Intro **bold**\n\n```\ncode\n\nstill code\n```\n\n- a\n- b\n\nlast words";
        let whole = plain(text);
        // Fed a few bytes at a time, the same lines come out, each block once it is complete.
        for step in [1, 3, 7, 100] {
            let mut s = Stream::new(false);
            let mut lines = Vec::new();
            let bytes: Vec<char> = text.chars().collect();
            for piece in bytes.chunks(step) {
                let piece: String = piece.iter().collect();
                lines.extend(s.push(&piece));
            }
            lines.extend(s.finish());
            assert_eq!(lines, whole, "step {step}");
        }
        let mut s = Stream::new(false);
        assert!(s.push("Intro **bold**\n\n").is_empty(), "a block may go on");
        assert_eq!(s.push("```\n"), ["Intro bold"], "the next block began");
        assert!(
            s.push("code\n\nstill code\n").is_empty(),
            "inside the fence"
        );
    }

    #[test]
    fn headings_and_one_line_items_show_as_soon_as_they_end() {
        let text = "# Plan\nFirst:\n- one\n- two\n- three\n\nDone.";
        let mut s = Stream::new(false);
        let mut seen = Vec::new();
        for line in text.split_inclusive('\n') {
            seen.push(s.push(line));
        }
        seen.push(s.finish());
        let expected: [&[&str]; 8] = [
            &[],
            &["Plan"],
            &[],
            &["", "First:", "", "• one"],
            &["• two"],
            &[],
            &[],
            &["• three", "", "Done."],
        ];
        assert_eq!(seen, expected);
        assert_eq!(seen.concat(), plain(text), "the same lines as the whole");
        assert_eq!(Line::of("1) x"), Line::Item);
        assert_eq!(Line::of("---"), Line::Other);
        assert_eq!(Line::of("#hashtag"), Line::Other);
        assert_eq!(Line::of("###"), Line::Heading);
    }

    #[test]
    fn fences_are_recognised() {
        assert_eq!(opening_fence("```rust"), Some(('`', 3)));
        assert_eq!(opening_fence("   ~~~~"), Some(('~', 4)));
        assert_eq!(opening_fence("    ```"), None);
        assert_eq!(opening_fence("``` a`b"), None);
        assert!(closes_fence("````", ('`', 3)));
        assert!(!closes_fence("``", ('`', 3)));
        assert!(!closes_fence("``` x", ('`', 3)));
    }
}
