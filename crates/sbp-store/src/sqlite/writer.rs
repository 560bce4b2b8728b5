//! The group-commit writer: one OS thread owns the write connection, takes every queued job, runs them
//! in one transaction (each in its own savepoint, so a failing job undoes only itself) and answers each
//! job only after COMMIT returned, so an acknowledged write is durable. A second thread checkpoints the
//! WAL so the writer never does.

use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender};
use std::thread::JoinHandle;

use rusqlite::Connection;
use rusqlite::wal::CheckpointMode;
use tokio::sync::oneshot;

use super::codec::db_err;
use crate::{StoreError, StoreResult};

/// How many jobs one transaction takes at most; bounds the latency a job adds to the others.
const MAX_BATCH: usize = 512;

/// A queued write, erased over its result type.
pub(crate) trait Job: Send {
    /// Runs the work on the writer connection; the result waits in the returned value until COMMIT.
    fn run(self: Box<Self>, conn: &Connection) -> Box<dyn Pending>;
    /// Answers without running (the transaction could not start).
    fn abort(self: Box<Self>, err: StoreError);
}

/// A job that ran and waits for its transaction's outcome.
pub(crate) trait Pending: Send {
    fn succeeded(&self) -> bool;
    /// `commit` is the outcome of the transaction the job ran in.
    fn deliver(self: Box<Self>, commit: StoreResult<()>);
}

struct WriteJob<F, T> {
    work: F,
    reply: oneshot::Sender<StoreResult<T>>,
}

struct Ran<T> {
    result: StoreResult<T>,
    reply: oneshot::Sender<StoreResult<T>>,
}

impl<F, T> Job for WriteJob<F, T>
where
    F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    T: Send + 'static,
{
    fn run(self: Box<Self>, conn: &Connection) -> Box<dyn Pending> {
        let WriteJob { work, reply } = *self;
        // A panicking job must not take the writer thread (and with it every later write) down; the
        // savepoint around it is rolled back like for any other failure.
        let result = catch_unwind(AssertUnwindSafe(|| work(conn)))
            .unwrap_or_else(|_| Err(StoreError::Backend("write job panicked".to_owned())));
        Box::new(Ran { result, reply })
    }

    fn abort(self: Box<Self>, err: StoreError) {
        // The caller may have gone away (cancelled future); nobody is left to tell.
        let _ = self.reply.send(Err(err));
    }
}

impl<T: Send + 'static> Pending for Ran<T> {
    fn succeeded(&self) -> bool {
        self.result.is_ok()
    }

    fn deliver(self: Box<Self>, commit: StoreResult<()>) {
        let result = match (self.result, commit) {
            (Ok(v), Ok(())) => Ok(v),
            (Ok(_), Err(e)) | (Err(e), _) => Err(e),
        };
        let _ = self.reply.send(result);
    }
}

/// Packs a closure and its reply channel into a job.
pub(crate) fn job<F, T>(work: F) -> (Box<dyn Job>, oneshot::Receiver<StoreResult<T>>)
where
    F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    T: Send + 'static,
{
    let (reply, rx) = oneshot::channel();
    (Box::new(WriteJob { work, reply }), rx)
}

/// Starts the writer on `conn` and the checkpointer on `checkpointer`; both threads end once every
/// job sender is gone (the checkpointer when the writer's connection closes).
pub(crate) fn spawn(
    mut conn: Connection,
    rx: Receiver<Box<dyn Job>>,
    checkpointer: Connection,
) -> StoreResult<(JoinHandle<()>, JoinHandle<()>)> {
    // Copying the WAL back into the database (and its fsync) would stall every queued job if the
    // writer did it after a commit, so the writer only rings a bell and a second thread does it.
    let (wake, woken) = std::sync::mpsc::sync_channel::<()>(1);
    conn.pragma_update(None, "wal_autocheckpoint", 0)
        .map_err(db_err)?;
    conn.wal_hook(Some(move |_: &mut rusqlite::hooks::Wal, frames: c_int| {
        if frames >= CHECKPOINT_FRAMES {
            // A full channel means a checkpoint is already due; one ring is enough.
            let _ = wake.try_send(());
        }
        Ok(())
    }))
    .map_err(db_err)?;
    let checkpoints = std::thread::Builder::new()
        .name("sbp-sqlite-ckpt".to_owned())
        .spawn(move || checkpoint_loop(checkpointer, woken))
        .map_err(|e| StoreError::Backend(format!("spawn sqlite checkpointer: {e}")))?;
    let writer = std::thread::Builder::new()
        .name("sbp-sqlite-writer".to_owned())
        .spawn(move || run(conn, rx))
        .map_err(|e| StoreError::Backend(format!("spawn sqlite writer: {e}")))?;
    Ok((writer, checkpoints))
}

/// WAL frames at which a checkpoint is requested: four times SQLite's own auto-checkpoint
/// default, so a page rewritten by many commits (a session's last leaf, the tables' right edges)
/// is copied into the database once per 16 MiB of WAL, not once per 4 MiB.
const CHECKPOINT_FRAMES: c_int = 4000;

fn checkpoint_loop(conn: Connection, woken: Receiver<()>) {
    while woken.recv().is_ok() {
        // PASSIVE never waits for the writer or readers; what it cannot copy now, a later round will.
        if let Err(e) = conn.wal_checkpoint_v2(None::<&str>, CheckpointMode::PASSIVE) {
            tracing::warn!(error = %e, "sqlite checkpoint failed");
        }
    }
}

pub(crate) type JobSender = Sender<Box<dyn Job>>;

/// Ends when every sender is gone, i.e. when the store is dropped.
fn run(conn: Connection, rx: Receiver<Box<dyn Job>>) {
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(MAX_BATCH);
    while let Ok(first) = rx.recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        tracing::trace!(jobs = batch.len(), "sqlite write batch");
        run_batch(&conn, batch.drain(..));
    }
}

fn exec(conn: &Connection, sql: &str) -> StoreResult<()> {
    conn.prepare_cached(sql)
        .and_then(|mut st| st.execute([]))
        .map(|_| ())
        .map_err(db_err)
}

/// Opens a batch's transaction. One left open by a batch whose ROLLBACK failed (an I/O error) is
/// rolled back first, so a single failure does not make every later BEGIN fail.
fn begin(conn: &Connection) -> StoreResult<()> {
    if !conn.is_autocommit() {
        tracing::warn!("sqlite writer found a transaction left open; rolling it back");
        exec(conn, "ROLLBACK")?;
    }
    exec(conn, "BEGIN IMMEDIATE")
}

/// A job alone in its batch runs without a savepoint (the transaction is its own: a failure rolls
/// it back). The savepoint exists to undo one job among others, and opening and releasing it costs
/// a sub-journal write of every page the job touches again.
fn run_batch(conn: &Connection, jobs: impl ExactSizeIterator<Item = Box<dyn Job>>) {
    let alone = jobs.len() == 1;
    let mut ran: Vec<Box<dyn Pending>> = Vec::new();
    let mut in_tx = false;
    for job in jobs {
        if in_tx && conn.is_autocommit() {
            // SQLite rolled the whole transaction back on its own (I/O error, disk full, ...):
            // the jobs that ran so far are lost, so they fail, and the rest start a fresh one.
            tracing::warn!(lost = ran.len(), "sqlite rolled back a write batch");
            let err = StoreError::Backend("transaction rolled back by sqlite".to_owned());
            for p in ran.drain(..) {
                p.deliver(Err(err.clone()));
            }
            in_tx = false;
        }
        if !in_tx {
            if let Err(e) = begin(conn) {
                job.abort(e);
                continue;
            }
            in_tx = true;
        }
        if alone {
            let pending = job.run(conn);
            if pending.succeeded() {
                ran.push(pending);
                break;
            }
            if !conn.is_autocommit()
                && let Err(e) = exec(conn, "ROLLBACK")
            {
                tracing::error!(error = %e, "sqlite rollback of a failed write failed");
            }
            // Nothing to commit: the job answers with its own error.
            pending.deliver(Ok(()));
            return;
        }
        if let Err(e) = exec(conn, "SAVEPOINT job") {
            job.abort(e);
            continue;
        }
        let pending = job.run(conn);
        let closed = if pending.succeeded() {
            exec(conn, "RELEASE job")
        } else {
            exec(conn, "ROLLBACK TO job").and_then(|()| exec(conn, "RELEASE job"))
        };
        if let Err(e) = closed {
            // Only happens when the transaction is already gone, which the next round notices.
            tracing::warn!(error = %e, "closing a sqlite savepoint failed");
        }
        ran.push(pending);
    }
    if !in_tx {
        return;
    }
    let commit = if conn.is_autocommit() {
        Err(StoreError::Backend(
            "transaction rolled back by sqlite".to_owned(),
        ))
    } else {
        exec(conn, "COMMIT")
    };
    if let Err(e) = &commit {
        tracing::warn!(error = %e, jobs = ran.len(), "sqlite batch commit failed");
        if !conn.is_autocommit()
            && let Err(e) = exec(conn, "ROLLBACK")
        {
            tracing::error!(error = %e, "sqlite rollback after failed commit failed");
        }
    }
    for p in ran {
        p.deliver(commit.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(conn: &Connection) -> i64 {
        conn.query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .expect("count")
    }

    fn insert_then(fail: bool) -> (Box<dyn Job>, oneshot::Receiver<StoreResult<()>>) {
        job(move |c: &Connection| {
            c.execute("INSERT INTO t VALUES (1)", []).map_err(db_err)?;
            if fail {
                return Err(StoreError::Backend("refused".to_owned()));
            }
            Ok(())
        })
    }

    /// A job alone in its batch runs without a savepoint: failing, it leaves nothing behind and
    /// the connection ready for the next batch; among others, it undoes only itself.
    #[test]
    fn a_failing_job_undoes_only_itself_alone_or_among_others() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch("CREATE TABLE t (x INTEGER)")
            .expect("table");
        let (failing, failed) = insert_then(true);
        run_batch(&conn, std::iter::once(failing));
        assert!(failed.blocking_recv().expect("answered").is_err());
        assert!(conn.is_autocommit(), "no transaction left open");
        assert_eq!(count(&conn), 0);

        let (ok, done) = insert_then(false);
        run_batch(&conn, std::iter::once(ok));
        assert!(done.blocking_recv().expect("answered").is_ok());
        assert_eq!(count(&conn), 1);

        let (a, a_rx) = insert_then(false);
        let (b, b_rx) = insert_then(true);
        let (c, c_rx) = insert_then(false);
        run_batch(&conn, [a, b, c].into_iter());
        assert!(a_rx.blocking_recv().expect("a").is_ok());
        assert!(b_rx.blocking_recv().expect("b").is_err());
        assert!(c_rx.blocking_recv().expect("c").is_ok());
        assert_eq!(count(&conn), 3);
    }

    /// A transaction left open (as when a failed job's or commit's ROLLBACK itself failed) is
    /// rolled back by the next batch, which then runs: the writer is not stuck refusing every
    /// BEGIN.
    #[test]
    fn a_transaction_left_open_does_not_stop_the_next_batch() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch("CREATE TABLE t (x INTEGER); BEGIN; INSERT INTO t VALUES (9)")
            .expect("a transaction left open");
        assert!(!conn.is_autocommit());
        let (ok, done) = insert_then(false);
        run_batch(&conn, std::iter::once(ok));
        assert!(done.blocking_recv().expect("answered").is_ok());
        assert!(conn.is_autocommit());
        assert_eq!(
            count(&conn),
            1,
            "the stale write is undone, the new one kept"
        );
    }
}
