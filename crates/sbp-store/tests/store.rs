//! Runs the storage conformance suite against the SQLite backend, each case on a fresh database file in
//! its own temp dir.

mod suite;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sbp_store::sqlite::{SqliteOptions, SqliteStore, Synchronous};
use sbp_store::{SessionStore, Store};
use tempfile::TempDir;

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

sqlite_cases!(
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = db_path(dir.path());
    let store = open(path.clone()).await;
    suite::survives_reopen(store, || open(path.clone())).await;
}

/// Options are honoured: nested parent dirs are created, WAL is on and the schema version is recorded,
/// and reopening an already migrated file works.
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
