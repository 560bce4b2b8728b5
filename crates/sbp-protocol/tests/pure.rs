//! The protocol crate is pure (ARCHITECTURE.md): its dependencies include no runtime, socket,
//! HTTP or storage crate, so clients and the gateway can share its types without pulling IO in.

#[test]
fn no_io_dependencies() {
    let manifest = include_str!("../Cargo.toml");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("a [dependencies] table");
    let names: Vec<&str> = deps
        .lines()
        .filter_map(|l| l.split(['=', '.']).next())
        .map(str::trim)
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect();
    assert!(names.contains(&"serde_json"), "parsed the table: {names:?}");
    for io in [
        "tokio",
        "futures",
        "reqwest",
        "axum",
        "hyper",
        "rusqlite",
        "redis",
        "tokio-postgres",
        "tungstenite",
        "tokio-tungstenite",
        "rmcp",
    ] {
        assert!(!names.contains(&io), "sbp-protocol depends on {io}");
    }
}
