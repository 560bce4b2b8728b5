//! The SQLite backend: one writer thread that group-commits every queued write in one transaction,
//! and a small pool of read-only connections that WAL lets run alongside it.

mod codec;
mod federation;
mod holds;
mod lifecycle;
mod ops;
mod reseal;
mod roaming;
mod schema;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{Connection, OpenFlags};
use sbp_protocol::{SessionStatus, SnapshotKind};
use tokio::sync::Semaphore;
use uuid::Uuid;

use self::codec::db_err;
use self::writer::JobSender;
use crate::RedeemOutcome;
use crate::seal::{Forget, Kept, Resealed, Sealer};
use crate::{
    AdoptOutcome, AdoptSession, BeginTurn, BeginTurnOutcome, ExportRecord, FailTurn, FinishTurn,
    FinishTurnOutcome, IdempotencyRecord, IdempotencyStore, Lineage, MemoryRecord, MessageRecord,
    MessageStore, NewBundle, NewExport, NewSession, RetentionStore, RoamingStore, SessionQuery,
    SessionRecord, SessionStore, SnapshotRecord, SnapshotStore, StoreError, StoreResult, Sweep,
    Swept, TetherEntry, TetherStore, Timestamp, TurnProgress, TurnProgressOutcome, TurnRecord,
    TurnStore,
};

/// How long a connection waits for a lock held by another process before giving up with `Backend`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Enough for every distinct statement the store prepares, so none is ever re-parsed.
const STATEMENT_CACHE: usize = 64;
/// Writer page cache, as SQLite's negative KiB count (16 MiB): enough for a batch of 512 turns with
/// time-ordered keys, small enough for the gateway's memory budget.
const WRITER_CACHE_KIB: i64 = -16384;

/// `PRAGMA synchronous` for the connections that write (the writer and the checkpointer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Synchronous {
    /// fsync the WAL on every commit: an acknowledged write survives a power loss.
    #[default]
    Full,
    /// fsync only at checkpoints: survives a process crash, may lose the last commits on power loss.
    Normal,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// The database file; missing parent directories are created.
    pub path: PathBuf,
    pub synchronous: Synchronous,
    /// Read-only connections, i.e. how many reads run at once (0 is taken as 1).
    pub readers: usize,
    /// Encryption at rest: seals the content columns (off: stored as they are). Checked against
    /// the keys the database records at open ([`Sealer::check`]).
    pub sealer: Sealer,
}

impl SqliteOptions {
    /// Options with the defaults: `Synchronous::Full`, 4 readers, encryption off.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            synchronous: Synchronous::Full,
            readers: 4,
            sealer: Sealer::off(),
        }
    }
}

/// A SQLite-backed [`crate::Store`]. Cheap to clone; the writer thread stops and the connections close
/// when the last clone is dropped.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// `Option` only so `Drop` can close the channel before joining the writer.
    jobs: Option<JobSender>,
    writer: Option<JoinHandle<()>>,
    checkpoints: Option<JoinHandle<()>>,
    readers: Arc<ReadPool>,
    seal: Sealer,
}

impl Drop for Inner {
    fn drop(&mut self) {
        drop(self.jobs.take());
        // No job can be queued any more (submitting needs `Inner`), so the writer finishes the batch
        // in hand and exits; joining makes "dropped" mean "closed" for a reopen of the same file.
        // The checkpointer follows once the writer's connection (which holds its bell) is closed.
        for handle in [self.writer.take(), self.checkpoints.take()]
            .into_iter()
            .flatten()
        {
            if handle.join().is_err() {
                tracing::error!("sqlite background thread panicked");
            }
        }
    }
}

struct ReadPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    permits: Arc<Semaphore>,
}

impl ReadPool {
    fn take(&self) -> StoreResult<Connection> {
        let idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        match idle {
            Some(conn) => Ok(conn),
            // A permit guarantees a pooled connection unless a read panicked and lost its one;
            // open a replacement instead of failing.
            None => open_reader(&self.path),
        }
    }

    fn give_back(&self, conn: Connection) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(conn);
        }
    }

    /// Runs `work` on a pooled connection, on this thread; the caller holds a permit. A panic in
    /// `work` drops the connection (`take` opens another when one is missing).
    fn run<T>(
        &self,
        seal: &Sealer,
        work: impl FnOnce(&Connection, &Sealer) -> StoreResult<T>,
    ) -> StoreResult<T> {
        let conn = self.take()?;
        let result = work(&conn, seal);
        self.give_back(conn);
        result
    }
}

fn configure(conn: &Connection) -> StoreResult<()> {
    conn.busy_timeout(BUSY_TIMEOUT).map_err(db_err)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // The bundled SQLite has STAT4, which re-prepares a cached statement whenever a bound value
    // of a range term (`seq > ?`) changes: 8% of the gateway's CPU. A stable query plan avoids it.
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )
    .map_err(db_err)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(db_err)
}

fn open_reader(path: &Path) -> StoreResult<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(db_err)?;
    configure(&conn)?;
    Ok(conn)
}

/// Times a reseal tries the truncating checkpoint while a reader holds the WAL.
const CHECKPOINT_ATTEMPTS: u32 = 5;
/// Pause between those attempts (each already waits up to the busy timeout).
const CHECKPOINT_PAUSE: Duration = Duration::from_millis(100);

/// Copies the WAL into the database file and empties it, so the earlier bytes a reseal replaced
/// (or an erasure zeroed) are in neither. SQLite answers `(busy, log frames, checkpointed
/// frames)` rather than failing when a reader's snapshot or a write holds frames back: that is
/// retried a few times. Whether the WAL is empty now.
fn truncate_wal(conn: &Connection) -> StoreResult<bool> {
    // No busy wait: a TRUNCATE checkpoint waiting for readers holds off every new writer of the
    // gateway meanwhile (SQLite's documented behaviour). Each attempt either completes at once or
    // gives up at once; the pauses between attempts leave writers free.
    conn.busy_timeout(Duration::ZERO).map_err(db_err)?;
    for attempt in 1..=CHECKPOINT_ATTEMPTS {
        let (busy, log, done): (i64, i64, i64) = conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .map_err(db_err)?;
        if busy == 0 {
            return Ok(true);
        }
        tracing::debug!(
            attempt,
            log,
            done,
            "wal checkpoint busy: a reader holds the wal"
        );
        if attempt < CHECKPOINT_ATTEMPTS {
            std::thread::sleep(CHECKPOINT_PAUSE);
        }
    }
    Ok(false)
}

/// [`truncate_wal`] on a connection of its own, off the writer thread.
fn truncate_wal_at(path: &Path) -> StoreResult<bool> {
    let conn = Connection::open(path).map_err(db_err)?;
    configure(&conn)?;
    truncate_wal(&conn)
}

/// Creates missing parent directories (owner only, 0700) and the database file (owner only, 0600)
/// before SQLite opens it: SQLite gives the `-wal` and `-shm` files the database file's mode. An
/// existing database, WAL or shared-memory file that others may read is narrowed to 0600 (logged).
fn private_files(path: &Path) -> StoreResult<()> {
    let fail = |what: &Path, e: std::io::Error| {
        StoreError::Backend(format!("prepare {}: {e}", what.display()))
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(dir).map_err(|e| fail(dir, e))?;
    }
    let mut create = std::fs::OpenOptions::new();
    create.write(true).create(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut create, 0o600);
    create.open(path).map_err(|e| fail(path, e))?;
    #[cfg(unix)]
    for suffix in ["", "-wal", "-shm"] {
        use std::os::unix::fs::PermissionsExt as _;
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let file = PathBuf::from(file);
        let Ok(meta) = std::fs::metadata(&file) else {
            continue;
        };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| fail(&file, e))?;
            tracing::warn!(
                path = %file.display(),
                was = format!("{mode:o}"),
                "database file was readable by others; narrowed to 0600"
            );
        }
    }
    Ok(())
}

fn open_writer(opts: &SqliteOptions) -> StoreResult<Connection> {
    private_files(&opts.path)?;
    let mut conn = Connection::open(&opts.path).map_err(db_err)?;
    configure(&conn)?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .map_err(db_err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Backend(format!(
            "journal_mode is {mode}, WAL required"
        )));
    }
    conn.pragma_update(None, "synchronous", opts.synchronous.pragma())
        .map_err(db_err)?;
    // Every job runs in a savepoint, whose undo pages would otherwise be written to a temp file.
    conn.pragma_update(None, "temp_store", "MEMORY")
        .map_err(db_err)?;
    // Once the WAL has been checkpointed and restarts, give its disk space back above 64 MiB.
    conn.pragma_update(None, "journal_size_limit", 64 * 1024 * 1024)
        .map_err(db_err)?;
    // Big batches dirty many pages; a larger cache keeps them from spilling mid-transaction.
    conn.pragma_update(None, "cache_size", WRITER_CACHE_KIB)
        .map_err(db_err)?;
    // Freed cells and pages are zeroed, so content a write replaced or deleted (an acknowledged
    // tether entry, a replaced memory document, an erased session) does not stay in the file's
    // free space; the pages a delete dirties are written anyway, so this costs little.
    conn.pragma_update(None, "secure_delete", "ON")
        .map_err(db_err)?;
    schema::migrate(&mut conn)?;
    schema::check_keys(&mut conn, &opts.sealer)?;
    Ok(conn)
}

fn open_checkpointer(opts: &SqliteOptions) -> StoreResult<Connection> {
    let conn = Connection::open(&opts.path).map_err(db_err)?;
    configure(&conn)?;
    // A checkpoint syncs the database file before the WAL may be reused; that follows this setting.
    conn.pragma_update(None, "synchronous", opts.synchronous.pragma())
        .map_err(db_err)?;
    Ok(conn)
}

impl SqliteStore {
    /// Opens (creating when missing) and migrates the database, then starts the writer thread.
    pub async fn open(opts: SqliteOptions) -> StoreResult<SqliteStore> {
        tokio::task::spawn_blocking(move || Self::open_blocking(opts))
            .await
            .map_err(|e| StoreError::Backend(format!("open task failed: {e}")))?
    }

    fn open_blocking(opts: SqliteOptions) -> StoreResult<SqliteStore> {
        let conn = open_writer(&opts)?;
        // Readers open after the writer so the WAL and shared-memory files exist for them.
        let count = opts.readers.max(1);
        let idle = (0..count)
            .map(|_| open_reader(&opts.path))
            .collect::<StoreResult<Vec<_>>>()?;
        let checkpointer = open_checkpointer(&opts)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let (writer, checkpoints) = writer::spawn(conn, rx, checkpointer)?;
        tracing::info!(
            path = %opts.path.display(),
            readers = count,
            encryption_at_rest = ?opts.sealer.current().map(|id| id.to_string()),
            "sqlite store open"
        );
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                jobs: Some(tx),
                writer: Some(writer),
                checkpoints: Some(checkpoints),
                readers: Arc::new(ReadPool {
                    path: opts.path,
                    idle: Mutex::new(idle),
                    permits: Arc::new(Semaphore::new(count)),
                }),
                seal: opts.sealer,
            }),
        })
    }

    /// Queues `work` for the writer; resolves once the transaction holding it has committed.
    /// `work` gets the connection and the store's sealer.
    async fn write<T, F>(&self, work: F) -> StoreResult<T>
    where
        F: FnOnce(&Connection, &Sealer) -> StoreResult<T> + Send + 'static,
        T: Send + 'static,
    {
        let closed = || StoreError::Backend("sqlite writer stopped".to_owned());
        let seal = self.inner.seal.clone();
        let (job, reply) = writer::job(move |c: &Connection| {
            // Inside the write transaction: a reseal's forgetting of this key (another process,
            // also one write transaction) is either before this check or after this job's values,
            // which its final scan then finds.
            if seal.is_on() {
                reseal::check_current(c, &seal)?;
            }
            work(c, &seal)
        });
        let jobs = self.inner.jobs.as_ref().ok_or_else(closed)?;
        jobs.send(job).map_err(|_| closed())?;
        reply.await.map_err(|_| closed())?
    }

    /// Re-seals every content value under the keyring's current key (plain values included), then
    /// drops the earlier keys from the database's record, so a start without them is accepted
    /// ([`SqliteStore::reseal_with`] with [`Forget::IfClean`]).
    pub async fn reseal(&self) -> StoreResult<Resealed> {
        self.reseal_with(Forget::IfClean).await
    }

    /// Re-seals every content value under the keyring's current key (plain values included); a
    /// value that does not open is left as it is and listed. Then, as `forget` allows and only if
    /// every value opened, drops the earlier keys from the database's record, so a start without
    /// them is accepted. Each page of rows is one write: run it with the gateways stopped, or
    /// while every running one already seals under the current key (their writes then need no
    /// reseal). Ends with a `VACUUM` and a truncating checkpoint, so no earlier bytes stay in free
    /// pages or the WAL.
    pub async fn reseal_with(&self, forget: Forget) -> StoreResult<Resealed> {
        if !self.inner.seal.is_on() {
            return Err(StoreError::Backend(
                "a reseal needs an encryption key".to_owned(),
            ));
        }
        // Cells the rewrites free are zeroed, not left holding the earlier bytes until reused.
        self.write(|c, _| c.pragma_update(None, "secure_delete", "ON").map_err(db_err))
            .await?;
        let mut done = Resealed::default();
        for &target in crate::seal::SEALED_COLUMNS {
            let mut after: Option<Vec<rusqlite::types::Value>> = None;
            loop {
                let from = after.take();
                let (page, next) = self
                    .write(move |c, s| reseal::reseal_page(c, s, target, from.as_deref()))
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
            && self.read(|c, _| reseal::has_tether(c)).await?
        {
            done.kept = Some(Kept::TetherNotResealed);
        }
        if done.kept.is_none() {
            done.forgot(self.write(reseal::forget_earlier_keys).await?);
        }
        // Rewritten rows leave their old bytes in free pages and in the WAL: rebuild the file from
        // the live (sealed) content, then empty the WAL.
        let path = self.inner.readers.path.clone();
        tokio::task::spawn_blocking(move || -> StoreResult<()> {
            let conn = Connection::open(&path).map_err(db_err)?;
            configure(&conn)?;
            conn.pragma_update(None, "secure_delete", "ON")
                .map_err(db_err)?;
            conn.execute_batch("VACUUM").map_err(db_err)?;
            if truncate_wal(&conn)? {
                return Ok(());
            }
            Err(StoreError::Backend(
                "every value is resealed, but another connection (a running gateway?) holds the \
                 database open, so the write-ahead log still holds earlier bytes: stop the \
                 gateways and run sbp store reseal again"
                    .to_owned(),
            ))
        })
        .await
        .map_err(|e| StoreError::Backend(format!("vacuum task failed: {e}")))??;
        tracing::info!(
            values = done.total(),
            unopened = done.unopened_total,
            earlier_keys_forgotten = ?done.forgotten,
            "sqlite store resealed"
        );
        Ok(done)
    }

    /// Runs `work` on a pooled read-only connection in the blocking pool.
    async fn read<T, F>(&self, work: F) -> StoreResult<T>
    where
        F: FnOnce(&Connection, &Sealer) -> StoreResult<T> + Send + 'static,
        T: Send + 'static,
    {
        let pool = Arc::clone(&self.inner.readers);
        let seal = self.inner.seal.clone();
        let permit = Arc::clone(&pool.permits)
            .acquire_owned()
            .await
            .map_err(|_| StoreError::Backend("sqlite read pool closed".to_owned()))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            pool.run(&seal, work)
        })
        .await
        .map_err(|e| StoreError::Backend(format!("sqlite read task failed: {e}")))?
    }

    /// A read of one row by its key (a b-tree descent over pages the OS caches), run on the
    /// calling thread when a pooled connection is free at once, else queued like [`Self::read`].
    /// Handing a read this small to the blocking pool and back cost more than the read: two
    /// thread wake-ups and switches, 15 % of a durable turn's gateway CPU (BENCHMARKS.md). A read
    /// never waits on the writer (WAL: readers see the last commit), so the thread is held for
    /// the descent alone.
    async fn read_point<T, F>(&self, work: F) -> StoreResult<T>
    where
        F: FnOnce(&Connection, &Sealer) -> StoreResult<T> + Send + 'static,
        T: Send + 'static,
    {
        let pool = &self.inner.readers;
        let Ok(_permit) = pool.permits.try_acquire() else {
            return self.read(work).await;
        };
        pool.run(&self.inner.seal, work)
    }
}

#[async_trait]
impl SessionStore for SqliteStore {
    async fn create_session(&self, session: NewSession) -> StoreResult<()> {
        self.write(move |c, s| ops::insert_session(c, s, &session))
            .await
    }

    async fn get_session(&self, id: Uuid) -> StoreResult<Option<SessionRecord>> {
        self.read_point(move |c, s| ops::get_session(c, s, id))
            .await
    }

    async fn find_session_by_token(&self, token_hash: &str) -> StoreResult<Option<SessionRecord>> {
        let token_hash = token_hash.to_owned();
        self.read_point(move |c, s| ops::find_session_by_token(c, s, &token_hash))
            .await
    }

    async fn latest_suspended_for_agent(
        &self,
        agent_id: &str,
    ) -> StoreResult<Option<SessionRecord>> {
        let agent_id = agent_id.to_owned();
        self.read(move |c, s| ops::latest_suspended_for_agent(c, s, &agent_id))
            .await
    }

    async fn update_status(
        &self,
        id: Uuid,
        to: SessionStatus,
        now: Timestamp,
    ) -> StoreResult<SessionStatus> {
        self.write(move |c, _| ops::update_status(c, id, to, now))
            .await
    }

    async fn mark_attached(&self, id: Uuid, now: Timestamp) -> StoreResult<SessionRecord> {
        self.write(move |c, s| ops::mark_attached(c, s, id, now))
            .await
    }

    async fn suspend_if_running(&self, id: Uuid, now: Timestamp) -> StoreResult<bool> {
        self.write(move |c, _| ops::suspend_if_running(c, id, now))
            .await
    }

    /// One row per status in `SessionStatus::ALL` order, zero counts included.
    async fn count_sessions_by_status(&self) -> StoreResult<Vec<(SessionStatus, u64)>> {
        self.read(|c, _| ops::count_sessions_by_status(c)).await
    }

    async fn list_sessions(&self, query: SessionQuery) -> StoreResult<Vec<SessionRecord>> {
        self.read(move |c, s| lifecycle::list_sessions(c, s, &query))
            .await
    }

    /// The erasure is one write (zeroing what it frees); then the WAL, which still holds the
    /// earlier versions of those pages, is copied back and truncated. A checkpoint that other
    /// connections keep busy is retried a few times, then left to the next one (logged): the
    /// erasure itself stands.
    async fn delete_session(&self, id: Uuid, now: Timestamp) -> StoreResult<()> {
        self.write(move |c, _| lifecycle::delete_session(c, id, &now))
            .await?;
        let path = self.inner.readers.path.clone();
        let truncated = tokio::task::spawn_blocking(move || truncate_wal_at(&path))
            .await
            .map_err(|e| StoreError::Backend(format!("checkpoint task failed: {e}")))
            .and_then(|r| r);
        match truncated {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                session_id = %id,
                "session erased; the write-ahead log stays busy, so its earlier pages go at a \
                 later checkpoint"
            ),
            Err(e) => {
                tracing::warn!(session_id = %id, error = %e, "session erased; truncating the write-ahead log failed")
            }
        }
        Ok(())
    }
}

#[async_trait]
impl MessageStore for SqliteStore {
    async fn list_messages(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<MessageRecord>> {
        self.read(move |c, s| ops::list_messages(c, s, session_id, after, Some(limit)))
            .await
    }

    async fn history(&self, session_id: Uuid) -> StoreResult<Vec<MessageRecord>> {
        self.read(move |c, s| ops::list_messages(c, s, session_id, None, None))
            .await
    }
}

#[async_trait]
impl SnapshotStore for SqliteStore {
    async fn latest_snapshot(
        &self,
        session_id: Uuid,
        kind: Option<SnapshotKind>,
    ) -> StoreResult<Option<SnapshotRecord>> {
        self.read(move |c, s| ops::latest_snapshot(c, s, session_id, kind))
            .await
    }

    async fn get_snapshot(&self, id: Uuid) -> StoreResult<Option<SnapshotRecord>> {
        self.read(move |c, s| ops::get_snapshot(c, s, id)).await
    }

    /// Newest first.
    async fn list_snapshots(
        &self,
        session_id: Uuid,
        limit: u32,
    ) -> StoreResult<Vec<SnapshotRecord>> {
        self.read(move |c, s| ops::list_snapshots(c, s, session_id, limit))
            .await
    }
}

#[async_trait]
impl TetherStore for SqliteStore {
    async fn record_sealing_tether(&self, prefix: &str) -> StoreResult<()> {
        let prefix = prefix.to_owned();
        self.write(move |c, _| reseal::record_tether(c, &prefix))
            .await
    }

    async fn tether_pending(
        &self,
        session_id: Uuid,
        after: Option<u64>,
        limit: u32,
    ) -> StoreResult<Vec<TetherEntry>> {
        self.read(move |c, s| ops::tether_pending(c, s, session_id, after, limit))
            .await
    }

    async fn tether_count(&self, session_id: Uuid) -> StoreResult<u64> {
        self.read(move |c, _| ops::tether_count(c, session_id))
            .await
    }

    async fn tether_issued(&self, session_id: Uuid) -> StoreResult<u64> {
        self.read(move |c, _| ops::tether_issued(c, session_id))
            .await
    }

    async fn tether_ack(&self, session_id: Uuid, up_to: u64) -> StoreResult<u64> {
        self.write(move |c, _| ops::tether_ack(c, session_id, up_to))
            .await
    }

    async fn tether_remove(&self, session_id: Uuid, seqs: &[u64]) -> StoreResult<u64> {
        let seqs = seqs.to_vec();
        self.write(move |c, _| ops::tether_remove(c, session_id, &seqs))
            .await
    }

    async fn tether_depth_total(&self) -> StoreResult<u64> {
        self.read(|c, _| ops::tether_depth_total(c)).await
    }
}

#[async_trait]
impl TurnStore for SqliteStore {
    async fn begin_turn(&self, begin: BeginTurn) -> StoreResult<BeginTurnOutcome> {
        self.write(move |c, s| ops::begin_turn(c, s, begin)).await
    }

    async fn finish_turn(&self, finish: FinishTurn) -> StoreResult<FinishTurnOutcome> {
        self.write(move |c, s| ops::finish_turn(c, s, finish)).await
    }

    async fn record_progress(&self, progress: TurnProgress) -> StoreResult<TurnProgressOutcome> {
        self.write(move |c, s| ops::record_progress(c, s, progress))
            .await
    }

    async fn fail_turn(&self, fail: FailTurn) -> StoreResult<()> {
        self.write(move |c, s| ops::fail_turn(c, s, &fail)).await
    }

    async fn recover_interrupted_turns(&self, now: Timestamp) -> StoreResult<Vec<TurnRecord>> {
        self.write(move |c, s| ops::recover_interrupted_turns(c, s, now))
            .await
    }

    async fn replica_heartbeat(&self, replica: &str, now: Timestamp) -> StoreResult<()> {
        let replica = replica.to_owned();
        self.write(move |c, _| ops::replica_heartbeat(c, &replica, now))
            .await
    }

    async fn recover_orphaned_turns(
        &self,
        now: Timestamp,
        stale_before: Timestamp,
    ) -> StoreResult<Vec<TurnRecord>> {
        self.write(move |c, s| ops::recover_orphaned_turns(c, s, now, stale_before))
            .await
    }

    async fn get_turn(&self, turn_id: Uuid) -> StoreResult<Option<TurnRecord>> {
        self.read_point(move |c, s| ops::get_turn(c, s, turn_id))
            .await
    }
}

#[async_trait]
impl IdempotencyStore for SqliteStore {
    async fn get_idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>> {
        let key = key.to_owned();
        self.read_point(move |c, s| ops::get_idempotency(c, s, &key))
            .await
    }
}

#[async_trait]
impl RetentionStore for SqliteStore {
    async fn sweep(&self, sweep: Sweep) -> StoreResult<Swept> {
        self.write(move |c, _| {
            let mut swept = roaming::sweep(c, &sweep)?;
            federation::sweep(c, &sweep, &mut swept)?;
            Ok(swept)
        })
        .await
    }
}

#[async_trait]
impl RoamingStore for SqliteStore {
    async fn create_export(&self, export: NewExport, bundle: NewBundle) -> StoreResult<()> {
        self.write(move |c, s| roaming::create_export(c, s, &export, &bundle))
            .await
    }

    async fn get_export(&self, id: Uuid) -> StoreResult<Option<ExportRecord>> {
        self.read(move |c, s| roaming::get_export(c, s, id)).await
    }

    async fn get_bundle(&self, cid: &str) -> StoreResult<Option<Vec<u8>>> {
        let cid = cid.to_owned();
        self.read(move |c, s| roaming::get_bundle(c, s, &cid)).await
    }

    async fn redeem_export(
        &self,
        id: Uuid,
        by: &str,
        now: Timestamp,
        retry_after: Timestamp,
    ) -> StoreResult<RedeemOutcome> {
        let by = by.to_owned();
        self.write(move |c, _| roaming::redeem_export(c, id, &by, &now, &retry_after))
            .await
    }

    async fn adopt_session(&self, adopt: AdoptSession) -> StoreResult<AdoptOutcome> {
        let adopt = Arc::new(adopt);
        let encoded =
            crate::codec::encode_ahead(&self.inner.seal, &adopt, |a| &a.messages, adopt.session.id)
                .await?;
        self.write(move |c, s| roaming::adopt_session(c, s, &adopt, encoded.as_ref()))
            .await
    }

    async fn lineage(&self, session_id: Uuid) -> StoreResult<Lineage> {
        self.read(move |c, s| roaming::lineage(c, s, session_id))
            .await
    }

    async fn get_memory(&self, session_id: Uuid) -> StoreResult<Option<MemoryRecord>> {
        self.read(move |c, s| roaming::get_memory(c, s, session_id))
            .await
    }

    async fn put_memory(
        &self,
        session_id: Uuid,
        schema_id: String,
        payload: serde_json::Value,
        now: Timestamp,
    ) -> StoreResult<MemoryRecord> {
        self.write(move |c, s| roaming::put_memory(c, s, session_id, &schema_id, &payload, &now))
            .await
    }
}
