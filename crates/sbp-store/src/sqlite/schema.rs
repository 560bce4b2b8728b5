//! The SQLite schema as an ordered list of migrations; `PRAGMA user_version` records how many have run,
//! so a later version appends a migration and never edits an old one.

use rusqlite::Connection;

use super::codec::db_err;
use crate::seal::Sealer;
use crate::{StoreError, StoreResult};

/// Migration `i` moves the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // v1: the first schema.
    r#"
    CREATE TABLE sessions (
        id             TEXT PRIMARY KEY NOT NULL,
        agent_id       TEXT NOT NULL,
        token_hash     TEXT NOT NULL,
        status         TEXT NOT NULL,
        step_count     INTEGER NOT NULL DEFAULT 0,
        message_count  INTEGER NOT NULL DEFAULT 0,
        last_task      TEXT,
        model          TEXT,
        tether_enabled INTEGER NOT NULL DEFAULT 0,
        -- The next tether seq to hand out; only ever grows, so a seq is never reused.
        tether_seq     INTEGER NOT NULL DEFAULT 1,
        created_at     TEXT NOT NULL,
        updated_at     TEXT NOT NULL,
        metadata       TEXT NOT NULL
    );
    CREATE UNIQUE INDEX sessions_token_hash ON sessions (token_hash);
    -- Partial: every turn rewrites updated_at, and only suspended sessions are looked up by it.
    CREATE INDEX sessions_suspended_by_agent ON sessions (agent_id, updated_at)
        WHERE status = 'suspended';
    CREATE INDEX sessions_status ON sessions (status);

    CREATE TABLE messages (
        session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        seq        INTEGER NOT NULL,
        role       TEXT NOT NULL,
        body       TEXT NOT NULL,
        model_used TEXT,
        cost_usd   REAL,
        created_at TEXT NOT NULL,
        PRIMARY KEY (session_id, seq)
    ) WITHOUT ROWID;

    CREATE TABLE snapshots (
        -- Insertion order: "latest" means the last written, never a timestamp tie.
        ord           INTEGER PRIMARY KEY AUTOINCREMENT,
        id            TEXT NOT NULL UNIQUE,
        session_id    TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        kind          TEXT NOT NULL,
        step_count    INTEGER NOT NULL,
        message_count INTEGER NOT NULL,
        model         TEXT,
        current_task  TEXT,
        created_at    TEXT NOT NULL,
        state         TEXT NOT NULL
    );
    CREATE INDEX snapshots_session ON snapshots (session_id, ord);
    CREATE INDEX snapshots_session_kind ON snapshots (session_id, kind, ord);

    CREATE TABLE tether (
        session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        seq        INTEGER NOT NULL,
        role       TEXT NOT NULL,
        content    TEXT,
        model_used TEXT,
        created_at TEXT NOT NULL,
        chunk_id   TEXT NOT NULL,
        PRIMARY KEY (session_id, seq)
    ) WITHOUT ROWID;

    CREATE TABLE turns (
        id          TEXT PRIMARY KEY NOT NULL,
        session_id  TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        state       TEXT NOT NULL,
        started_at  TEXT NOT NULL,
        finished_at TEXT,
        error       TEXT
    );
    -- Only running turns are ever looked up by state (restart recovery).
    CREATE INDEX turns_running ON turns (state) WHERE state = 'running';

    CREATE TABLE idempotency (
        key             TEXT PRIMARY KEY NOT NULL,
        session_id      TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        -- The turn that claimed (or re-claimed) the key, so restart recovery can release it.
        turn_id         TEXT,
        fingerprint     TEXT NOT NULL,
        state           TEXT NOT NULL,
        created_session INTEGER NOT NULL,
        response_status INTEGER,
        response_body   TEXT,
        created_at      TEXT NOT NULL,
        updated_at      TEXT NOT NULL
    );
    CREATE INDEX idempotency_turn ON idempotency (turn_id);
    "#,
    // v2: L3 roaming.
    r#"
    -- Content-addressed: the canonical bytes of the sealed bundle (`bundle_cid` included).
    CREATE TABLE bundles (
        cid        TEXT PRIMARY KEY NOT NULL,
        body       BLOB NOT NULL,
        created_at TEXT NOT NULL
    );

    -- No foreign key to sessions: a foreign export names a session of another gateway.
    CREATE TABLE exports (
        id                TEXT PRIMARY KEY NOT NULL,
        session_id        TEXT NOT NULL,
        bundle_cid        TEXT NOT NULL REFERENCES bundles (cid),
        label             TEXT,
        message_count     INTEGER NOT NULL,
        created_at        TEXT NOT NULL,
        expires_at        TEXT NOT NULL,
        foreign_origin    INTEGER NOT NULL,
        imported_at       TEXT,
        import_session_id TEXT
    );
    CREATE INDEX exports_session ON exports (session_id, created_at);

    CREATE TABLE lineage (
        id           TEXT PRIMARY KEY NOT NULL,
        kind         TEXT NOT NULL,
        from_session TEXT,
        to_session   TEXT NOT NULL,
        from_agent   TEXT,
        to_agent     TEXT,
        export_id    TEXT,
        label        TEXT,
        reason       TEXT,
        fork_point   INTEGER,
        reused       INTEGER NOT NULL,
        created_at   TEXT NOT NULL
    );
    CREATE INDEX lineage_from ON lineage (from_session, created_at);
    CREATE INDEX lineage_to ON lineage (to_session, created_at);

    CREATE TABLE session_memory (
        session_id TEXT PRIMARY KEY NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        schema_id  TEXT NOT NULL,
        payload    TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    "#,
    // v3: turn ownership, for several gateways on one database: a turn records the replica
    // running it, and a replica's heartbeat says it is alive, so a replica starting fails only the
    // turns of replicas that stopped heartbeating.
    r#"
    ALTER TABLE turns ADD COLUMN owner TEXT;

    CREATE TABLE replicas (
        id           TEXT PRIMARY KEY NOT NULL,
        heartbeat_at TEXT NOT NULL
    );
    "#,
    // v4: an Idempotency-Key on a pushed turn replays its tether seq.
    r#"
    ALTER TABLE idempotency ADD COLUMN tether_seq INTEGER;
    "#,
    // v5: the size of each transcript (the bytes of its messages' bodies as stored), kept beside
    // `message_count` for the per-session byte limit; existing sessions are measured once here.
    r#"
    ALTER TABLE sessions ADD COLUMN message_bytes INTEGER NOT NULL DEFAULT 0;
    UPDATE sessions SET message_bytes = (
        SELECT COALESCE(SUM(length(CAST(body AS BLOB))), 0) FROM messages
        WHERE messages.session_id = sessions.id
    );
    "#,
    // v6: encryption at rest. A row per key that content here is (or may be) sealed under, with a
    // value sealed under it that every start opens: a start without a key, or without one of
    // these keys, is refused before it could read a value it cannot open. No row: nothing sealed.
    r#"
    CREATE TABLE sealing_keys (
        key_id      TEXT PRIMARY KEY NOT NULL,
        check_value TEXT NOT NULL
    );
    "#,
    // v7: a row per Redis tether (its key prefix) that seals under this database's keyring, so a
    // reseal that was not given that tether keeps the earlier keys its streams may still need.
    r#"
    CREATE TABLE sealing_tethers (
        prefix TEXT PRIMARY KEY NOT NULL
    );
    "#,
    // v8: gateway federation (L6), every table it needs at once. None of it is session content, so
    // nothing here is sealed. The node's identity (one row, shared by replicas); the peers it
    // trusts; the replay cache of federation tokens; where a session is held when it moves between
    // gateways (no row: held here, epoch 0); the announcements made to trackers; a tracker's
    // registry (each provider's signed record exactly as received, and what it verified about each
    // gateway). Lineage links name the peer of a move, and exports say what they are for and
    // which gateway redeemed their token.
    r#"
    CREATE TABLE federation_identity (
        id           INTEGER PRIMARY KEY NOT NULL CHECK (id = 1),
        gateway_id   TEXT NOT NULL,
        first_key_id TEXT NOT NULL,
        created_at   TEXT NOT NULL
    );

    CREATE TABLE federation_peers (
        gateway_id  TEXT PRIMARY KEY NOT NULL,
        url         TEXT NOT NULL,
        public_key  TEXT NOT NULL,
        key_id      TEXT NOT NULL,
        -- A JSON array: the manifest's old keys with their expiry.
        old_keys    TEXT NOT NULL,
        -- pin | tracker | tofu
        source      TEXT NOT NULL,
        verified_at TEXT NOT NULL,
        updated_at  TEXT NOT NULL
    );

    CREATE TABLE federation_jti (
        issuer     TEXT NOT NULL,
        jti        TEXT NOT NULL,
        expires_at TEXT NOT NULL,
        PRIMARY KEY (issuer, jti)
    ) WITHOUT ROWID;
    CREATE INDEX federation_jti_expires ON federation_jti (expires_at);

    CREATE TABLE session_holds (
        session_id       TEXT PRIMARY KEY NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        epoch            INTEGER NOT NULL,
        -- home | leased | moved | incoming
        state            TEXT NOT NULL,
        peer_gateway     TEXT,
        peer_url         TEXT,
        migration_id     TEXT,
        lease_expires_at TEXT,
        updated_at       TEXT NOT NULL
    );
    -- Expired leases (the reaper) and unfinished incoming moves (at start) are found by state.
    CREATE INDEX session_holds_state ON session_holds (state, lease_expires_at);

    CREATE TABLE announcements (
        bundle_cid   TEXT PRIMARY KEY NOT NULL,
        seq          INTEGER NOT NULL,
        expires_at   TEXT NOT NULL,
        announced_at TEXT NOT NULL
    );
    CREATE INDEX announcements_expires ON announcements (expires_at);

    CREATE TABLE registry_records (
        gateway_id TEXT NOT NULL,
        bundle_cid TEXT NOT NULL,
        bundle_url TEXT NOT NULL,
        seq        INTEGER NOT NULL,
        issued_at  TEXT NOT NULL,
        expires_at TEXT NOT NULL,
        -- The signed JSON exactly as the gateway sent it.
        record     TEXT NOT NULL,
        PRIMARY KEY (gateway_id, bundle_cid)
    ) WITHOUT ROWID;
    CREATE INDEX registry_records_cid ON registry_records (bundle_cid, expires_at);
    CREATE INDEX registry_records_expires ON registry_records (expires_at);

    CREATE TABLE registry_gateways (
        gateway_id  TEXT PRIMARY KEY NOT NULL,
        gateway_url TEXT NOT NULL,
        public_key  TEXT NOT NULL,
        key_id      TEXT NOT NULL,
        verified_at TEXT NOT NULL
    );

    ALTER TABLE lineage ADD COLUMN peer_gateway TEXT;
    ALTER TABLE exports ADD COLUMN purpose TEXT NOT NULL DEFAULT 'roaming';
    ALTER TABLE exports ADD COLUMN redeemed_by TEXT;
    "#,
    // v9: session lifecycle (listing, erasure). Listing reads sessions newest first by
    // (created_at, id), optionally of one agent or one status: an index for each (created_at and
    // agent_id never change, so turns' updates of the row do not touch the first two; status was
    // indexed already). `session_bundles` records the bundles that came in with a session (an
    // import's, a move's), which its erasure removes; those of earlier imports of foreign tokens
    // are found through their export. `exports` loses its foreign key to `bundles` (rebuilt, the
    // SQLite way to drop one): a foreign export consumed by an erased session stays as the
    // record of the token's single use while its bundle goes.
    r#"
    CREATE INDEX sessions_created ON sessions (created_at, id);
    CREATE INDEX sessions_agent_created ON sessions (agent_id, created_at, id);
    DROP INDEX sessions_status;
    CREATE INDEX sessions_status ON sessions (status, created_at, id);

    CREATE TABLE session_bundles (
        session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        -- No foreign key: a retention sweep removes bundles no export refers to.
        bundle_cid TEXT NOT NULL,
        PRIMARY KEY (session_id, bundle_cid)
    ) WITHOUT ROWID;
    CREATE INDEX session_bundles_cid ON session_bundles (bundle_cid);
    INSERT OR IGNORE INTO session_bundles (session_id, bundle_cid)
        SELECT import_session_id, bundle_cid FROM exports
        WHERE foreign_origin = 1 AND import_session_id IN (SELECT id FROM sessions);

    CREATE TABLE exports_v9 (
        id                TEXT PRIMARY KEY NOT NULL,
        session_id        TEXT NOT NULL,
        bundle_cid        TEXT NOT NULL,
        label             TEXT,
        message_count     INTEGER NOT NULL,
        created_at        TEXT NOT NULL,
        expires_at        TEXT NOT NULL,
        foreign_origin    INTEGER NOT NULL,
        imported_at       TEXT,
        import_session_id TEXT,
        purpose           TEXT NOT NULL DEFAULT 'roaming',
        redeemed_by       TEXT
    );
    INSERT INTO exports_v9 (id, session_id, bundle_cid, label, message_count, created_at,
        expires_at, foreign_origin, imported_at, import_session_id, purpose, redeemed_by)
        SELECT id, session_id, bundle_cid, label, message_count, created_at, expires_at,
        foreign_origin, imported_at, import_session_id, purpose, redeemed_by FROM exports;
    DROP TABLE exports;
    ALTER TABLE exports_v9 RENAME TO exports;
    CREATE INDEX exports_session ON exports (session_id, created_at);
    CREATE INDEX exports_bundle ON exports (bundle_cid);
    CREATE INDEX exports_import_session ON exports (import_session_id);
    "#,
    // v10: a turn's snapshots cost one index entry fewer. `snapshots_session_kind` served only the
    // latest snapshot of one kind, which the (session_id, ord) index finds too by reading back
    // from the newest (a turn writes a pre- and a post-action snapshot, so every kind but a rare
    // one is a few rows back); each turn paid for it with a leaf page per session in every commit.
    r#"
    DROP INDEX IF EXISTS snapshots_session_kind;
    "#,
    // v11: a session's snapshots are a chain instead of an index. Each row names the one written
    // before it in its session (`prev_ord`) and the session row names its latest
    // (`latest_snapshot`), so writing a snapshot touches the table's last page and the session's
    // row, which the turn updates anyway. The (session_id, ord) index cost a leaf page per session
    // in every commit, a third of a growing-session commit's pages (BENCHMARKS.md, issue 17). The
    // table is rebuilt without its foreign key, whose cascade would scan the table without the
    // index: a session's snapshots are removed along the chain before its row.
    r#"
    CREATE TABLE snapshots_v11 (
        -- Insertion order: "latest" means the last written, never a timestamp tie.
        ord           INTEGER PRIMARY KEY AUTOINCREMENT,
        id            TEXT NOT NULL UNIQUE,
        session_id    TEXT NOT NULL,
        -- The session's snapshot written before this one (NULL: none, or swept).
        prev_ord      INTEGER,
        kind          TEXT NOT NULL,
        step_count    INTEGER NOT NULL,
        message_count INTEGER NOT NULL,
        model         TEXT,
        current_task  TEXT,
        created_at    TEXT NOT NULL,
        state         TEXT NOT NULL
    );
    INSERT INTO snapshots_v11 (ord, id, session_id, prev_ord, kind, step_count, message_count,
        model, current_task, created_at, state)
        SELECT ord, id, session_id, LAG(ord) OVER (PARTITION BY session_id ORDER BY ord), kind,
        step_count, message_count, model, current_task, created_at, state FROM snapshots;
    DROP TABLE snapshots;
    ALTER TABLE snapshots_v11 RENAME TO snapshots;
    ALTER TABLE sessions ADD COLUMN latest_snapshot INTEGER;
    UPDATE sessions SET latest_snapshot = latest.ord
        FROM (SELECT session_id, MAX(ord) AS ord FROM snapshots GROUP BY session_id) AS latest
        WHERE latest.session_id = sessions.id;
    "#,
];

/// Brings the database up to the latest schema in one immediate transaction, so two processes opening
/// the same file cannot both migrate.
pub(crate) fn migrate(conn: &mut Connection) -> StoreResult<()> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(db_err)?;
    let version: i64 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(db_err)?;
    let known = MIGRATIONS.len();
    let applied = usize::try_from(version)
        .map_err(|_| StoreError::Backend(format!("bad schema version {version}")))?;
    if applied > known {
        return Err(StoreError::Backend(format!(
            "database schema version {applied} is newer than this build knows ({known})"
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(applied) {
        tx.execute_batch(sql).map_err(db_err)?;
        tracing::info!(version = i + 1, "applied sqlite migration");
    }
    if applied < known {
        // PRAGMA takes no bound parameters; `known` is a small integer we own.
        tx.execute_batch(&format!("PRAGMA user_version = {known}"))
            .map_err(db_err)?;
    }
    tx.commit().map_err(db_err)
}

/// The keys the database records as sealing its content: `(key id, check value)`.
pub(crate) fn recorded_keys(conn: &Connection) -> StoreResult<Vec<(String, String)>> {
    conn.prepare("SELECT key_id, check_value FROM sealing_keys ORDER BY key_id")
        .and_then(|mut st| st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
        .map_err(db_err)
}

/// At open: refuses a keyring (or its absence) that does not fit the keys the database records,
/// then records the current key before anything is sealed under it.
pub(crate) fn check_keys(conn: &mut Connection, seal: &Sealer) -> StoreResult<()> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(db_err)?;
    if let Some((id, check)) = seal.check(&recorded_keys(&tx)?)? {
        tx.execute(
            "INSERT INTO sealing_keys (key_id, check_value) VALUES (?1, ?2) \
             ON CONFLICT (key_id) DO NOTHING",
            [&id, &check],
        )
        .map_err(db_err)?;
        tracing::info!(key_id = %id, "encryption at rest: new key recorded");
    }
    tx.commit().map_err(db_err)
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, Utc};
    use rusqlite::params;
    use uuid::Uuid;

    use super::*;
    use crate::sqlite::codec::{ts, uuid};
    use crate::sqlite::{SqliteOptions, SqliteStore};
    use crate::{
        FederationStore, IdempotencyState, IdempotencyStore, RoamingStore, SessionStore,
        SnapshotStore, TurnState, TurnStore,
    };

    /// A database an older build left at `version`: the first `version` migrations applied.
    fn database_at(path: &std::path::Path, version: usize) -> Connection {
        let conn = Connection::open(path).expect("open");
        for sql in &MIGRATIONS[..version] {
            conn.execute_batch(sql).expect("an earlier migration");
        }
        conn.execute_batch(&format!("PRAGMA user_version = {version}"))
            .expect("version");
        conn
    }

    /// A session row as every schema version since v1 holds it, created and updated `at`.
    fn old_session(
        conn: &Connection,
        id: &Uuid,
        token_hash: &str,
        status: &str,
        at: &chrono::DateTime<Utc>,
    ) {
        conn.execute(
            "INSERT INTO sessions (id, agent_id, token_hash, status, created_at, updated_at, \
             metadata) VALUES (?1, 'agent', ?2, ?3, ?4, ?4, '{}')",
            params![uuid(id), token_hash, status, ts(at)],
        )
        .expect("session");
    }

    /// Message bodies of an old database, with multi-byte characters.
    const BODIES: [&str; 2] = [
        r#"{"content":"héllo 東京","role":"user"}"#,
        r#"{"content":"x","role":"user"}"#,
    ];

    /// A database an older build left at v2 (before turn ownership), with a turn running and its
    /// key claimed, migrates in place: the turn keeps its row, has no owner, and is then an orphan
    /// for any replica's recovery.
    #[tokio::test]
    async fn v2_database_migrates_in_place() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("v2.sqlite3");
        let (session, turn) = (Uuid::new_v4(), Uuid::new_v4());
        let started = Utc::now() - Duration::minutes(5);
        {
            let conn = database_at(&path, 2);
            old_session(&conn, &session, "hash", "running", &started);
            conn.execute(
                "INSERT INTO turns (id, session_id, state, started_at) \
                 VALUES (?1, ?2, 'running', ?3)",
                params![uuid(&turn), uuid(&session), ts(&started)],
            )
            .expect("turn");
            conn.execute(
                "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
                 created_session, created_at, updated_at) \
                 VALUES ('k-v2', ?1, ?2, 'fp', 'in_progress', 0, ?3, ?3)",
                params![uuid(&session), uuid(&turn), ts(&started)],
            )
            .expect("key");
            for (seq, body) in BODIES.iter().enumerate() {
                conn.execute(
                    "INSERT INTO messages (session_id, seq, role, body, created_at) \
                     VALUES (?1, ?2, 'user', ?3, ?4)",
                    params![uuid(&session), seq as i64, body, ts(&started)],
                )
                .expect("message");
            }
        }

        let store = SqliteStore::open(SqliteOptions::new(&path))
            .await
            .expect("open migrates");
        let migrated = store
            .get_session(session)
            .await
            .expect("session")
            .expect("kept");
        assert_eq!(
            migrated.message_bytes,
            BODIES.iter().map(|b| b.len() as u64).sum::<u64>(),
            "v5 measures the existing transcript in bytes, not characters"
        );
        let old = store.get_turn(turn).await.expect("turn").expect("kept");
        assert_eq!((old.state, old.owner), (TurnState::Running, None));
        let now = Utc::now();
        store
            .replica_heartbeat("replica-1", now)
            .await
            .expect("replicas table");
        let recovered = store
            .recover_orphaned_turns(now, now - Duration::seconds(30))
            .await
            .expect("recover");
        assert_eq!(recovered.iter().map(|t| t.id).collect::<Vec<_>>(), [turn]);
        let key = store
            .get_idempotency("k-v2")
            .await
            .expect("idem")
            .expect("kept");
        assert_eq!(key.state, IdempotencyState::Failed);
        drop(store);

        let conn = Connection::open(&path).expect("inspect");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(usize::try_from(version).ok(), Some(MIGRATIONS.len()));
    }

    /// A database a v7 build left (before federation), with a session, an export and a lineage
    /// link, migrates in place: they read back as before, the new columns hold their defaults,
    /// and the federation tables work, `session_holds` tied to its session.
    #[tokio::test]
    async fn v7_database_migrates_in_place() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("v7.sqlite3");
        let (session, export, link) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let at = Utc::now() - Duration::minutes(5);
        {
            let conn = database_at(&path, 7);
            old_session(&conn, &session, "hash", "idle", &at);
            conn.execute(
                "INSERT INTO bundles (cid, body, created_at) VALUES ('cid-1', X'7B7D', ?1)",
                params![ts(&at)],
            )
            .expect("bundle");
            conn.execute(
                "INSERT INTO exports (id, session_id, bundle_cid, label, message_count, \
                 created_at, expires_at, foreign_origin) \
                 VALUES (?1, ?2, 'cid-1', 'label', 2, ?3, ?3, 0)",
                params![uuid(&export), uuid(&session), ts(&at)],
            )
            .expect("export");
            conn.execute(
                "INSERT INTO lineage (id, kind, to_session, export_id, reused, created_at) \
                 VALUES (?1, 'import', ?2, ?3, 0, ?4)",
                params![uuid(&link), uuid(&session), uuid(&export), ts(&at)],
            )
            .expect("link");
        }

        let store = SqliteStore::open(SqliteOptions::new(&path))
            .await
            .expect("open migrates");
        let kept = store
            .get_export(export)
            .await
            .expect("export")
            .expect("kept");
        assert_eq!(
            (kept.bundle_cid.as_str(), kept.label.as_deref()),
            ("cid-1", Some("label"))
        );
        let lineage = store.lineage(session).await.expect("lineage");
        assert_eq!(
            lineage.incoming.iter().map(|l| l.id).collect::<Vec<_>>(),
            [link]
        );
        let identity = store
            .init_identity("gw-1", "kid-1", at)
            .await
            .expect("identity table");
        assert_eq!(identity.gateway_id, "gw-1");
        assert!(store.insert_jti("gw-2", "j", at).await.expect("jti table"));
        drop(store);

        let conn = Connection::open(&path).expect("inspect");
        conn.pragma_update(None, "foreign_keys", "ON").expect("fk");
        let (purpose, redeemed_by): (String, Option<String>) = conn
            .query_row("SELECT purpose, redeemed_by FROM exports", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("export columns");
        assert_eq!((purpose.as_str(), redeemed_by), ("roaming", None));
        let peer: Option<String> = conn
            .query_row("SELECT peer_gateway FROM lineage", [], |r| r.get(0))
            .expect("lineage column");
        assert_eq!(peer, None);
        conn.execute(
            "INSERT INTO session_holds (session_id, epoch, state, updated_at) \
             VALUES (?1, 1, 'leased', ?2)",
            params![uuid(&session), ts(&at)],
        )
        .expect("a hold of an existing session");
        assert!(
            conn.execute(
                "INSERT INTO federation_identity (id, gateway_id, first_key_id, created_at) \
                 VALUES (2, 'x', 'y', 'z')",
                [],
            )
            .is_err(),
            "one identity row only"
        );
        conn.execute("DELETE FROM sessions WHERE id = ?1", [uuid(&session)])
            .expect("delete session");
        let holds: i64 = conn
            .query_row("SELECT COUNT(*) FROM session_holds", [], |r| r.get(0))
            .expect("holds");
        assert_eq!(holds, 0, "a hold goes with its session");
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(usize::try_from(version).ok(), Some(MIGRATIONS.len()));
    }

    /// A database a v8 build left (before session lifecycle), with a session that imported a
    /// foreign token (its export and bundle) and an unrelated session, migrates in place: the
    /// bundle is recorded as the session's, so erasing the session removes it and keeps the
    /// export (no longer tied to `bundles`) as the record of the token's single use.
    #[tokio::test]
    async fn v8_database_migrates_in_place() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("v8.sqlite3");
        let (imported, other, export) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let at = Utc::now() - Duration::minutes(5);
        {
            let conn = database_at(&path, 8);
            for (id, hash, minutes) in [(imported, "h1", 2), (other, "h2", 1)] {
                old_session(&conn, &id, hash, "idle", &(at + Duration::minutes(minutes)));
            }
            conn.execute(
                "INSERT INTO bundles (cid, body, created_at) VALUES ('cid-f', X'7B7D', ?1)",
                params![ts(&at)],
            )
            .expect("bundle");
            conn.execute(
                "INSERT INTO exports (id, session_id, bundle_cid, label, message_count, \
                 created_at, expires_at, foreign_origin, imported_at, import_session_id) \
                 VALUES (?1, ?2, 'cid-f', 'label', 2, ?3, ?3, 1, ?3, ?4)",
                params![
                    uuid(&export),
                    uuid(&Uuid::new_v4()),
                    ts(&at),
                    uuid(&imported)
                ],
            )
            .expect("export");
        }

        let store = SqliteStore::open(SqliteOptions::new(&path))
            .await
            .expect("open migrates");
        let listed = store
            .list_sessions(crate::SessionQuery {
                limit: 10,
                ..crate::SessionQuery::default()
            })
            .await
            .expect("list");
        assert_eq!(
            listed.iter().map(|s| s.id).collect::<Vec<_>>(),
            [imported, other]
        );
        store
            .delete_session(imported, Utc::now())
            .await
            .expect("erase");
        assert_eq!(store.get_bundle("cid-f").await.expect("bundle"), None);
        let kept = store
            .get_export(export)
            .await
            .expect("export")
            .expect("kept");
        assert_eq!((kept.label, kept.import_session_id), (None, Some(imported)));
    }

    /// A v9 database's snapshots become chains (v11): two sessions' snapshots written in turns
    /// are each found newest first, the latest of a rare kind many rows back included, with no
    /// (session, ord) index left; a snapshot written after the migration goes on its session's
    /// chain, and erasing a session removes its snapshots and only them.
    #[tokio::test]
    async fn v9_database_chains_its_snapshots() {
        use sbp_protocol::SnapshotKind;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("v9.sqlite3");
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let at = Utc::now() - Duration::minutes(5);
        let kinds = std::iter::once("checkpoint")
            .chain(["pre_action", "post_action"].into_iter().cycle().take(40));
        let mut ids = Vec::new();
        let mut other = Vec::new();
        {
            let conn = database_at(&path, 9);
            old_session(&conn, &a, "ha", "idle", &at);
            old_session(&conn, &b, "hb", "idle", &at);
            let insert = |session: &Uuid, kind: &str| {
                let id = Uuid::now_v7();
                conn.execute(
                    "INSERT INTO snapshots (id, session_id, kind, step_count, message_count, \
                     created_at, state) VALUES (?1, ?2, ?3, 0, 0, ?4, '{}')",
                    params![uuid(&id), uuid(session), kind, ts(&at)],
                )
                .expect("snapshot");
                id
            };
            for kind in kinds {
                ids.push(insert(&a, kind));
                other.push(insert(&b, "checkpoint"));
            }
        }
        let store = SqliteStore::open(SqliteOptions::new(&path))
            .await
            .expect("open migrates");
        let conn = Connection::open(&path).expect("inspect");
        let indexes: Vec<String> = conn
            .prepare(
                "SELECT name FROM sqlite_master WHERE tbl_name = 'snapshots' AND type = 'index'",
            )
            .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
            .expect("schema");
        assert_eq!(indexes, ["sqlite_autoindex_snapshots_1"], "only the id's");
        let latest = |kind| store.latest_snapshot(a, kind);
        let found = |s: Option<crate::SnapshotRecord>| s.expect("found").id;
        let checkpoint = latest(Some(SnapshotKind::Checkpoint))
            .await
            .expect("checkpoint");
        assert_eq!(found(checkpoint), ids[0]);
        let pre = latest(Some(SnapshotKind::PreAction)).await.expect("pre");
        assert_eq!(found(pre), ids[39]);
        let post = latest(Some(SnapshotKind::PostAction)).await.expect("post");
        assert_eq!(found(post), ids[40]);
        assert_eq!(found(latest(None).await.expect("any")), ids[40]);
        let listed = |session, limit| {
            let store = &store;
            async move {
                let list = store.list_snapshots(session, limit).await.expect("list");
                list.into_iter().map(|s| s.id).collect::<Vec<Uuid>>()
            }
        };
        let newest_first: Vec<Uuid> = ids.iter().rev().copied().collect();
        assert_eq!(listed(a, 100).await, newest_first);
        let three: Vec<Uuid> = other.iter().rev().take(3).copied().collect();
        assert_eq!(listed(b, 3).await, three);
        // Written after the migration: newest of its session, after every older row.
        let next = crate::NewSnapshot {
            id: Uuid::now_v7(),
            kind: SnapshotKind::Checkpoint,
            model: None,
            current_task: None,
            created_at: Utc::now(),
            state: serde_json::json!({}),
        };
        super::super::ops::write_snapshot(&conn, &crate::seal::Sealer::off(), b, (0, 0), &next)
            .expect("written");
        assert_eq!(listed(b, 2).await, [next.id, other[40]]);
        let count = |session: &Uuid| -> i64 {
            conn.query_row(
                "SELECT count(*) FROM snapshots WHERE session_id = ?1",
                [uuid(session)],
                |r| r.get(0),
            )
            .expect("count")
        };
        assert_eq!((count(&a), count(&b)), (41, 42));
        store.delete_session(a, Utc::now()).await.expect("erase");
        assert_eq!((count(&a), count(&b)), (0, 42));
    }
}
