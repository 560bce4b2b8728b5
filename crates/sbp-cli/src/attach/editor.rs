//! The terminal side of `sbp attach` when a person types into it: a line editor (reedline: arrow
//! keys, history, the usual Emacs keys) on a thread of its own, and [`Screen`], where everything
//! else `sbp attach` prints goes, so that a turn arriving while a line is being typed is printed
//! above that line instead of inside it.
//!
//! While the editor runs, whole lines written to the screen wait in a queue; the editor's idle
//! callback hands them to its external printer, which prints them above the prompt in the same
//! turn of its loop. Lines are only ever handed over while the editor is reading, so none is
//! left inside the editor when it stops: when it stops (end of input, Ctrl-C, or [`Editor::stop`])
//! the screen goes back to writing to stdout directly, the queue first.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::TrySendError;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use reedline::{
    ExternalPrinter, FileBackedHistory, Prompt, PromptEditMode, PromptHistorySearch,
    PromptHistorySearchStatus, Reedline, Signal,
};
use tokio::sync::{mpsc, oneshot};

use super::Input;

/// How often the editor looks for lines to print while waiting for keys.
const POLL: Duration = Duration::from_millis(30);
/// Lines handed to the editor's printer per turn of its loop (the rest wait for the next turn).
const PRINT_BATCH: usize = 512;
/// Lines typed that the up arrow brings back (kept in memory only: they are messages).
const HISTORY: usize = 1000;
/// Clears the line the cursor is on: the prompt of an editor that stopped mid-line.
const CLEAR_LINE: &str = "\r\x1b[2K";

#[derive(Default)]
struct Shared {
    /// The editor owns the terminal: lines go through `queue`.
    editing: bool,
    /// The editor was asked to stop.
    stop: bool,
    /// Whole lines waiting for the editor to print them.
    queue: VecDeque<String>,
    /// The start of a line whose end has not been written yet.
    partial: String,
}

/// Where `sbp attach` writes: stdout, or above the line being edited while the editor runs.
#[derive(Clone, Default)]
pub struct Screen {
    shared: Arc<Mutex<Shared>>,
}

impl Screen {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Write for Screen {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut shared = self.lock();
        if !shared.editing {
            // Under the lock, so that nothing overtakes the queue being written out at the stop.
            let mut out = io::stdout().lock();
            out.write_all(buf)?;
            return Ok(buf.len());
        }
        // Whole UTF-8 strings are written here (the terminal renderer writes `&str`s in one
        // call), so decoding each buffer alone splits no character.
        shared.partial.push_str(&String::from_utf8_lossy(buf));
        while let Some(end) = shared.partial.find('\n') {
            let line: String = shared.partial.drain(..=end).collect();
            let line = line.trim_end_matches('\n');
            // The printer splits what it is given into lines, and an empty string has none: a
            // blank line would vanish.
            let line = if line.is_empty() { " " } else { line };
            shared.queue.push_back(line.to_owned());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.lock().editing {
            return Ok(());
        }
        io::stdout().lock().flush()
    }
}

/// The prompt: a plain `› `.
struct Arrow;

impl Prompt for Arrow {
    fn render_prompt_left(&self) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn render_prompt_right(&self) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn render_prompt_indicator(&self, _: PromptEditMode) -> Cow<'_, str> {
        Cow::Borrowed("› ")
    }

    fn render_prompt_multiline_indicator(&self) -> Cow<'_, str> {
        Cow::Borrowed("  ")
    }

    fn render_prompt_history_search_indicator(&self, search: PromptHistorySearch) -> Cow<'_, str> {
        let failing = match search.status {
            PromptHistorySearchStatus::Passing => "",
            PromptHistorySearchStatus::Failing => "failing ",
        };
        Cow::Owned(format!("({failing}search: {}) ", search.term))
    }
}

/// The running line editor.
pub struct Editor {
    shared: Arc<Mutex<Shared>>,
    done: oneshot::Receiver<()>,
}

impl Editor {
    /// Starts the editor on its own thread: typed lines arrive as [`Input::Line`], Ctrl-D as the
    /// end of input, Ctrl-C as [`Input::Interrupt`]. From now on `screen` prints above the
    /// prompt.
    pub fn start(
        screen: &Screen,
        colour: bool,
        typed: mpsc::UnboundedSender<Input>,
    ) -> io::Result<Self> {
        let history = FileBackedHistory::new(HISTORY).map_err(io::Error::other)?;
        let printer = ExternalPrinter::<String>::new(PRINT_BATCH);
        let to_printer = printer.sender();
        let break_signal = Arc::new(AtomicBool::new(false));
        let shared = Arc::clone(&screen.shared);
        let forward = {
            let shared = Arc::clone(&shared);
            let break_signal = Arc::clone(&break_signal);
            // Runs on the editor's thread at the top of each turn of its loop; the printer's lines
            // are printed further down that same turn, and the break is checked before them: so a
            // stop hands over nothing, and nothing handed over is left unprinted.
            move || {
                let mut shared = shared.lock().unwrap_or_else(PoisonError::into_inner);
                if shared.stop {
                    break_signal.store(true, Ordering::SeqCst);
                    return;
                }
                while let Some(line) = shared.queue.pop_front() {
                    match to_printer.try_send(line) {
                        Ok(()) => {}
                        Err(TrySendError::Full(line)) => {
                            shared.queue.push_front(line);
                            break;
                        }
                        Err(TrySendError::Disconnected(_)) => break,
                    }
                }
            }
        };
        let mut editor = Reedline::create()
            .with_history(Box::new(history))
            .with_ansi_colors(colour)
            .with_external_printer(printer)
            .with_break_signal(break_signal)
            .with_poll_interval(POLL)
            .with_idle_callback(Box::new(forward));

        lock(&shared).editing = true;
        let (done_tx, done) = oneshot::channel();
        let thread_shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("sbp-attach-editor".into())
            .spawn(move || {
                let mut cleared = false;
                loop {
                    let event = match editor.read_line(&Arrow) {
                        Ok(Signal::Success(line)) => Some(Input::Line(Some(line))),
                        Ok(Signal::CtrlD) => {
                            cleared = true;
                            let _ = typed.send(Input::Line(None));
                            break;
                        }
                        Ok(Signal::CtrlC) => {
                            cleared = true;
                            let _ = typed.send(Input::Interrupt);
                            break;
                        }
                        // Asked to stop (the only break signal is ours).
                        Ok(Signal::ExternalBreak(_)) => {
                            cleared = true;
                            break;
                        }
                        Ok(_) => None,
                        // The terminal is gone: as the end of input.
                        Err(e) => {
                            tracing::debug!(error = %e, "line editor failed");
                            let _ = typed.send(Input::Line(None));
                            break;
                        }
                    };
                    if let Some(event) = event
                        && typed.send(event).is_err()
                    {
                        break;
                    }
                    if lock(&thread_shared).stop {
                        break;
                    }
                }
                drop(editor);
                hand_back(&thread_shared, cleared);
                let _ = done_tx.send(());
            });
        if let Err(e) = spawned {
            lock(&shared).editing = false;
            return Err(e);
        }
        Ok(Self { shared, done })
    }

    /// Stops the editor (the line being typed is dropped) and waits, until `deadline` at most,
    /// for the terminal to be back to normal and every line queued for it printed.
    ///
    /// The editor notices the stop within one turn of its loop ([`POLL`]), unless its thread is
    /// held up (a terminal slow to answer where the cursor is, a starved machine): past the
    /// deadline the screen writes directly and the terminal is put back in line mode from here,
    /// so that the program can end on time with the terminal usable.
    pub async fn stop(self, deadline: tokio::time::Instant) {
        lock(&self.shared).stop = true;
        if tokio::time::timeout_at(deadline, self.done).await.is_err() {
            tracing::warn!("the line editor did not stop in time");
            // The editor's thread, if it ever returns, finds the queue empty and the screen
            // handed back already.
            hand_back(&self.shared, false);
            // Raw mode is crossterm's process-wide state: the mode saved when the editor entered
            // it is restored, whichever thread asks.
            if let Err(e) = crossterm::terminal::disable_raw_mode() {
                tracing::warn!(error = %e, "the terminal could not be put back in line mode");
            }
        }
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The editor has stopped: the screen writes to stdout again, first what was queued for it.
/// `clear` removes the prompt left on the cursor's line.
fn hand_back(shared: &Mutex<Shared>, clear: bool) {
    let mut shared = lock(shared);
    if !shared.editing {
        return;
    }
    shared.editing = false;
    let mut out = io::stdout().lock();
    if clear {
        let _ = out.write_all(CLEAR_LINE.as_bytes());
    }
    for line in shared.queue.drain(..) {
        let _ = writeln!(out, "{line}");
    }
    let partial = std::mem::take(&mut shared.partial);
    let _ = out.write_all(partial.as_bytes());
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn while_editing_whole_lines_are_queued_and_partial_ones_wait() {
        let mut screen = Screen::default();
        screen.lock().editing = true;
        screen.write_all("one\ntw".as_bytes()).expect("write");
        screen.write_all("o\n\nthree ›".as_bytes()).expect("write");
        screen.flush().expect("flush");
        let shared = screen.lock();
        assert_eq!(
            shared.queue,
            ["one", "two", " "],
            "a blank line stays a line"
        );
        assert_eq!(shared.partial, "three ›");
    }
}
