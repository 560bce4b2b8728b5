#!/usr/bin/env bash
# Makes sure PostgreSQL (127.0.0.1:5432, trust auth, database `test`) and Redis (127.0.0.1:6379) are
# running: starts them when they are down and installs them with apt-get when they are absent.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

wait_for() { # name, command
  for _ in $(seq 1 60); do
    if eval "$2" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "services: $1 did not come up" >&2
  return 1
}

ensure_postgres() {
  if command -v pg_isready >/dev/null && pg_isready -h 127.0.0.1 -p 5432 -q; then return 0; fi
  if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    echo "services: installing PostgreSQL" >&2
    apt_install postgresql postgresql-client
  fi
  local version
  version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$version" ]; then
    version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
    as_root pg_createcluster "$version" main >/dev/null
  fi
  local hba="/etc/postgresql/$version/main/pg_hba.conf"
  if ! as_root grep -q "^host all all 127.0.0.1/32 trust" "$hba"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\nlocal all all trust' "$hba"
  fi
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_for PostgreSQL "pg_isready -h 127.0.0.1 -p 5432 -q"
  psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null
}

ensure_redis() {
  if command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then return 0; fi
  if ! command -v redis-server >/dev/null; then
    echo "services: installing Redis" >&2
    apt_install redis-server
  fi
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for Redis "redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG"
}

# The MCP tests run a stdio MCP server written in Python (standard library only).
ensure_python3() {
  if command -v python3 >/dev/null; then return 0; fi
  echo "services: installing python3" >&2
  apt_install python3
}

ensure_postgres
ensure_redis
ensure_python3
echo "services: PostgreSQL and Redis are up; python3 is present" >&2
