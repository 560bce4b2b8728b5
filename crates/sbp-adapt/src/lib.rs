//! Output adaptation for surfaces: rewrites an LLM reply (Markdown-ish text) into what a surface can
//! show or say, streamed delta by delta or whole, deterministically. Pure: no IO.
//!
//! The stored reply is never touched; each surface receives its own rendering. The same reply split
//! into deltas any way gives the same output as [`adapt`] on the whole text, because what is emitted
//! when depends only on the text received so far, never on where deltas were cut:
//!
//! - Passthrough emits each delta as it comes.
//! - Paragraph text streams within its line. A line outside code blocks and tables (no table in
//!   progress, no `|` line waiting to be told a header) is paragraph text once its first word shows it
//!   is not a heading, list item or fence and, for a line of `-`, `*`, `_` or `=`, not a rule either
//!   (another character has come); quoted paragraphs count. Such a line goes out in pieces, each
//!   ending at a *break*: a whitespace run after a visible character, followed by a visible character
//!   that has arrived, where no inline construct is open: no unmatched emphasis opener (`*`, `_`,
//!   `~~`), backtick run, `[` or link `(`. A piece is exactly what the whole line's adaptation holds
//!   up to that break, never ends in whitespace, and the first one has visible text that does not
//!   start like a heading. With a budget, and in prose, breaks count only after a sentence end (the
//!   piece's last word ends in `.`, `!`, `?`, `…`, `。`, `！` or `？`, closing quotes or brackets
//!   allowed). When tables are rewritten, a line whose first `|` comes no later than the character
//!   after its first break waits for its newline (it may be a table header); a `|` after that is
//!   text.
//! - Every other line (heading, list item, rule, fence, code, table row or possible table header) is
//!   held until its newline arrives (a possible table header one line longer), and so is the rest of
//!   a streaming line after its last break. [`Adapter::finish`] flushes the last partial line.
//!
//! A line that has waited more than 1 KiB is re-scanned only each time it doubles, so a huge line
//! stays linear; this may delay a piece, never change it.
//!
//! # Profile rules ([`Profile::for_surface`])
//!
//! - When `ui_capabilities` is non-empty it is authoritative: `markdown` = it contains "markdown";
//!   `tables` = it contains "tables" and "markdown"; `prose` = it contains "audio" or the device is
//!   "voice".
//! - When it is empty, per device: desktop, browser, unknown and any unrecognised string → Markdown
//!   and tables; mobile → Markdown without tables; iot → plain text; voice → prose.
//! - Prose is spoken, so it is always plain: `prose` forces `markdown` and `tables` off.
//! - Budget: `max_output_tokens` when given (and non-zero); otherwise 60 tokens for iot, none else.
//! - Passthrough (output = input, byte for byte) = Markdown and tables, no prose, no budget. An
//!   unknown device that declares nothing is passthrough.
//!
//! # Adaptation rules
//!
//! - **Tables** (any profile without tables): a GFM table (header row, `|---|` separator, rows)
//!   becomes one line per data row, "Header1: v1, Header2: v2" (empty cells skipped); header and
//!   separator lines are not emitted. A `|` line not followed by a separator stays text.
//! - **No Markdown** (plain text): headings lose their `#`s; `**b**`, `__b__`, `*i*`, `_i_`,
//!   `~~s~~` and code spans become their text (CommonMark flanking rules, so `snake_case` stays, and a
//!   single `*` between letters or digits, `2*3*4`, is never emphasis); a leftover run of two or more
//!   `*` is dropped, an unmatched backtick run too; `[text](url)` → "text (url)"; `![alt](url)` →
//!   "alt"; `<https://…>` → the URL; backslash escapes → the character; fence lines are dropped and
//!   code lines kept verbatim; `> ` quote markers and horizontal rules (and setext `===`) are dropped;
//!   `-`/`*`/`+` bullets → "• " (indentation kept); numbered items kept; HTML left alone; runs of
//!   blank lines collapse to one.
//! - **Prose** (voice, "audio"): each heading, list item (bullet or numbered, marker removed) and table
//!   row becomes a sentence ending in `.`, `!` or `?` (a trailing `:`/`;`/`,` becomes `.`); each
//!   code block becomes one "(code omitted)." sentence; links → their text; bare and `<…>` URLs →
//!   "(link)"; emphasis stripped; quote markers and rules dropped; everything is joined with single
//!   spaces (no newlines, no blank lines).
//! - **Budget**: tokens of emitted text are counted with [`estimate_tokens`], per line or per
//!   streamed piece. The line (or piece) that would overflow is cut at the end of its last sentence
//!   that fits (or at its start, when what was already emitted ends a sentence), else after its last
//!   whole word that fits, and "…" is appended (" …" after a sentence of the same line); the rest of
//!   the reply is dropped and [`Adapter::truncated`] turns true. Since pieces end at sentence ends,
//!   this is the cut the whole line would get. What was already streamed cannot be taken back, so
//!   sentence ends are only sought in that line. Cuts fall on char boundaries.
//!
//! Fences are recognised at any indentation (models indent them inside list items); indented code
//! blocks are not recognised. Nothing here panics, whatever the input.

mod adapter;
mod block;
mod budget;
mod inline;
mod profile;

pub use adapter::Adapter;
pub use budget::estimate_tokens;
pub use profile::{IOT_DEFAULT_BUDGET_TOKENS, Profile};

/// Whole-text adaptation; always equal to `push(text) + finish()` on a fresh [`Adapter`].
pub fn adapt(profile: &Profile, text: &str) -> String {
    let mut adapter = Adapter::new(*profile);
    let mut out = adapter.push(text);
    out.push_str(&adapter.finish());
    out
}
