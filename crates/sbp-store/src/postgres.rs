//! The PostgreSQL backend: a pool of tokio-postgres connections (deadpool), each with its own
//! prepared-statement cache. Every write is one transaction that takes the session row's lock
//! first, so concurrent turns of a session serialise on it while other sessions proceed; an
//! operation answers only after COMMIT returned (durable with the server's `synchronous_commit`).
//! Connections use TLS as the URL's libpq parameters say (`connect.rs`, `tls.rs`).

mod codec;
mod connect;
mod federation;
mod holds;
mod lifecycle;
mod ops;
mod reseal;
mod roaming;
mod schema;
mod tls;
mod x509;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Client, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use sbp_protocol::{SessionStatus, SnapshotKind};
use tokio_postgres::config::Host;
use uuid::Uuid;

pub use self::connect::{ConnectOptions, SslMode, TlsParams, UrlError, connect};
pub use self::schema::SCHEMA_VERSION;
pub use self::tls::{Check, HandshakeError, TlsFileError};

use self::codec::db_err;
use self::ops::Tx;
use crate::RedeemOutcome;
use crate::seal::{Forget, Kept, Resealed, Sealer};
use crate::{
    AdoptOutcome, AdoptSession, BeginTurn, BeginTurnOutcome, ExportRecord, FailTurn, FinishTurn,
    FinishTurnOutcome, IdempotencyRecord, IdempotencyStore, Lineage, MemoryRecord, MessageRecord,
    MessageStore, NewBundle, NewExport, NewSession, RoamingStore, SessionQuery, SessionRecord,
    SessionStore, SnapshotRecord, SnapshotStore, StoreError, StoreResult, TetherEntry, TetherStore,
    Timestamp, TurnProgress, TurnProgressOutcome, TurnRecord, TurnStore,
};

#[derive(Debug, Clone)]
pub struct PostgresOptions {
    /// Pooled connections, i.e. how many store operations run at once (0 is taken as 1).
    pub max_connections: usize,
    /// Schema holding the tables: set as each connection's `search_path` (it must exist). `None`
    /// keeps the server's default (normally `public`), or what the URL's `options` set.
    pub schema: Option<String>,
    /// How long an operation waits for a free pooled connection before failing with `Backend`.
    pub acquire_timeout: Duration,
    /// How long opening one connection may take, unless the URL sets `connect_timeout`.
    pub connect_timeout: Duration,
    /// Encryption at rest: seals the content columns (off: stored as they are). Checked against
    /// the keys the database records at open ([`Sealer::check`]).
    pub sealer: Sealer,
}

impl Default for PostgresOptions {
    /// 32 connections, the server's schema, 30 s to get a connection, 10 s to open one,
    /// encryption off.
    fn default() -> Self {
        Self {
            max_connections: 32,
            schema: None,
            acquire_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            sealer: Sealer::off(),
        }
    }
}

/// A PostgreSQL-backed [`crate::Store`]. Cheap to clone; the connections close when the last clone
/// is dropped.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    mode: SslMode,
    seal: Sealer,
}

type TxFuture<'t, T> = Pin<Box<dyn Future<Output = StoreResult<T>> + Send + 't>>;

/// Whether `name` can be put in `search_path` as it is (no quoting or escaping needed).
fn plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.len() < 64
}

/// `url` without its password and query parameters, for logs and the startup line.
pub fn redacted_url(url: &str) -> String {
    // Parameters can name the host; a URL refused for one of them still gets a label.
    let base = match connect::query_start(url) {
        Ok(Some(q)) => &url[..q],
        _ => url,
    };
    let parsed = connect::parse_url(url)
        .ok()
        .map(|parsed| parsed.config)
        .or_else(|| base.parse::<tokio_postgres::Config>().ok());
    let Some(config) = parsed else {
        return "postgres://(unparsable url)".to_owned();
    };
    let user = config
        .get_user()
        .map(|u| format!("{u}@"))
        .unwrap_or_default();
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first());
            match (host, port) {
                (Host::Tcp(h), Some(p)) => format!("{h}:{p}"),
                (Host::Tcp(h), None) => h.clone(),
                #[cfg(unix)]
                (Host::Unix(path), _) => path.display().to_string(),
            }
        })
        .collect();
    let db = config.get_dbname().unwrap_or_default();
    format!("postgres://{user}{}/{db}", hosts.join(","))
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user[:password]@host[:port]/db[?options]`), creates the pool
    /// and migrates the schema. TLS as libpq's URL parameters say: `sslmode` (`disable`, `prefer`
    /// the default, `require`, `verify-ca`, `verify-full`), `sslrootcert` (a PEM file of CAs, or
    /// `system`), `sslcert` and `sslkey` (a client certificate); their files are read here, once,
    /// on the blocking pool.
    pub async fn open(url: &str, opts: PostgresOptions) -> StoreResult<PostgresStore> {
        let options = ConnectOptions::load(url).await?;
        let connector = options.connector();
        let (mut config, tls) = (options.config, options.tls);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(opts.connect_timeout);
        }
        if config.get_application_name().is_none() {
            config.application_name("sbp-gateway");
        }
        // Every statement here is prepared once per connection and looks rows up by key, so one
        // generic plan per statement serves every call. Left to choose, PostgreSQL keeps planning
        // the turn's statements afresh on every call: a custom plan sees the arrays' real lengths
        // and looks cheaper than the generic one. First, so options in the URL can override it.
        let options = match config.get_options() {
            Some(existing) => format!("-c plan_cache_mode=force_generic_plan {existing}"),
            None => "-c plan_cache_mode=force_generic_plan".to_owned(),
        };
        config.options(options);
        if let Some(schema) = &opts.schema {
            if !plain_identifier(schema) {
                return Err(StoreError::Backend(format!(
                    "schema {schema:?}: use lowercase letters, digits and _"
                )));
            }
            let options = match config.get_options() {
                Some(existing) => format!("{existing} -c search_path={schema}"),
                None => format!("-c search_path={schema}"),
            };
            config.options(options);
        }
        let manager = Manager::from_connect(
            config,
            connector,
            ManagerConfig {
                // A closed connection is noticed without a round trip; a broken one fails its
                // operation with `Backend` and is then dropped.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let size = opts.max_connections.max(1);
        let pool = Pool::builder(manager)
            .max_size(size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(opts.acquire_timeout))
            .create_timeout(Some(opts.connect_timeout))
            .build()
            .map_err(|e| StoreError::Backend(format!("postgres pool: {e}")))?;
        let store = PostgresStore {
            pool,
            mode: tls.mode,
            seal: opts.sealer,
        };
        // The first connection's failure names the sslmode it was made under.
        let mut client = store.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => connect::connect_error(&tls, e),
            other => StoreError::Backend(format!("postgres pool: {other}")),
        })?;
        schema::migrate(&mut client).await?;
        schema::check_keys(&mut client, &store.seal).await?;
        // Not every server that speaks the protocol has pg_stat_ssl (poolers, compatible
        // databases): not knowing is no reason to refuse to start.
        let encrypted = encrypted(&client).await.ok();
        drop(client);
        tracing::info!(
            url = %redacted_url(url),
            schema = ?opts.schema,
            connections = size,
            sslmode = tls.mode.as_str(),
            encrypted = ?encrypted,
            encryption_at_rest = ?store.seal.current().map(|id| id.to_string()),
            "postgres store open"
        );
        Ok(store)
    }

    /// Re-seals every content value under the keyring's current key (plain values included), then
    /// drops the earlier keys from the database's record ([`PostgresStore::reseal_with`] with
    /// [`Forget::IfClean`]).
    pub async fn reseal(&self) -> StoreResult<Resealed> {
        self.reseal_with(Forget::IfClean).await
    }

    /// Re-seals every content value under the keyring's current key (plain values included); a
    /// value that does not open is left as it is and listed. Then, as `forget` allows and only if
    /// every value opened, drops the earlier keys from the database's record, so a start without
    /// them is accepted. Each page of rows is one transaction that locks them: run it with the
    /// gateways stopped, or while every running one already seals under the current key.
    pub async fn reseal_with(&self, forget: Forget) -> StoreResult<Resealed> {
        if !self.seal.is_on() {
            return Err(StoreError::Backend(
                "a reseal needs an encryption key".to_owned(),
            ));
        }
        let mut done = Resealed::default();
        for &target in crate::seal::SEALED_COLUMNS {
            let mut after: Option<Vec<String>> = None;
            loop {
                let from = after.take();
                let (page, next) = self
                    .write(move |tx| {
                        let seal = self.seal.clone();
                        Box::pin(async move { reseal::reseal_page(tx, &seal, target, from).await })
                    })
                    .await?;
                done.merge(page);
                match next {
                    Some(at) => after = Some(at),
                    None => break,
                }
            }
        }
        done.kept = done.keep_regardless(forget);
        if done.kept.is_none()
            && forget == Forget::IfClean
            && self
                .write(|tx| Box::pin(async move { reseal::has_tether(tx).await }))
                .await?
        {
            done.kept = Some(Kept::TetherNotResealed);
        }
        if done.kept.is_none() {
            let forgotten = self
                .write(move |tx| {
                    let seal = self.seal.clone();
                    Box::pin(async move { reseal::forget_earlier_keys(tx, &seal).await })
                })
                .await?;
            done.forgot(forgotten);
        }
        tracing::info!(
            values = done.total(),
            unopened = done.unopened_total,
            earlier_keys_forgotten = ?done.forgotten,
            "postgres store resealed"
        );
        Ok(done)
    }

    /// The URL's `sslmode`.
    pub fn ssl_mode(&self) -> SslMode {
        self.mode
    }

    /// Whether a pooled connection is encrypted, as the server sees it (`pg_stat_ssl`). Under
    /// `prefer` a server that declines TLS gets plaintext connections: this tells.
    pub async fn encrypted(&self) -> StoreResult<bool> {
        let client = self.client().await?;
        encrypted(&client).await
    }

    async fn client(&self) -> StoreResult<Client> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => db_err(e),
            other => StoreError::Backend(format!("postgres pool: {other}")),
        })
    }

    /// Runs `work` in a transaction on a pooled connection: COMMIT when it returns `Ok` (and only
    /// then answers), ROLLBACK when it returns `Err`, so a failed operation leaves nothing behind.
    ///
    /// BEGIN is not waited for: it is sent, and `work`'s first statements right behind it on the
    /// same connection, so opening the transaction costs no round trip of its own. (Had BEGIN failed,
    /// the connection is broken and those statements fail too.)
    async fn write<T, F>(&self, work: F) -> StoreResult<T>
    where
        F: for<'t> FnOnce(&'t Tx) -> TxFuture<'t, T> + Send,
        T: Send,
    {
        let open = OpenTx(Some(self.client().await?));
        let client: &Tx = open.client()?;
        // `join!` polls in order, so BEGIN is queued on the connection before the first statement.
        let (begun, done) = tokio::join!(client.batch_execute("BEGIN"), work(client));
        let end = match (&begun, &done) {
            (Ok(()), Ok(_)) => "COMMIT",
            _ => "ROLLBACK",
        };
        let ended = client.batch_execute(end).await;
        match (begun, done, ended) {
            (Ok(()), Ok(v), Ok(())) => {
                open.finish();
                Ok(v)
            }
            (Ok(()), Ok(_), Err(commit)) => Err(db_err(commit)),
            // The operation's own error says more than BEGIN's "transaction is aborted".
            (_, Err(e), ended) => {
                match ended {
                    Ok(()) => open.finish(),
                    // The connection is dropped with `open`, not reused in an unknown state.
                    Err(rollback) => tracing::warn!(error = %rollback, "postgres rollback failed"),
                }
                Err(e)
            }
            (Err(begin), Ok(_), _) => Err(db_err(begin)),
        }
    }

    /// Runs one statement outside an explicit transaction: PostgreSQL commits it on its own before
    /// it answers (durable with `synchronous_commit`), in one round trip.
    async fn autocommit<T>(
        &self,
        work: impl for<'t> FnOnce(&'t Tx) -> TxFuture<'t, T>,
    ) -> StoreResult<T> {
        let client = self.client().await?;
        work(&client).await
    }
}

async fn encrypted(client: &tokio_postgres::Client) -> StoreResult<bool> {
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(db_err)?;
    row.try_get(0).map_err(db_err)
}

/// A pooled connection with a transaction open on it. Dropped before [`OpenTx::finish`] (the
/// operation failed to end it, or its future was dropped mid-way), the connection is taken out of
/// the pool and closed, so the server rolls the transaction back and no later operation runs
/// inside it.
struct OpenTx(Option<Client>);

impl OpenTx {
    fn client(&self) -> StoreResult<&Tx> {
        self.0
            .as_ref()
            .ok_or_else(|| StoreError::Backend("postgres connection already released".to_owned()))
    }

    /// The transaction has ended: the connection goes back to the pool.
    fn finish(mut self) {
        self.0.take();
    }
}

impl Drop for OpenTx {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

#[async_trait]
impl SessionStore for PostgresStore {
    async fn create_session(&self, session: NewSession) -> StoreResult<()> {
        ops::insert_session(&self.client().await?, &self.seal, &session).await
    }

    async fn get_session(&self, id: Uuid) -> StoreResult<Option<SessionRecord>> {
        ops::get_session(&self.client().await?, &self.seal, id).await
    }

    async fn find_session_by_token(&self, token_hash: &str) -> StoreResult<Option<SessionRecord>> {
        ops::find_session_by_token(&self.client().await?, &self.seal, token_hash).await
    }

    async fn latest_suspended_for_agent(
        &self,
        agent_id: &str,
    ) -> StoreResult<Option<SessionRecord>> {
        ops::latest_suspended_for_agent(&self.client().await?, &self.seal, agent_id).await
    }

    async fn update_status(
        &self,
        id: Uuid,
        to: SessionStatus,
        now: Timestamp,
    ) -> StoreResult<SessionStatus> {
        self.write(move |tx| Box::pin(ops::update_status(tx, id, to, now)))
            .await
    }

    async fn mark_attached(&self, id: Uuid, now: Timestamp) -> StoreResult<SessionRecord> {
        ops::mark_attached(&self.client().await?, &self.seal, id, now).await
    }

    async fn suspend_if_running(&self, id: Uuid, now: Timestamp) -> StoreResult<bool> {
        ops::suspend_if_running(&self.client().await?, id, now).await
    }

    /// One row per status in `SessionStatus::ALL` order, zero counts included.
    async fn count_sessions_by_status(&self) -> StoreResult<Vec<(SessionStatus, u64)>> {
        ops::count_sessions_by_status(&self.client().await?).await
    }

    async fn list_sessions(&self, query: SessionQuery) -> StoreResult<Vec<SessionRecord>> {
        lifecycle::list_sessions(&self.client().await?, &self.seal, &query).await
    }

    async fn delete_session(&self, id: Uuid, now: Timestamp) -> StoreResult<()> {
        self.write(move |tx| Box::pin(lifecycle::delete_session(tx, id, now)))
            .await
    }
}

#[async_trait]
impl MessageStore for PostgresStore {
    async fn list_messages(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<MessageRecord>> {
        ops::list_messages(
            &self.client().await?,
            &self.seal,
            session_id,
            after,
            Some(limit),
        )
        .await
    }

    async fn history(&self, session_id: Uuid) -> StoreResult<Vec<MessageRecord>> {
        ops::list_messages(&self.client().await?, &self.seal, session_id, None, None).await
    }
}

#[async_trait]
impl SnapshotStore for PostgresStore {
    async fn latest_snapshot(
        &self,
        session_id: Uuid,
        kind: Option<SnapshotKind>,
    ) -> StoreResult<Option<SnapshotRecord>> {
        ops::latest_snapshot(&self.client().await?, &self.seal, session_id, kind).await
    }

    async fn get_snapshot(&self, id: Uuid) -> StoreResult<Option<SnapshotRecord>> {
        ops::get_snapshot(&self.client().await?, &self.seal, id).await
    }

    /// Newest first.
    async fn list_snapshots(
        &self,
        session_id: Uuid,
        limit: u32,
    ) -> StoreResult<Vec<SnapshotRecord>> {
        ops::list_snapshots(&self.client().await?, &self.seal, session_id, limit).await
    }
}

#[async_trait]
impl TetherStore for PostgresStore {
    async fn record_sealing_tether(&self, prefix: &str) -> StoreResult<()> {
        let prefix = prefix.to_owned();
        self.write(move |tx| Box::pin(async move { reseal::record_tether(tx, &prefix).await }))
            .await
    }

    async fn tether_pending(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<TetherEntry>> {
        ops::tether_pending(&self.client().await?, &self.seal, session_id, after, limit).await
    }

    async fn tether_count(&self, session_id: Uuid) -> StoreResult<u64> {
        ops::tether_count(&self.client().await?, session_id).await
    }

    async fn tether_issued(&self, session_id: Uuid) -> StoreResult<u64> {
        ops::tether_issued(&self.client().await?, session_id).await
    }

    async fn tether_ack(&self, session_id: Uuid, up_to: u64) -> StoreResult<u64> {
        ops::tether_ack(&self.client().await?, session_id, up_to).await
    }

    async fn tether_remove(&self, session_id: Uuid, seqs: &[u64]) -> StoreResult<u64> {
        ops::tether_remove(&self.client().await?, session_id, seqs).await
    }

    async fn tether_depth_total(&self) -> StoreResult<u64> {
        ops::tether_depth_total(&self.client().await?).await
    }
}

#[async_trait]
impl TurnStore for PostgresStore {
    /// Always a transaction: its hold guard must read after the session row's lock is held
    /// (`holds.rs`).
    async fn begin_turn(&self, begin: BeginTurn) -> StoreResult<BeginTurnOutcome> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { ops::begin_turn(tx, &seal, begin).await })
        })
        .await
    }

    async fn finish_turn(&self, finish: FinishTurn) -> StoreResult<FinishTurnOutcome> {
        if ops::finish_is_one_statement(&finish) {
            return self
                .autocommit(move |c| {
                    let seal = self.seal.clone();
                    Box::pin(async move { ops::finish_turn(c, &seal, finish).await })
                })
                .await;
        }
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { ops::finish_turn(tx, &seal, finish).await })
        })
        .await
    }

    async fn record_progress(&self, progress: TurnProgress) -> StoreResult<TurnProgressOutcome> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { ops::record_progress(tx, &seal, progress).await })
        })
        .await
    }

    async fn fail_turn(&self, fail: FailTurn) -> StoreResult<()> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { ops::fail_turn(tx, &seal, fail).await })
        })
        .await
    }

    async fn recover_interrupted_turns(&self, now: Timestamp) -> StoreResult<Vec<TurnRecord>> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { ops::recover_interrupted_turns(tx, &seal, now).await })
        })
        .await
    }

    async fn replica_heartbeat(&self, replica: &str, now: Timestamp) -> StoreResult<()> {
        let client = self.client().await?;
        if self.seal.is_on() {
            reseal::check_current(&client, &self.seal).await?;
        }
        ops::replica_heartbeat(&client, replica, now).await
    }

    async fn recover_orphaned_turns(
        &self,
        now: Timestamp,
        stale_before: Timestamp,
    ) -> StoreResult<Vec<TurnRecord>> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { ops::recover_orphaned_turns(tx, &seal, now, stale_before).await })
        })
        .await
    }

    async fn get_turn(&self, turn_id: Uuid) -> StoreResult<Option<TurnRecord>> {
        ops::get_turn(&self.client().await?, &self.seal, turn_id).await
    }
}

#[async_trait]
impl IdempotencyStore for PostgresStore {
    async fn get_idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>> {
        ops::get_idempotency(&self.client().await?, &self.seal, key).await
    }
}

#[async_trait]
impl crate::RetentionStore for PostgresStore {
    async fn sweep(&self, sweep: crate::Sweep) -> StoreResult<crate::Swept> {
        self.write(move |tx| {
            Box::pin(async move {
                let mut swept = roaming::sweep(tx, sweep).await?;
                federation::sweep(tx, &sweep, &mut swept).await?;
                Ok(swept)
            })
        })
        .await
    }
}

#[async_trait]
impl RoamingStore for PostgresStore {
    async fn create_export(&self, export: NewExport, bundle: NewBundle) -> StoreResult<()> {
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { roaming::create_export(tx, &seal, export, bundle).await })
        })
        .await
    }

    async fn get_export(&self, id: Uuid) -> StoreResult<Option<ExportRecord>> {
        roaming::get_export(&self.client().await?, &self.seal, id).await
    }

    async fn get_bundle(&self, cid: &str) -> StoreResult<Option<Vec<u8>>> {
        roaming::get_bundle(&self.client().await?, &self.seal, cid).await
    }

    async fn redeem_export(
        &self,
        id: Uuid,
        by: &str,
        now: Timestamp,
        retry_after: Timestamp,
    ) -> StoreResult<RedeemOutcome> {
        let by = by.to_owned();
        self.write(move |tx| {
            Box::pin(async move { roaming::redeem_export(tx, id, &by, &now, &retry_after).await })
        })
        .await
    }

    async fn adopt_session(&self, adopt: AdoptSession) -> StoreResult<AdoptOutcome> {
        let adopt = std::sync::Arc::new(adopt);
        let encoded =
            crate::codec::encode_ahead(&self.seal, &adopt, |a| &a.messages, adopt.session.id)
                .await?;
        let adopt = std::sync::Arc::unwrap_or_clone(adopt);
        self.write(move |tx| {
            let seal = self.seal.clone();
            Box::pin(async move { roaming::adopt_session(tx, &seal, adopt, encoded).await })
        })
        .await
    }

    async fn lineage(&self, session_id: Uuid) -> StoreResult<Lineage> {
        roaming::lineage(&self.client().await?, &self.seal, session_id).await
    }

    async fn get_memory(&self, session_id: Uuid) -> StoreResult<Option<MemoryRecord>> {
        roaming::get_memory(&self.client().await?, &self.seal, session_id).await
    }

    async fn put_memory(
        &self,
        session_id: Uuid,
        schema_id: String,
        payload: serde_json::Value,
        now: Timestamp,
    ) -> StoreResult<MemoryRecord> {
        roaming::put_memory(
            &self.client().await?,
            &self.seal,
            session_id,
            &schema_id,
            &payload,
            &now,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_password_and_parameters() {
        assert_eq!(
            redacted_url("postgres://u:secret@db.internal:6432/sbp?application_name=x"),
            "postgres://u@db.internal:6432/sbp"
        );
        assert_eq!(
            redacted_url("postgresql://127.0.0.1/test"),
            "postgres://127.0.0.1:5432/test"
        );
        assert!(!redacted_url("postgres://u:secret@h:x:y/db").contains("secret"));
        assert_eq!(
            redacted_url("postgres://u:secret@h/db?sslmode=verify-full&sslrootcert=/ca.pem"),
            "postgres://u@h:5432/db"
        );
        assert_eq!(
            redacted_url("postgres://u:secret@h/db?sslmode=nonsense&x=y"),
            "postgres://u@h:5432/db"
        );
    }

    #[test]
    fn schema_names_are_plain() {
        assert!(plain_identifier("sbp_test_0f3a"));
        for bad in ["", "Upper", "a b", "a;drop", "1abc", &"x".repeat(64)] {
            assert!(!plain_identifier(bad), "{bad:?}");
        }
    }
}
