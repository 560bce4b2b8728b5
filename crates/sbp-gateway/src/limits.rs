//! The configured bounds on what a caller may send and on how large a session's transcript may
//! grow, and the checks that hold them, in one place: the transport checks a body's shape before
//! parsing it, the engine checks a session's room before anything is stored.

use serde_json::Value;
use uuid::Uuid;

use crate::error::{Error, SizeLimit};

/// Bounds on inputs and transcripts (`--max-request-messages`, ... in `sbp serve`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Messages one completion request may carry.
    pub max_request_messages: usize,
    /// Bytes of one message as JSON (as sent in a request, as stored for a push or an import).
    pub max_message_bytes: usize,
    /// Messages a session's transcript may hold before its turns are refused.
    pub max_session_messages: u64,
    /// Bytes of a session's transcript (its messages as stored JSON) before its turns are refused.
    pub max_session_bytes: u64,
    /// Nesting of objects and arrays in a request body.
    pub max_json_depth: usize,
    /// Objects in one request body: parsed, each costs hundreds of bytes whatever its size in
    /// the body, so this, not the body size, bounds the memory a body can take.
    pub max_json_objects: usize,
    /// Values in one request body (objects, arrays, strings with keys, numbers, literals): each
    /// costs at least 32 bytes parsed, as little as 2 in the body.
    pub max_json_values: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_request_messages: 10_000,
            max_message_bytes: 4 << 20,
            max_session_messages: 100_000,
            max_session_bytes: 32 << 20,
            max_json_depth: 64,
            max_json_objects: 32_768,
            max_json_values: 262_144,
        }
    }
}

/// The largest count a session may carry (`step_count`, a snapshot's counts), whatever it is
/// imported from: 2^53, exactly representable as a JSON number everywhere (JavaScript included),
/// and far enough below the stores' `i64` that adding to it never overflows.
pub const MAX_STORED_COUNT: u64 = 1 << 53;

impl Limits {
    /// Refuses the shape of a request body (nesting, objects) before it is parsed.
    pub fn check_shape(&self, body: &[u8]) -> Result<(), Error> {
        use sbp_protocol::json_shape::{ShapeError, ShapeLimits, scan};
        let max = ShapeLimits {
            depth: self.max_json_depth,
            objects: self.max_json_objects,
            values: self.max_json_values,
        };
        scan(body, max).map(drop).map_err(|e| match e {
            ShapeError::TooDeep { max } => Error::over_limit(
                SizeLimit::JsonDepth,
                max,
                format!("the request body is nested deeper than {max} levels (max_json_depth)"),
            ),
            ShapeError::TooManyObjects { max } => Error::over_limit(
                SizeLimit::JsonObjects,
                max,
                format!("the request body holds more than {max} JSON objects (max_json_objects)"),
            ),
            ShapeError::TooManyValues { max } => Error::over_limit(
                SizeLimit::JsonValues,
                max,
                format!("the request body holds more than {max} JSON values (max_json_values)"),
            ),
        })
    }

    /// Refuses a request with more messages than allowed.
    pub fn check_request_messages(&self, count: usize) -> Result<(), Error> {
        if count > self.max_request_messages {
            return Err(Error::over_limit(
                SizeLimit::RequestMessages,
                self.max_request_messages,
                format!(
                    "the request carries {count} messages; at most {} are accepted \
                     (max_request_messages)",
                    self.max_request_messages
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a message of more than `max_message_bytes` (`what` names it: `messages[3]`).
    pub fn check_message_bytes(&self, what: &str, bytes: usize) -> Result<(), Error> {
        if bytes > self.max_message_bytes {
            return Err(Error::over_limit(
                SizeLimit::MessageBytes,
                self.max_message_bytes,
                format!(
                    "{what} is {bytes} bytes of JSON; at most {} are accepted (max_message_bytes)",
                    self.max_message_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Refuses adding `add` to session `id`, which holds `have`, past the transcript limits.
    pub fn check_room(&self, id: Uuid, have: Size, add: Size) -> Result<(), Error> {
        let full = |limit: SizeLimit, max: u64, what: &str, now: u64| Error::SessionFull {
            session_id: id,
            limit,
            max,
            message: format!(
                "session {id} is full: it holds {now} {what} and takes at most {max} ({}); fork \
                 it with POST /v1/sbp/sessions/{id}/fork {{\"keep_last\": N}} to continue with \
                 its last N messages in a new session",
                limit.name()
            ),
        };
        if have.messages.saturating_add(add.messages) > self.max_session_messages {
            return Err(full(
                SizeLimit::SessionMessages,
                self.max_session_messages,
                "messages",
                have.messages,
            ));
        }
        if have.bytes.saturating_add(add.bytes) > self.max_session_bytes {
            return Err(full(
                SizeLimit::SessionBytes,
                self.max_session_bytes,
                "bytes of messages",
                have.bytes,
            ));
        }
        Ok(())
    }
}

/// The size of a transcript or of messages to add to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Size {
    pub messages: u64,
    /// Their bodies as stored JSON text.
    pub bytes: u64,
}

impl Size {
    /// The size of `bodies` as a store keeps them (compact JSON text, as `message_bytes` counts).
    pub fn of<'a>(bodies: impl IntoIterator<Item = &'a Value>) -> Self {
        bodies.into_iter().fold(Self::default(), |s, b| Self {
            messages: s.messages + 1,
            bytes: s.bytes + stored_bytes(b),
        })
    }

    /// The size of bodies already serialised as stored.
    pub fn of_text<'a>(bodies: impl IntoIterator<Item = &'a str>) -> Self {
        bodies.into_iter().fold(Self::default(), |s, b| Self {
            messages: s.messages + 1,
            bytes: s.bytes + b.len() as u64,
        })
    }
}

/// The length of `body` as compact JSON text, counted without building the text.
pub fn stored_bytes(body: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` to a sink that never fails cannot fail.
    let _ = serde_json::to_writer(&mut count, body);
    count.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stored_bytes_is_the_compact_text() {
        let v = json!({"role": "user", "content": "héllo 東京", "n": [1, 2.5, null]});
        let text = serde_json::to_string(&v).expect("encodes");
        assert_eq!(stored_bytes(&v), text.len() as u64);
    }

    #[test]
    fn room_is_refused_past_either_limit() {
        let limits = Limits {
            max_session_messages: 10,
            max_session_bytes: 100,
            ..Limits::default()
        };
        let id = Uuid::nil();
        let size = |messages, bytes| Size { messages, bytes };
        assert!(limits.check_room(id, size(9, 90), size(1, 10)).is_ok());
        for (have, add, limit) in [
            (size(10, 0), size(1, 1), SizeLimit::SessionMessages),
            (size(0, 95), size(1, 6), SizeLimit::SessionBytes),
            (size(u64::MAX, 0), size(1, 0), SizeLimit::SessionMessages),
        ] {
            match limits.check_room(id, have, add) {
                Err(Error::SessionFull { limit: l, .. }) => assert_eq!(l, limit),
                other => panic!("expected SessionFull, got {other:?}"),
            }
        }
    }
}
