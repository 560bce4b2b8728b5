//! The README's federation walkthrough, run as written (only its four ports swapped for free
//! ones): a tracker and three gateways as `sbp serve` processes, an import by CID through the
//! tracker, and a session that moves to the gateway its surface attaches to.

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

/// The shell block under "### Federation: three gateways and a tracker".
fn walkthrough() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .expect("README.md");
    let at = readme
        .find("### Federation: three gateways and a tracker")
        .expect("the README has a federation walkthrough");
    let block = readme[at..].split_once("```sh\n").expect("a shell block").1;
    block
        .split_once("```")
        .expect("the block ends")
        .0
        .to_owned()
}

fn free_port() -> u16 {
    // Bound and released at once; the gateways bind it a moment later.
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// How one run of the walkthrough ended.
enum Run {
    Exited(std::process::Output),
    /// Still running after two minutes: (stdout, stderr).
    Hung(String, String),
}

/// Runs the walkthrough on four free ports in a fresh directory. Also returns whether a node
/// could not bind its port (another test took it between our check and its start: a retry
/// with other ports is owed, not a failure).
fn run_walkthrough() -> (Run, bool) {
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let mut script = walkthrough();
    // `700$n` (the loop) first, then the literal ports.
    script = script.replace("700$n", "${P[$n]}");
    for (n, port) in ports.iter().enumerate() {
        script = script.replace(&format!("700{n}"), &port.to_string());
    }
    let header = format!("P=(x {} {} {})\n", ports[1], ports[2], ports[3]);
    let script = header + &script;
    assert!(!script.contains("700"), "every port was swapped:\n{script}");
    let dir = tempfile::tempdir().expect("tempdir");
    let sbp_dir = Path::new(env!("CARGO_BIN_EXE_sbp"))
        .parent()
        .expect("the binary's directory")
        .to_owned();
    let path = format!(
        "{}:{}",
        sbp_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n{script}"
        ))
        .current_dir(dir.path())
        .env("PATH", path)
        .env_remove("SBP_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("bash runs");
    let port_taken = || {
        std::fs::read_dir(dir.path().join("fed"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .any(|e| {
                std::fs::read_to_string(e.path())
                    .is_ok_and(|log| log.contains("Address already in use"))
            })
    };
    let started = std::time::Instant::now();
    loop {
        if let Some(_status) = child.try_wait().expect("waits") {
            let out = child.wait_with_output().expect("output");
            return (Run::Exited(out), port_taken());
        }
        // A node that could not bind leaves the script waiting for it: stop at once.
        let taken = port_taken();
        if taken || started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            let hung = Run::Hung(
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
            return (hung, taken);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_readme_federation_walkthrough_runs_as_written() {
    let mut attempts = 0;
    let out = loop {
        attempts += 1;
        match run_walkthrough() {
            (_, true) if attempts < 3 => continue,
            (Run::Exited(out), _) => break out,
            (Run::Hung(stdout, stderr), taken) => panic!(
                "the walkthrough hung (a port taken by another process: {taken}):\n{stdout}\n{stderr}"
            ),
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The import by CID on gateway 3 restored the conversation.
    assert!(stdout.contains("\"messages_restored\":3"), "{stdout}");
    // The surface on gateway 2 got the tethered turn, and gateway 2 holds the whole history.
    assert!(stdout.contains("Your parcel arrived."), "{stdout}");
    assert!(
        stdout.matches("remember: the door code is 4711").count() >= 1
            && stdout.contains("\"session_id\""),
        "{stdout}"
    );
    // Gateway 1 says where the session went.
    assert!(stdout.contains("SBP_SESSION_MOVED"), "{stdout}");
}
