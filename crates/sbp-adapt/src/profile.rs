//! The rendering profile of a surface, derived from its SurfaceContext by a few fixed rules, and the
//! matching one-sentence hint for the model's system prompt.

use sbp_protocol::SurfaceContext;

use crate::budget::units_for;

/// What a surface can render. Build it with [`Profile::for_surface`]; the fields are public so callers
/// and tests can state a profile directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// Markdown is rendered; when false, output is plain text.
    pub markdown: bool,
    /// GFM tables are rendered (only meaningful with `markdown`).
    pub tables: bool,
    /// Audio-friendly prose: sentences only, no lists, code or URLs. Always plain text.
    pub prose: bool,
    /// Most tokens (by [`crate::estimate_tokens`]) the surface wants; None = no limit.
    pub budget_tokens: Option<u32>,
}

/// Budget for "iot" surfaces that declare none: a few short sentences.
pub const IOT_DEFAULT_BUDGET_TOKENS: u32 = 60;

impl Profile {
    /// Derives the rendering profile of a surface (rules in the crate documentation).
    pub fn for_surface(ctx: &SurfaceContext) -> Profile {
        let class = ctx.adaptation_class();
        let voice = class == "voice";
        let (markdown, tables, prose) = if ctx.ui_capabilities.is_empty() {
            match class {
                "mobile" => (true, false, false),
                "iot" => (false, false, false),
                "voice" => (false, false, true),
                _ => (true, true, false),
            }
        } else {
            let markdown = ctx.has_capability("markdown");
            (
                markdown,
                markdown && ctx.has_capability("tables"),
                ctx.has_capability("audio") || voice,
            )
        };
        let budget_tokens = ctx
            .max_output_tokens
            .filter(|&n| n > 0)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
            .or((class == "iot").then_some(IOT_DEFAULT_BUDGET_TOKENS));
        Profile {
            // Spoken output cannot show Markdown, so prose wins.
            markdown: markdown && !prose,
            tables: tables && !prose,
            prose,
            budget_tokens,
        }
    }

    /// The profile that changes nothing.
    pub fn passthrough() -> Profile {
        Profile {
            markdown: true,
            tables: true,
            prose: false,
            budget_tokens: None,
        }
    }

    /// True when output goes out untouched (no adaptation needed): the fast path.
    pub fn is_passthrough(&self) -> bool {
        self.markdown && self.tables && !self.prose && self.budget_tokens.is_none()
    }

    /// One short English sentence describing the surface's constraints, for an LLM system prompt
    /// (e.g. "The user is reading on a small-screen device: answer in at most 22 words, plain text,
    /// no Markdown."), or None for passthrough; followed by "Reply in the language of locale fr-FR."
    /// when the surface gave a locale that looks like a language tag (anything else is left out: the
    /// string comes from the client and must not be able to write into the prompt).
    pub fn instructions(&self, ctx: &SurfaceContext) -> Option<String> {
        if self.is_passthrough() {
            return None;
        }
        let who = if self.prose {
            if ctx.adaptation_class() == "voice" {
                "The user is listening through a voice assistant"
            } else {
                "The user is listening to the reply"
            }
        } else {
            match ctx.adaptation_class() {
                "mobile" => "The user is reading on a phone",
                "desktop" => "The user is reading on a desktop computer",
                "browser" => "The user is reading in a web browser",
                "iot" => "The user is reading on a small-screen device",
                _ => "The user's device has limited display",
            }
        };
        let style = if self.prose {
            Some("spoken-style sentences without lists, tables, code or links")
        } else if !self.markdown {
            Some("plain text, no Markdown")
        } else if !self.tables {
            Some("Markdown without tables")
        } else {
            None
        };
        let limit = self.budget_tokens.map(|b| match units_for(b) {
            0 | 1 => "at most 1 word".to_owned(),
            words => format!("at most {words} words"),
        });
        let how = match (limit, style) {
            (Some(limit), Some(style)) => format!("{limit}, {style}"),
            (Some(limit), None) => limit,
            (None, Some(style)) => style.to_owned(),
            // Not reached: a profile with neither is passthrough.
            (None, None) => return None,
        };
        let mut sentence = format!("{who}: answer in {how}.");
        if let Some(locale) = ctx.locale.as_deref().filter(|l| is_language_tag(l)) {
            sentence.push_str(&format!(" Reply in the language of locale {locale}."));
        }
        Some(sentence)
    }
}

/// A BCP 47-looking tag ("fr-FR", "zh_Hant_TW", "es-419"): letters first, then letters, digits, `-`, `_`.
fn is_language_tag(s: &str) -> bool {
    s.len() <= 35
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphabetic())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
