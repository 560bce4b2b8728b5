//! Runs the storage conformance suite against every backend: SQLite (each case on a fresh database
//! file in its own temp dir) and PostgreSQL (each case in a fresh schema of the database named by
//! `SBP_TEST_DATABASE_URL`, dropped afterwards), and both again with the tether in Redis Streams
//! (`SBP_TEST_REDIS_URL`, each case under a key prefix of its own, deleted afterwards) in mirror and
//! handoff mode. `postgres_tls` connects to the same server over TLS, each `sslmode` checked
//! against the certificate `scripts/services.sh` gave it. The suite runs once more with encryption
//! at rest on each SQL backend and on a tether, and `sealing` checks the raw rows, files and
//! streams for plaintext, rotation and reseal.

mod postgres_tls;
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
            suspend_if_running,
            begin_turn_with_create,
            begin_turn_is_atomic,
            finish_turn_counts_and_snapshots,
            progress_of_a_running_turn,
            written_snapshots_read_back_equal,
            message_bytes_follow_the_transcript,
            checkpoints_every_n,
            tether_seq_never_reused,
            tether_only_if_enabled,
            tether_pending_order_after_limit,
            fail_turn_and_retry,
            recover_interrupted_turns,
            turn_owner_round_trips,
            recover_orphaned_turns,
            heartbeat_keeps_a_replica_alive,
            stale_replicas_are_forgotten,
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
            retention_sweeps_what_no_longer_serves,
            sweeping_snapshots_written_while_the_clock_stepped_back,
            reserved_prefix_values_round_trip,
            federation_identity_is_set_once,
            federation_identity_races_to_one,
            federation_peers_upsert_and_read,
            federation_jti_is_accepted_once,
            federation_announcement_seq_grows,
            registry_seq_rule,
            registry_quota_per_gateway,
            registry_records_for_orders_and_excludes_expired,
            registry_vouch_round_trip,
            federation_sweep_drops_expired,
            hold_lease_refused_while_a_turn_runs,
            hold_lease_is_exclusive_and_idempotent,
            hold_lease_and_turn_race_to_one,
            hold_lease_expires_and_returns_home,
            hold_guards_turns_and_pushes,
            hold_commit_moves_the_session,
            hold_commit_after_expiry_is_refused,
            hold_adopt_migrated_round_trip,
            hold_adopt_replaces_only_a_moved_copy,
            hold_finish_incoming_false_deletes,
            hold_epoch_grows_across_moves,
            hold_release_ends_only_its_own_lease,
            list_sessions_newest_first_filtered_and_paged,
            delete_session_erases_everything_of_it,
            delete_session_under_a_running_turn,
            delete_session_bundles_it_came_in_with,
            delete_session_waits_for_a_move_to_end,
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

    /// The suite with encryption at rest on.
    mod sealed {
        use super::*;

        macro_rules! sealed_cases {
            ($($case:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let dir = tempfile::tempdir().expect("temp dir");
                    let opts = SqliteOptions {
                        sealer: crate::sealing::sealer(1, &[]),
                        ..SqliteOptions::new(db_path(dir.path()))
                    };
                    let store = SqliteStore::open(opts).await.expect("open sealed");
                    suite::$case(Arc::new(store)).await;
                }
            )*};
        }

        for_each_case!(sealed_cases);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn federation_survives_reopen() {
            let dir = tempfile::tempdir().expect("temp dir");
            let open = || async {
                let opts = SqliteOptions {
                    sealer: crate::sealing::sealer(1, &[]),
                    ..SqliteOptions::new(db_path(dir.path()))
                };
                Arc::new(SqliteStore::open(opts).await.expect("open sealed")) as Arc<dyn Store>
            };
            suite::federation_survives_reopen(open().await, open).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn survives_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = db_path(dir.path());
        let store = open(path.clone()).await;
        suite::survives_reopen(store, || open(path.clone())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn federation_survives_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = db_path(dir.path());
        let store = open(path.clone()).await;
        suite::federation_survives_reopen(store, || open(path.clone())).await;
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
            sealer: sbp_store::seal::Sealer::off(),
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
        assert_eq!(version, 11);
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
    use sbp_test_support::{run_then_clean_up, test_database_url};
    use serde_json::json;

    use crate::suite;

    /// A fresh schema for one test, dropped by [`TestSchema::drop`].
    pub(crate) struct TestSchema {
        pub(crate) url: String,
        name: String,
    }

    /// A plain connection for the harness's own DDL. Fails the test (never skips it) when
    /// PostgreSQL cannot be reached.
    async fn admin(url: &str) -> tokio_postgres::Client {
        // The connection's task ends when the client is dropped; an error of the connection
        // shows up as a failed statement.
        let (client, _conn) = sbp_store::postgres::connect(url).await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL at {url} is not reachable ({e}). The PostgreSQL cases need it: \
                 run `bash scripts/services.sh` to start it, or set SBP_TEST_DATABASE_URL to a \
                 database this user may create schemas in."
            )
        });
        client
    }

    impl TestSchema {
        pub(crate) async fn create() -> TestSchema {
            let url = test_database_url();
            let name = format!("sbp_test_{}", uuid::Uuid::new_v4().simple());
            admin(&url)
                .await
                .batch_execute(&format!("CREATE SCHEMA {name}"))
                .await
                .unwrap_or_else(|e| panic!("create schema {name} at {url}: {e}"));
            TestSchema { url, name }
        }

        pub(crate) fn options(&self) -> PostgresOptions {
            PostgresOptions {
                // Two cases run at once by default; leave room below max_connections = 100.
                max_connections: 16,
                schema: Some(self.name.clone()),
                ..PostgresOptions::default()
            }
        }

        pub(crate) async fn open(&self) -> Arc<dyn Store> {
            Arc::new(
                PostgresStore::open(&self.url, self.options())
                    .await
                    .expect("open postgres store"),
            )
        }

        pub(crate) async fn open_with(
            &self,
            sealer: sbp_store::seal::Sealer,
        ) -> Result<PostgresStore, StoreError> {
            let opts = PostgresOptions {
                sealer,
                ..self.options()
            };
            PostgresStore::open(&self.url, opts).await
        }

        pub(crate) fn name(&self) -> &str {
            &self.name
        }

        /// Best effort: a schema left behind by a crash only costs space.
        pub(crate) async fn drop(self) {
            let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name);
            if let Err(e) = admin(&self.url).await.batch_execute(&sql).await {
                eprintln!("could not drop schema {}: {e}", self.name);
            }
        }

        /// Runs `case` (in its own task, so its panic is caught), drops the schema, then passes the
        /// panic on.
        pub(crate) async fn run<F>(self, case: F)
        where
            F: Future<Output = ()> + Send + 'static,
        {
            run_then_clean_up(case, self.drop()).await;
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

    /// The suite with encryption at rest on.
    mod sealed {
        use super::*;

        macro_rules! sealed_cases {
            ($($case:ident),* $(,)?) => {$(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let schema = TestSchema::create().await;
                    let store = schema.open_with(crate::sealing::sealer(1, &[])).await;
                    let store = Arc::new(store.expect("open sealed"));
                    schema.run(suite::$case(store)).await;
                }
            )*};
        }

        for_each_case!(sealed_cases);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn federation_survives_reopen() {
            let schema = TestSchema::create().await;
            let store = schema.open_with(crate::sealing::sealer(1, &[])).await;
            let store: Arc<dyn Store> = Arc::new(store.expect("open sealed"));
            let opts = PostgresOptions {
                sealer: crate::sealing::sealer(1, &[]),
                ..schema.options()
            };
            let url = schema.url.clone();
            let reopen = move || async move {
                Arc::new(
                    PostgresStore::open(&url, opts)
                        .await
                        .expect("reopen sealed"),
                ) as Arc<dyn Store>
            };
            schema
                .run(suite::federation_survives_reopen(store, reopen))
                .await;
        }
    }

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

    /// A new pool on the same schema: another replica, or the gateway after a restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn federation_survives_reopen() {
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
        schema
            .run(suite::federation_survives_reopen(store, reopen))
            .await;
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
                            body: (&body).into(),
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
                        owner: None,
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
                    idempotency_claim: None,
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

/// The suite again with the tether in Redis Streams over each SQL backend, in both modes, plus the
/// cases only a split tether has: entries committed but never streamed, replays, Redis losing its
/// data, handoff of the outbox.
mod redis_tether {
    use std::future::Future;
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Duration;

    use sbp_store::Store;
    use sbp_store::redis_tether::{RedisTetherOptions, TetherMode, TetheredStore};
    use sbp_store::sqlite::{SqliteOptions, SqliteStore};
    use sbp_test_support::{run_then_clean_up, test_redis_url};
    use tempfile::TempDir;

    use crate::postgres::TestSchema;

    enum Backing {
        Sqlite(TempDir),
        Postgres(TestSchema),
    }

    /// One case's SQL store and Redis key prefix; [`Fixture::run`] deletes both afterwards.
    pub(crate) struct Fixture {
        backing: Backing,
        pub(crate) prefix: String,
        mode: TetherMode,
        relay_interval: Duration,
        pub(crate) sealer: sbp_store::seal::Sealer,
    }

    impl Fixture {
        pub(crate) async fn new(postgres: bool, mode: TetherMode) -> Fixture {
            let backing = if postgres {
                Backing::Postgres(TestSchema::create().await)
            } else {
                Backing::Sqlite(tempfile::tempdir().expect("temp dir"))
            };
            Fixture {
                backing,
                prefix: format!("sbptest:{}:", uuid::Uuid::new_v4().simple()),
                mode,
                // Short, so the relay's handoffs race the cases' own calls.
                relay_interval: Duration::from_millis(20),
                sealer: sbp_store::seal::Sealer::off(),
            }
        }

        fn options(&self) -> RedisTetherOptions {
            RedisTetherOptions {
                prefix: self.prefix.clone(),
                mode: self.mode,
                relay_interval: self.relay_interval,
                sealer: self.sealer.clone(),
                ..RedisTetherOptions::default()
            }
        }

        fn sqlite_path(dir: &TempDir) -> PathBuf {
            dir.path().join("sbp.sqlite3")
        }

        /// Opens the SQL store and wraps it; every call opens a new pair on the same data (a
        /// restart, or another replica when the backend is PostgreSQL).
        pub(crate) async fn tethered(&self) -> Arc<TetheredStore<dyn Store>> {
            let inner: Arc<dyn Store> = match &self.backing {
                Backing::Sqlite(dir) => Arc::new(
                    SqliteStore::open(SqliteOptions {
                        sealer: self.sealer.clone(),
                        ..SqliteOptions::new(Self::sqlite_path(dir))
                    })
                    .await
                    .expect("open sqlite store"),
                ),
                Backing::Postgres(schema) => Arc::new(
                    schema
                        .open_with(self.sealer.clone())
                        .await
                        .expect("open postgres store"),
                ),
            };
            let url = test_redis_url();
            let store = TetheredStore::open(inner, &url, self.options())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "Redis at {url} is not reachable ({e}). The Redis tether cases need it: \
                         run `bash scripts/services.sh` to start it, or set SBP_TEST_REDIS_URL."
                    )
                });
            Arc::new(store)
        }

        pub(crate) async fn open(&self) -> Arc<dyn Store> {
            self.tethered().await
        }

        /// Runs `case` in its own task, deletes the keys and the SQL data, then passes a panic on.
        pub(crate) async fn run<F>(self, case: F)
        where
            F: Future<Output = ()> + Send + 'static,
        {
            run_then_clean_up(case, async move {
                if let Err(e) = delete_prefix(&self.prefix).await {
                    eprintln!("could not delete redis keys {}*: {e}", self.prefix);
                }
                match self.backing {
                    Backing::Sqlite(dir) => drop(dir),
                    Backing::Postgres(schema) => schema.drop().await,
                }
            })
            .await;
        }
    }

    /// Deletes every key under `prefix` (also how a test makes Redis "lose its data").
    pub(crate) async fn delete_prefix(prefix: &str) -> redis::RedisResult<()> {
        sbp_test_support::delete_prefix(&test_redis_url(), prefix).await
    }

    macro_rules! tethered_cases {
        ($($case:ident),* $(,)?) => {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let fx = fixture().await;
                    let store = fx.open().await;
                    fx.run(crate::suite::$case(store)).await;
                }
            )*

            tethered_reopen_cases!(survives_reopen, federation_survives_reopen);
        };
    }

    /// Cases that reopen the store (a restart) on the same data.
    macro_rules! tethered_reopen_cases {
        ($($case:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let fx = fixture().await;
                let store = fx.open().await;
                let fx = std::sync::Arc::new(fx);
                let again = std::sync::Arc::clone(&fx);
                let reopen = move || async move { again.open().await };
                let case = crate::suite::$case(store, reopen);
                // The case holds one reference to the fixture until it ends.
                let outcome = tokio::spawn(case).await;
                let fx = std::sync::Arc::try_unwrap(fx)
                    .unwrap_or_else(|_| panic!("fixture still shared"));
                fx.run(async move {
                    if let Err(e) = outcome {
                        std::panic::resume_unwind(e.into_panic());
                    }
                })
                .await;
            }
        )*};
    }

    mod sqlite_mirror {
        use super::*;
        async fn fixture() -> Fixture {
            Fixture::new(false, TetherMode::Mirror).await
        }
        for_each_case!(tethered_cases);
    }

    mod sqlite_handoff {
        use super::*;
        async fn fixture() -> Fixture {
            Fixture::new(false, TetherMode::Handoff).await
        }
        for_each_case!(tethered_cases);
    }

    mod postgres_mirror {
        use super::*;
        async fn fixture() -> Fixture {
            Fixture::new(true, TetherMode::Mirror).await
        }
        for_each_case!(tethered_cases);
    }

    mod postgres_handoff {
        use super::*;
        async fn fixture() -> Fixture {
            Fixture::new(true, TetherMode::Handoff).await
        }
        for_each_case!(tethered_cases);
    }

    /// Handoff (the mode where entries live only in Redis) with encryption at rest on.
    mod sealed_sqlite_handoff {
        use super::*;
        async fn fixture() -> Fixture {
            let mut fx = Fixture::new(false, TetherMode::Handoff).await;
            fx.sealer = crate::sealing::sealer(1, &[]);
            fx
        }
        for_each_case!(tethered_cases);
    }

    mod split {
        //! What only a tether split between SQL and Redis can get wrong.

        use super::*;
        use chrono::Utc;
        use sbp_store::{
            FinishTurn, NewSession, NewTetherEntry, SessionStore, TetherEntry, TetherStore,
            TurnStore,
        };
        use uuid::Uuid;

        /// A fixture whose relay never runs on its own: the test calls `relay_once`.
        async fn manual(mode: TetherMode) -> Fixture {
            let mut fx = Fixture::new(false, mode).await;
            fx.relay_interval = Duration::from_secs(3600);
            fx
        }

        async fn session(store: &dyn Store) -> Uuid {
            let id = Uuid::new_v4();
            store
                .create_session(NewSession {
                    id,
                    agent_id: "agent-r".to_owned(),
                    token_hash: format!("{}{}", id.simple(), Uuid::new_v4().simple()),
                    created_at: Utc::now(),
                    metadata: serde_json::json!({}),
                })
                .await
                .expect("create");
            id
        }

        /// A pushed turn with a tether entry; returns its seq.
        async fn push(store: &dyn TurnStore, sid: Uuid, text: &str) -> u64 {
            let out = store
                .finish_turn(FinishTurn {
                    session_id: sid,
                    turn_id: None,
                    messages: Vec::new(),
                    count_step: false,
                    post_action: None,
                    checkpoint: None,
                    tether: Some(NewTetherEntry {
                        role: "assistant".to_owned(),
                        content: Some(text.to_owned()),
                        model_used: None,
                        created_at: Utc::now(),
                        chunk_id: Uuid::new_v4(),
                    }),
                    tether_only_if_enabled: false,
                    idempotency_done: None,
                    idempotency_claim: None,
                    now: Utc::now(),
                })
                .await
                .expect("finish");
            out.tether_seq.expect("tethered")
        }

        async fn pending(store: &dyn TetherStore, sid: Uuid) -> Vec<(u64, String)> {
            store
                .tether_pending(sid, None, 100)
                .await
                .expect("pending")
                .into_iter()
                .map(|e: TetherEntry| (e.seq, e.content.unwrap_or_default()))
                .collect()
        }

        fn texts(v: &[(u64, &str)]) -> Vec<(u64, String)> {
            v.iter().map(|(s, t)| (*s, (*t).to_owned())).collect()
        }

        /// A gateway that committed turns and died before streaming them (simulated by writing
        /// through the SQL store alone): the next turn, any read, and another replica see them, in
        /// order and once.
        async fn committed_but_not_streamed(mode: TetherMode) {
            let fx = manual(mode).await;
            let store = fx.tethered().await;
            let other = fx.tethered().await;
            fx.run(async move {
                let sid = session(&*store).await;
                assert_eq!(push(&**store.inner(), sid, "a").await, 1);
                assert_eq!(push(&**store.inner(), sid, "b").await, 2);
                assert_eq!(store.tether_count(sid).await.expect("count"), 2);
                assert_eq!(push(&*store, sid, "c").await, 3);
                let want = texts(&[(1, "a"), (2, "b"), (3, "c")]);
                assert_eq!(pending(&*store, sid).await, want);
                assert_eq!(pending(&*other, sid).await, want, "another replica");
                assert_eq!(other.tether_count(sid).await.expect("count"), 3);
                assert_eq!(push(&**store.inner(), sid, "d").await, 4);
                assert_eq!(push(&*store, sid, "e").await, 5, "a gap is filled first");
                assert_eq!(
                    pending(&*other, sid)
                        .await
                        .iter()
                        .map(|e| e.0)
                        .collect::<Vec<_>>(),
                    vec![1, 2, 3, 4, 5]
                );
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn committed_but_not_streamed_mirror() {
            committed_but_not_streamed(TetherMode::Mirror).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn committed_but_not_streamed_handoff() {
            committed_but_not_streamed(TetherMode::Handoff).await;
        }

        /// An erased session's stream goes with it, and its marker stops any later append (here
        /// a writer that still has the session: its row made again behind the store's back, as a
        /// turn that read it before the erasure would have).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn erasure_drops_the_stream_and_stops_late_appends() {
            let fx = manual(TetherMode::Mirror).await;
            let store = fx.tethered().await;
            let prefix = fx.prefix.clone();
            fx.run(async move {
                let sid = session(&*store).await;
                push(&*store, sid, "a").await;
                assert_eq!(store.tether_count(sid).await.expect("count"), 1);
                store.delete_session(sid, Utc::now()).await.expect("erase");
                let client = redis::Client::open(test_redis_url()).expect("url");
                let mut con = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect");
                let stream: bool = redis::cmd("EXISTS")
                    .arg(format!("{prefix}tether:{sid}"))
                    .query_async(&mut con)
                    .await
                    .expect("exists");
                assert!(!stream, "the stream is gone");

                let record = NewSession {
                    id: sid,
                    agent_id: "agent-r".to_owned(),
                    token_hash: format!("{}{}", sid.simple(), Uuid::new_v4().simple()),
                    created_at: Utc::now(),
                    metadata: serde_json::json!({}),
                };
                store.inner().create_session(record).await.expect("again");
                push(&*store, sid, "late").await;
                assert_eq!(store.inner().tether_count(sid).await.expect("outbox"), 1);
                assert_eq!(store.tether_count(sid).await.expect("count"), 0);
                assert!(pending(&*store, sid).await.is_empty());
                store.relay_once().await.expect("relay");
                assert_eq!(store.tether_count(sid).await.expect("count"), 0);
            })
            .await;
        }

        /// Reconciling again and again appends nothing twice, and an acknowledged seq never comes
        /// back from the outbox (its row is still there in handoff mode until the relay runs).
        async fn replays_are_idempotent(mode: TetherMode) {
            let fx = manual(mode).await;
            let store = fx.tethered().await;
            fx.run(async move {
                let sid = session(&*store).await;
                for t in ["a", "b", "c"] {
                    push(&*store, sid, t).await;
                }
                assert_eq!(store.tether_ack(sid, 2).await.expect("ack"), 2);
                for _ in 0..3 {
                    assert_eq!(pending(&*store, sid).await, texts(&[(3, "c")]));
                    assert_eq!(store.tether_count(sid).await.expect("count"), 1);
                }
                let outbox = store.inner().tether_count(sid).await.expect("outbox");
                match mode {
                    TetherMode::Mirror => assert_eq!(outbox, 1, "acks reach SQL"),
                    _ => assert_eq!(outbox, 3, "rows wait for the relay"),
                }
                store.relay_once().await.expect("relay");
                let outbox = store.inner().tether_count(sid).await.expect("outbox");
                match mode {
                    TetherMode::Mirror => assert_eq!(outbox, 1, "mirror keeps the row"),
                    _ => assert_eq!(outbox, 0, "handed off"),
                }
                assert_eq!(pending(&*store, sid).await, texts(&[(3, "c")]));
                assert_eq!(store.tether_remove(sid, &[3]).await.expect("remove"), 1);
                assert_eq!(push(&*store, sid, "d").await, 4);
                assert_eq!(pending(&*store, sid).await, texts(&[(4, "d")]));
                assert_eq!(store.tether_depth_total().await.expect("depth"), 1);
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn replays_are_idempotent_mirror() {
            replays_are_idempotent(TetherMode::Mirror).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn replays_are_idempotent_handoff() {
            replays_are_idempotent(TetherMode::Handoff).await;
        }

        /// Mirror mode: Redis restarting empty (no persistence, simulated by deleting the keys)
        /// loses nothing and brings back nothing acknowledged.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn mirror_rebuilds_after_redis_loses_its_data() {
            let fx = manual(TetherMode::Mirror).await;
            let store = fx.tethered().await;
            let prefix = fx.prefix.clone();
            fx.run(async move {
                let sid = session(&*store).await;
                let idle = session(&*store).await;
                for t in ["a", "b", "c"] {
                    push(&*store, sid, t).await;
                }
                push(&*store, idle, "x").await;
                store.tether_ack(sid, 1).await.expect("ack");
                store.tether_remove(sid, &[2]).await.expect("remove");
                delete_prefix(&prefix).await.expect("flush");
                assert_eq!(pending(&*store, sid).await, texts(&[(3, "c")]));
                assert_eq!(push(&*store, sid, "d").await, 4);
                assert_eq!(pending(&*store, sid).await, texts(&[(3, "c"), (4, "d")]));
                assert_eq!(pending(&*store, idle).await, texts(&[(1, "x")]));
                assert_eq!(store.tether_depth_total().await.expect("depth"), 3);
            })
            .await;
        }

        /// Handoff mode: streamed entries leave SQL, acks then touch only Redis, and seqs still
        /// come from SQL (never reused).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn handoff_empties_the_outbox() {
            let fx = manual(TetherMode::Handoff).await;
            let store = fx.tethered().await;
            fx.run(async move {
                let sid = session(&*store).await;
                for t in ["a", "b", "c"] {
                    push(&*store, sid, t).await;
                }
                assert_eq!(store.relay_once().await.expect("relay"), 3);
                assert_eq!(store.inner().tether_depth_total().await.expect("sql"), 0);
                assert_eq!(store.tether_count(sid).await.expect("count"), 3);
                assert_eq!(store.tether_depth_total().await.expect("depth"), 3);
                assert_eq!(store.tether_ack(sid, 3).await.expect("ack"), 3);
                assert_eq!(store.tether_depth_total().await.expect("depth"), 0);
                assert_eq!(push(&*store, sid, "d").await, 4);
                assert_eq!(pending(&*store, sid).await, texts(&[(4, "d")]));
            })
            .await;
        }

        /// Auto picks handoff only on a Redis that fsyncs every write.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn auto_mode_follows_redis_persistence() {
            let fx = manual(TetherMode::Auto).await;
            let store = fx.tethered().await;
            let client = redis::Client::open(test_redis_url()).expect("url");
            let mut con = client
                .get_multiplexed_async_connection()
                .await
                .expect("connect");
            let get = async |con: &mut redis::aio::MultiplexedConnection, name: &str| {
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async::<std::collections::HashMap<String, String>>(con)
                    .await
                    .ok()
                    .and_then(|mut m| m.remove(name))
            };
            let durable = get(&mut con, "appendonly").await.as_deref() == Some("yes")
                && get(&mut con, "appendfsync").await.as_deref() == Some("always");
            let want = if durable {
                TetherMode::Handoff
            } else {
                TetherMode::Mirror
            };
            assert_eq!(store.mode(), want);
            fx.run(async {}).await;
        }
    }
}

/// Erasing a session on SQLite: the database files themselves (main, WAL and shared memory, read
/// as raw bytes) keep nothing of it, while the gateway's store is still open and after it closed.
mod erasure {
    use std::sync::Arc;

    use sbp_store::Store;
    use sbp_store::sqlite::{SqliteOptions, SqliteStore};

    use crate::sealing::{files_contain, marker};
    use crate::suite::sealing::{write_everything, write_migrated};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_files_hold_nothing_of_an_erased_session() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn Store> = Arc::new(
            SqliteStore::open(SqliteOptions::new(dir.path().join("sbp.sqlite3")))
                .await
                .expect("open"),
        );
        let (erased, moved, kept) = (marker(), marker(), marker());
        // A marker in every content column, through every unit of work, and a fork that copied
        // the transcript; a session moved in from another gateway; a control left alone.
        let w = write_everything(&store, &erased).await;
        let m = write_migrated(&store, &moved).await;
        write_everything(&store, &kept).await;
        assert!(
            files_contain(dir.path(), &erased),
            "written before the erasure"
        );
        assert!(files_contain(dir.path(), &moved));

        let now = chrono::Utc::now();
        // The move completes (an arriving session cannot be erased).
        for hold in store.incoming_holds().await.expect("holds") {
            let migration = hold.migration_id.expect("a migration");
            store
                .finish_incoming(hold.session_id, migration, true, now)
                .await
                .expect("finish");
        }
        for id in [w.session.id, w.adopted, m.session.id] {
            store.delete_session(id, now).await.expect("erase");
        }
        assert!(!files_contain(dir.path(), &erased), "erased, store open");
        assert!(!files_contain(dir.path(), &moved), "moved in, erased");
        assert!(files_contain(dir.path(), &kept), "the control stays");
        drop(store);
        assert!(!files_contain(dir.path(), &erased), "after the last close");
        assert!(files_contain(dir.path(), &kept));
    }
}

/// Encryption at rest on each backend: the raw files, rows and streams hold no plaintext (and do
/// without a key, so the search can find it), keys rotate and a reseal retires the old one, and a
/// start with a keyring that does not fit the database is refused.
pub(crate) mod sealing {
    use std::path::Path;
    use std::sync::Arc;

    use sbp_store::seal::{Key, Keyring, PREFIX, SealError, Sealed, Sealer};
    use sbp_store::sqlite::{SqliteOptions, SqliteStore};
    use sbp_store::{Store, StoreError};

    use crate::suite::federation::{reads_federation, write_federation};
    use crate::suite::sealing::{
        reads_everything, reads_migrated, write_everything, write_migrated,
    };

    pub(crate) fn key(n: u8) -> Key {
        Key::from_bytes(&[n; 32]).expect("32 bytes")
    }

    pub(crate) fn sealer(current: u8, previous: &[u8]) -> Sealer {
        let previous = previous.iter().map(|n| key(*n)).collect();
        Sealer::new(Keyring::new(key(current), previous).expect("distinct keys"))
    }

    pub(crate) fn marker() -> String {
        format!("MARK-{}", uuid::Uuid::new_v4().simple())
    }

    fn contains(haystack: &[u8], needle: &str) -> bool {
        haystack
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
    }

    /// Whether any file of the database (main, `-wal`, `-shm`) holds `needle`, read as raw bytes.
    pub(crate) fn files_contain(dir: &Path, needle: &str) -> bool {
        std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| std::fs::read(e.expect("entry").path()).expect("read"))
            .any(|bytes| contains(&bytes, needle))
    }

    async fn open_sqlite(dir: &Path, sealer: Sealer) -> Result<SqliteStore, StoreError> {
        SqliteStore::open(SqliteOptions {
            sealer,
            ..SqliteOptions::new(dir.join("sbp.sqlite3"))
        })
        .await
    }

    fn sealing_error(r: Result<impl Sized, StoreError>) -> SealError {
        match r {
            Err(StoreError::Sealing(e)) => e,
            Err(e) => panic!("expected a sealing error, got {e:?}"),
            Ok(_) => panic!("expected the open to be refused"),
        }
    }

    /// Every message body and tether entry is sealed by `id`, read straight from the file.
    fn sqlite_sealed_by(dir: &Path, id: Sealed) {
        let conn = rusqlite::Connection::open(dir.join("sbp.sqlite3")).expect("inspect");
        for sql in [
            "SELECT body FROM messages",
            "SELECT content FROM tether",
            "SELECT state FROM snapshots",
            "SELECT metadata FROM sessions",
        ] {
            let values: Vec<String> = conn
                .prepare(sql)
                .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
                .expect("values");
            assert!(!values.is_empty(), "{sql}");
            for v in values {
                assert_eq!(Sealer::sealed_by(&v), id, "{sql}: {v}");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_files_hold_no_plaintext_and_keys_rotate() {
        let dir = tempfile::tempdir().expect("temp dir");
        let first = marker();
        let store: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), sealer(1, &[])).await.expect("open"));
        let w1 = write_everything(&store, &first).await;
        reads_everything(&store, &w1, true).await;
        let moved = marker();
        let m1 = write_migrated(&store, &moved).await;
        reads_migrated(&store, &m1).await;
        assert!(!files_contain(dir.path(), &first), "live WAL and database");
        assert!(!files_contain(dir.path(), &moved), "a migrated session too");
        drop(store);
        assert!(!files_contain(dir.path(), &first), "after the last close");

        // The same writes without a key: the search finds the marker.
        let plain_dir = tempfile::tempdir().expect("temp dir");
        let plain: Arc<dyn Store> = Arc::new(
            open_sqlite(plain_dir.path(), Sealer::off())
                .await
                .expect("open"),
        );
        write_everything(&plain, &first).await;
        write_migrated(&plain, &moved).await;
        assert!(
            files_contain(plain_dir.path(), &first),
            "the control finds its marker"
        );
        assert!(files_contain(plain_dir.path(), &moved));
        drop(plain);

        assert_eq!(
            sealing_error(open_sqlite(dir.path(), Sealer::off()).await),
            SealError::Locked(vec![key(1).id()])
        );
        assert_eq!(
            sealing_error(open_sqlite(dir.path(), sealer(3, &[])).await),
            SealError::MissingKeys(vec![key(1).id()])
        );

        // Rotation: the new key seals, the old one still opens.
        let rotated = open_sqlite(dir.path(), sealer(2, &[1]))
            .await
            .expect("rotated");
        let store: Arc<dyn Store> = Arc::new(rotated.clone());
        reads_everything(&store, &w1, true).await;
        let second = marker();
        let w2 = write_everything(&store, &second).await;
        let done = rotated.reseal().await.expect("reseal");
        assert!(done.total() >= 20, "{done:?}");
        assert!(
            done.columns
                .iter()
                .any(|(c, n)| *c == "bundles.body" && *n == 1),
            "{done:?}"
        );
        drop((store, rotated));
        sqlite_sealed_by(dir.path(), Sealed::By(key(2).id()));
        assert!(!files_contain(dir.path(), &second));

        let store: Arc<dyn Store> = Arc::new(
            open_sqlite(dir.path(), sealer(2, &[]))
                .await
                .expect("new key only"),
        );
        reads_everything(&store, &w1, true).await;
        reads_everything(&store, &w2, true).await;
        drop(store);
        assert_eq!(
            sealing_error(open_sqlite(dir.path(), sealer(1, &[])).await),
            SealError::MissingKeys(vec![key(2).id()])
        );
    }

    /// A reader (a running gateway's) holds its snapshot while a reseal runs: the truncating
    /// checkpoint cannot empty the WAL, and the reseal says so instead of reporting success with
    /// plaintext left in the files; once the reader is gone, running it again leaves none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_reseal_with_a_reader_refuses_then_cleans_up() {
        use sbp_store::SessionStore;
        let dir = tempfile::tempdir().expect("temp dir");
        let mark = marker();
        let plain = open_sqlite(dir.path(), Sealer::off()).await.expect("open");
        let s = sbp_store::NewSession {
            id: uuid::Uuid::new_v4(),
            agent_id: "agent".to_owned(),
            token_hash: uuid::Uuid::new_v4().simple().to_string(),
            created_at: chrono::Utc::now(),
            metadata: serde_json::json!({ "note": mark }),
        };
        plain.create_session(s.clone()).await.expect("create");
        drop(plain);
        let on = open_sqlite(dir.path(), sealer(1, &[])).await.expect("on");
        let reader = rusqlite::Connection::open(dir.path().join("sbp.sqlite3")).expect("reader");
        reader.execute_batch("BEGIN").expect("begin");
        let _: i64 = reader
            .query_row("SELECT count(*) FROM sessions", [], |r| r.get(0))
            .expect("read");
        match on.reseal().await {
            Err(StoreError::Backend(message)) => {
                assert!(message.contains("stop the gateways"), "{message}")
            }
            other => panic!("a held WAL must not pass for clean: {other:?}"),
        }
        reader.execute_batch("COMMIT").expect("end");
        drop(reader);
        let done = on.reseal().await.expect("reseal again");
        assert!(done.unopened.is_empty(), "{done:?}");
        assert!(!files_contain(dir.path(), &mark), "no plaintext left");
        let back = on.get_session(s.id).await.expect("read").expect("there");
        assert_eq!(back.metadata["note"], mark);
    }

    /// A gateway still on key 1 after a reseal elsewhere retired it: its next write is refused
    /// (nothing is sealed under a key the database no longer records), and a start with key 2
    /// alone reads everything.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_a_retired_key_seals_nothing_more() {
        let dir = tempfile::tempdir().expect("temp dir");
        let old: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), sealer(1, &[])).await.expect("old"));
        let w = write_everything(&old, &marker()).await;
        let new = open_sqlite(dir.path(), sealer(2, &[1]))
            .await
            .expect("rotated");
        let done = new.reseal().await.expect("reseal");
        assert_eq!(done.forgotten, Some(1), "{done:?}");
        drop(new);
        match write_refused(&old).await {
            StoreError::Sealing(SealError::Retired(id)) => assert_eq!(id, key(1).id()),
            other => panic!("{other:?}"),
        }
        drop(old);
        let store: Arc<dyn Store> = Arc::new(
            open_sqlite(dir.path(), sealer(2, &[]))
                .await
                .expect("key 2 alone"),
        );
        reads_everything(&store, &w, true).await;
    }

    async fn write_refused(store: &Arc<dyn Store>) -> StoreError {
        let s = sbp_store::NewSession {
            id: uuid::Uuid::new_v4(),
            agent_id: "agent".to_owned(),
            token_hash: uuid::Uuid::new_v4().simple().to_string(),
            created_at: chrono::Utc::now(),
            metadata: serde_json::json!({}),
        };
        store.create_session(s).await.expect_err("refused")
    }

    /// A gateway still on key 1 keeps running while a reseal elsewhere retires key 1: it writes
    /// away during the reseal. Whatever it managed to write stays readable (the reseal either
    /// resealed it, or its last scan found it and kept key 1), and once key 1 is forgotten it
    /// refuses to seal anything more under it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_stale_gateway_during_a_reseal_loses_nothing() {
        use sbp_store::seal::Kept;
        let dir = tempfile::tempdir().expect("temp dir");
        let old: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), sealer(1, &[])).await.expect("old"));
        let new = open_sqlite(dir.path(), sealer(2, &[1]))
            .await
            .expect("rotated");
        let session = |n: u32| sbp_store::NewSession {
            id: uuid::Uuid::new_v4(),
            agent_id: "agent".to_owned(),
            token_hash: uuid::Uuid::new_v4().simple().to_string(),
            created_at: chrono::Utc::now(),
            metadata: serde_json::json!({ "n": n }),
        };
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
        let writer = {
            let old = Arc::clone(&old);
            tokio::spawn(async move {
                let mut first_tx = Some(first_tx);
                let mut written = Vec::new();
                for n in 0..10_000 {
                    if let Some(tx) = (!written.is_empty()).then(|| first_tx.take()).flatten() {
                        let _ = tx.send(());
                    }
                    if stop_rx.try_recv().is_ok() {
                        break;
                    }
                    let s = session(n);
                    match old.create_session(s.clone()).await {
                        Ok(()) => written.push(s.id),
                        Err(StoreError::Sealing(SealError::Retired(id))) => {
                            assert_eq!(id, key(1).id());
                            break;
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                }
                written
            })
        };
        // The reseal starts once the stale gateway is writing.
        first_rx.await.expect("the stale gateway wrote");
        let done = new.reseal().await;
        let _ = stop_tx.send(());
        let written = writer.await.expect("writer");
        assert!(!written.is_empty());
        let done = match done {
            Ok(done) => done,
            // The stale gateway kept writing through the final checkpoint, so the WAL may still
            // hold earlier bytes: the reseal says so and asks to be run again with the gateways
            // stopped. Run again, that one must finish and forget key 1 (or find it forgotten).
            Err(StoreError::Backend(m)) if m.contains("holds the database open") => {
                drop(old);
                let again = new
                    .reseal()
                    .await
                    .expect("again, with the stale gateway stopped");
                assert_eq!(again.kept, None, "{again:?}");
                drop(new);
                return reopen_under_key_2_alone(dir.path(), &written).await;
            }
            Err(e) => panic!("reseal: {e:?}"),
        };
        eprintln!("written {} kept {:?}", written.len(), done.kept);
        match (done.kept, done.forgotten) {
            (None, Some(1)) => {
                // Forgotten: the stale gateway can no longer write under key 1.
                match old.create_session(session(0)).await {
                    Err(StoreError::Sealing(SealError::Retired(id))) => {
                        assert_eq!(id, key(1).id())
                    }
                    other => panic!("a retired key must not seal: {other:?}"),
                }
                drop(old);
            }
            (Some(Kept::WrittenMeanwhile), None) => {
                // Caught by the last scan: key 1 stays until a run with nobody on it.
                drop(old);
                let again = new.reseal().await.expect("again");
                assert_eq!((again.kept, again.forgotten), (None, Some(1)), "{again:?}");
            }
            other => panic!("{other:?} {done:?}"),
        }
        drop(new);
        reopen_under_key_2_alone(dir.path(), &written).await;
    }

    /// Opens the database with key 2 alone (key 1 forgotten) and reads every session written.
    async fn reopen_under_key_2_alone(dir: &Path, written: &[uuid::Uuid]) {
        use sbp_store::SessionStore;
        let only_new = open_sqlite(dir, sealer(2, &[])).await.expect("key 2 alone");
        for id in written {
            only_new
                .get_session(*id)
                .await
                .expect("everything written opens under key 2")
                .expect("there");
        }
    }

    /// A value moved into another session's row does not open: it is bound to its place.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sealed_value_moved_to_another_row_does_not_open() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), sealer(1, &[])).await.expect("open"));
        let a = write_everything(&store, &marker()).await;
        let b = write_everything(&store, &marker()).await;
        drop(store);
        let conn = rusqlite::Connection::open(dir.path().join("sbp.sqlite3")).expect("tamper");
        conn.execute(
            "UPDATE sessions SET last_task = (SELECT last_task FROM sessions WHERE id = ?1) \
             WHERE id = ?2",
            [a.session.id.to_string(), b.session.id.to_string()],
        )
        .expect("swap");
        drop(conn);
        let store = open_sqlite(dir.path(), sealer(1, &[])).await.expect("open");
        match sbp_store::SessionStore::get_session(&store, b.session.id).await {
            Err(StoreError::Sealing(SealError::Forged(column))) => {
                assert_eq!(column, "sessions.last_task")
            }
            other => panic!("a moved value must not open: {other:?}"),
        }
    }

    /// Turned on over a database written without a key: plain values read as they are, a reseal
    /// seals them and leaves none of their bytes in the files, and from then on a key is needed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_turned_on_over_a_plain_database() {
        let dir = tempfile::tempdir().expect("temp dir");
        let old = marker();
        let plain: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), Sealer::off()).await.expect("open"));
        let w0 = write_everything(&plain, &old).await;
        drop(plain);
        assert!(files_contain(dir.path(), &old));
        let on = open_sqlite(dir.path(), sealer(1, &[]))
            .await
            .expect("turn on");
        let store: Arc<dyn Store> = Arc::new(on.clone());
        reads_everything(&store, &w0, true).await;
        let done = on.reseal().await.expect("reseal");
        assert!(done.total() >= 20, "{done:?}");
        reads_everything(&store, &w0, true).await;
        drop((store, on));
        assert!(!files_contain(dir.path(), &old), "no plaintext left behind");
        sqlite_sealed_by(dir.path(), Sealed::By(key(1).id()));
        assert_eq!(
            sealing_error(open_sqlite(dir.path(), Sealer::off()).await),
            SealError::Locked(vec![key(1).id()])
        );
    }

    /// A database written before reserved values were escaped holds a prompt that starts with the
    /// seal prefix as it is: it reads as the plain value without a key, with one, and after a
    /// reseal (which seals it like any plain value).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn legacy_values_with_the_prefix_read_plain_and_reseal() {
        use sbp_store::{SessionStore, TetherStore};
        let dir = tempfile::tempdir().expect("temp dir");
        let plain: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), Sealer::off()).await.expect("open"));
        let w = write_everything(&plain, &marker()).await;
        let id = w.session.id;
        drop(plain);
        let legacy = ["sbp:enc:v1:hello", "sbp:enc:v1:AAAAAAAA"];
        let conn = rusqlite::Connection::open(dir.path().join("sbp.sqlite3")).expect("legacy");
        conn.execute(
            "UPDATE sessions SET last_task = ?1 WHERE id = ?2",
            [legacy[0], &id.to_string()],
        )
        .expect("legacy task");
        conn.execute("UPDATE tether SET content = ?1", [legacy[1]])
            .expect("legacy tether");
        drop(conn);
        let check = async |store: &SqliteStore| {
            let s = store
                .get_session(id)
                .await
                .expect("readable")
                .expect("there");
            assert_eq!(s.last_task.as_deref(), Some(legacy[0]));
            let pending = store.tether_pending(id, None, 10).await.expect("readable");
            assert!(!pending.is_empty());
            assert!(
                pending
                    .iter()
                    .all(|e| e.content.as_deref() == Some(legacy[1]))
            );
        };
        let off = open_sqlite(dir.path(), Sealer::off()).await.expect("off");
        check(&off).await;
        drop(off);
        let on = open_sqlite(dir.path(), sealer(1, &[])).await.expect("on");
        check(&on).await;
        let done = on.reseal().await.expect("reseal");
        assert!(done.unopened.is_empty(), "{done:?}");
        check(&on).await;
        drop(on);
        sqlite_sealed_by(dir.path(), Sealed::By(key(1).id()));
    }

    /// A value that does not open (sealed under a key nobody has) does not stop a reseal: every
    /// other value is resealed, that one is listed with its place, and the earlier keys are kept
    /// until it is gone; the next clean run forgets them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_reseal_lists_what_does_not_open_and_keeps_the_keys() {
        use sbp_store::seal::{Column, Kept};
        let dir = tempfile::tempdir().expect("temp dir");
        let store: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), sealer(1, &[])).await.expect("open"));
        let w = write_everything(&store, &marker()).await;
        drop(store);
        let id = w.session.id.to_string();
        let stray = sealer(9, &[])
            .seal(Column::SessionLastTask, &id, "lost")
            .expect("seal")
            .into_owned();
        let conn = rusqlite::Connection::open(dir.path().join("sbp.sqlite3")).expect("plant");
        conn.execute(
            "UPDATE sessions SET last_task = ?1 WHERE id = ?2",
            [&stray, &id],
        )
        .expect("plant");
        drop(conn);
        let rotated = open_sqlite(dir.path(), sealer(2, &[1]))
            .await
            .expect("rotated");
        let done = rotated.reseal().await.expect("the run goes on");
        assert!(done.total() >= 20, "every other value: {done:?}");
        assert_eq!(done.unopened_total, 1, "{done:?}");
        assert_eq!(done.unopened[0].column, "sessions.last_task");
        assert_eq!(done.unopened[0].row, id);
        assert_eq!(
            done.unopened[0].error,
            SealError::UnknownKey("sessions.last_task", key(9).id())
        );
        assert_eq!((done.kept, done.forgotten), (Some(Kept::Unopened), None));
        drop(rotated);
        assert_eq!(
            sealing_error(open_sqlite(dir.path(), sealer(2, &[])).await),
            SealError::MissingKeys(vec![key(1).id()]),
            "key 1 is still recorded"
        );
        let conn = rusqlite::Connection::open(dir.path().join("sbp.sqlite3")).expect("repair");
        conn.execute("UPDATE sessions SET last_task = NULL WHERE id = ?1", [&id])
            .expect("repair");
        drop(conn);
        let rotated = open_sqlite(dir.path(), sealer(2, &[1]))
            .await
            .expect("rotated");
        let done = rotated.reseal().await.expect("clean run");
        assert!(done.unopened.is_empty(), "{done:?}");
        assert_eq!((done.kept, done.forgotten), (None, Some(1)));
        drop(rotated);
        open_sqlite(dir.path(), sealer(2, &[]))
            .await
            .expect("key 2 alone starts");
    }

    /// As the SQLite case, on PostgreSQL: a stray value is listed and the earlier keys kept.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_reseal_lists_what_does_not_open_and_keeps_the_keys() {
        use sbp_store::seal::{Column, Kept};
        let schema = crate::postgres::TestSchema::create().await;
        let name = schema.name().to_owned();
        let first = schema.open_with(sealer(1, &[])).await;
        let schema = std::sync::Arc::new(schema);
        let again = std::sync::Arc::clone(&schema);
        let case = async move {
            let store: Arc<dyn Store> = Arc::new(first.expect("open"));
            let w = write_everything(&store, &marker()).await;
            let stray = sealer(9, &[])
                .seal(Column::SnapshotState, &w.snapshot.id.to_string(), "{}")
                .expect("seal")
                .into_owned();
            let url = sbp_test_support::test_database_url();
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .expect("connect");
            tokio::spawn(conn);
            client
                .execute(
                    &format!("UPDATE {name}.snapshots SET state = $1 WHERE id = $2::text::uuid"),
                    &[&stray, &w.snapshot.id.to_string()],
                )
                .await
                .expect("plant");
            let rotated = again.open_with(sealer(2, &[1])).await.expect("rotated");
            let done = rotated.reseal().await.expect("the run goes on");
            assert!(done.total() >= 20, "{done:?}");
            assert_eq!(done.unopened_total, 1, "{done:?}");
            assert_eq!(done.unopened[0].column, "snapshots.state");
            assert_eq!(done.unopened[0].row, w.snapshot.id.to_string());
            assert_eq!((done.kept, done.forgotten), (Some(Kept::Unopened), None));
            assert_eq!(
                sealing_error(again.open_with(sealer(2, &[])).await),
                SealError::MissingKeys(vec![key(1).id()])
            );
        };
        let outcome = tokio::spawn(case).await;
        let schema = std::sync::Arc::try_unwrap(schema).unwrap_or_else(|_| panic!("shared"));
        schema
            .run(async move {
                if let Err(e) = outcome {
                    std::panic::resume_unwind(e.into_panic());
                }
            })
            .await;
    }

    /// Whether any row of the schema's tables holds `needle` (bundles' bytes searched as bytes).
    async fn postgres_rows_contain(schema: &str, needle: &str) -> bool {
        let url = sbp_test_support::test_database_url();
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        let tables: Vec<String> = client
            .query(
                "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
                &[&schema],
            )
            .await
            .expect("tables")
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(tables.len() >= 10, "{tables:?}");
        for table in tables {
            let rows = client
                .query(&format!("SELECT t::text FROM {schema}.{table} t"), &[])
                .await
                .expect("rows");
            if rows.iter().any(|r| r.get::<_, String>(0).contains(needle)) {
                return true;
            }
        }
        let bundles = client
            .query(&format!("SELECT body FROM {schema}.bundles"), &[])
            .await
            .expect("bundles");
        bundles
            .iter()
            .any(|r| contains(&r.get::<_, Vec<u8>>(0), needle))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_rows_hold_no_plaintext_and_keys_rotate() {
        let schema = crate::postgres::TestSchema::create().await;
        let control = crate::postgres::TestSchema::create().await;
        let control_name = control.name().to_owned();
        let name = schema.name().to_owned();
        let first = marker();
        let opened = schema.open_with(sealer(1, &[])).await;
        let plain = control.open_with(Sealer::off()).await;
        let schema = std::sync::Arc::new(schema);
        let again = std::sync::Arc::clone(&schema);
        let case = async move {
            let store: Arc<dyn Store> = Arc::new(opened.expect("open"));
            let w1 = write_everything(&store, &first).await;
            reads_everything(&store, &w1, true).await;
            let moved = marker();
            let m1 = write_migrated(&store, &moved).await;
            reads_migrated(&store, &m1).await;
            assert!(!postgres_rows_contain(&name, &first).await);
            assert!(!postgres_rows_contain(&name, &moved).await);
            let plain: Arc<dyn Store> = Arc::new(plain.expect("open plain"));
            write_everything(&plain, &first).await;
            write_migrated(&plain, &moved).await;
            assert!(
                postgres_rows_contain(&control_name, &first).await,
                "the control finds it"
            );
            assert!(postgres_rows_contain(&control_name, &moved).await);

            assert_eq!(
                sealing_error(again.open_with(Sealer::off()).await),
                SealError::Locked(vec![key(1).id()])
            );
            assert_eq!(
                sealing_error(again.open_with(sealer(3, &[])).await),
                SealError::MissingKeys(vec![key(1).id()])
            );
            let rotated = again.open_with(sealer(2, &[1])).await.expect("rotated");
            let store: Arc<dyn Store> = Arc::new(rotated.clone());
            reads_everything(&store, &w1, true).await;
            let second = marker();
            let w2 = write_everything(&store, &second).await;
            let done = rotated.reseal().await.expect("reseal");
            assert!(done.total() >= 20, "{done:?}");
            assert!(!postgres_rows_contain(&name, &second).await);
            let fresh: Arc<dyn Store> =
                Arc::new(again.open_with(sealer(2, &[])).await.expect("new key only"));
            reads_everything(&fresh, &w1, true).await;
            reads_everything(&fresh, &w2, true).await;
            assert_eq!(
                sealing_error(again.open_with(sealer(1, &[])).await),
                SealError::MissingKeys(vec![key(2).id()])
            );
        };
        let outcome = tokio::spawn(case).await;
        control.drop().await;
        let schema = std::sync::Arc::try_unwrap(schema).unwrap_or_else(|_| panic!("shared"));
        schema
            .run(async move {
                if let Err(e) = outcome {
                    std::panic::resume_unwind(e.into_panic());
                }
            })
            .await;
    }

    /// PostgreSQL: a replica still on key 1 after a reseal elsewhere retired it notices on its
    /// next heartbeat (which itself still succeeds) and seals nothing more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_retired_key_seals_nothing_more_after_a_heartbeat() {
        let schema = crate::postgres::TestSchema::create().await;
        let first = schema.open_with(sealer(1, &[])).await;
        let schema = std::sync::Arc::new(schema);
        let again = std::sync::Arc::clone(&schema);
        let case = async move {
            let old: Arc<dyn Store> = Arc::new(first.expect("old"));
            let w = write_everything(&old, &marker()).await;
            let new = again.open_with(sealer(2, &[1])).await.expect("rotated");
            let done = new.reseal().await.expect("reseal");
            assert_eq!(done.forgotten, Some(1), "{done:?}");
            old.replica_heartbeat("stale", chrono::Utc::now())
                .await
                .expect("the heartbeat goes on");
            match write_refused(&old).await {
                StoreError::Sealing(SealError::Retired(id)) => assert_eq!(id, key(1).id()),
                other => panic!("{other:?}"),
            }
            let fresh: Arc<dyn Store> =
                Arc::new(again.open_with(sealer(2, &[])).await.expect("key 2 alone"));
            reads_everything(&fresh, &w, true).await;
        };
        let outcome = tokio::spawn(case).await;
        let schema = std::sync::Arc::try_unwrap(schema).unwrap_or_else(|_| panic!("shared"));
        schema
            .run(async move {
                if let Err(e) = outcome {
                    std::panic::resume_unwind(e.into_panic());
                }
            })
            .await;
    }

    /// The tables (by name prefix) that hold federation rows: none of them is session content.
    const FEDERATION_TABLES: [&str; 4] =
        ["federation_", "session_holds", "announcements", "registry_"];

    fn resealed_no_federation_column(done: &sbp_store::seal::Resealed) {
        assert!(
            done.columns
                .iter()
                .all(|(c, _)| !FEDERATION_TABLES.iter().any(|t| c.starts_with(t))),
            "{done:?}"
        );
    }

    /// Federation rows are no session content: under a keyring they are stored as they are (a
    /// tracker hands a record's bytes back verbatim), a reseal walks past them, and they read the
    /// same under the new key alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_federation_rows_stay_clear_through_a_reseal() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mark = marker();
        let store: Arc<dyn Store> =
            Arc::new(open_sqlite(dir.path(), sealer(1, &[])).await.expect("open"));
        let w = write_federation(&store, &mark).await;
        drop(store);
        let stored_clear = || {
            let conn = rusqlite::Connection::open(dir.path().join("sbp.sqlite3")).expect("inspect");
            let one = |sql: &str| -> String { conn.query_row(sql, [], |r| r.get(0)).expect(sql) };
            assert_eq!(one("SELECT record FROM registry_records"), w.record.record);
            assert_eq!(one("SELECT url FROM federation_peers"), w.peer.url);
            assert_eq!(one("SELECT jti FROM federation_jti"), mark);
            assert_eq!(
                one("SELECT gateway_url FROM registry_gateways"),
                w.vouch.gateway_url
            );
        };
        stored_clear();
        let rotated = open_sqlite(dir.path(), sealer(2, &[1]))
            .await
            .expect("rotated");
        let done = rotated.reseal().await.expect("reseal");
        assert_eq!(done.forgotten, Some(1), "{done:?}");
        resealed_no_federation_column(&done);
        drop(rotated);
        stored_clear();
        let store: Arc<dyn Store> = Arc::new(
            open_sqlite(dir.path(), sealer(2, &[]))
                .await
                .expect("key 2 alone"),
        );
        reads_federation(&store, &w, &mark).await;
    }

    /// [`sqlite_federation_rows_stay_clear_through_a_reseal`] on PostgreSQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_federation_rows_stay_clear_through_a_reseal() {
        let schema = crate::postgres::TestSchema::create().await;
        let name = schema.name().to_owned();
        let first = schema.open_with(sealer(1, &[])).await;
        let schema = std::sync::Arc::new(schema);
        let again = std::sync::Arc::clone(&schema);
        let case = async move {
            let mark = marker();
            let store: Arc<dyn Store> = Arc::new(first.expect("open"));
            let w = write_federation(&store, &mark).await;
            drop(store);
            let (client, conn) = tokio_postgres::connect(
                &sbp_test_support::test_database_url(),
                tokio_postgres::NoTls,
            )
            .await
            .expect("connect");
            tokio::spawn(conn);
            let stored_clear = async || {
                for (sql, expected) in [
                    ("SELECT record FROM {}.registry_records", &w.record.record),
                    ("SELECT url FROM {}.federation_peers", &w.peer.url),
                    ("SELECT jti FROM {}.federation_jti", &mark),
                    (
                        "SELECT gateway_url FROM {}.registry_gateways",
                        &w.vouch.gateway_url,
                    ),
                ] {
                    let sql = sql.replace("{}", &name);
                    let row = client.query_one(&sql, &[]).await.expect("row");
                    assert_eq!(&row.get::<_, String>(0), expected, "{sql}");
                }
            };
            stored_clear().await;
            let rotated = again.open_with(sealer(2, &[1])).await.expect("rotated");
            let done = rotated.reseal().await.expect("reseal");
            assert_eq!(done.forgotten, Some(1), "{done:?}");
            resealed_no_federation_column(&done);
            drop(rotated);
            stored_clear().await;
            let fresh: Arc<dyn Store> =
                Arc::new(again.open_with(sealer(2, &[])).await.expect("key 2 alone"));
            reads_federation(&fresh, &w, &mark).await;
        };
        let outcome = tokio::spawn(case).await;
        let schema = std::sync::Arc::try_unwrap(schema).unwrap_or_else(|_| panic!("shared"));
        schema
            .run(async move {
                if let Err(e) = outcome {
                    std::panic::resume_unwind(e.into_panic());
                }
            })
            .await;
    }

    /// Every field of every entry in the prefix's tether streams, as raw strings.
    async fn stream_fields(prefix: &str) -> Vec<String> {
        let client = redis::Client::open(sbp_test_support::test_redis_url()).expect("url");
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}tether:*"))
            .query_async(&mut con)
            .await
            .expect("keys");
        let mut fields = Vec::new();
        for key in keys {
            let kind: String = redis::cmd("TYPE")
                .arg(&key)
                .query_async(&mut con)
                .await
                .expect("type");
            if kind != "stream" {
                continue;
            }
            let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
                .arg(&key)
                .arg("-")
                .arg("+")
                .query_async(&mut con)
                .await
                .expect("xrange");
            fields.extend(entries.into_iter().flat_map(|(_, f)| f));
        }
        fields
    }

    /// Handed-off tether entries live only in Redis, sealed under key 1. A reseal of the database
    /// alone keeps key 1 (the database records that a Redis tether seals here), and the tether
    /// itself refuses a start without key 1; resealing the streams first lets both forget it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reseal_without_the_tether_keeps_the_keys_its_entries_need() {
        use sbp_store::redis_tether::{RedisTetherOptions, TetherMode, TetheredStore};
        use sbp_store::seal::{Forget, Kept};
        use sbp_store::{FinishTurn, SessionStore, TetherStore, TurnStore};
        let dir = tempfile::tempdir().expect("temp dir");
        let url = sbp_test_support::test_redis_url();
        let prefix = format!("sbptest:{}:", uuid::Uuid::new_v4().simple());
        let (url_in, prefix_in) = (url.clone(), prefix.clone());
        let case = async move {
            let (url, prefix) = (url_in, prefix_in);
            let opts = |s: Sealer| RedisTetherOptions {
                prefix: prefix.clone(),
                mode: TetherMode::Handoff,
                // The test runs the relay itself.
                relay_interval: std::time::Duration::from_secs(3600),
                sealer: s,
                ..RedisTetherOptions::default()
            };
            let tethered = async |sql: Sealer, redis: Sealer| {
                let inner: Arc<dyn Store> = Arc::new(open_sqlite(dir.path(), sql).await?);
                TetheredStore::open(inner, &url, opts(redis)).await
            };
            let store = tethered(sealer(1, &[]), sealer(1, &[]))
                .await
                .expect("open");
            let s = sbp_store::NewSession {
                id: uuid::Uuid::new_v4(),
                agent_id: "agent".to_owned(),
                token_hash: uuid::Uuid::new_v4().simple().to_string(),
                created_at: chrono::Utc::now(),
                metadata: serde_json::json!({}),
            };
            store.create_session(s.clone()).await.expect("create");
            store
                .mark_attached(s.id, chrono::Utc::now())
                .await
                .expect("attach");
            let entry = sbp_store::NewTetherEntry {
                role: "assistant".to_owned(),
                content: Some("pending reply".to_owned()),
                model_used: None,
                created_at: chrono::Utc::now(),
                chunk_id: uuid::Uuid::new_v4(),
            };
            store
                .finish_turn(FinishTurn {
                    session_id: s.id,
                    turn_id: None,
                    messages: vec![],
                    count_step: false,
                    post_action: None,
                    checkpoint: None,
                    tether: Some(entry),
                    tether_only_if_enabled: false,
                    idempotency_done: None,
                    idempotency_claim: None,
                    now: chrono::Utc::now(),
                })
                .await
                .expect("finish");
            store.relay_once().await.expect("hand off");
            assert_eq!(
                store.inner().tether_count(s.id).await.expect("outbox"),
                0,
                "handed off: the entry lives only in Redis"
            );
            drop(store);

            // `sbp store reseal` without --tether.
            let sql = open_sqlite(dir.path(), sealer(2, &[1]))
                .await
                .expect("rotated");
            let done = sql.reseal().await.expect("reseal");
            assert!(done.is_clean(), "{done:?}");
            assert_eq!(
                (done.kept, done.forgotten),
                (Some(Kept::TetherNotResealed), None)
            );
            drop(sql);
            assert_eq!(
                sealing_error(open_sqlite(dir.path(), sealer(2, &[])).await),
                SealError::MissingKeys(vec![key(1).id()])
            );
            assert_eq!(
                sealing_error(tethered(sealer(2, &[1]), sealer(2, &[])).await),
                SealError::MissingKeys(vec![key(1).id()]),
                "the tether records key 1 too"
            );
            assert_eq!(
                sealing_error(tethered(sealer(2, &[1]), Sealer::off()).await),
                SealError::Locked(vec![key(1).id()]),
            );

            // With --tether: the streams first, then the database.
            let store = tethered(sealer(2, &[1]), sealer(2, &[1]))
                .await
                .expect("rotated");
            let streams = store.reseal_streams().await.expect("streams");
            assert_eq!(streams.total(), 1, "{streams:?}");
            assert!(streams.is_clean());
            drop(store);
            let sql = open_sqlite(dir.path(), sealer(2, &[1]))
                .await
                .expect("rotated");
            let done = sql
                .reseal_with(Forget::IfCleanWithTether)
                .await
                .expect("reseal");
            assert_eq!((done.kept, done.forgotten), (None, Some(1)));
            drop(sql);
            let store = tethered(sealer(2, &[]), sealer(2, &[]))
                .await
                .expect("key 2 alone");
            let pending = store.tether_pending(s.id, None, 10).await.expect("opens");
            assert_eq!(pending.len(), 1);
            assert_eq!(pending[0].content.as_deref(), Some("pending reply"));
        };
        let outcome = tokio::spawn(case).await;
        let _ = sbp_test_support::delete_prefix(&url, &prefix).await;
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_streams_hold_no_plaintext_and_reseal() {
        use sbp_store::redis_tether::TetherMode;
        let mut fx = crate::redis_tether::Fixture::new(false, TetherMode::Handoff).await;
        fx.sealer = sealer(1, &[]);
        let mut control = crate::redis_tether::Fixture::new(false, TetherMode::Handoff).await;
        control.sealer = Sealer::off();
        let first = marker();
        let tethered = fx.tethered().await;
        let plain = control.tethered().await;
        let (prefix, control_prefix) = (fx.prefix.clone(), control.prefix.clone());
        fx.sealer = sealer(2, &[1]);
        let fx = Arc::new(fx);
        let again = Arc::clone(&fx);
        let case = async move {
            let store: Arc<dyn Store> = tethered.clone();
            let w1 = write_everything(&store, &first).await;
            reads_everything(&store, &w1, true).await;
            let fields = stream_fields(&prefix).await;
            assert!(fields.iter().any(|f| f.starts_with(PREFIX)), "{fields:?}");
            assert!(!fields.iter().any(|f| f.contains(&first)), "{fields:?}");
            let plain: Arc<dyn Store> = plain;
            write_everything(&plain, &first).await;
            let moved = marker();
            write_migrated(&plain, &moved).await;
            let control = stream_fields(&control_prefix).await;
            assert!(
                control.iter().any(|f| f.contains(&first)),
                "the control finds it"
            );
            assert!(control.iter().any(|f| f.contains(&moved)));
            drop((store, tethered));

            // Rotated: the stream entry sealed under key 1 is resealed under key 2.
            let rotated = again.tethered().await;
            assert_eq!(rotated.reseal_streams().await.expect("reseal").total(), 1);
            let fields = stream_fields(&prefix).await;
            let sealed: Vec<&String> = fields.iter().filter(|f| f.starts_with(PREFIX)).collect();
            assert!(!sealed.is_empty());
            for f in sealed {
                assert_eq!(Sealer::sealed_by(f), Sealed::By(key(2).id()));
            }
            let store: Arc<dyn Store> = rotated;
            reads_everything(&store, &w1, true).await;
            // A migrated session's carried tether is streamed sealed too.
            let m1 = write_migrated(&store, &moved).await;
            reads_migrated(&store, &m1).await;
            let fields = stream_fields(&prefix).await;
            assert!(!fields.iter().any(|f| f.contains(&moved)), "{fields:?}");
        };
        let outcome = tokio::spawn(case).await;
        control.run(async {}).await;
        let fx = Arc::try_unwrap(fx).unwrap_or_else(|_| panic!("shared"));
        fx.run(async move {
            if let Err(e) = outcome {
                std::panic::resume_unwind(e.into_panic());
            }
        })
        .await;
    }
}
