//! How the demo prints: numbered step headings, one-line explanations, facts seen on the wire,
//! quoted text as a surface received it, and replies streamed as their chunks arrive. The words
//! are the same with and without colour, so a pipe (and the tests) read what a terminal shows.

use std::io::{IsTerminal as _, Write as _};

#[derive(Debug, Clone, Copy)]
pub enum Style {
    Heading,
    Dim,
    Agent,
    User,
    Tool,
    Good,
    Bad,
}

impl Style {
    fn code(self) -> &'static str {
        match self {
            Self::Heading => "\x1b[1;34m",
            Self::Dim => "\x1b[2m",
            Self::Agent => "\x1b[36m",
            Self::User => "\x1b[1m",
            Self::Tool => "\x1b[35m",
            Self::Good => "\x1b[32m",
            Self::Bad => "\x1b[31m",
        }
    }
}

/// `--color`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColorChoice {
    /// Colour when stdout is a terminal and `NO_COLOR` is unset or empty.
    #[default]
    Auto,
    Always,
    Never,
}

impl ColorChoice {
    pub fn enabled(self) -> bool {
        match self {
            Self::Always => true,
            Self::Never => false,
            Self::Auto => {
                std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
                    && std::io::stdout().is_terminal()
            }
        }
    }
}

/// Indent of everything under a heading.
const BODY: &str = "  ";
/// Indent of quoted text, with its bar.
const QUOTE: &str = "    │ ";

/// stdout, with colour or without.
pub struct Out {
    colour: bool,
    /// A streamed reply is being printed on the current line.
    streaming: bool,
    /// Indent of a streamed reply's continuation lines (the width of its `who › ` prefix).
    stream_pad: String,
}

impl Out {
    pub fn new(colour: bool) -> Self {
        Self {
            colour,
            streaming: false,
            stream_pad: String::new(),
        }
    }

    pub fn paint(&self, style: Style, text: &str) -> String {
        if self.colour && !text.is_empty() {
            format!("{}{text}\x1b[0m", style.code())
        } else {
            text.to_owned()
        }
    }

    /// Writes and flushes. A closed stdout (`sbp demo | head`) is no reason to fail the demo.
    fn write(&mut self, text: &str) {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    }

    fn end_stream(&mut self) {
        if self.streaming {
            self.streaming = false;
            self.write("\n");
        }
    }

    pub fn line(&mut self, text: &str) {
        self.end_stream();
        self.write(&format!("{text}\n"));
    }

    pub fn blank(&mut self) {
        self.line("");
    }

    pub fn title(&mut self, text: &str) {
        let painted = self.paint(Style::Heading, text);
        self.line(&painted);
    }

    /// `[n/total] title`, after a blank line.
    pub fn heading(&mut self, n: usize, total: usize, title: &str) {
        self.blank();
        let painted = self.paint(Style::Heading, &format!("[{n}/{total}] {title}"));
        self.line(&painted);
    }

    pub fn explain(&mut self, text: &str) {
        let painted = self.paint(Style::Dim, text);
        self.line(&format!("{BODY}{painted}"));
    }

    /// A fact seen on the wire.
    pub fn fact(&mut self, text: &str) {
        self.line(&format!("{BODY}· {text}"));
    }

    pub fn good(&mut self, text: &str) {
        let painted = self.paint(Style::Good, &format!("✓ {text}"));
        self.line(&format!("{BODY}{painted}"));
    }

    pub fn bad(&mut self, text: &str) {
        let painted = self.paint(Style::Bad, &format!("✗ {text}"));
        self.line(&format!("{BODY}{painted}"));
    }

    pub fn tool(&mut self, text: &str) {
        let painted = self.paint(Style::Tool, text);
        self.line(&format!("{BODY}· {painted}"));
    }

    /// `who › text`, one line per line of `text`.
    pub fn said(&mut self, who: &str, style: Style, text: &str) {
        let prefix = format!("{BODY}{who} › ");
        let pad = " ".repeat(prefix.chars().count());
        for (i, line) in text.lines().enumerate() {
            let lead = if i == 0 { &prefix } else { &pad };
            let painted = self.paint(style, line);
            self.line(&format!("{lead}{painted}"));
        }
    }

    /// Text as a surface received it, each line behind a bar (so blank lines show too).
    pub fn quote(&mut self, style: Style, text: &str) {
        for line in text.split('\n') {
            let painted = self.paint(style, line);
            self.line(&format!("{QUOTE}{painted}"));
        }
    }

    /// Starts a reply that streams in: `who › ` and then each delta as it comes.
    pub fn stream_start(&mut self, who: &str) {
        self.end_stream();
        let prefix = format!("{BODY}{who} › ");
        self.stream_pad = " ".repeat(prefix.chars().count());
        self.write(&prefix);
        self.streaming = true;
    }

    pub fn stream(&mut self, delta: &str) {
        if !self.streaming {
            return;
        }
        // Continuation lines line up under the reply rather than at the margin.
        let text = delta.replace('\n', &format!("\n{}", self.stream_pad));
        let painted = self.paint(Style::Agent, &text);
        self.write(&painted);
    }

    pub fn stream_end(&mut self) {
        self.end_stream();
    }
}
