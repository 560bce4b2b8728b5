//! The streaming adapter: buffers deltas into lines, rewrites each line for the profile (paragraph
//! text in pieces, as soon as a piece is settled) and enforces the budget, so that any split of a
//! reply into deltas yields the same output.

use crate::block::{self, Fence, Kind, Start};
use crate::budget;
use crate::inline::{self, Style};
use crate::profile::Profile;

/// A partial line is re-scanned on every push while this few bytes of it wait; beyond that, only
/// once what waits has doubled since the last scan, so a huge line that never settles stays linear.
const RESCAN_FREE: usize = 1024;

/// What is done to lines outside code and tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Lines stay as they are (tables may still be rewritten).
    Markdown,
    Plain,
    Prose,
}

/// Where we are in a (possible) table.
#[derive(Debug)]
enum Table {
    Off,
    /// A line with a `|`, held back until the next line tells whether it is a table header.
    Candidate {
        line: String,
        eol: &'static str,
    },
    /// Inside a table: the (rendered) header cells.
    Rows {
        headers: Vec<String>,
    },
}

/// How far the current line has been streamed.
#[derive(Debug, Default)]
struct Partial {
    start: Start,
    /// Some of the line was emitted: it is paragraph text now, whatever follows.
    committed: bool,
    /// Bytes of the line's content emitted so far.
    done: usize,
    /// Length of the line at the last scan.
    scanned: usize,
}

/// Adapts one reply, fed as streamed deltas.
#[derive(Debug)]
pub struct Adapter {
    profile: Profile,
    mode: Mode,
    /// Tables go out as they are (otherwise they become one line per row).
    keep_tables: bool,
    passthrough: bool,
    /// The incomplete last line.
    pending: String,
    partial: Partial,
    fence: Option<Fence>,
    table: Table,
    out: Emitter,
}

impl Adapter {
    pub fn new(profile: Profile) -> Self {
        let mode = if profile.prose {
            Mode::Prose
        } else if profile.markdown {
            Mode::Markdown
        } else {
            Mode::Plain
        };
        Self {
            profile,
            mode,
            keep_tables: mode == Mode::Markdown && profile.tables,
            passthrough: profile.is_passthrough(),
            pending: String::new(),
            partial: Partial::default(),
            fence: None,
            table: Table::Off,
            out: Emitter {
                room: profile.budget_tokens.map(budget::units_for),
                truncated: false,
                collapse_blanks: mode == Mode::Plain,
                prose: mode == Mode::Prose,
                last_blank: false,
                spoke: false,
                sentence_end: false,
            },
        }
    }

    /// The profile this adapter renders for.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Feeds a streamed delta; returns the adapted text that can be emitted now (may be empty).
    pub fn push(&mut self, delta: &str) -> String {
        if self.passthrough {
            return delta.to_owned();
        }
        let mut out = String::new();
        if self.out.truncated {
            return out;
        }
        // Only the new bytes can hold a newline the previous push did not see.
        let start = self.pending.len();
        self.pending.push_str(delta);
        if let Some(last_nl) = self.pending[start..].rfind('\n') {
            let rest = self.pending.split_off(start + last_nl + 1);
            let complete = std::mem::replace(&mut self.pending, rest);
            for line in complete.split_inclusive('\n') {
                self.line(line, &mut out);
            }
        }
        if !self.out.truncated && !self.pending.is_empty() {
            let partial = std::mem::take(&mut self.pending);
            self.stream(&partial, false, &mut out);
            self.pending = partial;
        }
        if self.out.truncated {
            // Everything after the cut is dropped: no need to keep it.
            self.pending = String::new();
        }
        out
    }

    /// End of the reply: returns whatever is left.
    pub fn finish(&mut self) -> String {
        let mut out = String::new();
        if self.passthrough {
            return out;
        }
        let last = std::mem::take(&mut self.pending);
        if !last.is_empty() {
            self.line(&last, &mut out);
        }
        if let Table::Candidate { line, eol } = std::mem::replace(&mut self.table, Table::Off) {
            self.text_line(&line, eol, &mut out);
        }
        out
    }

    /// Whether the budget was exhausted (the rest of the reply is dropped).
    pub fn truncated(&self) -> bool {
        self.out.truncated
    }

    fn line(&mut self, raw: &str, out: &mut String) {
        if self.out.truncated {
            return;
        }
        let (content, eol) = split_eol(raw);
        let tail = self.stream(content, true, out);
        self.partial = Partial::default();
        if let Some(tail) = tail {
            if self.out.piece(&tail, false, out) && self.mode != Mode::Prose {
                out.push_str(eol);
            }
            return;
        }
        if let Some(fence) = self.fence {
            self.code_line(content, eol, fence, out);
            return;
        }
        match std::mem::replace(&mut self.table, Table::Off) {
            Table::Candidate {
                line,
                eol: line_eol,
            } => {
                if let Some(headers) = block::table_header(&line, content) {
                    let headers = headers.iter().map(|h| self.cell(h)).collect();
                    self.table = Table::Rows { headers };
                    return;
                }
                self.text_line(&line, line_eol, out);
            }
            Table::Rows { headers } if content.contains('|') => {
                self.row(&headers, content, eol, out);
                self.table = Table::Rows { headers };
                return;
            }
            Table::Rows { .. } | Table::Off => {}
        }
        if let Some(fence) = block::fence_open(content) {
            self.fence = Some(fence);
            match self.mode {
                Mode::Markdown => self.out.line(content, eol, out),
                Mode::Plain => {}
                Mode::Prose => self.out.sentence("(code omitted).", out),
            }
            return;
        }
        if !self.keep_tables && content.contains('|') {
            self.table = Table::Candidate {
                line: content.to_owned(),
                eol,
            };
            return;
        }
        self.text_line(content, eol, out);
    }

    /// Emits the settled pieces of the current line (`content`, all of it when `complete`, else what
    /// has arrived) that were not emitted yet, and returns the adapted rest of a complete line that
    /// streamed. Only paragraph text outside code and tables streams, in pieces that end where a
    /// [`inline::Break`] is (every construct closed, a word follows), cut at sentence ends for prose
    /// and budgets. Which pieces there are depends only on the line's bytes up to the word after each
    /// break, never on how the line arrived, so the output is the same however the reply is split.
    fn stream(&mut self, content: &str, complete: bool, out: &mut String) -> Option<String> {
        if self.fence.is_some() || !matches!(self.table, Table::Off) || self.out.truncated {
            return None;
        }
        let p = &mut self.partial;
        if !complete {
            let (waiting, seen) = (content.len() - p.done, p.scanned.saturating_sub(p.done));
            if content.len() <= p.scanned || (waiting > RESCAN_FREE && waiting < 2 * seen) {
                return None;
            }
            p.scanned = content.len();
        }
        if p.start == Start::Undecided {
            p.start = block::start(content);
        }
        let Start::Para { rest, from } = p.start else {
            return None;
        };
        let base = if p.committed { p.done } else { rest };
        let style = match self.mode {
            Mode::Prose => Style::Prose,
            Mode::Markdown | Mode::Plain => Style::Plain,
        };
        let (rendered, breaks) = inline::render_breaks(&content[base..], style);
        // A line that may be a table header waits, unless it streamed before its first `|`.
        let pipe = match p.committed || self.keep_tables {
            true => usize::MAX,
            false => content.find('|').unwrap_or(usize::MAX),
        };
        let sentences = self.mode == Mode::Prose || self.profile.budget_tokens.is_some();
        let mut out_done = 0;
        for b in breaks {
            let (end, next) = (base + b.raw, base + b.next);
            let first = !p.committed;
            if first && (end < from || next >= pipe) {
                continue;
            }
            let piece = match self.mode {
                Mode::Markdown => content[p.done..end].to_owned(),
                Mode::Plain | Mode::Prose => {
                    let text = &rendered[out_done..b.out];
                    if first {
                        // The line's text is trimmed, and one that starts like a heading loses it.
                        let text = text.trim_start();
                        if text.is_empty() || block::heading_level(text).is_some() {
                            continue;
                        }
                        let indent = match self.mode {
                            Mode::Plain => &content[..content.len() - content.trim_start().len()],
                            Mode::Markdown | Mode::Prose => "",
                        };
                        format!("{indent}{text}")
                    } else {
                        text.to_owned()
                    }
                }
            };
            // Prose trims the end of its sentence: a piece must not end in what could be trimmed.
            if piece.ends_with(char::is_whitespace) || (sentences && !budget::ends_sentence(&piece))
            {
                continue;
            }
            p.committed = true;
            p.done = end;
            out_done = b.out;
            if !self.out.piece(&piece, first, out) {
                return None;
            }
        }
        if !(complete && p.committed) {
            return None;
        }
        Some(match self.mode {
            Mode::Markdown => content[p.done..].to_owned(),
            Mode::Plain => rendered[out_done..].to_owned(),
            Mode::Prose => rendered[out_done..].trim_end().to_owned(),
        })
    }

    fn code_line(&mut self, content: &str, eol: &'static str, fence: Fence, out: &mut String) {
        let closing = block::fence_close(content, fence);
        if closing {
            self.fence = None;
        }
        match self.mode {
            Mode::Markdown => self.out.line(content, eol, out),
            // Code stays verbatim, but fence markers never show: not even a nested one.
            Mode::Plain if !closing && block::fence_open(content).is_none() => {
                self.out.line(content, eol, out);
            }
            Mode::Plain | Mode::Prose => {}
        }
    }

    /// A line outside code and tables.
    fn text_line(&mut self, content: &str, eol: &'static str, out: &mut String) {
        match self.mode {
            Mode::Markdown => self.out.line(content, eol, out),
            Mode::Plain => {
                if content.trim().is_empty() {
                    self.out.blank(eol, out);
                    return;
                }
                let b = block::classify(content);
                let text = inline::render(b.rest, Style::Plain);
                let line = match b.kind {
                    Kind::Rule => return,
                    // Dropped delimiters can leave "** # x" as " # x": trim before looking.
                    Kind::Heading | Kind::Para => {
                        format!("{}{}", b.indent, block::strip_headings(text.trim_start()))
                    }
                    Kind::Bullet => format!("{}• {text}", b.indent),
                    Kind::Ordered => format!("{}{} {text}", b.indent, b.marker),
                };
                if line.trim().is_empty() {
                    self.out.blank(eol, out);
                } else {
                    self.out.line(&line, eol, out);
                }
            }
            Mode::Prose => {
                let b = block::classify(content);
                let text = inline::render(b.rest, Style::Prose);
                let text = block::strip_headings(text.trim());
                let sentence = match b.kind {
                    Kind::Rule => return,
                    Kind::Heading | Kind::Bullet | Kind::Ordered => inline::ensure_sentence(text),
                    Kind::Para => text.to_owned(),
                };
                self.out.sentence(&sentence, out);
            }
        }
    }

    /// A table cell (or header) as it will be shown.
    fn cell(&self, raw: &str) -> String {
        match self.mode {
            Mode::Markdown => raw.trim().to_owned(),
            Mode::Plain => inline::render(raw, Style::Plain).trim().to_owned(),
            Mode::Prose => inline::render(raw, Style::Prose).trim().to_owned(),
        }
    }

    /// A table data row as "Header1: v1, Header2: v2".
    fn row(&mut self, headers: &[String], content: &str, eol: &'static str, out: &mut String) {
        let mut parts = Vec::new();
        for (i, raw) in block::split_cells(content).iter().enumerate() {
            let value = self.cell(raw);
            if value.is_empty() {
                continue;
            }
            match headers.get(i).filter(|h| !h.is_empty()) {
                Some(header) => parts.push(format!("{header}: {value}")),
                None => parts.push(value),
            }
        }
        let text = parts.join(", ");
        match self.mode {
            Mode::Markdown if !text.is_empty() => self.out.line(&text, eol, out),
            Mode::Plain if !text.is_empty() => {
                self.out.line(block::strip_headings(&text), eol, out);
            }
            Mode::Markdown | Mode::Plain => {}
            Mode::Prose => {
                let text = inline::ensure_sentence(block::strip_headings(&text));
                self.out.sentence(&text, out);
            }
        }
    }
}

/// Splits a line from its ending, so "\r\n" replies keep their line endings.
fn split_eol(line: &str) -> (&str, &'static str) {
    for eol in ["\r\n", "\n", "\r"] {
        if let Some(content) = line.strip_suffix(eol) {
            return (content, eol);
        }
    }
    (line, "")
}

/// Writes adapted pieces, joining them (lines, or sentences for prose) and enforcing the budget.
#[derive(Debug)]
struct Emitter {
    /// Budget units still free; None = no budget.
    room: Option<u64>,
    truncated: bool,
    collapse_blanks: bool,
    /// Pieces are sentences joined by spaces rather than lines.
    prose: bool,
    last_blank: bool,
    /// Prose: something was said already, so the next sentence needs a space.
    spoke: bool,
    /// The text emitted so far ends a sentence: a clean place to cut.
    sentence_end: bool,
}

impl Emitter {
    fn line(&mut self, text: &str, eol: &str, out: &mut String) {
        if self.truncated {
            return;
        }
        self.last_blank = false;
        if self.put("", text, false, out) {
            out.push_str(eol);
        }
    }

    /// A piece of a line (for prose, of a sentence) emitted before the line ends; `first` opens it.
    /// Returns false when the budget ran out.
    fn piece(&mut self, text: &str, first: bool, out: &mut String) -> bool {
        if self.truncated {
            return false;
        }
        let mut sep = "";
        if first {
            self.last_blank = false;
            if self.prose {
                if self.spoke {
                    sep = " ";
                }
                self.spoke = true;
            }
        }
        self.put(sep, text, !first, out)
    }

    fn blank(&mut self, eol: &str, out: &mut String) {
        if self.truncated || (self.collapse_blanks && self.last_blank) {
            return;
        }
        self.last_blank = true;
        out.push_str(eol);
    }

    fn sentence(&mut self, text: &str, out: &mut String) {
        let text = text.trim();
        if self.truncated || text.is_empty() {
            return;
        }
        let sep = if self.spoke { " " } else { "" };
        self.spoke = true;
        self.put(sep, text, false, out);
    }

    /// Emits `sep` + `text` when it fits the budget and returns true; otherwise emits the part that
    /// fits, then "…", and stops the reply. `joined`: `text` continues a line or sentence of which
    /// pieces were emitted, so a cut at its very start still follows text of the same line (" …").
    fn put(&mut self, sep: &str, text: &str, joined: bool, out: &mut String) -> bool {
        let Some(room) = self.room else {
            out.push_str(sep);
            out.push_str(text);
            return true;
        };
        let m = budget::measure(text);
        if m.units <= room {
            self.room = Some(room - m.units);
            if m.units > 0 {
                self.sentence_end = m.ends_sentence;
            }
            out.push_str(sep);
            out.push_str(text);
            return true;
        }
        let cut = budget::cut(text, room, self.sentence_end);
        let head = text.get(..cut.end).unwrap_or_default().trim_end();
        out.push_str(sep);
        out.push_str(head);
        if cut.at_sentence && (joined || !head.is_empty()) {
            out.push(' ');
        }
        out.push('…');
        self.truncated = true;
        self.room = Some(0);
        false
    }
}
