#!/usr/bin/env bash
# The soak suite (RELIABILITY.md), outside the test command:
#
#   bash scripts/soak.sh [storm|badinput|exhaust|wsconformance|fuzz|all] [ARGS...]
#
# storm, badinput, exhaust: ARGS go to `sbp-soak PART` (e.g. `storm --kills-sqlite 5`; see
#   `target/release/sbp-soak PART --help`). They run against release builds of `sbp` and
#   `sbp-fake-llm`, which this script builds first; the storm's PostgreSQL (and Redis) are started
#   like scripts/test.sh does. Logs and failure reports land in soak-out/.
# wsconformance: the RFC 6455 table (crates/sbp-gateway/tests/gateway/ws_conformance.rs, also
#   part of the test command), run on its own with its result line.
# fuzz: ARGS are [SECONDS per target, default 600] [TARGET...] (targets: frames chat_request
#   bundle canonical token fed_token_peek); needs the nightly toolchain, installs cargo-fuzz when absent.
# all: every part with its defaults, one after the other.
#
# Prints one summary line per part; exits non-zero when any part failed.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:-all}"
if [ $# -gt 0 ]; then shift; fi
out=soak-out
mkdir -p "$out"

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; }

build() {
  echo "soak: building release binaries (sbp, sbp-fake-llm, sbp-soak)" >&2
  cargo build --release --locked -p sbp-cli -p sbp-fake-llm -p sbp-soak
}

# Runs `sbp-soak PART ARGS...`, its output also in soak-out/PART.log; returns its status.
run_soak() {
  local p=$1
  shift
  local status=0
  target/release/sbp-soak --out-dir "$out" "$p" "$@" 2>&1 | tee "$out/$p.log" || status=$?
  # With pipefail the pipeline's status is sbp-soak's (tee does not fail).
  return "$status"
}

ensure_fuzz_tools() {
  if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "soak: cargo fuzz needs the nightly toolchain, which is not installed" >&2
    return 1
  fi
  if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "soak: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
  fi
}

# fuzz [SECONDS] [TARGET...]: each target for SECONDS, new inputs in soak-out/fuzz/corpus/TARGET
# (the committed seeds in fuzz/corpus/TARGET are read, never written), crashes in
# soak-out/fuzz/artifacts/TARGET/.
fuzz() {
  local secs=600
  if [ $# -gt 0 ]; then
    secs=$1
    shift
  fi
  local targets=("$@")
  if [ ${#targets[@]} -eq 0 ]; then targets=(frames chat_request bundle canonical token fed_token_peek); fi
  ensure_fuzz_tools
  local failed=0 lines=() t
  for t in "${targets[@]}"; do
    local work="$PWD/$out/fuzz/corpus/$t" art="$PWD/$out/fuzz/artifacts/$t/" log="$out/fuzz-$t.log"
    mkdir -p "$work" "$art"
    echo "fuzz $t: ${secs} s (log $log)" >&2
    local status=PASS
    if ! cargo +nightly fuzz run "$t" "$work" "$PWD/fuzz/corpus/$t" -- \
      -max_total_time="$secs" -artifact_prefix="$art" -print_final_stats=1 >"$log" 2>&1; then
      status=FAIL
      failed=1
    fi
    local runs execs cov corp crashes
    # A target that did not build has none of these lines: no match must not end the script.
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{print $2}' | tail -n 1 || true)
    execs=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | awk '{print $2}' | tail -n 1 || true)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -n 1 || true)
    corp=$(find "$work" -type f | wc -l)
    crashes=$(find "$art" -type f | wc -l)
    lines+=("fuzz $t: $status ${secs} s, ${runs:-?} runs (${execs:-?}/s), ${cov:-cov ?}, corpus $corp new + $(find "fuzz/corpus/$t" -type f | wc -l) seeds, crashes $crashes")
    if [ "$status" = FAIL ]; then
      lines+=("  see $log; crashing inputs in $art")
    fi
  done
  printf '%s\n' "${lines[@]}" | tee "$out/fuzz.log"
  return "$failed"
}

# The RFC 6455 conformance table: every case on its own connection, the count of those passed.
wsconformance() {
  local status=0
  cargo test --locked -p sbp-gateway --test gateway ws_conformance -- --nocapture 2>&1 \
    | tee "$out/wsconformance-test.log" | grep -E 'RFC 6455 conformance|test result' || true
  if ! grep -q 'test result: ok' "$out/wsconformance-test.log"; then status=1; fi
  local line
  line=$(grep -o 'RFC 6455 conformance: .*' "$out/wsconformance-test.log" | tail -n 1)
  if [ "$status" = 0 ]; then line="wsconformance: PASS ${line#RFC 6455 conformance: }"; else line="wsconformance: FAIL ${line#RFC 6455 conformance: } (see $out/wsconformance-test.log)"; fi
  echo "$line" | tee "$out/wsconformance.log"
  return "$status"
}

export SBP_TEST_DATABASE_URL="${SBP_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export SBP_TEST_REDIS_URL="${SBP_TEST_REDIS_URL:-redis://127.0.0.1:6379}"

case "$part" in
  storm)
    build
    bash scripts/services.sh
    run_soak storm "$@"
    ;;
  badinput | exhaust)
    build
    run_soak "$part" "$@"
    ;;
  wsconformance)
    wsconformance
    ;;
  fuzz)
    fuzz "$@"
    ;;
  all)
    if [ $# -gt 0 ]; then
      echo "soak: 'all' takes no arguments; run the parts one by one to pass some" >&2
      exit 2
    fi
    build
    bash scripts/services.sh
    failed=()
    for p in storm badinput exhaust; do
      run_soak "$p" || failed+=("$p")
    done
    wsconformance || failed+=(wsconformance)
    fuzz || failed+=(fuzz)
    echo
    echo "soak summary:"
    grep -hE '^(storm|badinput|exhaust) ' "$out/storm.log" "$out/badinput.log" "$out/exhaust.log" || true
    cat "$out/wsconformance.log"
    cat "$out/fuzz.log"
    if [ ${#failed[@]} -gt 0 ]; then
      echo "soak: FAILED: ${failed[*]}"
      exit 1
    fi
    echo "soak: every part passed"
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
