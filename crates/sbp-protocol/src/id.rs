//! The one spelling of an id on the wire: a UUID in lower-case hyphenated form
//! (`0192f0c4-8a6e-7c3b-9d2e-5f1a2b3c4d5e`), which is how the gateway writes every id it makes.
//! Other spellings the `uuid` crate would also read (upper case, braces, `urn:uuid:`, no hyphens)
//! are refused everywhere alike, so one session never has two names (in paths, frames, logs,
//! per-session limits).

use uuid::Uuid;

/// The UUID `raw` spells, if it is in the canonical form.
pub fn parse_canonical(raw: &str) -> Option<Uuid> {
    let canonical = raw.len() == 36
        && raw.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    canonical.then(|| Uuid::parse_str(raw).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_lower_case_hyphenated_form_is_read() {
        let id = Uuid::now_v7();
        let s = id.to_string();
        assert_eq!(parse_canonical(&s), Some(id));
        for alias in [
            s.to_uppercase(),
            format!("{{{s}}}"),
            format!("urn:uuid:{s}"),
            id.simple().to_string(),
            format!(" {s}"),
            format!("{s}\n"),
            s.replacen('-', "+", 1),
            String::new(),
        ] {
            assert_eq!(parse_canonical(&alias), None, "{alias}");
        }
    }
}
