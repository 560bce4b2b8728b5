//! What `sbp attach` prints: connection state, drained turns under a "while you were away" heading,
//! live replies as they stream, turn boundaries and tool calls. Colour only on a terminal (and not
//! with `NO_COLOR`); the text is the same either way, so piped output reads (and tests) the same.
//! On a terminal, replies are rendered from Markdown ([`super::markdown`]), a block at a time as
//! they stream; piped, they are the text as the model wrote it, streamed as it comes.

use std::io::{IsTerminal as _, Write};
use std::time::Duration;

use sbp_client::protocol::frames::{TetherTurn, TurnComplete};
use serde_json::Value;

use super::markdown;

/// Longest rendering of a tool's input or result on its status line.
const TOOL_TEXT_MAX: usize = 160;

#[derive(Debug, Clone, Copy)]
pub enum Style {
    Plain,
    Dim,
    Bold,
    Assistant,
    Good,
    Warn,
    Bad,
    Tool,
}

impl Style {
    fn code(self) -> &'static str {
        match self {
            Self::Plain => "",
            Self::Dim => "\x1b[2m",
            Self::Bold => "\x1b[1m",
            Self::Assistant => "\x1b[36m",
            Self::Good => "\x1b[32m",
            Self::Warn => "\x1b[33m",
            Self::Bad => "\x1b[31m",
            Self::Tool => "\x1b[35m",
        }
    }
}

/// Whether to colour stdout: a terminal, and `NO_COLOR` unset or empty (no-color.org).
pub fn use_colour() -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stdout().is_terminal()
}

/// The terminal, and where the cursor is in what it shows.
pub struct Term<W: Write> {
    out: W,
    colour: bool,
    /// The last byte written was not a newline.
    line_open: bool,
    /// Inside a reply body: the next character starts an indented continuation line.
    at_body_line_start: bool,
    /// The turn whose chunks are being printed, and whether something else was printed since its
    /// last chunk (then its next chunk gets the prefix again).
    streaming: Option<String>,
    interrupted: bool,
    /// The turn last cut off by a drop: it comes back whole as a TETHER_TURN with this chunk_id.
    cut: Option<String>,
    /// In a drain: its heading was printed and the closing rule is due.
    draining: bool,
    /// Tether turns still expected in this drain (SESSION_ATTACHED's count).
    drain_left: u64,
    /// Replies rendered from Markdown (a terminal) rather than written as they come.
    markdown: bool,
    /// With Markdown: the streaming turn's text not rendered yet, and whether any of its lines
    /// were written.
    stream: Option<markdown::Stream>,
    stream_shown: bool,
}

impl<W: Write> Term<W> {
    pub fn new(out: W, colour: bool) -> Self {
        Self {
            out,
            colour,
            line_open: false,
            at_body_line_start: false,
            streaming: None,
            interrupted: false,
            cut: None,
            draining: false,
            drain_left: 0,
            markdown: false,
            stream: None,
            stream_shown: false,
        }
    }

    /// Renders replies from Markdown (for a terminal).
    pub fn with_markdown(mut self, on: bool) -> Self {
        self.markdown = on;
        self
    }

    #[cfg(test)]
    pub fn into_inner(self) -> W {
        self.out
    }

    fn paint(&self, style: Style, text: &str) -> String {
        if self.colour && !matches!(style, Style::Plain) && !text.is_empty() {
            format!("{}{text}\x1b[0m", style.code())
        } else {
            text.to_owned()
        }
    }

    /// Writes and flushes. A terminal that went away (EPIPE) is not worth failing over here: the
    /// stdin side ends the program.
    fn write(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let _ = self.out.write_all(text.as_bytes());
        let _ = self.out.flush();
        self.line_open = !text.ends_with('\n');
    }

    /// Ends the line being written, if any.
    fn break_line(&mut self) {
        if self.line_open {
            self.write("\n");
        }
        if self.streaming.is_some() {
            self.interrupted = true;
        }
    }

    /// One whole line of `style`.
    pub fn line(&mut self, style: Style, text: &str) {
        self.break_line();
        let painted = self.paint(style, text);
        self.write(&format!("{painted}\n"));
    }

    /// A status line: `symbol text`, the symbol in `style`.
    pub fn status(&mut self, symbol: &str, style: Style, text: &str) {
        self.break_line();
        let painted = format!("{} {text}\n", self.paint(style, symbol));
        self.write(&painted);
    }

    /// A new connection: a drain of `queued` turns may follow.
    pub fn attached(&mut self, queued: u64) {
        self.close_drain();
        self.drain_left = queued;
    }

    /// A reply body, continuation lines indented under its prefix.
    fn body(&mut self, text: &str) {
        let mut buf = String::with_capacity(text.len() + 8);
        for ch in text.chars() {
            if self.at_body_line_start && ch != '\n' {
                buf.push_str("  ");
            }
            buf.push(ch);
            self.at_body_line_start = ch == '\n';
        }
        self.write(&buf);
    }

    /// A live TURN_CHUNK.
    pub fn chunk(&mut self, chunk_id: &str, delta: &str) {
        self.close_drain();
        if self.markdown {
            if self.streaming.as_deref() != Some(chunk_id) {
                self.end_stream();
                self.streaming = Some(chunk_id.to_owned());
                self.stream = Some(markdown::Stream::new(self.colour));
                self.stream_shown = false;
                self.interrupted = false;
            }
            let lines = self
                .stream
                .as_mut()
                .map(|s| s.push(delta))
                .unwrap_or_default();
            self.reply_lines(&lines);
            return;
        }
        let same = self.streaming.as_deref() == Some(chunk_id);
        if !same || self.interrupted {
            self.break_line();
            let prefix = self.paint(Style::Assistant, "assistant ›");
            self.write(&format!("{prefix} "));
            self.streaming = Some(chunk_id.to_owned());
            self.interrupted = false;
            self.at_body_line_start = false;
        }
        self.body(delta);
    }

    /// With Markdown: the lines of a streaming reply, the first (and the first after anything
    /// else was printed) after the reply's prefix, the others indented under it.
    fn reply_lines(&mut self, lines: &[String]) {
        for line in lines {
            if self.line_open {
                self.write("\n");
            }
            let resuming = !self.stream_shown || self.interrupted;
            if resuming && line.is_empty() {
                // A block's separator right after the prefix would only be a gap.
                continue;
            }
            if resuming {
                let prefix = self.paint(Style::Assistant, "assistant ›");
                self.write(&format!("{prefix} {line}\n"));
                self.stream_shown = true;
                self.interrupted = false;
            } else if line.is_empty() {
                self.write("\n");
            } else {
                self.write(&format!("  {line}\n"));
            }
        }
    }

    /// With Markdown: renders what is left of the streaming reply. Returns whether the reply
    /// showed any line at all.
    fn end_stream(&mut self) -> bool {
        let Some(mut stream) = self.stream.take() else {
            return false;
        };
        let lines = stream.finish();
        self.reply_lines(&lines);
        std::mem::take(&mut self.stream_shown)
    }

    /// TURN_COMPLETE: the end of a live turn.
    pub fn complete(&mut self, c: &TurnComplete) {
        self.close_drain();
        let shown = if self.streaming.as_deref() == Some(c.chunk_id.as_str()) {
            // Piped, the chunks were the text; with Markdown, whether any line came of them.
            !self.markdown || self.end_stream()
        } else {
            self.end_stream();
            false
        };
        if !shown {
            // A turn with no text (or whose chunks went to an earlier connection).
            self.break_line();
            let prefix = self.paint(Style::Assistant, "assistant ›");
            let none = self.paint(Style::Dim, "(no text)");
            self.write(&format!("{prefix} {none}"));
        }
        self.streaming = None;
        self.interrupted = false;
        self.break_line();
        let mut parts = vec!["turn complete".to_owned()];
        if let Some(m) = &c.model_used {
            parts.push(m.clone());
        }
        if let Some(seq) = c.seq {
            parts.push(format!("seq {seq}"));
        }
        self.line(Style::Dim, &format!("  ✓ {}", parts.join(" · ")));
    }

    /// The connection dropped: a reply being streamed is cut off (it comes back whole, tethered).
    pub fn cut_off(&mut self) {
        self.end_stream();
        if let Some(chunk_id) = self.streaming.take() {
            self.cut = Some(chunk_id);
            self.break_line();
            self.line(
                Style::Dim,
                "  … cut off (if the turn finishes, it comes back whole after the reconnect)",
            );
        }
        self.interrupted = false;
    }

    /// A drained TETHER_TURN, under the "while you were away" heading.
    pub fn tether_turn(&mut self, t: &TetherTurn) {
        if !self.draining {
            self.break_line();
            let heading = self.paint(Style::Bold, "── while you were away ──");
            self.write(&format!("{heading}\n"));
            self.draining = true;
        }
        let when = local_time(&t.created_at);
        let again = t.chunk_id.is_some() && t.chunk_id == self.cut;
        let when = if again {
            self.cut = None;
            format!("{when}, the reply cut off above, whole")
        } else {
            when
        };
        let head = self.paint(Style::Dim, &format!("[{when}]"));
        let role = self.paint(role_style(&t.role), &format!("{} ›", t.role));
        self.write(&format!("{head} {role} "));
        self.at_body_line_start = false;
        let rendered = match t.content.as_deref() {
            Some(text) if self.markdown => markdown::render(text, self.colour),
            _ => Vec::new(),
        };
        match t.content.as_deref() {
            Some(_) if !rendered.is_empty() => {
                for (i, line) in rendered.iter().enumerate() {
                    match i {
                        0 => self.write(&format!("{line}\n")),
                        _ if line.is_empty() => self.write("\n"),
                        _ => self.write(&format!("  {line}\n")),
                    }
                }
            }
            Some(text) if !text.is_empty() && !self.markdown => self.body(text),
            _ => {
                let none = self.paint(Style::Dim, "(no text)");
                self.write(&none);
            }
        }
        self.break_line();
        self.drain_left = self.drain_left.saturating_sub(1);
        if self.drain_left == 0 {
            self.close_drain();
        }
    }

    /// Ends a drain with a rule, once.
    fn close_drain(&mut self) {
        if self.draining {
            self.draining = false;
            self.line(Style::Bold, "── end of what you missed ──");
        }
    }

    /// A tool call has started.
    pub fn tool_called(&mut self, name: &str, input: &Value) {
        self.close_drain();
        let symbol = self.paint(Style::Tool, "⚙");
        let text = format!("{name}({})", short_json(input));
        self.break_line();
        self.write(&format!("{symbol} tool {text}\n"));
    }

    /// A tool call has finished.
    pub fn tool_finished(&mut self, name: &str, outcome: &Result<Value, String>, took: Duration) {
        let ms = took.as_millis();
        match outcome {
            Ok(v) => self.status(
                "⚙",
                Style::Tool,
                &format!("{name} → {} ({ms} ms)", short_json(v)),
            ),
            Err(e) => {
                let failed = self.paint(Style::Bad, "failed:");
                self.status("⚙", Style::Tool, &format!("{name} {failed} {e} ({ms} ms)"));
            }
        }
    }
}

fn role_style(role: &str) -> Style {
    match role {
        "assistant" => Style::Assistant,
        "user" => Style::Bold,
        _ => Style::Dim,
    }
}

/// An RFC 3339 time as local `YYYY-MM-DD HH:MM:SS`, or as given if it does not parse.
fn local_time(iso: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(iso)
        .map(|t| {
            t.with_timezone(&chrono::Local)
                .format("%Y-%m-%d %H:%M:%S")
                .to_string()
        })
        .unwrap_or_else(|_| iso.to_owned())
}

/// Compact JSON, cut to a status line's length.
fn short_json(v: &Value) -> String {
    let text = match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let text = text.replace('\n', " ");
    match text.char_indices().nth(TOOL_TEXT_MAX) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(term: Term<Vec<u8>>) -> String {
        String::from_utf8(term.into_inner()).expect("utf-8")
    }

    fn turn(seq: u64, content: &str) -> TetherTurn {
        serde_json::from_value(json!({
            "turn_index": seq - 1, "role": "assistant", "content": content,
            "model_used": null, "created_at": "2026-01-02T03:04:05Z", "seq": seq
        }))
        .expect("tether turn")
    }

    #[test]
    fn streams_a_reply_and_its_boundary() {
        let mut t = Term::new(Vec::new(), false);
        t.chunk("c1", "Hello ");
        t.chunk("c1", "world,\nsecond line");
        t.complete(&TurnComplete::new(
            "c1".into(),
            Some(4),
            Some("sbp/echo".into()),
        ));
        assert_eq!(
            text(t),
            "assistant › Hello world,\n  second line\n  ✓ turn complete · sbp/echo · seq 4\n"
        );
    }

    #[test]
    fn a_status_line_interrupting_a_stream_resumes_it_with_a_prefix() {
        let mut t = Term::new(Vec::new(), false);
        t.chunk("c1", "Let me check");
        t.tool_called("clock", &json!({}));
        t.tool_finished("clock", &Ok(json!({"t": 1})), Duration::from_millis(3));
        t.chunk("c1", "It is late.");
        t.cut_off();
        assert_eq!(
            text(t),
            "assistant › Let me check\n⚙ tool clock({})\n⚙ clock → {\"t\":1} (3 ms)\nassistant › It is late.\n  … cut off (if the turn finishes, it comes back whole after the reconnect)\n"
        );
    }

    #[test]
    fn a_reply_cut_off_is_named_when_it_comes_back_whole() {
        let mut t = Term::new(Vec::new(), false);
        t.chunk("c7", "Half a re");
        t.cut_off();
        t.attached(1);
        let mut whole = turn(3, "Half a reply.");
        whole.chunk_id = Some("c7".into());
        t.tether_turn(&whole);
        let out = text(t);
        assert!(
            out.contains("[2026-")
                && out.contains(", the reply cut off above, whole] assistant › Half a reply.\n"),
            "{out}"
        );
    }

    #[test]
    fn a_drain_has_one_heading_and_one_rule() {
        let mut t = Term::new(Vec::new(), false);
        t.attached(2);
        t.tether_turn(&turn(1, "first"));
        t.tether_turn(&turn(2, "second\nline"));
        t.chunk("c9", "live");
        let out = text(t);
        assert_eq!(out.matches("while you were away").count(), 1, "{out}");
        assert_eq!(out.matches("end of what you missed").count(), 1, "{out}");
        assert!(out.contains("assistant › first\n"), "{out}");
        assert!(out.contains("assistant › second\n  line\n"), "{out}");
        assert!(
            out.ends_with("── end of what you missed ──\nassistant › live"),
            "{out}"
        );
    }

    #[test]
    fn on_a_terminal_a_reply_is_rendered_a_block_at_a_time() {
        let mut t = Term::new(Vec::new(), false).with_markdown(true);
        t.chunk("c1", "Hello **wor");
        t.chunk("c1", "ld**\n\n- a\n");
        t.tool_called("clock", &json!({}));
        t.chunk("c1", "- b");
        t.complete(&TurnComplete::new("c1".into(), Some(2), None));
        t.complete(&TurnComplete::new("c2".into(), Some(3), None));
        assert_eq!(
            text(t),
            "assistant › Hello world\n⚙ tool clock({})\nassistant › • a\n  • b\n  ✓ turn complete · seq 2\n\
             assistant › (no text)\n  ✓ turn complete · seq 3\n"
        );
    }

    #[test]
    fn on_a_terminal_a_drained_turn_is_rendered_whole() {
        let mut t = Term::new(Vec::new(), false).with_markdown(true);
        t.attached(1);
        t.tether_turn(&turn(1, "# Gate\n\nNow **B12**."));
        let out = text(t);
        assert!(
            out.contains("assistant › Gate\n\n  Now B12.\n── end of what you missed ──\n"),
            "{out}"
        );
    }

    #[test]
    fn colour_only_when_asked() {
        let mut plain = Term::new(Vec::new(), false);
        plain.status("●", Style::Good, "connected");
        assert_eq!(text(plain), "● connected\n");
        let mut coloured = Term::new(Vec::new(), true);
        coloured.status("●", Style::Good, "connected");
        assert_eq!(text(coloured), "\x1b[32m●\x1b[0m connected\n");
    }

    #[test]
    fn long_tool_output_is_shortened() {
        let long = json!({"content": "x".repeat(1000)});
        let s = short_json(&long);
        assert!(s.chars().count() <= TOOL_TEXT_MAX + 1, "{s}");
        assert!(s.ends_with('…'));
    }
}
