//! Timestamps as the wire writes them: RFC 3339 with milliseconds, UTC (every response and frame),
//! and Unix seconds (token claims) in that form.

use chrono::{DateTime, SecondsFormat, Utc};

/// `2024-01-02T03:04:05.678Z`.
pub fn iso(ts: &DateTime<Utc>) -> String {
    ts.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A Unix time (a token claim) in the form of [`iso`]; `None` when out of range.
pub fn unix_iso(secs: i64) -> Option<String> {
    DateTime::<Utc>::from_timestamp(secs, 0).map(|t| iso(&t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millisecond_utc() {
        assert_eq!(
            unix_iso(1_700_000_000).as_deref(),
            Some("2023-11-14T22:13:20.000Z")
        );
        assert_eq!(unix_iso(i64::MAX), None);
    }
}
