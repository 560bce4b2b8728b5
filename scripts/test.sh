#!/usr/bin/env bash
# The project's test command: starts PostgreSQL and Redis if needed, installs the browser tests'
# Chromium and playwright-core, OpenAI's Python and Node SDKs and the terminal tests' tmux if
# needed, then runs every test of the
# workspace (unit, storage suite, gateway integration tests over loopback, real-binary tests, the
# page in headless Chromium, `sbp attach` in a tmux pane).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/browser-deps.sh
bash scripts/sdk-deps.sh
bash scripts/terminal-deps.sh
export SBP_TEST_DATABASE_URL="${SBP_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export SBP_TEST_REDIS_URL="${SBP_TEST_REDIS_URL:-redis://127.0.0.1:6379}"
# The CA of the test server's certificate (services.sh makes it; its directory also holds
# wrong-ca.crt, client.crt and client.key).
export SBP_TEST_PG_CA="${SBP_TEST_PG_CA:-/var/lib/postgresql/sbp-test-tls/ca.crt}"
# The fuzz targets (a workspace of their own, run by scripts/soak.sh on nightly) must keep
# compiling against the protocol crate they fuzz.
cargo check --locked --quiet --manifest-path fuzz/Cargo.toml --bins --examples
cargo test --workspace --all-targets --locked "$@"
