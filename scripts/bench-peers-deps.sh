#!/usr/bin/env bash
# Installs the gateways `sbp-bench peers` measures sbp beside (the bench itself never installs
# anything): nginx from Debian's packages, LiteLLM's proxy in a venv under
# target/bench-peers/litellm-venv, and Portkey's gateway under target/bench-peers/portkey.
# Each step is skipped when its peer is already there; LITELLM_SPEC / PORTKEY_SPEC choose other
# versions (`LITELLM_SPEC='litellm[proxy]==1.2.3'`, `PORTKEY_SPEC=@portkey-ai/gateway@1.2.3`).
set -euo pipefail
cd "$(dirname "$0")/.."

LITELLM_SPEC=${LITELLM_SPEC:-'litellm[proxy]'}
PORTKEY_SPEC=${PORTKEY_SPEC:-@portkey-ai/gateway}
DIR=target/bench-peers

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_nginx() {
  # Debian installs it in /usr/sbin, which a non-root PATH may lack; the bench looks there too.
  if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then return 0; fi
  echo "bench-peers-deps: installing nginx" >&2
  apt_install nginx-light 2>/dev/null || apt_install nginx
  # The package starts a system-wide nginx on port 80; the bench starts its own on a free port.
  as_root systemctl disable --now nginx >/dev/null 2>&1 || as_root service nginx stop >/dev/null 2>&1 || true
}

ensure_litellm() {
  local venv=$DIR/litellm-venv
  if [ -x "$venv/bin/litellm" ]; then return 0; fi
  echo "bench-peers-deps: installing $LITELLM_SPEC in $venv" >&2
  mkdir -p "$DIR"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "$LITELLM_SPEC"
}

ensure_portkey() {
  local dir=$DIR/portkey
  if [ -f "$dir/node_modules/@portkey-ai/gateway/package.json" ]; then return 0; fi
  if ! command -v npm >/dev/null; then
    echo "bench-peers-deps: installing node and npm" >&2
    apt_install nodejs npm
  fi
  echo "bench-peers-deps: installing $PORTKEY_SPEC in $dir" >&2
  mkdir -p "$dir"
  [ -f "$dir/package.json" ] || echo '{"private":true}' >"$dir/package.json"
  npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "$PORTKEY_SPEC" >/dev/null
}

ensure_nginx
ensure_litellm
ensure_portkey
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
echo "bench-peers-deps: $("$nginx_bin" -v 2>&1), litellm $("$DIR/litellm-venv/bin/pip" show litellm 2>/dev/null | awk '/^Version/{print $2}'), @portkey-ai/gateway $(node -p "require('./$DIR/portkey/node_modules/@portkey-ai/gateway/package.json').version"), node $(node --version)" >&2
