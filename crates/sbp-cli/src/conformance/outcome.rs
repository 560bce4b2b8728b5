//! What one check concludes: passed (maybe with a note), failed, differed from a SHOULD (warned),
//! skipped, or not observable from outside, with a one-line reason; and how strongly the seeds
//! or the spec require what it verifies.

use std::fmt;

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    /// The gateway behaves differently from a SHOULD / RECOMMENDED (or from this gateway's own
    /// design): worth knowing, never a failure.
    Warn,
    Skip,
    /// A MUST that no client can observe (durability across a restart of the gateway's process):
    /// listed so the report does not imply it was covered; it does not block a verdict.
    Manual,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Fail => "FAIL",
            Self::Warn => "WARN",
            Self::Skip => "SKIP",
            Self::Manual => "MANUAL",
        }
    }

    pub fn json(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail => "fail",
            Self::Warn => "warn",
            Self::Skip => "skip",
            Self::Manual => "not_observable",
        }
    }
}

/// How strongly what a check verifies is required (RFC 2119 words, as the seeds and SPEC use them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requirement {
    /// A MUST of the seeds (or a REQUIRED endpoint): a difference is a failure.
    Must,
    /// A SHOULD or RECOMMENDED of the seeds or SPEC: a difference is a warning.
    Should,
    /// Neither seeds nor SPEC require it (this gateway's own design): a difference is a note.
    Optional,
}

impl Requirement {
    pub fn label(self) -> &'static str {
        match self {
            Self::Must => "MUST",
            Self::Should => "SHOULD",
            Self::Optional => "MAY",
        }
    }

    pub fn json(self) -> &'static str {
        match self {
            Self::Must => "must",
            Self::Should => "should",
            Self::Optional => "may",
        }
    }

    /// What a check of this strength reports instead of `status`: only a MUST fails.
    pub fn soften(self, status: Status) -> Status {
        match (self, status) {
            (Self::Must, s) => s,
            (_, Status::Fail) => Status::Warn,
            (_, s) => s,
        }
    }
}

/// A passing check, with what it could not verify or what it observed worth reporting.
#[derive(Debug, Default)]
pub struct Passed {
    pub note: Option<String>,
}

/// Why a check did not pass: a failure (expected vs got) or a reason it could not apply.
#[derive(Debug)]
pub struct Problem {
    pub status: Status,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

pub type Outcome = Result<Passed, Problem>;

pub fn pass() -> Outcome {
    Ok(Passed::default())
}

pub fn pass_with(note: impl Into<String>) -> Outcome {
    Ok(Passed {
        note: Some(note.into()),
    })
}

pub fn fail(reason: impl Into<String>) -> Problem {
    Problem {
        status: Status::Fail,
        reason: reason.into(),
    }
}

pub fn skip(reason: impl Into<String>) -> Problem {
    Problem {
        status: Status::Skip,
        reason: reason.into(),
    }
}

/// A MUST no client can observe (see [`Status::Manual`]).
pub fn not_observable(reason: impl Into<String>) -> Problem {
    Problem {
        status: Status::Manual,
        reason: reason.into(),
    }
}

/// `Err(fail(reason))` unless `cond`; the reason is built only when needed.
pub fn ensure(cond: bool, reason: impl FnOnce() -> String) -> Result<(), Problem> {
    if cond { Ok(()) } else { Err(fail(reason())) }
}

/// `text` cut to `max` characters, on one line, for reasons that quote a response.
pub fn short(text: &str, max: usize) -> String {
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    match one_line.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &one_line[..i]),
        None => one_line,
    }
}
