#!/usr/bin/env bash
# Makes sure the OpenAI SDK tests (crates/sbp-cli/tests/binary/openai_sdks.rs) can run: OpenAI's
# official Python SDK in a virtualenv at tests/sdk/.venv (version pinned in
# tests/sdk/requirements.txt) and its Node SDK in tests/sdk/node_modules (`npm ci` from
# tests/sdk/package-lock.json). Installs what is absent: python3 and its venv module with
# apt-get, the SDKs from PyPI and npm.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

dir=tests/sdk

ensure_python() {
  if command -v python3 >/dev/null && python3 -c 'import venv, ensurepip' 2>/dev/null; then return 0; fi
  echo "sdk-deps: installing python3 and python3-venv" >&2
  apt_install python3 python3-venv
}

# The venv is (re)made when missing or when requirements.txt is newer than its stamp.
ensure_python_sdk() {
  local stamp="$dir/.venv/.requirements"
  if [ -x "$dir/.venv/bin/python" ] && [ -f "$stamp" ] && [ ! "$dir/requirements.txt" -nt "$stamp" ]; then
    return 0
  fi
  echo "sdk-deps: installing the Python SDK into $dir/.venv" >&2
  rm -rf "$dir/.venv"
  python3 -m venv "$dir/.venv"
  "$dir/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$dir/requirements.txt"
  cp "$dir/requirements.txt" "$stamp"
}

ensure_node_sdk() {
  if [ -f "$dir/node_modules/openai/package.json" ] \
    && [ ! "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
    return 0
  fi
  if ! command -v npm >/dev/null; then
    echo "sdk-deps: installing node and npm" >&2
    apt_install nodejs npm
  fi
  echo "sdk-deps: npm ci in $dir" >&2
  npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error >/dev/null
}

ensure_python
ensure_python_sdk
ensure_node_sdk
echo "sdk-deps: openai (Python) $("$dir/.venv/bin/python" -c 'import openai; print(openai.__version__)'), openai (Node) $(node -p "require('./$dir/node_modules/openai/package.json').version")" >&2
