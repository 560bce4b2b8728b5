//! The boundaries ARCHITECTURE.md states, checked on the source: the engine names no transport
//! type, and no service is handed the whole gateway.

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
        for transport in ["axum", "http::", "tungstenite", "StatusCode", "HeaderMap"] {
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
