//! The token estimate behind output budgets, and where to cut a line that does not fit.
//!
//! The estimate counts "units" (roughly words) so that it is additive over lines: the adapter keeps a
//! running total instead of re-reading what it already emitted, and the whole-text estimate of its
//! output is exactly the sum it kept.

/// A word of ordinary text counts one unit per this many characters (rounded up), so a huge run without
/// spaces (a URL, base64, a hash) cannot slip past a budget as "one word".
const CHARS_PER_UNIT: u64 = 10;

/// Rough token estimate used for budgets.
///
/// The rule: a *word* is a maximal run of non-whitespace characters, except that every CJK character
/// (Han, kana, Hangul, full-width forms) is a word of its own, since those scripts do not put spaces
/// between words. A word counts one unit per started 10 characters (so nearly every English word is one
/// unit), and `tokens = ceil(units × 4 / 3)`: a token is about 3/4 of a word. A budget of `b` tokens
/// therefore holds `floor(3b / 4)` ordinary words (30 tokens → 22 words).
pub fn estimate_tokens(text: &str) -> u32 {
    let units = measure(text).units;
    u32::try_from(units.saturating_mul(4).div_ceil(3)).unwrap_or(u32::MAX)
}

/// How many units a budget of `tokens` holds: the largest `u` with `ceil(4u / 3) <= tokens`.
pub(crate) fn units_for(tokens: u32) -> u64 {
    u64::from(tokens) * 3 / 4
}

/// Units in `text`, and whether its last word ends a sentence.
pub(crate) struct Measure {
    pub units: u64,
    pub ends_sentence: bool,
}

pub(crate) fn measure(text: &str) -> Measure {
    let mut m = Measure {
        units: 0,
        ends_sentence: false,
    };
    for_each_word(text, |_, units, sentence| {
        m.units += units;
        m.ends_sentence = sentence;
        true
    });
    m
}

/// Whether the last word of `text` ends a sentence (as [`measure`] counts it).
pub(crate) fn ends_sentence(text: &str) -> bool {
    let last = text.trim_end();
    // Only the last word matters: measuring it alone keeps repeated checks linear.
    let word = last.rsplit(char::is_whitespace).next().unwrap_or_default();
    measure(word).ends_sentence
}

/// Where to cut a line that does not fit: `text[..end]` is kept.
pub(crate) struct Cut {
    pub end: usize,
    /// The cut is at the end of a sentence (rather than merely between words).
    pub at_sentence: bool,
}

/// Cuts `text` to `room` units: at the end of the last whole sentence that fits, else after the last
/// whole word that fits. `start_is_sentence` says the text emitted before `text` ended a sentence,
/// which makes the very start of `text` a sentence boundary too.
pub(crate) fn cut(text: &str, room: u64, start_is_sentence: bool) -> Cut {
    let mut used = 0u64;
    let mut word_end = 0;
    let mut sentence_end = start_is_sentence.then_some(0);
    for_each_word(text, |end, units, sentence| {
        if used + units > room {
            return false;
        }
        used += units;
        word_end = end;
        if sentence {
            sentence_end = Some(end);
        }
        true
    });
    match sentence_end {
        Some(end) => Cut {
            end,
            at_sentence: true,
        },
        None => Cut {
            end: word_end,
            at_sentence: false,
        },
    }
}

/// Calls `f(end, units, ends_sentence)` for each word of `text` in order, where `end` is the byte
/// offset just past the word (always a char boundary); stops early when `f` returns false.
fn for_each_word(text: &str, mut f: impl FnMut(usize, u64, bool) -> bool) {
    let mut chars = 0u64;
    // The last character of the current word that is not a closing quote or bracket: "it ends." and
    // "(it ends.)" both end a sentence.
    let mut last: Option<char> = None;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() || is_cjk(c) {
            if chars > 0
                && !f(
                    i,
                    chars.div_ceil(CHARS_PER_UNIT),
                    last.is_some_and(is_terminal),
                )
            {
                return;
            }
            chars = 0;
            last = None;
            if !c.is_whitespace() && !f(i + c.len_utf8(), 1, is_terminal(c)) {
                return;
            }
        } else {
            chars += 1;
            if !is_closer(c) {
                last = Some(c);
            }
        }
    }
    if chars > 0 {
        f(
            text.len(),
            chars.div_ceil(CHARS_PER_UNIT),
            last.is_some_and(is_terminal),
        );
    }
}

/// Scripts written without spaces between words, where each character is counted as a word.
pub(crate) fn is_cjk(c: char) -> bool {
    matches!(
        u32::from(c),
        0x2E80..=0x9FFF | 0xAC00..=0xD7AF | 0xF900..=0xFAFF | 0xFF00..=0xFFEF | 0x20000..=0x3FFFF
    )
}

/// Characters that end a sentence.
pub(crate) fn is_terminal(c: char) -> bool {
    matches!(c, '.' | '!' | '?' | '…' | '。' | '！' | '？')
}

/// Closing quotes and brackets that may follow a sentence's final punctuation.
pub(crate) fn is_closer(c: char) -> bool {
    matches!(c, '"' | '\'' | ')' | ']' | '»' | '”' | '’' | '」' | '』')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates() {
        for (text, tokens) in [
            ("", 0),
            ("   \n\t ", 0),
            ("one", 2),
            ("one two three", 4),
            ("internationalization", 3),
            ("東京", 3),
            ("東京tower", 4),
            (&"word ".repeat(22), 30),
            (&"word ".repeat(23), 31),
        ] {
            assert_eq!(estimate_tokens(text), tokens, "{text:?}");
        }
        assert_eq!(units_for(30), 22);
        assert_eq!(units_for(60), 45);
        assert_eq!(units_for(0), 0);
    }

    #[test]
    fn cuts_prefer_sentences_then_words() {
        let text = "One two. Three four five";
        let c = cut(text, 4, false);
        assert_eq!((&text[..c.end], c.at_sentence), ("One two.", true));
        let c = cut("One two three", 2, false);
        assert_eq!(
            ("One two three".get(..c.end), c.at_sentence),
            (Some("One two"), false)
        );
        let c = cut("One two three", 2, true);
        assert_eq!((c.end, c.at_sentence), (0, true));
        let c = cut("(Done.) more", 1, false);
        assert_eq!((c.end, c.at_sentence), (7, true));
        let c = cut("日本語です。次", 6, false);
        assert_eq!(
            ("日本語です。次".get(..c.end), c.at_sentence),
            (Some("日本語です。"), true)
        );
    }
}
