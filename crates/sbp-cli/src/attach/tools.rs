//! The local tools `sbp attach` answers TOOL_CALLs with: the built-ins (`clock`, `system_info`,
//! `read_file` confined to one directory) and every tool of the local stdio MCP servers given with
//! `--mcp`, each declared with its full schema. Every call is reported to the terminal twice (called,
//! then its outcome) through a channel, so the UI loop stays the only writer of stdout.

use std::collections::HashMap;
use std::io::Read as _;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use sbp_client::{ToolHandler, ToolSpec};
use sbp_mcp::{ServerConfig, Southbound};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// How long a `--mcp` server may take to start and list its tools.
const MCP_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long one MCP tool call may run (the gateway's default TOOL_CALL timeout).
const MCP_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// `read_file` returns at most this much of a file unless asked for less.
const READ_DEFAULT_BYTES: u64 = 64 * 1024;
/// ... and never more than this, whatever `max_bytes` says (a TOOL_RESULT is one WebSocket frame).
const READ_MAX_BYTES: u64 = 512 * 1024;
/// Entries listed for a directory.
const LIST_MAX_ENTRIES: usize = 500;

pub const CLOCK: &str = "clock";
pub const SYSTEM_INFO: &str = "system_info";
pub const READ_FILE: &str = "read_file";

/// What the UI shows about tool calls.
#[derive(Debug)]
pub enum ToolNote {
    Called {
        name: String,
        input: Value,
    },
    Finished {
        name: String,
        outcome: Result<Value, String>,
        elapsed: Duration,
    },
}

/// Where a declared tool's calls go.
#[derive(Debug, Clone)]
enum Route {
    Clock,
    SystemInfo,
    ReadFile,
    Mcp { server: String, tool: String },
}

/// The tool handler of the terminal surface.
pub struct LocalTools {
    specs: Vec<ToolSpec>,
    routes: HashMap<String, Route>,
    /// Canonical; `read_file` is declared only when it is set.
    allow_dir: Option<PathBuf>,
    mcp: Southbound,
    notes: mpsc::UnboundedSender<ToolNote>,
}

/// The `--mcp` servers, started: each is `mcp<N>` (1-based, in the order given).
pub async fn start_mcp(commands: &[String]) -> anyhow::Result<Southbound> {
    if commands.is_empty() {
        return Ok(Southbound::empty());
    }
    let configs = commands
        .iter()
        .enumerate()
        .map(|(i, command)| {
            format!("mcp{}=stdio:{command}", i + 1)
                .parse::<ServerConfig>()
                .map_err(|e| anyhow::anyhow!("--mcp {command:?}: {e}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let southbound = Southbound::connect(configs, MCP_CONNECT_TIMEOUT).await;
    let up = southbound.servers();
    for (i, command) in commands.iter().enumerate() {
        if !up.contains(&format!("mcp{}", i + 1)) {
            southbound.shutdown().await;
            bail!(
                "--mcp {command:?} could not be started, or did not list its tools within {MCP_CONNECT_TIMEOUT:?} (the reason is logged above)"
            );
        }
    }
    Ok(southbound)
}

impl LocalTools {
    /// The built-ins (read_file only with `allow_dir`, which must be a directory) and every tool of
    /// `mcp`. An MCP tool keeps its own name unless a built-in or an earlier server's tool has it;
    /// then it is declared as `<server>_<tool>` (the startup lines show the names).
    pub fn new(
        allow_dir: Option<&Path>,
        mcp: Southbound,
        notes: mpsc::UnboundedSender<ToolNote>,
    ) -> anyhow::Result<Self> {
        let allow_dir = match allow_dir {
            None => None,
            Some(dir) => {
                let real = dir
                    .canonicalize()
                    .with_context(|| format!("--allow-dir {}", dir.display()))?;
                if !real.is_dir() {
                    bail!("--allow-dir {}: not a directory", dir.display());
                }
                Some(real)
            }
        };
        let mut specs = vec![
            ToolSpec::new(CLOCK)
                .description("The current date and time on the user's device, with its time zone.")
                .input_schema(json!({"type": "object", "properties": {}, "additionalProperties": false})),
            ToolSpec::new(SYSTEM_INFO)
                .description("The user's device: operating system, CPU architecture, host name and number of CPUs.")
                .input_schema(json!({"type": "object", "properties": {}, "additionalProperties": false})),
        ];
        let mut routes = HashMap::from([
            (CLOCK.to_owned(), Route::Clock),
            (SYSTEM_INFO.to_owned(), Route::SystemInfo),
        ]);
        if allow_dir.is_some() {
            specs.push(ToolSpec::new(READ_FILE)
                .description("Read a text file (or list a directory) inside the one directory the user shared. Paths are relative to it; nothing outside it can be read.")
                .input_schema(json!({
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path relative to the shared directory (\".\" for the directory itself)."},
                        "max_bytes": {"type": "integer", "minimum": 1, "maximum": READ_MAX_BYTES, "description": "Read at most this many bytes (default 65536)."}
                    },
                    "required": ["path"],
                    "additionalProperties": false
                })));
            routes.insert(READ_FILE.to_owned(), Route::ReadFile);
        }
        for (server, tool) in mcp.tools() {
            let Some(name) = free_name(&routes, &server, &tool.name) else {
                tracing::warn!(server = %server, tool = %tool.name, "MCP tool left out: its name is taken");
                continue;
            };
            let mut spec = ToolSpec::new(&name).input_schema(tool.input_schema.clone());
            if let Some(d) = &tool.description {
                spec = spec.description(d);
            }
            specs.push(spec);
            routes.insert(
                name,
                Route::Mcp {
                    server,
                    tool: tool.name,
                },
            );
        }
        Ok(Self {
            specs,
            routes,
            allow_dir,
            mcp,
            notes,
        })
    }

    /// Declared names, each with where it comes from ("built-in" or `mcp<N> <tool>`).
    pub fn catalogue(&self) -> Vec<(String, String)> {
        self.specs
            .iter()
            .map(|s| {
                let origin = match self.routes.get(&s.name) {
                    Some(Route::Mcp { server, tool }) if *tool == s.name => server.clone(),
                    Some(Route::Mcp { server, tool }) => format!("{server} {tool}"),
                    _ => "built-in".to_owned(),
                };
                (s.name.clone(), origin)
            })
            .collect()
    }

    async fn run(&self, route: Route, input: Value) -> Result<Value, String> {
        match route {
            Route::Clock => Ok(clock()),
            Route::SystemInfo => Ok(system_info()),
            Route::ReadFile => {
                let Some(root) = self.allow_dir.clone() else {
                    return Err("read_file is not enabled".into());
                };
                tokio::task::spawn_blocking(move || read_file(&root, &input))
                    .await
                    .map_err(|e| format!("read_file failed: {e}"))?
            }
            Route::Mcp { server, tool } => {
                let arguments = match input {
                    Value::Null => Value::Object(Default::default()),
                    other => other,
                };
                match self
                    .mcp
                    .call(&server, &tool, arguments, MCP_CALL_TIMEOUT)
                    .await
                {
                    Ok(out) if out.is_error => Err(out.text),
                    Ok(out) => Ok(out.content),
                    Err(e) => Err(e.to_string()),
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl ToolHandler for LocalTools {
    fn tools(&self) -> Vec<ToolSpec> {
        self.specs.clone()
    }

    async fn call(&self, name: &str, input: Value) -> Result<Value, String> {
        // The UI loop is gone only while the program exits: nothing left to show.
        let _ = self.notes.send(ToolNote::Called {
            name: name.to_owned(),
            input: input.clone(),
        });
        let started = Instant::now();
        let outcome = match self.routes.get(name) {
            Some(route) => self.run(route.clone(), input).await,
            None => Err(format!("unknown tool '{name}'")),
        };
        let _ = self.notes.send(ToolNote::Finished {
            name: name.to_owned(),
            outcome: outcome.clone(),
            elapsed: started.elapsed(),
        });
        outcome
    }
}

/// The name an MCP server's tool is declared under: its own, or `<server>_<tool>` when that is
/// taken (by a built-in or an earlier server's tool); `None` when both are.
fn free_name<V>(taken: &HashMap<String, V>, server: &str, tool: &str) -> Option<String> {
    [tool.to_owned(), format!("{server}_{tool}")]
        .into_iter()
        .find(|name| !taken.contains_key(name))
}

/// `clock`: local time, UTC offset and time zone name.
fn clock() -> Value {
    let now = chrono::Local::now();
    json!({
        "local_time": now.to_rfc3339_opts(chrono::SecondsFormat::Secs, false),
        "utc_time": now.with_timezone(&chrono::Utc).to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "unix_time": now.timestamp(),
        "utc_offset": now.format("%:z").to_string(),
        "timezone": timezone_name().unwrap_or_else(|| now.format("UTC%:z").to_string()),
        "weekday": now.format("%A").to_string(),
    })
}

/// The IANA name of the local time zone: `TZ`, else the `/etc/localtime` link, else `/etc/timezone`.
fn timezone_name() -> Option<String> {
    if let Ok(tz) = std::env::var("TZ") {
        let tz = tz.trim_start_matches(':');
        if !tz.is_empty() {
            return Some(tz.to_owned());
        }
    }
    if let Ok(target) = std::fs::read_link("/etc/localtime") {
        let target = target.to_string_lossy();
        if let Some((_, name)) = target.split_once("zoneinfo/") {
            return Some(name.to_owned());
        }
    }
    std::fs::read_to_string("/etc/timezone")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `system_info`: what the device is.
fn system_info() -> Value {
    json!({
        "os": std::env::consts::OS,
        "os_family": std::env::consts::FAMILY,
        "os_release": os_release(),
        "arch": std::env::consts::ARCH,
        "hostname": hostname(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    })
}

fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| {
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
        })
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// `PRETTY_NAME` of /etc/os-release, where there is one.
fn os_release() -> Option<String> {
    let text = std::fs::read_to_string("/etc/os-release").ok()?;
    text.lines().find_map(|line| {
        line.strip_prefix("PRETTY_NAME=")
            .map(|v| v.trim_matches('"').to_owned())
    })
}

/// `read_file`: a file's text (or a directory's entries) under `root`, which is canonical.
fn read_file(root: &Path, input: &Value) -> Result<Value, String> {
    let path = input
        .get("path")
        .and_then(Value::as_str)
        .ok_or("`path` (a string) is required")?;
    let max = input
        .get("max_bytes")
        .and_then(Value::as_u64)
        .unwrap_or(READ_DEFAULT_BYTES)
        .clamp(1, READ_MAX_BYTES);
    let real = confine(root, path)?;
    let shown = match real.strip_prefix(root) {
        Ok(rel) if rel.as_os_str().is_empty() => ".".to_owned(),
        Ok(rel) => rel.to_string_lossy().into_owned(),
        Err(_) => path.to_owned(),
    };
    let meta = std::fs::metadata(&real).map_err(|e| format!("'{path}': {e}"))?;
    if meta.is_dir() {
        let mut entries = std::fs::read_dir(&real)
            .map_err(|e| format!("'{path}': {e}"))?
            .filter_map(Result::ok)
            .map(|e| {
                let kind = match e.file_type() {
                    Ok(t) if t.is_dir() => "directory",
                    Ok(t) if t.is_symlink() => "symlink",
                    Ok(_) => "file",
                    Err(_) => "unknown",
                };
                let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                (e.file_name().to_string_lossy().into_owned(), kind, size)
            })
            .collect::<Vec<_>>();
        entries.sort();
        let truncated = entries.len() > LIST_MAX_ENTRIES;
        entries.truncate(LIST_MAX_ENTRIES);
        let entries: Vec<Value> = entries
            .into_iter()
            .map(|(name, kind, size)| json!({"name": name, "type": kind, "size": size}))
            .collect();
        return Ok(
            json!({"path": shown, "type": "directory", "entries": entries, "truncated": truncated}),
        );
    }
    let mut bytes = Vec::new();
    std::fs::File::open(&real)
        .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("'{path}': {e}"))?;
    // The limit is a u64 no larger than READ_MAX_BYTES: it fits in usize.
    let limit = usize::try_from(max).unwrap_or(usize::MAX);
    let truncated = bytes.len() > limit;
    bytes.truncate(limit);
    let (content, binary) = match String::from_utf8(bytes) {
        Ok(text) => (text, false),
        Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), true),
    };
    Ok(json!({
        "path": shown,
        "type": "file",
        "size": meta.len(),
        "content": content,
        "truncated": truncated,
        "not_utf8": binary,
    }))
}

/// `path` (relative to `root`, or absolute) resolved inside `root`, or why not. Checked twice: as
/// written (so `..` cannot climb out, and nothing is learnt about paths outside), then after
/// resolving symlinks (so a link inside cannot point out).
fn confine(root: &Path, path: &str) -> Result<PathBuf, String> {
    let outside = || format!("'{path}' is outside the shared directory");
    if path.is_empty() {
        return Err("`path` is empty".into());
    }
    let candidate = Path::new(path);
    let joined = if candidate.is_absolute() {
        candidate.to_path_buf()
    } else {
        root.join(candidate)
    };
    let lexical = normalize(&joined).ok_or_else(outside)?;
    if !lexical.starts_with(root) {
        return Err(outside());
    }
    let real = lexical.canonicalize().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("'{path}' does not exist"),
        _ => format!("'{path}': {e}"),
    })?;
    if !real.starts_with(root) {
        return Err(outside());
    }
    Ok(real)
}

/// `path` with `.` and `..` resolved without touching the file system; `None` if `..` climbs
/// above the root of the file system.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_inside_the_shared_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("canonical");
        std::fs::create_dir(root.join("sub")).expect("mkdir");
        std::fs::write(root.join("sub/a.txt"), "hello").expect("write");
        let outside = tempfile::tempdir().expect("tempdir");
        std::fs::write(outside.path().join("secret"), "no").expect("write");
        std::os::unix::fs::symlink(outside.path().join("secret"), root.join("link"))
            .expect("symlink");

        let ok = |p: &str| confine(&root, p).expect(p);
        assert_eq!(ok("sub/a.txt"), root.join("sub/a.txt"));
        assert_eq!(ok("./sub/../sub/a.txt"), root.join("sub/a.txt"));
        assert_eq!(ok("."), root);
        let abs = root.join("sub/a.txt");
        assert_eq!(ok(abs.to_str().expect("utf-8")), abs);

        let secret = outside.path().join("secret");
        for bad in [
            "..",
            "../x",
            "sub/../../x",
            "/etc/passwd",
            "link",
            secret.to_str().expect("utf-8"),
        ] {
            let err = confine(&root, bad).expect_err(bad);
            assert!(err.contains("outside the shared directory"), "{bad}: {err}");
        }
        // Whether something exists outside is not revealed.
        assert!(
            confine(&root, "../surely-not-there")
                .expect_err("outside")
                .contains("outside")
        );
        assert!(
            confine(&root, "nope.txt")
                .expect_err("missing")
                .contains("does not exist")
        );
    }

    #[test]
    fn reads_files_and_lists_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("canonical");
        std::fs::write(root.join("a.txt"), "0123456789").expect("write");
        std::fs::write(root.join("bin"), [0xff, 0xfe, b'a']).expect("write");
        let v = read_file(&root, &json!({"path": "a.txt"})).expect("read");
        assert_eq!(v["content"], "0123456789");
        assert_eq!(v["truncated"], false);
        let v = read_file(&root, &json!({"path": "a.txt", "max_bytes": 4})).expect("read");
        assert_eq!(v["content"], "0123");
        assert_eq!(v["truncated"], true);
        assert_eq!(v["size"], 10);
        let v = read_file(&root, &json!({"path": "bin"})).expect("read");
        assert_eq!(v["not_utf8"], true);
        let v = read_file(&root, &json!({"path": "."})).expect("list");
        assert_eq!(v["type"], "directory");
        assert_eq!(v["path"], ".");
        let names: Vec<&str> = v["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .filter_map(|e| e["name"].as_str())
            .collect();
        assert_eq!(names, ["a.txt", "bin"]);
        assert!(read_file(&root, &json!({})).is_err());
    }

    #[test]
    fn read_file_is_declared_only_with_a_directory() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let names = |t: &LocalTools| t.tools().into_iter().map(|s| s.name).collect::<Vec<_>>();
        let without = LocalTools::new(None, Southbound::empty(), tx.clone()).expect("tools");
        assert_eq!(names(&without), [CLOCK, SYSTEM_INFO]);
        let dir = tempfile::tempdir().expect("tempdir");
        let with =
            LocalTools::new(Some(dir.path()), Southbound::empty(), tx.clone()).expect("tools");
        assert_eq!(names(&with), [CLOCK, SYSTEM_INFO, READ_FILE]);
        assert!(
            with.tools()
                .iter()
                .all(|s| s.input_schema.is_some() && s.description.is_some())
        );
        let file = dir.path().join("f");
        std::fs::write(&file, "x").expect("write");
        assert!(LocalTools::new(Some(&file), Southbound::empty(), tx).is_err());
    }

    #[test]
    fn mcp_tools_keep_their_names_unless_taken() {
        let mut taken = HashMap::from([(READ_FILE.to_owned(), ())]);
        assert_eq!(free_name(&taken, "mcp1", "add").as_deref(), Some("add"));
        taken.insert("add".into(), ());
        assert_eq!(
            free_name(&taken, "mcp2", "add").as_deref(),
            Some("mcp2_add")
        );
        assert_eq!(
            free_name(&taken, "mcp1", READ_FILE).as_deref(),
            Some("mcp1_read_file")
        );
        taken.insert("mcp2_add".into(), ());
        assert_eq!(free_name(&taken, "mcp2", "add"), None);
    }

    #[test]
    fn builtins_answer() {
        let c = clock();
        assert!(c["unix_time"].as_i64().expect("unix") > 1_700_000_000);
        assert!(c["timezone"].as_str().is_some_and(|s| !s.is_empty()), "{c}");
        let s = system_info();
        assert_eq!(s["os"], std::env::consts::OS);
        assert!(s["cpus"].as_u64().expect("cpus") >= 1);
    }
}
