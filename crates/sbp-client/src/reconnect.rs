//! When and how often a surface reconnects: exponential backoff with jitter, and the close codes
//! after which reconnecting would be wrong (forbidden, not found, displaced, protocol error).

use std::time::Duration;

use sbp_protocol::frames::{CLOSE_FORBIDDEN, CLOSE_NOT_FOUND, CLOSE_PROTOCOL_ERROR};

pub use sbp_protocol::frames::CLOSE_DISPLACED;

/// RFC 6455 1013, "try again later": with federation, the gateway could not bring the session
/// over from the gateway holding it just now (a turn running there, a handover racing this one,
/// a peer unreachable). Never terminal: the next attempt follows the move.
pub const CLOSE_TRY_AGAIN: u16 = 1013;

/// Exponential backoff: attempt `n` (from 1) waits `initial * multiplier^(n-1)`, at most `max`,
/// minus a random share of up to `jitter` (0 to 1) of it, so surfaces dropped together by one
/// gateway restart do not all come back in the same instant.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(30),
            multiplier: 2.0,
            jitter: 0.3,
        }
    }
}

impl Backoff {
    /// The delay before attempt `attempt` (1-based) without jitter.
    pub fn base_delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(64) as i32;
        let factor = self.multiplier.max(1.0).powi(exp);
        let secs = (self.initial.as_secs_f64() * factor).min(self.max.as_secs_f64());
        Duration::try_from_secs_f64(secs).unwrap_or(self.max)
    }

    /// The delay before attempt `attempt`, with `unit` (a random number in [0, 1)) choosing the jitter.
    pub fn delay_with(&self, attempt: u32, unit: f64) -> Duration {
        let base = self.base_delay(attempt);
        let share = self.jitter.clamp(0.0, 1.0) * unit.clamp(0.0, 1.0);
        base.mul_f64(1.0 - share)
    }

    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        self.delay_with(attempt, rand::random::<f64>())
    }
}

/// Whether and how a [`Surface`](crate::Surface) reconnects after its connection drops.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconnectPolicy {
    /// `false`: the first drop ends the surface.
    pub enabled: bool,
    pub backoff: Backoff,
    /// Give up after this many failed attempts in a row (`None`: never).
    pub max_attempts: Option<u32>,
    /// Close codes after which the surface does not reconnect. Default: 1003 (protocol error),
    /// 4003 (forbidden), 4004 (session not found), 4409 (displaced by another surface).
    pub terminal_codes: Vec<u16>,
    /// A connection that stayed up this long starts the next backoff from `initial` again; one
    /// that dropped sooner continues the sequence, so a gateway that accepts and drops at once is
    /// not hammered.
    pub reset_after: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            backoff: Backoff::default(),
            max_attempts: None,
            terminal_codes: vec![
                CLOSE_PROTOCOL_ERROR,
                CLOSE_FORBIDDEN,
                CLOSE_NOT_FOUND,
                CLOSE_DISPLACED,
            ],
            reset_after: Duration::from_secs(5),
        }
    }
}

impl ReconnectPolicy {
    /// Never reconnect.
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    pub(crate) fn is_terminal(&self, code: Option<u16>) -> bool {
        code.is_some_and(|c| self.terminal_codes.contains(&c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
            multiplier: 2.0,
            jitter: 0.5,
        };
        let ms = |d: Duration| d.as_millis();
        let cases = [
            (0, 100),
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (500, 1000),
        ];
        for (attempt, want) in cases {
            assert_eq!(ms(b.base_delay(attempt)), want, "attempt {attempt}");
            assert_eq!(ms(b.delay_with(attempt, 0.0)), want, "no jitter drawn");
            assert_eq!(
                ms(b.delay_with(attempt, 1.0)),
                want / 2,
                "full jitter share"
            );
        }
        for _ in 0..100 {
            let d = b.delay(3);
            assert!(
                d >= Duration::from_millis(200) && d <= Duration::from_millis(400),
                "{d:?}"
            );
        }
    }

    #[test]
    fn odd_settings_stay_sane() {
        let b = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
            multiplier: 0.5,
            jitter: 7.0,
        };
        assert_eq!(b.base_delay(9), Duration::from_millis(10), "never shrinks");
        assert_eq!(
            b.delay_with(1, 1.0),
            Duration::ZERO,
            "jitter is capped at 100%"
        );
        let huge = Backoff {
            multiplier: 1e300,
            ..b
        };
        assert_eq!(huge.base_delay(40), Duration::from_millis(50));
    }

    #[test]
    fn terminal_codes() {
        let p = ReconnectPolicy::default();
        for (code, terminal) in [
            (Some(4003), true),
            (Some(4004), true),
            (Some(4409), true),
            (Some(1003), true),
            (Some(1001), false),
            (Some(1000), false),
            (Some(CLOSE_TRY_AGAIN), false),
            (None, false),
        ] {
            assert_eq!(p.is_terminal(code), terminal, "{code:?}");
        }
    }
}
