//! Conformance cases of federation storage (L6): the identity written once, trusted peers, the
//! replay cache of federation tokens (once, across restarts and under contention), announcement
//! seqs, a tracker's registry (the seq rule, the per-gateway quota, expiry) and the retention
//! sweep of expired rows.

use std::future::Future;
use std::sync::Arc;

use sbp_store::{
    PeerRecord, PeerSource, PutRecord, RegistryRecordRow, Store, Sweep, Swept, VouchRow,
};
use serde_json::json;
use tokio::task::JoinSet;

use super::t;

fn peer(gateway_id: &str, source: PeerSource) -> PeerRecord {
    PeerRecord {
        gateway_id: gateway_id.to_owned(),
        url: format!("https://{gateway_id}.example:8443/base"),
        public_key: format!("MCowBQYDK2VwAyEA{gateway_id}"),
        key_id: format!("kid-{gateway_id}"),
        old_keys: json!([]),
        source,
        verified_at: t(10),
        updated_at: t(11),
    }
}

/// A record of `gateway` for `cid`, live until `expires` (seconds of [`t`]); its signed JSON
/// holds the seq, so two seqs never share bytes.
fn record(gateway: &str, cid: &str, seq: u64, expires: i64) -> RegistryRecordRow {
    RegistryRecordRow {
        gateway_id: gateway.to_owned(),
        bundle_cid: cid.to_owned(),
        bundle_url: format!("https://{gateway}.example/v1/sbp/bundles/{cid}"),
        seq,
        issued_at: t(0),
        expires_at: t(expires),
        // Key order and spacing as a peer might send them: stored and served verbatim.
        record: format!(
            r#"{{"seq": {seq}, "gateway_id":"{gateway}", "bundle_cid":"{cid}", "signature":"c2ln"}}"#
        ),
    }
}

fn cid(n: u32) -> String {
    format!("{n:0>64x}")
}

pub async fn federation_identity_is_set_once(store: Arc<dyn Store>) {
    assert_eq!(store.identity().await.expect("identity"), None);
    let first = store
        .init_identity("gw-first", "kid-first", t(1))
        .await
        .expect("init");
    assert_eq!(
        (first.gateway_id.as_str(), first.first_key_id.as_str()),
        ("gw-first", "kid-first")
    );
    assert_eq!(first.created_at, t(1));
    let again = store
        .init_identity("gw-other", "kid-other", t(2))
        .await
        .expect("second init");
    assert_eq!(again, first, "a second call changes nothing");
    assert_eq!(store.identity().await.expect("identity"), Some(first));
}

/// Replicas starting at once with different first keys: one identity wins and every replica is
/// told the same one.
pub async fn federation_identity_races_to_one(store: Arc<dyn Store>) {
    let mut tasks = JoinSet::new();
    for i in 0..8 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            store
                .init_identity(&format!("gw-{i}"), &format!("kid-{i}"), t(i))
                .await
                .expect("init")
        });
    }
    let told: Vec<_> = tasks.join_all().await;
    let stored = store.identity().await.expect("identity").expect("stored");
    assert!(
        told.iter().all(|id| *id == stored),
        "{told:?} vs {stored:?}"
    );
    assert_eq!(
        stored.gateway_id.strip_prefix("gw-"),
        stored.first_key_id.strip_prefix("kid-"),
        "one call's values, not a mix"
    );
}

pub async fn federation_peers_upsert_and_read(store: Arc<dyn Store>) {
    assert!(store.peers().await.expect("peers").is_empty());
    assert_eq!(store.peer("gw-b").await.expect("peer"), None);
    let b = peer("gw-b", PeerSource::Tofu);
    let a = peer("gw-a", PeerSource::Pin);
    store.upsert_peer(b.clone()).await.expect("upsert b");
    store.upsert_peer(a.clone()).await.expect("upsert a");
    assert_eq!(store.peer("gw-b").await.expect("peer"), Some(b.clone()));
    assert_eq!(store.peers().await.expect("peers"), vec![a.clone(), b]);

    // A key rotation followed: every field is replaced.
    let rotated = PeerRecord {
        url: "https://gw-b.example/".to_owned(),
        public_key: "MCowBQYDK2VwAyEAnew".to_owned(),
        key_id: "kid-new".to_owned(),
        old_keys: json!([{ "key_id": "kid-gw-b", "public_key": "old", "expires_at": "2025-03-11T00:00:00Z" }]),
        source: PeerSource::Tracker,
        verified_at: t(100),
        updated_at: t(101),
        ..peer("gw-b", PeerSource::Tofu)
    };
    store.upsert_peer(rotated.clone()).await.expect("rotate");
    assert_eq!(
        store.peer("gw-b").await.expect("peer"),
        Some(rotated.clone())
    );
    assert_eq!(store.peers().await.expect("peers"), vec![a, rotated]);
}

pub async fn federation_jti_is_accepted_once(store: Arc<dyn Store>) {
    assert!(
        store
            .insert_jti("gw-a", "jti-1", t(360))
            .await
            .expect("first")
    );
    assert!(
        !store
            .insert_jti("gw-a", "jti-1", t(360))
            .await
            .expect("replay"),
        "a replay is refused"
    );
    assert!(
        !store
            .insert_jti("gw-a", "jti-1", t(9999))
            .await
            .expect("replay"),
        "also with another expiry"
    );
    assert!(
        store
            .insert_jti("gw-b", "jti-1", t(360))
            .await
            .expect("other issuer"),
        "a jti is scoped to its issuer"
    );
    assert!(
        store
            .insert_jti("gw-a", "jti-2", t(360))
            .await
            .expect("other jti")
    );

    // Replicas verifying one token at once: exactly one accepts it.
    let mut tasks = JoinSet::new();
    for _ in 0..16 {
        let store = Arc::clone(&store);
        tasks.spawn(async move { store.insert_jti("gw-c", "jti-race", t(360)).await });
    }
    let accepted = tasks
        .join_all()
        .await
        .into_iter()
        .map(|r| r.expect("insert"))
        .filter(|fresh| *fresh)
        .count();
    assert_eq!(accepted, 1);
}

pub async fn federation_announcement_seq_grows(store: Arc<dyn Store>) {
    let a = cid(0xa);
    let next = |now_ms: u64, expires: i64, now: i64| {
        let (store, a) = (Arc::clone(&store), a.clone());
        async move {
            store
                .next_announcement(&a, now_ms, t(expires), t(now))
                .await
                .expect("announce")
        }
    };
    assert_eq!(next(1_000, 100, 1).await, 1_000, "the first seq is now_ms");
    assert_eq!(
        next(1_000, 200, 2).await,
        1_001,
        "same millisecond: last + 1"
    );
    assert_eq!(
        next(500, 300, 3).await,
        1_002,
        "the clock went back: still grows"
    );
    assert_eq!(next(5_000, 400, 4).await, 5_000, "the clock moved on");
    let b = cid(0xb);
    assert_eq!(
        store
            .next_announcement(&b, 7, t(50), t(5))
            .await
            .expect("other cid"),
        7,
        "each bundle has its own seq"
    );
    let due = store
        .announcements_expiring_before(t(1_000))
        .await
        .expect("due");
    assert_eq!(due.len(), 2);
    assert_eq!(
        (due[0].bundle_cid.as_str(), due[0].seq, due[0].expires_at),
        (b.as_str(), 7, t(50)),
        "soonest first"
    );
    assert_eq!(
        (due[1].seq, due[1].expires_at, due[1].announced_at),
        (5_000, t(400), t(4)),
        "the last announcement's seq and expiry"
    );
    let soon = store
        .announcements_expiring_before(t(400))
        .await
        .expect("due");
    assert_eq!(soon.iter().map(|d| d.seq).collect::<Vec<_>>(), [7]);

    // Announces of one bundle at once, in one millisecond: each gets its own seq.
    let mut tasks = JoinSet::new();
    for _ in 0..12 {
        tasks.spawn(next(5_000, 500, 6));
    }
    let mut seqs = tasks.join_all().await;
    seqs.sort_unstable();
    assert_eq!(seqs, (5_001..5_013).collect::<Vec<_>>());
}

pub async fn registry_seq_rule(store: Arc<dyn Store>) {
    let c = cid(1);
    let put = |r: RegistryRecordRow| {
        let store = Arc::clone(&store);
        async move { store.put_record(r, 10, t(1)).await.expect("put") }
    };
    assert_eq!(put(record("gw-a", &c, 5, 3600)).await, PutRecord::Inserted);
    assert_eq!(
        put(record("gw-a", &c, 5, 3600)).await,
        PutRecord::Unchanged,
        "the same record again"
    );
    let mut other_bytes = record("gw-a", &c, 5, 3600);
    other_bytes.record.push(' ');
    assert_eq!(
        put(other_bytes).await,
        PutRecord::Stale,
        "the same seq with other bytes"
    );
    assert_eq!(put(record("gw-a", &c, 4, 7200)).await, PutRecord::Stale);
    let stored = store.records_for(&c, t(1), 10).await.expect("records");
    assert_eq!(stored, vec![record("gw-a", &c, 5, 3600)], "nothing changed");

    let newer = record("gw-a", &c, 6, 7200);
    assert_eq!(put(newer.clone()).await, PutRecord::Replaced);
    assert_eq!(
        store.records_for(&c, t(1), 10).await.expect("records"),
        vec![newer.clone()]
    );
    assert_eq!(put(record("gw-a", &c, 5, 3600)).await, PutRecord::Stale);
    assert_eq!(
        put(record("gw-b", &c, 1, 3600)).await,
        PutRecord::Inserted,
        "another gateway's record of the same CID"
    );
    assert_eq!(store.count_records("gw-a", t(1)).await.expect("count"), 1);

    // Once the record expired it is as good as absent: any seq is a new record.
    let later = |r: RegistryRecordRow| {
        let store = Arc::clone(&store);
        async move { store.put_record(r, 10, t(8000)).await.expect("put") }
    };
    assert_eq!(
        later(record("gw-a", &c, 2, 9000)).await,
        PutRecord::Inserted
    );
    assert_eq!(
        store.records_for(&c, t(8000), 10).await.expect("records"),
        vec![record("gw-a", &c, 2, 9000)]
    );
}

pub async fn registry_quota_per_gateway(store: Arc<dyn Store>) {
    let put = |r: RegistryRecordRow, now: i64| {
        let store = Arc::clone(&store);
        async move { store.put_record(r, 2, t(now)).await.expect("put") }
    };
    assert_eq!(
        put(record("gw-a", &cid(1), 1, 100), 0).await,
        PutRecord::Inserted
    );
    assert_eq!(
        put(record("gw-a", &cid(2), 1, 3600), 0).await,
        PutRecord::Inserted
    );
    assert_eq!(
        put(record("gw-a", &cid(3), 1, 3600), 0).await,
        PutRecord::QuotaExceeded,
        "a third CID"
    );
    assert_eq!(
        put(record("gw-a", &cid(2), 2, 3600), 0).await,
        PutRecord::Replaced,
        "replacing one of its records needs no room"
    );
    assert_eq!(
        put(record("gw-b", &cid(3), 1, 3600), 0).await,
        PutRecord::Inserted,
        "the quota is per gateway"
    );
    assert!(
        store
            .records_for(&cid(3), t(0), 10)
            .await
            .expect("records")
            .iter()
            .all(|r| r.gateway_id == "gw-b"),
        "the refused record was not stored"
    );
    // The first record expired at 100: it no longer counts.
    assert_eq!(store.count_records("gw-a", t(0)).await.expect("count"), 2);
    assert_eq!(store.count_records("gw-a", t(200)).await.expect("count"), 1);
    assert_eq!(
        put(record("gw-a", &cid(3), 1, 3600), 200).await,
        PutRecord::Inserted
    );
    assert_eq!(
        put(record("gw-a", &cid(1), 1, 3600), 200).await,
        PutRecord::QuotaExceeded,
        "its expired CID is a new record, and there is no room"
    );

    // Announces of new CIDs at once cannot overrun the quota.
    let mut tasks = JoinSet::new();
    for n in 10..20 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            store
                .put_record(record("gw-c", &cid(n), 1, 3600), 3, t(0))
                .await
                .expect("put")
        });
    }
    let outcomes = tasks.join_all().await;
    let inserted = outcomes
        .iter()
        .filter(|o| **o == PutRecord::Inserted)
        .count();
    assert_eq!(inserted, 3, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, PutRecord::Inserted | PutRecord::QuotaExceeded))
    );
    assert_eq!(store.count_records("gw-c", t(0)).await.expect("count"), 3);
}

pub async fn registry_records_for_orders_and_excludes_expired(store: Arc<dyn Store>) {
    let c = cid(7);
    for r in [
        record("gw-a", &c, 20, 3600),
        record("gw-b", &c, 30, 3600),
        record("gw-c", &c, 99, 100),
        record("gw-d", &c, 20, 3600),
        record("gw-e", &cid(8), 50, 3600),
    ] {
        assert_eq!(
            store.put_record(r, 10, t(0)).await.expect("put"),
            PutRecord::Inserted
        );
    }
    let found = store.records_for(&c, t(0), 10).await.expect("records");
    let order: Vec<(&str, u64)> = found
        .iter()
        .map(|r| (r.gateway_id.as_str(), r.seq))
        .collect();
    assert_eq!(
        order,
        [("gw-c", 99), ("gw-b", 30), ("gw-a", 20), ("gw-d", 20)],
        "newest seq first"
    );
    assert_eq!(
        found[0],
        record("gw-c", &c, 99, 100),
        "every field as stored"
    );
    let later = store.records_for(&c, t(100), 10).await.expect("records");
    assert_eq!(
        later
            .iter()
            .map(|r| r.gateway_id.as_str())
            .collect::<Vec<_>>(),
        ["gw-b", "gw-a", "gw-d"],
        "a record is not served from its expiry on"
    );
    let two = store.records_for(&c, t(100), 2).await.expect("records");
    assert_eq!(two.len(), 2);
    assert_eq!(two[0].seq, 30);
    assert!(
        store
            .records_for(&cid(9), t(0), 10)
            .await
            .expect("records")
            .is_empty()
    );
}

pub async fn registry_vouch_round_trip(store: Arc<dyn Store>) {
    assert_eq!(store.vouch("gw-a").await.expect("vouch"), None);
    let v = VouchRow {
        gateway_id: "gw-a".to_owned(),
        gateway_url: "https://gw-a.example".to_owned(),
        public_key: "MCowBQYDK2VwAyEAone".to_owned(),
        key_id: "kid-1".to_owned(),
        verified_at: t(5),
    };
    store.put_vouch(v.clone()).await.expect("put");
    assert_eq!(store.vouch("gw-a").await.expect("vouch"), Some(v.clone()));
    let rotated = VouchRow {
        public_key: "MCowBQYDK2VwAyEAtwo".to_owned(),
        key_id: "kid-2".to_owned(),
        verified_at: t(50),
        ..v
    };
    store.put_vouch(rotated.clone()).await.expect("replace");
    assert_eq!(store.vouch("gw-a").await.expect("vouch"), Some(rotated));
}

pub async fn federation_sweep_drops_expired(store: Arc<dyn Store>) {
    assert!(store.insert_jti("gw-a", "old", t(100)).await.expect("jti"));
    assert!(
        store
            .insert_jti("gw-a", "live", t(1000))
            .await
            .expect("jti")
    );
    for r in [
        record("gw-a", &cid(1), 1, 100),
        record("gw-a", &cid(2), 1, 1000),
    ] {
        store.put_record(r, 10, t(0)).await.expect("put");
    }
    store
        .next_announcement(&cid(1), 1, t(100), t(0))
        .await
        .expect("announce");
    store
        .next_announcement(&cid(2), 1, t(1000), t(0))
        .await
        .expect("announce");

    let none = Sweep {
        expired_before: Some(t(100)),
        ..Sweep::default()
    };
    assert_eq!(
        store.sweep(none).await.expect("sweep"),
        Swept::default(),
        "nothing expired before 100"
    );
    let swept = store
        .sweep(Sweep {
            expired_before: Some(t(500)),
            ..Sweep::default()
        })
        .await
        .expect("sweep");
    assert_eq!(
        swept,
        Swept {
            jti: 1,
            registry_records: 1,
            announcements: 1,
            ..Swept::default()
        }
    );
    assert!(
        !store
            .insert_jti("gw-a", "live", t(1000))
            .await
            .expect("jti"),
        "a live jti is kept and still refused"
    );
    assert!(
        store.insert_jti("gw-a", "old", t(2000)).await.expect("jti"),
        "a swept jti is gone (its token expired long ago)"
    );
    assert_eq!(store.count_records("gw-a", t(0)).await.expect("count"), 1);
    assert_eq!(
        store
            .records_for(&cid(2), t(0), 10)
            .await
            .expect("records")
            .len(),
        1
    );
    let left = store
        .announcements_expiring_before(t(10_000))
        .await
        .expect("announcements");
    assert_eq!(
        left.iter()
            .map(|a| a.bundle_cid.clone())
            .collect::<Vec<_>>(),
        [cid(2)]
    );
    assert_eq!(
        store.sweep(Sweep::default()).await.expect("sweep"),
        Swept::default(),
        "a sweep without cut-offs removes nothing"
    );
}

/// What [`write_federation`] wrote, to read back.
pub struct FederationWritten {
    pub peer: PeerRecord,
    pub record: RegistryRecordRow,
    pub vouch: VouchRow,
    pub seq: u64,
}

/// One row of every federation table, with `marker` in its free text.
pub async fn write_federation(store: &Arc<dyn Store>, marker: &str) -> FederationWritten {
    store
        .init_identity("gw-self", "kid-self", t(1))
        .await
        .expect("identity");
    let mut peer = peer("gw-peer", PeerSource::Pin);
    peer.url = format!("https://peer.example/{marker}");
    store.upsert_peer(peer.clone()).await.expect("peer");
    assert!(
        store
            .insert_jti("gw-peer", marker, t(3600))
            .await
            .expect("jti")
    );
    let seq = store
        .next_announcement(&cid(1), 1_000, t(3600), t(1))
        .await
        .expect("announce");
    let mut record = record("gw-peer", &cid(1), 1, 3600);
    record.record = format!(r#"{{"note":"{marker}",  "seq":1}}"#);
    assert_eq!(
        store
            .put_record(record.clone(), 10, t(1))
            .await
            .expect("put"),
        PutRecord::Inserted
    );
    let vouch = VouchRow {
        gateway_id: "gw-peer".to_owned(),
        gateway_url: format!("https://peer.example/{marker}"),
        public_key: "MCowBQYDK2VwAyEApeer".to_owned(),
        key_id: "kid-peer".to_owned(),
        verified_at: t(2),
    };
    store.put_vouch(vouch.clone()).await.expect("vouch");
    FederationWritten {
        peer,
        record,
        vouch,
        seq,
    }
}

/// Everything [`write_federation`] wrote reads back, and the once-only rules still hold.
pub async fn reads_federation(store: &Arc<dyn Store>, w: &FederationWritten, marker: &str) {
    let identity = store
        .init_identity("gw-new", "kid-new", t(50))
        .await
        .expect("identity");
    assert_eq!(
        (identity.gateway_id.as_str(), identity.first_key_id.as_str()),
        ("gw-self", "kid-self"),
        "the identity stays the first one"
    );
    assert_eq!(store.peers().await.expect("peers"), vec![w.peer.clone()]);
    assert!(
        !store
            .insert_jti("gw-peer", marker, t(3600))
            .await
            .expect("jti"),
        "a seen jti stays refused"
    );
    assert_eq!(
        store
            .put_record(w.record.clone(), 10, t(1))
            .await
            .expect("put"),
        PutRecord::Unchanged,
        "the record's bytes exactly as received"
    );
    assert_eq!(
        store.records_for(&cid(1), t(1), 10).await.expect("records"),
        vec![w.record.clone()]
    );
    assert_eq!(
        store.vouch("gw-peer").await.expect("vouch"),
        Some(w.vouch.clone())
    );
    let due = store
        .announcements_expiring_before(t(3601))
        .await
        .expect("announcements");
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].bundle_cid, cid(1));
    assert!(due[0].seq >= w.seq);
}

/// Federation state survives a restart (SQLite file reopened, PostgreSQL a new pool): the
/// identity is kept, a seen jti is still refused, announcement seqs go on growing.
pub async fn federation_survives_reopen<F, Fut>(store: Arc<dyn Store>, reopen: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Arc<dyn Store>>,
{
    let marker = "jti-before-restart";
    let written = write_federation(&store, marker).await;
    drop(store);
    let store = reopen().await;
    reads_federation(&store, &written, marker).await;
    let seq = store
        .next_announcement(&cid(1), 10, t(3600), t(60))
        .await
        .expect("announce");
    assert_eq!(
        seq,
        written.seq + 1,
        "the seq goes on from before the restart"
    );
}
