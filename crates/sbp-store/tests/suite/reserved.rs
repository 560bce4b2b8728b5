//! Values in the reserved `sbp:` family (a prompt that reads `sbp:enc:v1:hello`) round-trip on
//! every backend, with or without a key: they are escaped on write, never taken for sealed data.

use std::sync::Arc;

use sbp_protocol::SessionStatus;
use sbp_store::Store;

use super::{begin, created, finish, msg, session, tether_entry};

/// The values a user can choose that land in sealed columns: the prompt (a message body and the
/// session's last task) and a reply streamed to the tether.
const RESERVED: [&str; 3] = ["sbp:enc:v1:hello", "sbp:enc:v1:AAAAAAAA", "sbp:raw:x"];

pub async fn reserved_prefix_values_round_trip(store: Arc<dyn Store>) {
    let s = created(&store, "agent").await;
    store
        .mark_attached(s.id, super::t(5))
        .await
        .expect("tether on");
    for (i, text) in RESERVED.iter().enumerate() {
        let mut b = begin(s.id, vec![msg("user", text)]);
        b.last_task = Some((*text).to_owned());
        b.status = Some(SessionStatus::Running);
        let turn = b.turn_id;
        store
            .begin_turn(b)
            .await
            .expect("begin commits and reads back");
        assert_eq!(
            session(&store, s.id).await.last_task.as_deref(),
            Some(*text)
        );
        let mut f = finish(s.id, Some(turn));
        f.messages = vec![msg("assistant", text)];
        f.tether = Some(tether_entry(text));
        store.finish_turn(f).await.expect("finish");
        let pending = store.tether_pending(s.id, None, 10).await.expect("pending");
        assert_eq!(pending.len(), i + 1);
        assert_eq!(pending[i].content.as_deref(), Some(*text));
    }
    let history = store.history(s.id).await.expect("history");
    let texts: Vec<&str> = history
        .iter()
        .filter_map(|m| m.body.get("content").and_then(|c| c.as_str()))
        .collect();
    assert_eq!(texts.len(), 2 * RESERVED.len());
    for (pair, text) in texts.chunks(2).zip(RESERVED) {
        assert_eq!(pair, [text, text]);
    }
}
