//! The REST wire: the request and response bodies of every HTTP endpoint a gateway serves (but
//! `/v1/chat/completions`), typed once for the gateway that sends them and the clients that read
//! them.
//!
//! **Responses** are `Serialize + Deserialize`. What a gateway sends, read back, serialises to the
//! same JSON (values, nulls, and absent versus null). Clients read any SBP gateway's answers, so
//! parsing is lenient: only the fields a client cannot do without are required, every other one is
//! `#[serde(default)]` (on the struct, where none is required), and unknown fields are kept in
//! `extra`.
//!
//! Some values are sent under two names, for the clients of the spec, the HTTP API docs and the
//! reference server at once (the rule: accept every name on input, send a superset on output).
//! serde's `alias` would refuse a body holding both names ("duplicate field"), so the second name is
//! a field of its own, documented as the same value, and each such type has a `with_aliases` that
//! fills the second names from the first: what a gateway calls on what it sends.
//!
//! **Requests** serialise as clients send them: unset optional fields are left out. A gateway
//! accepts more than these types describe (other names, `null` for absent, bounded lengths with
//! its own error messages), so the gateway parses most request bodies with its own lenient
//! parsers; these types give the canonical shape.

mod roaming;
mod sessions;
mod tools;

pub use roaming::{
    Export, ExportImport, ExportInfo, ExportList, ExportRequest, ForkInfo, ForkLink, ForkOrigin,
    ForkRequest, HANDOFF_COMPLETED, HandoffInfo, HandoffRequest, ImportInfo, ImportLink,
    ImportRequest, ImportedFrom, IncomingHandoff, Lineage, Memory, MemoryPut, OutgoingHandoff,
    Provenance,
};
pub use sessions::{
    Delivery, Health, MessagePage, MessagesQuery, NewSession, PushTurn, PushedTurn, SessionCreated,
    SessionDeleted, SessionInfo, SessionList, SessionSummary, SessionsQuery, SetStatus, Snapshot,
    SnapshotInfo, SnapshotList, StatusChanged, StoredMessage, TetherLoaded,
};
pub use tools::{ToolCallOutcome, ToolCallRequest, ToolCallStatus};

use serde::{Deserialize, Deserializer};

/// For a field whose absence and `null` differ: absent is `None` (through `#[serde(default)]`),
/// anything present, `null` included, is `Some` (`Some(Value::Null)`, or `Some(None)` for an
/// `Option`). Paired with `skip_serializing_if = "Option::is_none"`, it writes back what it read.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[cfg(test)]
pub(crate) mod test_support {
    use serde::Serialize;
    use serde::de::DeserializeOwned;
    use serde_json::Value;

    /// `body` read as a `T` and written back: it must come out unchanged.
    pub fn round_trips<T: Serialize + DeserializeOwned>(body: &Value) {
        let typed: T = serde_json::from_value(body.clone())
            .unwrap_or_else(|e| panic!("{e}: {body} does not parse"));
        let back = serde_json::to_value(&typed).expect("serialises");
        assert_eq!(&back, body, "{} changed", std::any::type_name::<T>());
    }

    /// A body holding only the required fields parses (a foreign gateway's minimal answer).
    pub fn parses<T: DeserializeOwned>(body: &Value) -> T {
        serde_json::from_value(body.clone())
            .unwrap_or_else(|e| panic!("{e}: minimal {body} does not parse"))
    }

    /// After `with_aliases`, each pair of names carries the same value.
    pub fn has_aliases<T: Serialize>(sent: &T, pairs: &[(&str, &str)]) {
        let v = serde_json::to_value(sent).expect("serialises");
        for (name, alias) in pairs {
            assert!(
                v.get(name).is_some() && v.get(alias).is_some(),
                "{name}/{alias}: {v}"
            );
            assert_eq!(v[name], v[alias], "{name} != {alias}: {v}");
        }
    }
}
