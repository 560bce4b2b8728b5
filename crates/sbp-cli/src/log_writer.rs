//! The gateway's stderr: formatted lines go to a thread of their own, so a request's access line
//! costs no write system call on a runtime worker, and no line is ever dropped. A full queue
//! makes the logging thread wait, and at exit every queued line is written before `main`
//! returns however long stderr's reader takes, as when each line was written where it was
//! logged (tracing-appender gives up after a second and drops the rest: lost when a log
//! collector falls behind, and the last lines, the shutdown's, are the ones lost).

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// Bytes of lines waiting before a logging thread waits for the writer.
const QUEUE_BYTES: usize = 16 * 1024 * 1024;

/// How long the writer lets lines gather after writing some.
const GATHER: std::time::Duration = std::time::Duration::from_millis(2);

/// Lines waiting to be written, appended to one buffer: the writer takes all of them at once and
/// writes them with one call, and is woken only when the buffer was empty, so under load many
/// lines cost one wake-up and one write.
#[derive(Default)]
struct Pending {
    bytes: Vec<u8>,
    /// Set by the guard: the writer writes what is left and ends; later lines are written where
    /// they are logged.
    stopped: bool,
}

#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    /// Lines arrived, or the guard stopped the writer.
    filled: Condvar,
    /// The writer took the lines: a logging thread waiting on a full buffer goes on.
    drained: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `MakeWriter` of the gateway's subscriber.
pub struct Stderr {
    shared: Arc<Shared>,
}

/// Held by `main`: dropping it writes every queued line, then stops the thread.
pub struct Guard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Starts the thread that writes to the process's stderr.
pub fn stderr() -> io::Result<(Stderr, Guard)> {
    to(io::stderr())
}

fn to(out: impl Write + Send + 'static) -> io::Result<(Stderr, Guard)> {
    let shared = Arc::new(Shared::default());
    let thread = {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("sbp-log".to_owned())
            .spawn(move || write_lines(&shared, out))?
    };
    Ok((
        Stderr {
            shared: Arc::clone(&shared),
        },
        Guard {
            shared,
            thread: Some(thread),
        },
    ))
}

fn write_lines(shared: &Shared, mut out: impl Write) {
    let mut batch = Vec::new();
    loop {
        let stopped = {
            let mut pending = shared.lock();
            while pending.bytes.is_empty() && !pending.stopped {
                pending = shared
                    .filled
                    .wait(pending)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            std::mem::swap(&mut batch, &mut pending.bytes);
            pending.stopped
        };
        shared.drained.notify_all();
        // Lines stderr refuses (closed) are lost whoever writes them; nothing to tell.
        let _ = out.write_all(&batch).and_then(|()| out.flush());
        batch.clear();
        // Once stopped, nothing more is queued (a line finds `stopped` and is written where it
        // is logged), so the batch just written was the last.
        if stopped {
            return;
        }
        // Lines logged meanwhile find the buffer not empty and wake nobody: under load the
        // writer wakes a few hundred times a second, not once a line.
        std::thread::sleep(GATHER);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shared.lock().stopped = true;
        self.shared.filled.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Write for &Stderr {
    /// The fmt layer writes each formatted line with one call.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut pending = self.shared.lock();
        while pending.bytes.len() >= QUEUE_BYTES && !pending.stopped {
            pending = self
                .shared
                .drained
                .wait(pending)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if pending.stopped {
            // The writer is ending (or gone): write it here, as a direct writer would (it may
            // come out before the last queued lines the writer is still writing).
            drop(pending);
            return io::stderr().write(buf);
        }
        let was_empty = pending.bytes.is_empty();
        pending.bytes.extend_from_slice(buf);
        drop(pending);
        if was_empty {
            self.shared.filled.notify_one();
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = &'a Stderr;

    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// A reader of stderr that falls behind: 16 bytes a millisecond.
    #[derive(Clone, Default)]
    struct Slow(Arc<Mutex<Vec<u8>>>);

    impl Write for Slow {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            std::thread::sleep(Duration::from_millis(1));
            let n = buf.len().min(16);
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Lines still queued when the guard drops are all written (in order), however long the
    /// reader takes: about two seconds here, twice what tracing-appender waits.
    #[test]
    fn dropping_the_guard_writes_every_queued_line() {
        let sink = Slow::default();
        let (stderr, guard) = to(sink.clone()).expect("thread");
        let lines: Vec<String> = (0..3000).map(|i| format!("line {i:04}\n")).collect();
        for line in &lines {
            (&stderr).write_all(line.as_bytes()).expect("queued");
        }
        drop(guard);
        let written = sink.0.lock().expect("sink").clone();
        assert_eq!(String::from_utf8(written).expect("utf-8"), lines.concat());
    }
}
