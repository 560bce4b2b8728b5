//! The results: a plain table (coloured only on a terminal without NO_COLOR) or JSON, and the
//! summary line with its verdict. A verdict of conformance needs a full run (no `--only`) with no
//! failure and no skipped MUST check; warnings (SHOULD differences) and MUSTs no client can
//! observe do not block it, but are counted.

use std::io::IsTerminal as _;
use std::time::Duration;

use serde_json::{Value, json};

use super::outcome::{Requirement, Status};

/// One row: a check or a vector file.
#[derive(Debug)]
pub struct Row {
    pub level: &'static str,
    pub id: String,
    pub title: String,
    pub requirement: Requirement,
    pub status: Status,
    pub duration: Duration,
    /// Why it failed or was skipped, or a note on a pass.
    pub reason: Option<String>,
}

pub struct Summary {
    pub passed: usize,
    pub failed: usize,
    pub warned: usize,
    pub skipped: usize,
    /// Skipped rows of MUST checks: each leaves a requirement unverified.
    pub skipped_must: usize,
    pub manual: usize,
    pub elapsed: Duration,
    /// `Some(level)` when the run may certify that level: every check of it was selected.
    pub full_run_at: Option<&'static str>,
}

impl Summary {
    /// Conformant at the level run: a full run, nothing failed, no MUST left unverified.
    pub fn certified(&self) -> Option<&'static str> {
        self.full_run_at
            .filter(|_| self.failed == 0 && self.skipped_must == 0)
    }

    pub fn verdict(&self) -> String {
        if self.failed > 0 {
            return "NOT conformant".to_owned();
        }
        if let Some(level) = self.certified() {
            return format!("conformant at {level}");
        }
        let why = if self.full_run_at.is_none() {
            "not every check of the level was selected".to_owned()
        } else {
            format!("{} MUST check(s) skipped", self.skipped_must)
        };
        format!("partial run — not certified ({why})")
    }
}

/// `full_run_at`: the level when the whole level was run (no `--only`), else `None`.
pub fn summarize(rows: &[Row], elapsed: Duration, full_run_at: Option<&'static str>) -> Summary {
    let count = |s| rows.iter().filter(|r| r.status == s).count();
    Summary {
        passed: count(Status::Pass),
        failed: count(Status::Fail),
        warned: count(Status::Warn),
        skipped: count(Status::Skip),
        skipped_must: rows
            .iter()
            .filter(|r| r.status == Status::Skip && r.requirement == Requirement::Must)
            .count(),
        manual: count(Status::Manual),
        elapsed,
        full_run_at,
    }
}

/// Whether to colour stdout: a terminal, and `NO_COLOR` unset or empty (no-color.org).
pub fn use_colour() -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stdout().is_terminal()
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.0} ms")
    }
}

/// The table: `LEVEL CHECK RESULT REQ TIME DETAIL`, one line per row, then the summary line.
pub fn table(rows: &[Row], summary: &Summary, target: &str, colour: bool) -> String {
    let id_width = rows.iter().map(|r| r.id.len()).max().unwrap_or(5).max(5);
    let paint = |status: Status| {
        let label = status.label();
        if !colour {
            return label.to_owned();
        }
        let code = match status {
            Status::Pass => "32",
            Status::Fail => "31",
            Status::Warn | Status::Skip => "33",
            Status::Manual => "36",
        };
        format!("\x1b[{code}m{label}\x1b[0m")
    };
    let mut out = format!(
        "{:<5}  {:<id_width$}  {:<6}  {:<6}  {:>9}  DETAIL\n",
        "LEVEL", "CHECK", "RESULT", "REQ", "TIME"
    );
    for r in rows {
        // One line per row, whatever a gateway put in the text quoted by a reason.
        let detail: String = r
            .reason
            .as_deref()
            .unwrap_or("")
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        // The label is padded before colouring, so escape codes do not break the columns.
        let pad = " ".repeat(6usize.saturating_sub(r.status.label().len()));
        out.push_str(
            format!(
                "{:<5}  {:<id_width$}  {}{pad}  {:<6}  {:>9}  {detail}",
                r.level,
                r.id,
                paint(r.status),
                r.requirement.label(),
                ms(r.duration),
            )
            .trim_end(),
        );
        out.push('\n');
    }
    out.push_str(&summary_line(summary, target));
    out.push('\n');
    out
}

pub fn summary_line(s: &Summary, target: &str) -> String {
    format!(
        "{} passed, {} failed, {} skipped, {} warned, {} not observable in {:.1} s against {target}: {}",
        s.passed,
        s.failed,
        s.skipped,
        s.warned,
        s.manual,
        s.elapsed.as_secs_f64(),
        s.verdict()
    )
}

pub fn json(rows: &[Row], summary: &Summary, target: &str, level: &str) -> Value {
    json!({
        "url": target,
        "level": level,
        "checks": rows.iter().map(|r| json!({
            "level": r.level,
            "id": r.id,
            "title": r.title,
            "requirement": r.requirement.json(),
            "status": r.status.json(),
            "duration_ms": (r.duration.as_secs_f64() * 1000.0 * 10.0).round() / 10.0,
            "reason": r.reason,
        })).collect::<Vec<_>>(),
        "summary": {
            "passed": summary.passed,
            "failed": summary.failed,
            "skipped": summary.skipped,
            "skipped_must": summary.skipped_must,
            "warned": summary.warned,
            "not_observable": summary.manual,
            "duration_ms": summary.elapsed.as_millis() as u64,
            "certified_level": summary.certified(),
            "verdict": summary.verdict(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(requirement: Requirement, status: Status) -> Row {
        Row {
            level: "L1",
            id: "x".into(),
            title: String::new(),
            requirement,
            status,
            duration: Duration::ZERO,
            reason: None,
        }
    }

    #[test]
    fn a_full_clean_run_is_conformant_and_manual_rows_do_not_block() {
        let rows = [
            row(Requirement::Must, Status::Pass),
            row(Requirement::Should, Status::Warn),
            row(Requirement::Should, Status::Skip),
            row(Requirement::Must, Status::Manual),
        ];
        let s = summarize(&rows, Duration::ZERO, Some("L2"));
        assert_eq!(s.verdict(), "conformant at L2");
    }

    #[test]
    fn a_partial_or_skipping_or_failing_run_is_not() {
        let pass = [row(Requirement::Must, Status::Pass)];
        let s = summarize(&pass, Duration::ZERO, None);
        assert!(s.verdict().starts_with("partial run — not certified"));
        let skipped = [row(Requirement::Must, Status::Skip)];
        let s = summarize(&skipped, Duration::ZERO, Some("L5"));
        assert_eq!(
            s.verdict(),
            "partial run — not certified (1 MUST check(s) skipped)"
        );
        let failed = [row(Requirement::Must, Status::Fail)];
        let s = summarize(&failed, Duration::ZERO, Some("L5"));
        assert_eq!(s.verdict(), "NOT conformant");
        assert!(summary_line(&s, "http://x").starts_with("0 passed, 1 failed, 0 skipped"));
    }
}
