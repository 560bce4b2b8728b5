#!/usr/bin/env bash
# Gateway CPU per durable turn by session length (BENCHMARKS.md, "Turn cost and session length").
# For each N given: a fresh `sbp serve` (SQLite, synchronous=full, rate limits off) in front of
# `sbp-fake-llm`, WORKERS keep-alive clients (default 16) on sessions preloaded with N messages,
# SECS seconds measured (default 10). Needs the release build:
#   cargo build --release -p sbp-cli -p sbp-fake-llm
#   scripts/bench-long-sessions.sh 2 1000 10000
# RATE=N paces all workers to N turns/s together (compare lengths at one turn rate). The
# environment reaches the gateway (e.g. SBP_HISTORY_CACHE_MIB=0 to compare without the cache).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
for N in "$@"; do
  D=$(mktemp -d)
  "$BIN/sbp-fake-llm" --listen 127.0.0.1:0 --no-record >"$D/fake.out" 2>"$D/fake.err" &
  FP=$!
  GP=
  trap 'kill $FP $GP 2>/dev/null || true; rm -rf "$D"' EXIT
  until FURL=$(grep -o 'http://[0-9.:]*' "$D/fake.out" | head -1) && [ -n "$FURL" ]; do sleep 0.1; done
  "$BIN/sbp" serve --listen 127.0.0.1:0 --data-dir "$D/data" --llm-base-url "$FURL/v1" \
    --sqlite-synchronous full --ping-interval 300 --max-request-messages 20000 \
    --rate-limit-ip 0 --rate-limit-session 0 --rate-limit-key 0 --rate-limit-auth-failures 0 \
    >"$D/sbp.out" 2>"$D/sbp.err" &
  GP=$!
  until GADDR=$(grep -o '127.0.0.1:[0-9]*' "$D/sbp.out" | head -1) && [ -n "$GADDR" ]; do sleep 0.1; done
  python3 scripts/bench/long_sessions.py "$GP" "$GADDR" "$N" "${WORKERS:-16}" "${SECS:-10}"
  grep VmHWM "/proc/$GP/status"
  kill "$GP" "$FP"
  wait "$GP" "$FP" 2>/dev/null || true
  rm -rf "$D"
  trap - EXIT
done
