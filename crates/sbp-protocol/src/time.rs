//! Timestamps as the wire writes them: RFC 3339 with milliseconds, UTC (every response and frame),
//! and Unix seconds (token claims) in that form.

use chrono::{DateTime, SecondsFormat, Utc};

/// `2024-01-02T03:04:05.678Z`.
pub fn iso(ts: &DateTime<Utc>) -> String {
    ts.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A timestamp another implementation wrote: RFC 3339, or an ISO 8601 date-time without an offset
/// (Python's naive `isoformat()`), read as UTC.
pub fn parse(s: &str) -> Option<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Some(t.with_timezone(&Utc));
    }
    chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f")
        .ok()
        .map(|t| t.and_utc())
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

    #[test]
    fn timestamps_of_other_implementations_parse() {
        let want = unix_iso(1_700_000_000);
        for s in [
            "2023-11-14T22:13:20Z",
            "2023-11-14T22:13:20.000+00:00",
            "2023-11-14T23:13:20+01:00",
            "2023-11-14T22:13:20",
            "2023-11-14T22:13:20.000000",
        ] {
            assert_eq!(parse(s).map(|t| iso(&t)), want, "{s}");
        }
        for s in [
            "",
            "yesterday",
            "2023-11-14",
            "2023-13-14T22:13:20Z",
            "1700000000",
        ] {
            assert_eq!(parse(s), None, "{s}");
        }
    }
}
