#!/usr/bin/env bash
# Makes sure the browser tests (crates/sbp-cli/tests/binary/browser.rs) and the reference-client
# test (crates/sbp-cli/tests/binary/refclient.rs) can run: Debian's Chromium at /usr/bin/chromium,
# node and npm, tests/browser's node_modules (playwright-core only) and tests/refclient's
# (typescript only), each at the exact version of its package-lock.json. Installs what is absent
# with apt-get and `npm ci`; never downloads a browser of its own (playwright-core drives the
# system Chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_chromium() {
  if [ -x /usr/bin/chromium ]; then return 0; fi
  echo "browser-deps: installing chromium" >&2
  apt_install chromium
}

ensure_node() {
  if command -v node >/dev/null && command -v npm >/dev/null; then return 0; fi
  echo "browser-deps: installing node and npm" >&2
  apt_install nodejs npm
}

# `npm ci` in DIR when its node_modules lacks PACKAGE or is older than the lockfile (so a version
# bump lands).
ensure_modules() {
  local dir=$1 package=$2
  if [ -f "$dir/node_modules/$package/package.json" ] \
    && [ ! "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
    return 0
  fi
  echo "browser-deps: npm ci in $dir" >&2
  # The browser is Debian's: nothing may download one.
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error >/dev/null
}

ensure_chromium
ensure_node
ensure_modules tests/browser playwright-core
ensure_modules tests/refclient typescript
echo "browser-deps: chromium $(/usr/bin/chromium --version 2>/dev/null | awk '{print $2}'), node $(node --version), playwright-core $(node -p "require('./tests/browser/node_modules/playwright-core/package.json').version"), typescript $(node -p "require('./tests/refclient/node_modules/typescript/package.json').version")" >&2
