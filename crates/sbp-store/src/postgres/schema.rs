//! The PostgreSQL schema as an ordered list of migrations, applied at open. `sbp_schema_version`
//! keeps one row per applied migration, so a later version appends one and never edits an old one.
//! Several gateways starting at once take turns through a transaction-scoped advisory lock.

use deadpool_postgres::Client;

use super::codec::db_err;
use crate::seal::Sealer;
use crate::{StoreError, StoreResult};

/// First key of the advisory lock that serialises migrations ("sbp" in ASCII); the second is a
/// hash of the schema, so stores in different schemas of one database do not wait for each other.
const LOCK_CLASS: i32 = 0x0073_6270;

/// Migration `i` moves the schema from version `i` to `i + 1`.
///
/// Same tables, keys and meaning as the SQLite schema (`sqlite/schema.rs`). JSON is kept as the
/// exact text serde_json wrote, not `jsonb`, which would normalise it (`-0.0`, `1e-7`, duplicate
/// keys, `\u0000`) and change what a re-canonicalised bundle hashes to.
const MIGRATIONS: &[&str] = &[
    // v1: the schema of SQLite v2 (core + L3 roaming).
    r#"
    CREATE TABLE sessions (
        id             uuid PRIMARY KEY,
        -- Insertion order (SQLite's rowid): breaks ties between sessions updated in the same
        -- microsecond in `latest_suspended_for_agent`.
        ord            bigint GENERATED ALWAYS AS IDENTITY,
        agent_id       text NOT NULL,
        token_hash     text NOT NULL,
        status         text NOT NULL,
        step_count     bigint NOT NULL DEFAULT 0,
        message_count  bigint NOT NULL DEFAULT 0,
        last_task      text,
        model          text,
        tether_enabled boolean NOT NULL DEFAULT false,
        -- The next tether seq to hand out; only ever grows, so a seq is never reused.
        tether_seq     bigint NOT NULL DEFAULT 1,
        created_at     timestamptz NOT NULL,
        updated_at     timestamptz NOT NULL,
        metadata       text NOT NULL
    );
    CREATE UNIQUE INDEX sessions_token_hash ON sessions (token_hash);
    -- Partial: every turn rewrites updated_at, and only suspended sessions are looked up by it.
    CREATE INDEX sessions_suspended_by_agent ON sessions (agent_id, updated_at DESC, ord DESC)
        WHERE status = 'suspended';
    CREATE INDEX sessions_status ON sessions (status);

    CREATE TABLE messages (
        session_id uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        seq        bigint NOT NULL,
        role       text NOT NULL,
        body       text NOT NULL,
        model_used text,
        cost_usd   double precision,
        created_at timestamptz NOT NULL,
        PRIMARY KEY (session_id, seq)
    );

    CREATE TABLE snapshots (
        -- Insertion order: "latest" means the last written, never a timestamp tie. Writes of one
        -- session hold its row lock, so within a session this is also commit order.
        ord           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id            uuid NOT NULL UNIQUE,
        session_id    uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        kind          text NOT NULL,
        step_count    bigint NOT NULL,
        message_count bigint NOT NULL,
        model         text,
        current_task  text,
        created_at    timestamptz NOT NULL,
        state         text NOT NULL
    );
    CREATE INDEX snapshots_session ON snapshots (session_id, ord);
    CREATE INDEX snapshots_session_kind ON snapshots (session_id, kind, ord);

    CREATE TABLE tether (
        session_id uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        seq        bigint NOT NULL,
        role       text NOT NULL,
        content    text,
        model_used text,
        created_at timestamptz NOT NULL,
        chunk_id   uuid NOT NULL,
        PRIMARY KEY (session_id, seq)
    );

    CREATE TABLE turns (
        id          uuid PRIMARY KEY,
        session_id  uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        state       text NOT NULL,
        started_at  timestamptz NOT NULL,
        finished_at timestamptz,
        error       text
    );
    -- Only running turns are ever looked up by state (restart recovery).
    CREATE INDEX turns_running ON turns (state) WHERE state = 'running';

    CREATE TABLE idempotency (
        key             text PRIMARY KEY,
        session_id      uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        -- The turn that claimed (or re-claimed) the key, so restart recovery can release it.
        turn_id         uuid,
        fingerprint     text NOT NULL,
        state           text NOT NULL,
        created_session boolean NOT NULL,
        response_status integer,
        response_body   text,
        created_at      timestamptz NOT NULL,
        updated_at      timestamptz NOT NULL
    );
    CREATE INDEX idempotency_turn ON idempotency (turn_id);

    -- Content-addressed: the canonical bytes of the sealed bundle (`bundle_cid` included).
    CREATE TABLE bundles (
        cid        text PRIMARY KEY,
        body       bytea NOT NULL,
        created_at timestamptz NOT NULL
    );

    -- No foreign key to sessions: a foreign export names a session of another gateway.
    CREATE TABLE exports (
        id                uuid PRIMARY KEY,
        session_id        uuid NOT NULL,
        bundle_cid        text NOT NULL REFERENCES bundles (cid),
        label             text,
        message_count     bigint NOT NULL,
        created_at        timestamptz NOT NULL,
        expires_at        timestamptz NOT NULL,
        foreign_origin    boolean NOT NULL,
        imported_at       timestamptz,
        import_session_id uuid
    );
    CREATE INDEX exports_session ON exports (session_id, created_at);

    CREATE TABLE lineage (
        id           uuid PRIMARY KEY,
        kind         text NOT NULL,
        from_session uuid,
        to_session   uuid NOT NULL,
        from_agent   text,
        to_agent     text,
        export_id    uuid,
        label        text,
        reason       text,
        fork_point   bigint,
        reused       boolean NOT NULL,
        created_at   timestamptz NOT NULL
    );
    CREATE INDEX lineage_from ON lineage (from_session, created_at);
    CREATE INDEX lineage_to ON lineage (to_session, created_at);

    CREATE TABLE session_memory (
        session_id uuid PRIMARY KEY REFERENCES sessions (id) ON DELETE CASCADE,
        schema_id  text NOT NULL,
        payload    text NOT NULL,
        updated_at timestamptz NOT NULL
    );
    "#,
    // v2: a turn updates its session row twice, and those updates should be HOT (no new index
    // entries, dead versions pruned within the page). An update is HOT only when no indexed column
    // changes, and every turn changes updated_at, which v1 indexed for the suspended-session lookup:
    // that index now holds only agent_id, and the lookup sorts one agent's suspended sessions.
    // Free space left in each page lets the new version stay on its page.
    r#"
    DROP INDEX sessions_suspended_by_agent;
    CREATE INDEX sessions_suspended_by_agent ON sessions (agent_id) WHERE status = 'suspended';
    ALTER TABLE sessions SET (fillfactor = 70);
    "#,
    // v3: turn ownership, as SQLite v3: a turn records the replica running it, and a replica's
    // heartbeat says it is alive, so a replica starting fails only the turns of replicas that
    // stopped heartbeating. A nullable column without a default is added without rewriting turns.
    r#"
    ALTER TABLE turns ADD COLUMN owner text;

    CREATE TABLE replicas (
        id           text PRIMARY KEY,
        heartbeat_at timestamptz NOT NULL
    );
    "#,
    // v4: an Idempotency-Key on a pushed turn replays its tether seq.
    r#"
    ALTER TABLE idempotency ADD COLUMN tether_seq bigint;
    "#,
    // v5: the size of each transcript (the bytes of its messages' bodies as stored), kept beside
    // `message_count` for the per-session byte limit, as SQLite v5; existing sessions are measured
    // once here. A column with a constant default is added without rewriting the table.
    r#"
    ALTER TABLE sessions ADD COLUMN message_bytes bigint NOT NULL DEFAULT 0;
    UPDATE sessions SET message_bytes = m.bytes
        FROM (SELECT session_id, SUM(octet_length(body)) AS bytes FROM messages GROUP BY session_id) m
        WHERE m.session_id = sessions.id;
    "#,
    // v6: encryption at rest (SQLite v6). A row per key that content here is (or may be) sealed
    // under, with a value sealed under it that every start opens.
    r#"
    CREATE TABLE sealing_keys (
        key_id      text PRIMARY KEY,
        check_value text NOT NULL
    );
    "#,
    // v7: a row per Redis tether (its key prefix) that seals under this keyring (SQLite v7).
    r#"
    CREATE TABLE sealing_tethers (
        prefix text PRIMARY KEY
    );
    "#,
    // v8: gateway federation (L6), the tables and columns of SQLite v8. Nothing here is sealed.
    // The added columns are nullable or have a constant default: no table is rewritten.
    r#"
    CREATE TABLE federation_identity (
        id           integer PRIMARY KEY CHECK (id = 1),
        gateway_id   text NOT NULL,
        first_key_id text NOT NULL,
        created_at   timestamptz NOT NULL
    );

    CREATE TABLE federation_peers (
        gateway_id  text PRIMARY KEY,
        url         text NOT NULL,
        public_key  text NOT NULL,
        key_id      text NOT NULL,
        -- A JSON array (text, as every JSON column here).
        old_keys    text NOT NULL,
        -- pin | tracker | tofu
        source      text NOT NULL,
        verified_at timestamptz NOT NULL,
        updated_at  timestamptz NOT NULL
    );

    CREATE TABLE federation_jti (
        issuer     text NOT NULL,
        jti        text NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (issuer, jti)
    );
    CREATE INDEX federation_jti_expires ON federation_jti (expires_at);

    CREATE TABLE session_holds (
        session_id       uuid PRIMARY KEY REFERENCES sessions (id) ON DELETE CASCADE,
        epoch            bigint NOT NULL,
        -- home | leased | moved | incoming
        state            text NOT NULL,
        peer_gateway     text,
        peer_url         text,
        migration_id     text,
        lease_expires_at timestamptz,
        updated_at       timestamptz NOT NULL
    );
    CREATE INDEX session_holds_state ON session_holds (state, lease_expires_at);

    CREATE TABLE announcements (
        bundle_cid   text PRIMARY KEY,
        seq          bigint NOT NULL,
        expires_at   timestamptz NOT NULL,
        announced_at timestamptz NOT NULL
    );
    CREATE INDEX announcements_expires ON announcements (expires_at);

    CREATE TABLE registry_records (
        gateway_id text NOT NULL,
        bundle_cid text NOT NULL,
        bundle_url text NOT NULL,
        seq        bigint NOT NULL,
        issued_at  timestamptz NOT NULL,
        expires_at timestamptz NOT NULL,
        -- The signed JSON exactly as the gateway sent it.
        record     text NOT NULL,
        PRIMARY KEY (gateway_id, bundle_cid)
    );
    CREATE INDEX registry_records_cid ON registry_records (bundle_cid, expires_at);
    CREATE INDEX registry_records_expires ON registry_records (expires_at);

    CREATE TABLE registry_gateways (
        gateway_id  text PRIMARY KEY,
        gateway_url text NOT NULL,
        public_key  text NOT NULL,
        key_id      text NOT NULL,
        verified_at timestamptz NOT NULL
    );

    ALTER TABLE lineage ADD COLUMN peer_gateway text;
    ALTER TABLE exports ADD COLUMN purpose text NOT NULL DEFAULT 'roaming';
    ALTER TABLE exports ADD COLUMN redeemed_by text;
    "#,
    // v9: session lifecycle (listing, erasure), as SQLite v9. Listing reads sessions newest first
    // by (created_at, id), optionally of one agent or one status. created_at and agent_id never
    // change, so the new indexes keep a turn's updates HOT; status was indexed already.
    // `session_bundles` records the bundles that came in with a session (an import's, a move's);
    // `exports` drops its foreign key to `bundles`, so a foreign export consumed by an erased
    // session stays as the record of the token's single use while its bundle goes.
    r#"
    CREATE INDEX sessions_created ON sessions (created_at, id);
    CREATE INDEX sessions_agent_created ON sessions (agent_id, created_at, id);
    DROP INDEX sessions_status;
    CREATE INDEX sessions_status ON sessions (status, created_at, id);

    CREATE TABLE session_bundles (
        session_id uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
        -- No foreign key: a retention sweep removes bundles no export refers to.
        bundle_cid text NOT NULL,
        PRIMARY KEY (session_id, bundle_cid)
    );
    CREATE INDEX session_bundles_cid ON session_bundles (bundle_cid);
    INSERT INTO session_bundles (session_id, bundle_cid)
        SELECT import_session_id, bundle_cid FROM exports
        WHERE foreign_origin AND import_session_id IN (SELECT id FROM sessions)
        ON CONFLICT DO NOTHING;

    ALTER TABLE exports DROP CONSTRAINT IF EXISTS exports_bundle_cid_fkey;
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
];

/// How many migrations this build knows, i.e. the schema version it runs on.
pub const SCHEMA_VERSION: usize = MIGRATIONS.len();

/// One row per applied migration.
const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS sbp_schema_version (
     version    integer PRIMARY KEY,
     applied_at timestamptz NOT NULL DEFAULT now()
 )";

/// The schema's migration lock, held until `tx` ends. Without a schema to create in (a
/// search_path naming none that exists), current_schema() is NULL; the lock is then taken on ''.
async fn migration_lock(tx: &deadpool_postgres::Transaction<'_>) -> StoreResult<()> {
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, hashtext(COALESCE(current_schema(), '')))",
        &[&LOCK_CLASS],
    )
    .await
    .map_err(db_err)?;
    Ok(())
}

/// Brings the schema up to date in one transaction under the advisory lock: of several gateways
/// starting at once, one migrates and the others find the work done.
pub(crate) async fn migrate(client: &mut Client) -> StoreResult<()> {
    let tx = client.transaction().await.map_err(db_err)?;
    // Without a schema to create in, the CREATE below fails with PostgreSQL's own clear message.
    migration_lock(&tx).await?;
    tx.batch_execute(VERSION_TABLE).await.map_err(db_err)?;
    let applied: i32 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM sbp_schema_version",
            &[],
        )
        .await
        .map_err(db_err)?
        .get(0);
    let applied = usize::try_from(applied)
        .map_err(|_| StoreError::Backend(format!("bad schema version {applied}")))?;
    if applied > SCHEMA_VERSION {
        return Err(StoreError::Backend(format!(
            "database schema version {applied} is newer than this build knows ({SCHEMA_VERSION})"
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(applied) {
        let version = i32::try_from(i + 1)
            .map_err(|_| StoreError::Backend("too many migrations".to_owned()))?;
        tx.batch_execute(sql).await.map_err(db_err)?;
        tx.execute(
            "INSERT INTO sbp_schema_version (version) VALUES ($1)",
            &[&version],
        )
        .await
        .map_err(db_err)?;
        tracing::info!(version, "applied postgres migration");
    }
    tx.commit().await.map_err(db_err)
}

/// The keys the database records as sealing its content: `(key id, check value)`.
pub(crate) async fn recorded_keys(
    c: &impl deadpool_postgres::GenericClient,
) -> StoreResult<Vec<(String, String)>> {
    let rows = c
        .query(
            "SELECT key_id, check_value FROM sealing_keys ORDER BY key_id",
            &[],
        )
        .await
        .map_err(db_err)?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// At open: refuses a keyring (or its absence) that does not fit the keys the database records,
/// then records the current key before anything is sealed under it. Under the migration lock, so
/// replicas starting at once with a new key record it once.
pub(crate) async fn check_keys(client: &mut Client, seal: &Sealer) -> StoreResult<()> {
    let tx = client.transaction().await.map_err(db_err)?;
    migration_lock(&tx).await?;
    if let Some((id, check)) = seal.check(&recorded_keys(&tx).await?)? {
        tx.execute(
            "INSERT INTO sealing_keys (key_id, check_value) VALUES ($1, $2) \
             ON CONFLICT (key_id) DO NOTHING",
            &[&id, &check],
        )
        .await
        .map_err(db_err)?;
        tracing::info!(key_id = %id, "encryption at rest: new key recorded");
    }
    tx.commit().await.map_err(db_err)
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, Utc};
    use uuid::Uuid;

    use super::*;
    use crate::postgres::{PostgresOptions, PostgresStore};
    use crate::{
        FederationStore, IdempotencyState, IdempotencyStore, RoamingStore, SessionStore, TurnState,
        TurnStore,
    };

    /// The database tests/store.rs uses (what scripts/test.sh exports, or its default).
    fn url() -> String {
        std::env::var("SBP_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    async fn connect(url: &str) -> tokio_postgres::Client {
        // The connection's task ends when the client is dropped; an error of the connection
        // shows up as a failed statement.
        let (client, _conn) = crate::postgres::connect(url)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is not reachable: {e}"));
        client
    }

    /// A schema an older build left at v2 (before turn ownership), with a turn running and its
    /// key claimed, migrates in place: the turn keeps its row, has no owner, and is then an orphan
    /// for any replica's recovery. Runs in a fresh schema, dropped afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v2_schema_migrates_in_place() {
        in_fresh_schema(migrate_from_v2).await;
    }

    /// A schema a v7 build left (before federation), with a session, an export and a lineage
    /// link, migrates in place: they read back as before, the new columns hold their defaults,
    /// and the federation tables work, `session_holds` tied to its session.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v7_schema_migrates_in_place() {
        in_fresh_schema(migrate_from_v7).await;
    }

    /// Runs `case(url, schema)` in a fresh schema, dropped afterwards.
    async fn in_fresh_schema<F, Fut>(case: F)
    where
        F: FnOnce(String, String) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let url = url();
        let schema = format!("sbp_test_{}", Uuid::new_v4().simple());
        let admin = connect(&url).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .expect("create schema");
        let outcome = tokio::spawn(case(url, schema.clone())).await;
        if let Err(e) = admin
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
        {
            eprintln!("could not drop schema {schema}: {e}");
        }
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    /// A connection whose tables are the schema's, at `version` (migrations applied by hand).
    async fn old_schema(url: &str, schema: &str, version: usize) -> tokio_postgres::Client {
        let old = connect(url).await;
        old.batch_execute(&format!("SET search_path TO {schema}"))
            .await
            .expect("search_path");
        old.batch_execute(VERSION_TABLE).await.expect("versions");
        for (version, sql) in (1i32..).zip(&MIGRATIONS[..version]) {
            old.batch_execute(sql).await.expect("old migration");
            old.execute(
                "INSERT INTO sbp_schema_version (version) VALUES ($1)",
                &[&version],
            )
            .await
            .expect("version");
        }
        old
    }

    async fn migrate_from_v7(url: String, schema: String) {
        let (session, export, link) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let at = Utc::now() - Duration::minutes(5);
        let old = old_schema(&url, &schema, 7).await;
        old.execute(
            "INSERT INTO sessions (id, agent_id, token_hash, status, created_at, updated_at, \
             metadata) VALUES ($1, 'agent', 'hash', 'idle', $2, $2, '{}')",
            &[&session, &at],
        )
        .await
        .expect("session");
        old.execute(
            "INSERT INTO bundles (cid, body, created_at) VALUES ('cid-1', '\\x7b7d', $1)",
            &[&at],
        )
        .await
        .expect("bundle");
        old.execute(
            "INSERT INTO exports (id, session_id, bundle_cid, label, message_count, created_at, \
             expires_at, foreign_origin) VALUES ($1, $2, 'cid-1', 'label', 2, $3, $3, false)",
            &[&export, &session, &at],
        )
        .await
        .expect("export");
        old.execute(
            "INSERT INTO lineage (id, kind, to_session, export_id, reused, created_at) \
             VALUES ($1, 'import', $2, $3, false, $4)",
            &[&link, &session, &export, &at],
        )
        .await
        .expect("link");

        let opts = PostgresOptions {
            max_connections: 2,
            schema: Some(schema),
            ..PostgresOptions::default()
        };
        let store = PostgresStore::open(&url, opts)
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

        let row = old
            .query_one("SELECT purpose, redeemed_by FROM exports", &[])
            .await
            .expect("export columns");
        assert_eq!(
            (row.get::<_, String>(0), row.get::<_, Option<String>>(1)),
            ("roaming".to_owned(), None)
        );
        let row = old
            .query_one("SELECT peer_gateway FROM lineage", &[])
            .await
            .expect("lineage column");
        assert_eq!(row.get::<_, Option<String>>(0), None);
        old.execute(
            "INSERT INTO session_holds (session_id, epoch, state, updated_at) \
             VALUES ($1, 1, 'leased', $2)",
            &[&session, &at],
        )
        .await
        .expect("a hold of an existing session");
        assert!(
            old.execute(
                "INSERT INTO federation_identity (id, gateway_id, first_key_id, created_at) \
                 VALUES (2, 'x', 'y', now())",
                &[],
            )
            .await
            .is_err(),
            "one identity row only"
        );
        old.execute("DELETE FROM sessions WHERE id = $1", &[&session])
            .await
            .expect("delete session");
        let holds: i64 = old
            .query_one("SELECT COUNT(*) FROM session_holds", &[])
            .await
            .expect("holds")
            .get(0);
        assert_eq!(holds, 0, "a hold goes with its session");
        let versions: Vec<i32> = old
            .query(
                "SELECT version FROM sbp_schema_version ORDER BY version",
                &[],
            )
            .await
            .expect("versions")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let latest = i32::try_from(SCHEMA_VERSION).expect("a few migrations");
        assert_eq!(versions, (1..=latest).collect::<Vec<_>>());
    }

    /// A schema a v8 build left (before session lifecycle), with a session that imported a
    /// foreign token (its export and bundle) and an unrelated session, migrates in place: the
    /// bundle is recorded as the session's, so erasing the session removes it and keeps the
    /// export as the record of the token's single use; listing works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v8_schema_migrates_in_place() {
        in_fresh_schema(migrate_from_v8).await;
    }

    async fn migrate_from_v8(url: String, schema: String) {
        let (imported, other, export) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let at = Utc::now() - Duration::minutes(5);
        let old = old_schema(&url, &schema, 8).await;
        for (id, hash, minutes) in [(imported, "h1", 2), (other, "h2", 1)] {
            let created = at + Duration::minutes(minutes);
            old.execute(
                "INSERT INTO sessions (id, agent_id, token_hash, status, created_at, \
                 updated_at, metadata) VALUES ($1, 'agent', $2, 'idle', $3, $3, '{}')",
                &[&id, &hash, &created],
            )
            .await
            .expect("session");
        }
        old.execute(
            "INSERT INTO bundles (cid, body, created_at) VALUES ('cid-f', '\\x7b7d', $1)",
            &[&at],
        )
        .await
        .expect("bundle");
        old.execute(
            "INSERT INTO exports (id, session_id, bundle_cid, label, message_count, created_at, \
             expires_at, foreign_origin, imported_at, import_session_id) \
             VALUES ($1, $2, 'cid-f', 'label', 2, $3, $3, true, $3, $4)",
            &[&export, &Uuid::new_v4(), &at, &imported],
        )
        .await
        .expect("export");

        let opts = PostgresOptions {
            max_connections: 2,
            schema: Some(schema),
            ..PostgresOptions::default()
        };
        let store = PostgresStore::open(&url, opts)
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

    async fn migrate_from_v2(url: String, schema: String) {
        let (session, turn) = (Uuid::new_v4(), Uuid::new_v4());
        let started = Utc::now() - Duration::minutes(5);
        let old = old_schema(&url, &schema, 2).await;
        old.execute(
            "INSERT INTO sessions (id, agent_id, token_hash, status, created_at, updated_at, \
             metadata) VALUES ($1, 'agent', 'hash', 'running', $2, $2, '{}')",
            &[&session, &started],
        )
        .await
        .expect("session");
        old.execute(
            "INSERT INTO turns (id, session_id, state, started_at) VALUES ($1, $2, 'running', $3)",
            &[&turn, &session, &started],
        )
        .await
        .expect("turn");
        old.execute(
            "INSERT INTO idempotency (key, session_id, turn_id, fingerprint, state, \
             created_session, created_at, updated_at) \
             VALUES ('k-v2', $1, $2, 'fp', 'in_progress', false, $3, $3)",
            &[&session, &turn, &started],
        )
        .await
        .expect("key");
        let bodies = [
            r#"{"content":"héllo 東京","role":"user"}"#,
            r#"{"content":"x","role":"user"}"#,
        ];
        for (seq, body) in (0i64..).zip(bodies) {
            old.execute(
                "INSERT INTO messages (session_id, seq, role, body, created_at) \
                 VALUES ($1, $2, 'user', $3, $4)",
                &[&session, &seq, &body, &started],
            )
            .await
            .expect("message");
        }

        let opts = PostgresOptions {
            max_connections: 2,
            schema: Some(schema),
            ..PostgresOptions::default()
        };
        let store = PostgresStore::open(&url, opts)
            .await
            .expect("open migrates");
        let rec = store.get_turn(turn).await.expect("turn").expect("kept");
        assert_eq!((rec.state, rec.owner), (TurnState::Running, None));
        let migrated = store
            .get_session(session)
            .await
            .expect("session")
            .expect("kept");
        assert_eq!(
            migrated.message_bytes,
            bodies.iter().map(|b| b.len() as u64).sum::<u64>(),
            "v5 measures the existing transcript in bytes"
        );
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
        let versions: Vec<i32> = old
            .query(
                "SELECT version FROM sbp_schema_version ORDER BY version",
                &[],
            )
            .await
            .expect("versions")
            .iter()
            .map(|r| r.get(0))
            .collect();
        let latest = i32::try_from(SCHEMA_VERSION).expect("a few migrations");
        assert_eq!(versions, (1..=latest).collect::<Vec<_>>());
    }
}
