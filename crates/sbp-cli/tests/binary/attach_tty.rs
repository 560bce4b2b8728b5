//! `sbp attach` on a terminal, as a person uses it: the real binary in a tmux pane of fixed size,
//! keys typed with `send-keys`, the screen read with `capture-pane` (polled until what is expected
//! shows, with a deadline). The line editor recalls history with the up arrow, a turn pushed while
//! a line is half typed is printed above that line and leaves it intact, replies are rendered
//! from Markdown, and /quit or Ctrl-C ends the program with the terminal back in line mode.
//!
//! `sbp attach` runs under `sh -c`, which prints its exit status and the terminal's mode once it
//! has ended; the tests read those from the screen. tmux's own record of the pane's end is not
//! used: Debian's tmux (3.3a, built with libutempter) sets SIGCHLD to its default action while
//! it runs the utempter helper for a pane whose pty has closed, so the SIGCHLD of the program's
//! exit, arriving in that window, is discarded; the program stays a zombie and
//! `#{pane_dead_status}` is never set. On a loaded machine that window is often hit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::support::{Sbp, WAIT, send};

const WIDTH: u16 = 110;
const HEIGHT: u16 = 40;

/// tmux must be installed: a terminal test that passes without a terminal would prove nothing.
fn require_tmux() {
    let found = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "tmux is missing: `bash scripts/test.sh` installs it (scripts/terminal-deps.sh: Debian's tmux)"
    );
}

/// A private tmux server (its own socket and an empty configuration) running one pane. Dropping
/// it ends the server and what runs in the pane.
struct Pane {
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Pane {
    /// Runs `program args...` in a detached pane of WIDTH x HEIGHT, with `env` and no inherited
    /// `SBP_*` or `NO_COLOR`. The pane stays after the program exits, to read what it printed.
    fn start(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        require_tmux();
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("tmux.sock");
        let config = dir.path().join("tmux.conf");
        std::fs::write(
            &config,
            "set -g remain-on-exit on\nset -g history-limit 2000\n",
        )
        .expect("tmux config");
        let mut command = shell_quote(&program.to_string_lossy());
        for a in args {
            command.push(' ');
            command.push_str(&shell_quote(a));
        }
        let mut tmux = Command::new("tmux");
        tmux.arg("-S")
            .arg(&socket)
            .arg("-f")
            .arg(&config)
            .args(["new-session", "-d", "-s", "attach"])
            .args(["-x", &WIDTH.to_string(), "-y", &HEIGHT.to_string()]);
        for (key, value) in env {
            tmux.arg("-e").arg(format!("{key}={value}"));
        }
        tmux.arg(command);
        for (key, _) in std::env::vars_os() {
            let key_text = key.to_string_lossy();
            if key_text.starts_with("SBP_") || key_text == "NO_COLOR" || key_text == "TMUX" {
                tmux.env_remove(&key);
            }
        }
        let out = tmux.output().expect("run tmux");
        assert!(out.status.success(), "tmux new-session: {}", text(&out));
        Self { socket, _dir: dir }
    }

    fn tmux(&self, args: &[&str]) -> Output {
        let out = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run tmux");
        assert!(out.status.success(), "tmux {args:?}: {}", text(&out));
        out
    }

    /// Types `text` as it is (no key names).
    fn type_text(&self, text: &str) {
        self.tmux(&["send-keys", "-t", "attach", "-l", text]);
    }

    /// Presses keys by name (`Enter`, `Up`, `C-u`).
    fn press(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "attach"];
        args.extend_from_slice(keys);
        self.tmux(&args);
    }

    /// The screen as text.
    fn screen(&self) -> String {
        text(&self.tmux(&["capture-pane", "-p", "-t", "attach"]))
    }

    /// The screen with its styles as escape sequences.
    fn styled_screen(&self) -> String {
        text(&self.tmux(&["capture-pane", "-p", "-e", "-t", "attach"]))
    }

    /// Polls the screen until `check` holds; returns that screen.
    async fn until(&self, what: &str, check: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let screen = self.screen();
            if check(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not on the screen within {WAIT:?}:\n{screen}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls until the shell around `sbp attach` ([`attach_in_pane`]) has reported how it
    /// ended: the exit status and whether the terminal is in line mode again. `sbp attach` leaves
    /// within two seconds whatever the gateway does, so a screen's deadline is enough.
    async fn exited(&self) -> Exited {
        let screen = self
            .until("the exit status and the terminal's mode", |s| {
                s.lines().any(|l| l.starts_with("status="))
                    && s.lines().any(|l| matches!(l.trim(), "icanon" | "-icanon"))
            })
            .await;
        let status = screen
            .lines()
            .find_map(|l| l.strip_prefix("status="))
            .and_then(|code| code.trim().parse().ok())
            .unwrap_or_else(|| panic!("no exit status on the screen:\n{screen}"));
        let line_mode = screen.lines().any(|l| l.trim() == "icanon");
        Exited {
            status,
            line_mode,
            screen,
        }
    }
}

/// How `sbp attach` ended, as the shell around it reported.
struct Exited {
    status: i32,
    /// The terminal is in canonical (line) mode again: the line editor's raw mode is undone.
    line_mode: bool,
    /// The screen with the report.
    screen: String,
}

/// Runs `sbp attach ARGS...` with `env` in a pane, under a shell that then prints `status=N` and
/// the terminal's `icanon` or `-icanon`.
fn attach_in_pane(args: &[&str], env: &[(&str, &str)]) -> Pane {
    let mut script = shell_quote(env!("CARGO_BIN_EXE_sbp"));
    for a in ["attach"].iter().chain(args) {
        script.push(' ');
        script.push_str(&shell_quote(a));
    }
    script.push_str("; echo \"status=$?\"; stty -a | grep -o -- '-\\?icanon'");
    Pane::start(Path::new("/bin/sh"), &["-c", &script], env)
}

impl Drop for Pane {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The line being edited: the last one that starts with the prompt.
fn prompt_line(screen: &str) -> Option<(usize, &str)> {
    screen
        .lines()
        .enumerate()
        .filter(|(_, l)| l.starts_with('›'))
        .last()
}

/// The first line that contains `what`, and its index.
fn line_with<'a>(screen: &'a str, what: &str) -> Option<(usize, &'a str)> {
    screen.lines().enumerate().find(|(_, l)| l.contains(what))
}

/// Typing into the line editor: Enter sends, the up arrow brings the last line back, a turn
/// pushed while a line is half typed is printed (rendered from Markdown: no asterisks, bold in
/// bold, a bullet for the list item) above that line, which stays as typed and is sent next;
/// /quit detaches with 0 and leaves the terminal in line mode.
#[tokio::test]
async fn on_a_terminal_lines_are_edited_and_turns_print_above_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let (status, _, body) = send(gw.post("/v1/sessions", &json!({}))).await;
    assert_eq!(status, 201, "{body}");
    let id = body["session_id"].as_str().expect("id").to_owned();
    let token = body["session_token"].as_str().expect("token").to_owned();

    let pane = attach_in_pane(
        &["--url", &gw.url, "--session", &id],
        &[("SBP_SESSION_TOKEN", &token)],
    );
    pane.until("the prompt under the connected line", |s| {
        s.contains("● connected") && prompt_line(s).is_some()
    })
    .await;

    pane.type_text("first message");
    pane.press(&["Enter"]);
    pane.until("the reply", |s| {
        s.contains("assistant › Echo: first message") && s.contains("✓ turn complete")
    })
    .await;

    // History: the up arrow brings the message back, Enter sends it again.
    pane.press(&["Up"]);
    pane.until("the recalled line", |s| {
        prompt_line(s).is_some_and(|(_, l)| l == "› first message")
    })
    .await;
    pane.press(&["Enter"]);
    pane.until("the second reply", |s| {
        s.matches("Echo: first message").count() == 2
    })
    .await;

    // A turn arrives while a line is half typed.
    pane.type_text("half typed");
    pane.until("the half-typed line", |s| {
        prompt_line(s).is_some_and(|(_, l)| l == "› half typed")
    })
    .await;
    let pushed = gw
        .push(
            &id,
            &token,
            "Boarding at **gate B12** now.\n\n- bring `passport`",
        )
        .await;
    assert_eq!(pushed["delivery"], "live", "{pushed}");
    // The editor prints a turn by taking its prompt away, writing the lines and drawing the prompt
    // again below them: the screen is read once the prompt is back under the turn.
    let screen = pane
        .until("the pushed turn above the prompt", |s| {
            match (line_with(s, "• bring passport"), prompt_line(s)) {
                (Some((turn_at, _)), Some((prompt_at, _))) => prompt_at > turn_at,
                _ => false,
            }
        })
        .await;
    let (at, line) = line_with(&screen, "gate B12").expect("the pushed line");
    assert_eq!(line, "assistant › Boarding at gate B12 now.", "{screen}");
    assert!(!screen.contains("**"), "Markdown rendered:\n{screen}");
    let (prompt_at, prompt) = prompt_line(&screen).expect("the prompt");
    assert_eq!(
        prompt, "› half typed",
        "the line being typed is intact:\n{screen}"
    );
    assert!(
        prompt_at > at,
        "the turn is printed above the prompt:\n{screen}"
    );
    assert_eq!(
        screen.matches("half typed").count(),
        1,
        "nothing was printed inside the line being typed:\n{screen}"
    );
    let styled = pane.styled_screen();
    let (_, styled_line) = line_with(&styled, "gate B12").expect("the styled line");
    assert!(
        styled_line.contains("\x1b[1mgate B12"),
        "bold in bold: {styled_line:?}"
    );

    // The half-typed line is still the editor's: finishing it sends it.
    pane.type_text(", and done");
    pane.press(&["Enter"]);
    pane.until("the reply to the finished line", |s| {
        s.contains("Echo: half typed, and done")
    })
    .await;

    pane.type_text("/quit");
    pane.press(&["Enter"]);
    let exited = pane.exited().await;
    assert_eq!(exited.status, 0, "{}", exited.screen);
    assert!(exited.screen.contains("○ detached"), "{}", exited.screen);
    assert!(
        exited.line_mode,
        "the terminal is in line mode again:\n{}",
        exited.screen
    );

    let users: Vec<String> = gw
        .messages(&id, &token)
        .await
        .into_iter()
        .filter(|(role, _)| role == "user")
        .map(|(_, text)| text)
        .collect();
    assert_eq!(
        users,
        ["first message", "first message", "half typed, and done"]
    );
}

/// Ctrl-C in the editor (read as a key, not a signal) detaches with 130 and gives the terminal
/// back in line mode.
#[tokio::test]
async fn ctrl_c_on_a_terminal_detaches_with_130_and_restores_the_terminal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = Sbp::start(dir.path(), &[]).await;
    let pane = attach_in_pane(&["--url", &gw.url], &[]);
    pane.until("the prompt", |s| {
        s.contains("● connected") && prompt_line(s).is_some()
    })
    .await;
    pane.type_text("never sent");
    pane.press(&["C-c"]);
    let exited = pane.exited().await;
    assert_eq!(exited.status, 130, "{}", exited.screen);
    assert!(exited.screen.contains("○ detached"), "{}", exited.screen);
    assert!(
        exited.line_mode,
        "the terminal is in line mode again:\n{}",
        exited.screen
    );
}
