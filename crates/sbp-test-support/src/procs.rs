//! Starting the project's release binaries as child processes for the bench and the soak suite:
//! a child that prints `... listening on http://ADDR...` on stdout, its stderr in a log file, and
//! the PostgreSQL statements they make and drop their schemas with.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A child that said where it listens.
pub struct Listening {
    pub child: Child,
    pub pid: u32,
    pub addr: SocketAddr,
}

/// Starts `cmd` with stderr to `log_file` (opened by the caller: created or appended to, at
/// `log`), killed when dropped, and waits up to 60 s for its address on stdout. Stdout is read on
/// to the end afterwards, so a later line never blocks the child on a full pipe.
pub async fn spawn_listening(
    name: &str,
    mut cmd: Command,
    log_file: std::fs::File,
    log: &Path,
) -> anyhow::Result<Listening> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        // Backstop: an error or panic anywhere in the caller still kills the child.
        .kill_on_drop(true);
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let pid = child
        .id()
        .with_context(|| format!("{name} exited at once"))?;
    let stdout = child
        .stdout
        .take()
        .with_context(|| format!("{name}: no stdout pipe"))?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(addr) = parse_listen_line(&line) {
                return Ok::<_, anyhow::Error>(Some(addr));
            }
        }
        Ok(None)
    })
    .await;
    let addr = match first {
        Ok(Ok(Some(addr))) => addr,
        Ok(Ok(None)) => bail!(
            "{name} exited before printing its address; log {}:\n{}",
            log.display(),
            tail(log)
        ),
        Ok(Err(e)) => return Err(e.context(format!("reading {name}'s stdout"))),
        Err(_) => bail!(
            "{name} printed no address within 60 s; log {}:\n{}",
            log.display(),
            tail(log)
        ),
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Listening { child, pid, addr })
}

/// `... listening on http://127.0.0.1:PORT/v1` or `... listening on http://127.0.0.1:PORT (...)`.
pub fn parse_listen_line(line: &str) -> Option<SocketAddr> {
    let rest = line.split("listening on http://").nth(1)?;
    let end = rest
        .find(|c: char| c == '/' || c.is_whitespace())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The last lines of a log file, for error messages.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Runs one statement on a fresh connection to `url` (with the URL's TLS settings, as the
/// gateway's own connections).
pub async fn pg_exec(url: &str, sql: &str) -> anyhow::Result<()> {
    let (client, conn) = sbp_store::postgres::connect(url).await.with_context(|| {
        format!(
            "connecting to {} (scripts/services.sh starts PostgreSQL)",
            sbp_store::postgres::redacted_url(url)
        )
    })?;
    let result = client.batch_execute(sql).await;
    drop(client);
    let _ = conn.await;
    result.with_context(|| format!("running {sql:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_lines_parse() {
        assert_eq!(
            parse_listen_line("sbp-fake-llm listening on http://127.0.0.1:4100/v1"),
            Some("127.0.0.1:4100".parse().expect("addr"))
        );
        assert_eq!(
            parse_listen_line(
                "sbp gateway listening on http://127.0.0.1:9 (storage sqlite://x; upstream y)"
            ),
            Some("127.0.0.1:9".parse().expect("addr"))
        );
        assert_eq!(parse_listen_line("hello"), None);
    }
}
