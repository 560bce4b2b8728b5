#!/usr/bin/env bash
# Makes sure the terminal tests (crates/sbp-cli/tests/binary/attach_tty.rs) can run: they drive
# `sbp attach` in a tmux pane. Installs Debian's tmux with apt-get when it is absent.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v tmux >/dev/null; then
  echo "terminal-deps: installing tmux" >&2
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends tmux >/dev/null
fi
echo "terminal-deps: $(tmux -V)" >&2
