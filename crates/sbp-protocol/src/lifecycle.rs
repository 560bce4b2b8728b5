//! The session lifecycle of SPEC 7.1 and the snapshot kinds of 7.2.

use serde::{Deserialize, Serialize};

#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionStatus {
    Idle,
    Running,
    Suspended,
    Completed,
    Failed,
}

impl SessionStatus {
    pub const ALL: [SessionStatus; 5] = [
        Self::Idle,
        Self::Running,
        Self::Suspended,
        Self::Completed,
        Self::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Running => "running",
            Self::Suspended => "suspended",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed)
    }

    /// Whether `self -> to` is allowed. Staying in the same state is allowed (idempotent requests).
    /// Beyond SPEC 7.1's table, an idle session may be suspended, completed or failed by its owner, and a
    /// suspended one completed: none of these skips work the protocol requires.
    pub fn can_transition(self, to: SessionStatus) -> bool {
        use SessionStatus::*;
        if self == to {
            return true;
        }
        match self {
            Idle => true,
            Running => matches!(to, Suspended | Completed | Failed),
            Suspended => matches!(to, Running | Completed | Failed),
            Completed | Failed => false,
        }
    }
}

impl std::fmt::Display for SessionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    PreAction,
    PostAction,
    Checkpoint,
}

impl SnapshotKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PreAction => "pre_action",
            Self::PostAction => "post_action",
            Self::Checkpoint => "checkpoint",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::PreAction, Self::PostAction, Self::Checkpoint]
            .into_iter()
            .find(|k| k.as_str() == s)
    }
}

#[cfg(test)]
mod tests {
    use super::SessionStatus::{self, *};

    #[test]
    fn spec_transitions_are_allowed() {
        for (from, to) in [
            (Idle, Running),
            (Running, Suspended),
            (Suspended, Running),
            (Running, Completed),
            (Running, Failed),
            (Suspended, Failed),
        ] {
            assert!(from.can_transition(to), "{from} -> {to}");
        }
    }

    #[test]
    fn terminal_states_are_final() {
        for from in [Completed, Failed] {
            for to in SessionStatus::ALL {
                assert_eq!(from.can_transition(to), from == to, "{from} -> {to}");
            }
        }
        assert!(!Running.can_transition(Idle));
        assert!(!Suspended.can_transition(Idle));
    }

    #[test]
    fn names_round_trip() {
        for st in SessionStatus::ALL {
            assert_eq!(SessionStatus::parse(st.as_str()), Some(st));
            assert_eq!(
                serde_json::to_value(st).ok(),
                Some(serde_json::json!(st.as_str()))
            );
        }
        assert_eq!(SessionStatus::parse("paused"), None);
    }
}
