//! Output adaptation for surfaces: rewrites an LLM reply (Markdown-ish text) into what a surface can
//! show or say, streamed delta by delta or whole, deterministically. Pure: no IO.
//!
//! The stored reply is never touched; each surface receives its own rendering. The same reply split
//! into deltas any way gives the same output as [`adapt`] on the whole text, because the adapter works
//! line by line: it holds a line until its newline arrives (a possible table header one line longer)
//! and [`Adapter::finish`] flushes the last partial line.
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
//! - **Budget**: tokens of emitted text are counted with [`estimate_tokens`]. The line that would
//!   overflow is cut at the end of its last sentence that fits (or at its start, when what was
//!   already emitted ends a sentence), else after its last whole word that fits, and "…" is appended
//!   (" …" after a sentence); the rest of the reply is dropped and [`Adapter::truncated`] turns true.
//!   What was already streamed cannot be taken back, so sentence ends are only sought in that line.
//!   Cuts fall on char boundaries.
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
