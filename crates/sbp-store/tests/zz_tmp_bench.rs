//! Temporary throughput probe (deleted after use).
use chrono::Utc;
use sbp_store::sqlite::{SqliteOptions, SqliteStore};
use sbp_store::*;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench() {
    let dir = tempfile::tempdir().expect("d");
    let store = Arc::new(
        SqliteStore::open(SqliteOptions::new(dir.path().join("b.db")))
            .await
            .expect("o"),
    );
    let sessions = 200;
    let mut ids = vec![];
    for i in 0..sessions {
        let id = Uuid::new_v4();
        store
            .create_session(NewSession {
                id,
                agent_id: "a".into(),
                token_hash: format!("{i}"),
                created_at: Utc::now(),
                metadata: json!({}),
            })
            .await
            .expect("c");
        ids.push(id);
    }
    let per = 100;
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for (n, id) in ids.iter().copied().enumerate() {
        let store = store.clone();
        set.spawn(async move {
            for k in 0..per {
                let turn = Uuid::new_v4();
                let m = NewMessage {
                    role: "user".into(),
                    body: json!({"role":"user","content":"hello there"}),
                    model_used: None,
                    cost_usd: None,
                    created_at: Utc::now(),
                };
                store
                    .begin_turn(BeginTurn {
                        session_id: id,
                        turn_id: turn,
                        create: None,
                        new_messages: vec![m.clone()],
                        status: None,
                        last_task: None,
                        model: None,
                        pre_action: None,
                        idempotency: Some(NewIdempotency {
                            key: format!("{n}-{k}"),
                            fingerprint: "f".into(),
                            created_session: false,
                        }),
                        retry_key: None,
                        now: Utc::now(),
                    })
                    .await
                    .expect("b");
                store
                    .finish_turn(FinishTurn {
                        session_id: id,
                        turn_id: Some(turn),
                        messages: vec![m],
                        count_step: true,
                        post_action: None,
                        checkpoint: None,
                        tether: None,
                        idempotency_done: Some((format!("{n}-{k}"), 200, json!({"x":1}))),
                        now: Utc::now(),
                    })
                    .await
                    .expect("f");
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.expect("t");
    }
    let el = start.elapsed();
    println!(
        "{} turns in {:?} = {:.0} turns/s",
        sessions * per,
        el,
        (sessions * per) as f64 / el.as_secs_f64()
    );
}
