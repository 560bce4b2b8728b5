//! The boundaries ARCHITECTURE.md states, checked on the source: the engine names no transport
//! type, no service is handed the whole gateway, and each service uses only the services to its
//! right in the engine's order.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Code lines (comments left out) of every file under `src/engine`, with their file.
fn engine_code() -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine"),
        &mut files,
    );
    assert!(files.len() > 10, "the engine's files were found: {files:?}");
    files
        .into_iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(&f).expect("readable file");
            text.lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .map(|l| (f.clone(), l.to_owned()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_engine_knows_no_http_or_websocket_types() {
    for (file, line) in engine_code() {
        for transport in [
            "axum",
            "http::",
            "hyper",
            "reqwest",
            "tungstenite",
            "StatusCode",
            "HeaderMap",
            "IntoResponse",
            "crate::transport",
        ] {
            assert!(
                !line.contains(transport),
                "{} names `{transport}`: {line}",
                file.display()
            );
        }
    }
}

#[test]
fn services_are_not_handed_the_gateway() {
    for (file, line) in engine_code() {
        if file.ends_with("engine/mod.rs") {
            continue;
        }
        let names_the_root = line
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|word| word == "Gateway");
        assert!(
            !names_the_root,
            "{} reaches for the composition root: {line}",
            file.display()
        );
    }
}

/// The engine's modules, each allowed to use only those after it (ARCHITECTURE.md, `engine/mod.rs`).
const LAYERS: [&str; 10] = [
    "turns",
    "surfaces",
    "federation",
    "roaming",
    "tools",
    "sessions",
    "replicas",
    "connections",
    "calls",
    "tasks",
];

/// The engine module a file belongs to (`engine/turns/agent.rs` -> `turns`).
fn module_of(file: &Path) -> Option<&'static str> {
    let engine = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let first = file.strip_prefix(&engine).ok()?.components().next()?;
    let name = first.as_os_str().to_str()?.trim_end_matches(".rs");
    LAYERS.iter().copied().find(|m| *m == name)
}

#[test]
fn each_service_uses_only_those_to_its_right() {
    let mut edges = 0;
    for (file, line) in engine_code() {
        let Some(from) = module_of(&file) else {
            continue; // mod.rs: the composition root uses them all
        };
        let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
        // `super::x` names a module of the engine from a file directly under `engine/` or from a
        // module's `mod.rs`; elsewhere it names the file's own module.
        let in_engine_dir = file.parent().and_then(|p| p.file_name()) == Some("engine".as_ref());
        let prefixes: &[&str] = if in_engine_dir || file.ends_with("mod.rs") {
            &["crate::engine::", "super::"]
        } else {
            &["crate::engine::"]
        };
        for prefix in prefixes {
            for (at, _) in line.match_indices(prefix) {
                let rest = &line[at + prefix.len()..];
                let used: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let (Some(a), Some(b)) = (rank(from), rank(&used)) else {
                    continue;
                };
                edges += 1;
                assert!(
                    a < b || from == used,
                    "{} ({from}) uses {used}, which is not to its right: {line}",
                    file.display()
                );
            }
        }
    }
    assert!(edges > 10, "the engine's imports were read ({edges} edges)");
}
