//! Runs the storage conformance suite against every backend: SQLite (each case on a fresh database
//! file in its own temp dir) and PostgreSQL (each case in a fresh schema of the database named by
//! `SBP_TEST_DATABASE_URL`, dropped afterwards).

mod suite;

/// Every backend-agnostic case; `$runner` defines one test per case for its backend.
macro_rules! for_each_case {
    ($runner:ident) => {
        $runner!(
            create_get_find_by_token,
            duplicate_token_is_conflict,
            status_transitions,
            suspended_lookup_and_counts,
            mark_attached,
            begin_turn_with_create,
            begin_turn_is_atomic,
            finish_turn_counts_and_snapshots,
            progress_of_a_running_turn,
            checkpoints_every_n,
            tether_seq_never_reused,
            tether_only_if_enabled,
            tether_pending_order_after_limit,
            fail_turn_and_retry,
            recover_interrupted_turns,
            list_messages_pagination,
            concurrent_turns_across_sessions,
            concurrent_finish_one_session,
            concurrent_conflicts_are_isolated,
            export_and_bundle_round_trip,
            adopt_session_with_history,
            adopt_consumes_once_concurrently,
            adopt_is_all_or_nothing,
            adopt_suspends_source_and_forks,
            foreign_export_is_recorded_once,
            memory_put_get,
            adopt_long_history_in_order,
        );
    };
}

mod sqlite {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use sbp_store::sqlite::{SqliteOptions, SqliteStore, Synchronous};
    use sbp_store::{SessionStore, Store};
    use tempfile::TempDir;

    use crate::suite;

    fn db_path(dir: &Path) -> PathBuf {
        dir.join("sbp.sqlite3")
    }

    async fn open(path: PathBuf) -> Arc<dyn Store> {
        Arc::new(
            SqliteStore::open(SqliteOptions::new(path))
                .await
                .expect("open sqlite store"),
        )
    }

    async fn fresh() -> (TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(db_path(dir.path())).await;
        (dir, store)
    }

    macro_rules! sqlite_cases {
        ($($case:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (_dir, store) = fresh().await;
                suite::$case(store).await;
            }
        )*};
    }

    for_each_case!(sqlite_cases);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survives_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = db_path(dir.path());
        let store = open(path.clone()).await;
        suite::survives_reopen(store, || open(path.clone())).await;
    }

    /// Options are honoured: nested parent dirs are created, WAL is on and the schema version is
    /// recorded, and reopening an already migrated file works.
    #[tokio::test]
    async fn open_creates_dirs_and_migrates() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("a/b/c/store.db");
        let opts = SqliteOptions {
            path: path.clone(),
            synchronous: Synchronous::Normal,
            readers: 0,
        };
        let store = SqliteStore::open(opts.clone()).await.expect("open");
        assert!(
            store
                .count_sessions_by_status()
                .await
                .expect("read works with readers = 0")
                .len()
                == 5
        );
        drop(store);
        let store = SqliteStore::open(opts)
            .await
            .expect("reopen a migrated file");
        drop(store);

        let conn = rusqlite::Connection::open(&path).expect("inspect");
        let mode: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .expect("mode");
        assert_eq!(mode, "wal");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(version, 2);
    }
}

mod postgres {
    use std::future::Future;
    use std::sync::Arc;

    use sbp_protocol::SessionStatus;
    use sbp_store::postgres::{PostgresOptions, PostgresStore, SCHEMA_VERSION};
    use sbp_store::{
        BeginTurn, FinishTurn, NewMessage, NewSession, NewTetherEntry, SessionStore, Store,
        StoreError,
    };
    use serde_json::json;
    use tokio_postgres::NoTls;

    use crate::suite;

    /// What scripts/test.sh exports; used when the variable is unset, so a plain `cargo test`
    /// works on a machine where scripts/services.sh has started PostgreSQL.
    const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

    fn url() -> String {
        std::env::var("SBP_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
    }

    /// A fresh schema for one test, dropped by [`TestSchema::drop`].
    struct TestSchema {
        url: String,
        name: String,
    }

    /// A plain connection for the harness's own DDL. Fails the test (never skips it) when
    /// PostgreSQL cannot be reached.
    async fn admin(url: &str) -> tokio_postgres::Client {
        let connected = tokio_postgres::connect(url, NoTls).await;
        let (client, conn) = connected.unwrap_or_else(|e| {
            let cause = std::error::Error::source(&e).map(|c| format!(": {c}"));
            panic!(
                "PostgreSQL at {url} is not reachable ({e}{}). The PostgreSQL cases need it: \
                 run `bash scripts/services.sh` to start it, or set SBP_TEST_DATABASE_URL to a \
                 database this user may create schemas in.",
                cause.unwrap_or_default()
            )
        });
        tokio::spawn(async move {
            // Ends when the client is dropped; an error here shows up as a failed statement.
            let _ = conn.await;
        });
        client
    }

    impl TestSchema {
        async fn create() -> TestSchema {
            let url = url();
            let name = format!("sbp_test_{}", uuid::Uuid::new_v4().simple());
            admin(&url)
                .await
                .batch_execute(&format!("CREATE SCHEMA {name}"))
                .await
                .unwrap_or_else(|e| panic!("create schema {name} at {url}: {e}"));
            TestSchema { url, name }
        }

        fn options(&self) -> PostgresOptions {
            PostgresOptions {
                // Two cases run at once by default; leave room below max_connections = 100.
                max_connections: 16,
                schema: Some(self.name.clone()),
                ..PostgresOptions::default()
            }
        }

        async fn open(&self) -> Arc<dyn Store> {
            Arc::new(
                PostgresStore::open(&self.url, self.options())
                    .await
                    .expect("open postgres store"),
            )
        }

        /// Best effort: a schema left behind by a crash only costs space.
        async fn drop(self) {
            let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name);
            if let Err(e) = admin(&self.url).await.batch_execute(&sql).await {
                eprintln!("could not drop schema {}: {e}", self.name);
            }
        }

        /// Runs `case` (in its own task, so its panic is caught), drops the schema, then passes the
        /// panic on.
        async fn run<F>(self, case: F)
        where
            F: Future<Output = ()> + Send + 'static,
        {
            let outcome = tokio::spawn(case).await;
            self.drop().await;
            if let Err(e) = outcome {
                match e.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    Err(e) => panic!("case did not finish: {e}"),
                }
            }
        }
    }

    macro_rules! postgres_cases {
        ($($case:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let schema = TestSchema::create().await;
                let store = schema.open().await;
                schema.run(suite::$case(store)).await;
            }
        )*};
    }

    for_each_case!(postgres_cases);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survives_reopen() {
        let schema = TestSchema::create().await;
        let store = schema.open().await;
        let (url, opts) = (schema.url.clone(), schema.options());
        let reopen = move || async move {
            Arc::new(
                PostgresStore::open(&url, opts)
                    .await
                    .expect("reopen postgres store"),
            ) as Arc<dyn Store>
        };
        schema.run(suite::survives_reopen(store, reopen)).await;
    }

    /// PostgreSQL's text cannot hold U+0000: free-text columns keep it as U+FFFD (the turn is
    /// stored, not refused) while the transcript's JSON keeps it exactly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nul_in_free_text_is_kept_as_replacement() {
        let schema = TestSchema::create().await;
        let store = schema.open().await;
        schema
            .run(async move {
                let now = chrono::Utc::now();
                let s = NewSession {
                    id: uuid::Uuid::new_v4(),
                    agent_id: "agent\0x".to_owned(),
                    token_hash: "ab".repeat(32),
                    created_at: now,
                    metadata: json!({ "k": "v\0" }),
                };
                let body = json!({ "role": "user", "content": "a\0b" });
                let mut entry = NewTetherEntry {
                    role: "assistant".to_owned(),
                    content: Some("x\0y".to_owned()),
                    model_used: None,
                    created_at: now,
                    chunk_id: uuid::Uuid::new_v4(),
                };
                let out = store
                    .begin_turn(BeginTurn {
                        session_id: s.id,
                        turn_id: uuid::Uuid::new_v4(),
                        create: Some(s.clone()),
                        new_messages: vec![NewMessage {
                            role: "user".to_owned(),
                            body: body.clone(),
                            model_used: None,
                            cost_usd: None,
                            created_at: now,
                        }],
                        status: Some(SessionStatus::Suspended),
                        last_task: Some("a\0b".to_owned()),
                        model: None,
                        pre_action: None,
                        idempotency: None,
                        retry_key: None,
                        now,
                    })
                    .await
                    .expect("a NUL does not fail the turn");
                assert_eq!(out.session.last_task.as_deref(), Some("a\u{FFFD}b"));
                assert_eq!(out.session.agent_id, "agent\u{FFFD}x");
                assert_eq!(out.session.metadata, s.metadata, "JSON is exact");
                let history = store.history(s.id).await.expect("history");
                assert_eq!(history[0].body, body, "the transcript is exact");
                let found = store
                    .latest_suspended_for_agent("agent\0x")
                    .await
                    .expect("lookup");
                assert_eq!(found.map(|f| f.id), Some(s.id), "found by the same name");
                let finish = FinishTurn {
                    session_id: s.id,
                    turn_id: None,
                    messages: Vec::new(),
                    count_step: false,
                    post_action: None,
                    checkpoint: None,
                    tether: Some(entry.clone()),
                    tether_only_if_enabled: false,
                    idempotency_done: None,
                    now,
                };
                store.finish_turn(finish).await.expect("tethered");
                let pending = store.tether_pending(s.id, None, 10).await.expect("pending");
                entry.content = Some("x\u{FFFD}y".to_owned());
                assert_eq!(pending[0].content, entry.content);
            })
            .await;
    }

    /// Gateways starting at once migrate the schema once (the advisory lock), a migrated schema
    /// opens again, and a schema newer than this build is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_opens_migrate_once() {
        let schema = TestSchema::create().await;
        let (url, opts) = (schema.url.clone(), schema.options());
        schema
            .run(async move {
                let mut opens = tokio::task::JoinSet::new();
                for _ in 0..6 {
                    let (url, opts) = (url.clone(), opts.clone());
                    opens.spawn(async move { PostgresStore::open(&url, opts).await });
                }
                while let Some(opened) = opens.join_next().await {
                    let store = opened.expect("task").expect("open");
                    assert_eq!(
                        store.count_sessions_by_status().await.expect("read").len(),
                        5
                    );
                }
                let client = admin(&url).await;
                let search_path = opts.schema.as_deref().expect("schema");
                let versions: Vec<i32> = client
                    .query(
                        &format!(
                            "SELECT version FROM {search_path}.sbp_schema_version ORDER BY version"
                        ),
                        &[],
                    )
                    .await
                    .expect("versions")
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                let expected: Vec<i32> = (1..=SCHEMA_VERSION as i32).collect();
                assert_eq!(versions, expected, "each migration applied once");

                client
                    .batch_execute(&format!(
                        "INSERT INTO {search_path}.sbp_schema_version (version) VALUES ({})",
                        SCHEMA_VERSION + 1
                    ))
                    .await
                    .expect("pretend a newer build migrated");
                match PostgresStore::open(&url, opts).await {
                    Err(StoreError::Backend(m)) => assert!(m.contains("newer"), "{m}"),
                    Err(e) => panic!("unexpected error {e:?}"),
                    Ok(_) => panic!("a newer schema must be refused"),
                }
            })
            .await;
    }
}
