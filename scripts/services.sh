#!/usr/bin/env bash
# Makes sure PostgreSQL (127.0.0.1:5432, trust auth, database `test`, TLS with a test CA's
# certificate) and Redis (127.0.0.1:6379) are running: starts them when they are down and installs
# them with apt-get when they are absent.
set -euo pipefail

# The test TLS files (scripts/test.sh exports SBP_TEST_PG_CA=$PG_TLS_DIR/ca.crt).
PG_TLS_DIR=/var/lib/postgresql/sbp-test-tls

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
  # The cluster configured for port 5432, else the newest one, else a new one. `|| true`: with no
  # cluster yet, pg_lsclusters and ls fail, which set -e and pipefail would take as fatal.
  local version
  version=$( (pg_lsclusters -h 2>/dev/null || true) | awk '$2 == "main" && $3 == 5432 { print $1; exit }')
  if [ -z "$version" ]; then
    version=$( (ls /etc/postgresql 2>/dev/null || true) | sort -V | tail -n 1)
  fi
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

# psql as the test server's superuser (trust auth on 127.0.0.1): the server itself says where its
# files are and takes its TLS settings (ALTER SYSTEM), so no cluster layout is guessed.
pg_sql() { psql -X -q -h 127.0.0.1 -p 5432 -U postgres -d postgres -v ON_ERROR_STOP=1 -tA "$@"; }

PG_TLS_FILES=(ca.crt ca.key server.crt server.key client.crt client.key wrong-ca.crt)

# Whether the test TLS files are all there and the ones the tests read are readable by whoever
# runs this (plain tests: no root needed to look).
pg_tls_files_ready() {
  local f
  for f in "${PG_TLS_FILES[@]}"; do test -s "$PG_TLS_DIR/$f" || return 1; done
  for f in ca.crt wrong-ca.crt client.crt client.key; do test -r "$PG_TLS_DIR/$f" || return 1; done
}

# Makes the files (as root, under a lock, so concurrent runs make them once): a test CA; the
# server's certificate from it for localhost, 127.0.0.1 and ::1 (key owned by the server's user,
# 0600); a client certificate from it (key owned by whoever runs the tests, 0600), which the
# server verifies when presented (ssl_ca_file); and a second, unrelated CA (its certificate only),
# which the tests must see refused. They are built in a directory of their own, and
# $PG_TLS_DIR, a symbolic link, is switched to it by one rename: a reader sees the old set or the
# new one, never half of each, and a concurrent run never nests one directory in another.
make_pg_tls_files() {
  command -v openssl >/dev/null || apt_install openssl
  local owner server_user parent
  owner=${SUDO_USER:-$(id -un)}
  # The server's user owns its data directory (its key must be that user's, or root's).
  server_user=$(stat -c %U "$(pg_sql -c "SHOW data_directory")" 2>/dev/null || echo postgres)
  parent=$(dirname "$PG_TLS_DIR")
  as_root flock "$parent/.sbp-test-tls.lock" bash -euo pipefail -c '
    dir=$1 owner=$2 server_user=$3
    shift 3
    parent=$(dirname "$dir")
    # Another run may have made them while this one waited for the lock.
    complete=1
    for f in "$@"; do test -s "$dir/$f" || complete=0; done
    if [ "$complete" = 1 ] && [ "$(stat -L -c %U "$dir/client.key")" = "$owner" ]; then exit 0; fi
    echo "services: making the PostgreSQL test certificates in $dir" >&2
    new=$(mktemp -d "$parent/.sbp-test-tls.XXXXXX")
    # Nothing half-made stays behind when a step fails.
    trap '\''rm -rf "$new" "$parent/.sbp-test-tls.link.$$"'\'' EXIT
    cd "$new"
    umask 077
    ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    openssl req -x509 $ec -keyout ca.key -out ca.crt -days 3650 -subj "/CN=sbp test CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    openssl req -x509 $ec -keyout wrong-ca.key -out wrong-ca.crt -days 3650 -subj "/CN=sbp unrelated CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    rm wrong-ca.key
    leaf() { # name, subject, extensions
      openssl req -new $ec -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
      printf "%s\n" "$3" > "$1.ext"
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
        -days 3650 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
      rm "$1.csr" "$1.ext"
    }
    leaf server "/CN=localhost" "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth"
    leaf client "/CN=sbp-test-client" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
    chmod 0644 ca.crt wrong-ca.crt server.crt client.crt
    chown "$server_user:" server.key
    chown "$owner" client.key
    chmod 0755 "$new"
    # A directory from before the link (or a broken link) is moved aside first (once).
    old=
    if [ -e "$dir" ] || [ -L "$dir" ]; then
      if [ -L "$dir" ]; then
        old=$(readlink -f "$dir" || true)
      else
        old=$(mktemp -d "$parent/.sbp-test-tls.old.XXXXXX")
        mv -T "$dir" "$old"
      fi
    fi
    ln -s "$(basename "$new")" "$parent/.sbp-test-tls.link.$$"
    mv -T "$parent/.sbp-test-tls.link.$$" "$dir"
    trap - EXIT
    case "$old" in "$parent"/.sbp-test-tls.*) rm -rf "$old" ;; esac
  ' _ "$PG_TLS_DIR" "$owner" "$server_user" "${PG_TLS_FILES[@]}"
}

# The test certificates, and the server presenting them: set through the running server
# (ALTER SYSTEM, then a reload: TLS settings need no restart, and the server is shared with tests
# that are running, so it is never restarted); trust auth stays as it is. When the files and the
# settings are in place, nothing here runs as root.
ensure_postgres_tls() {
  local dir=$PG_TLS_DIR reload=0
  if ! pg_tls_files_ready; then
    make_pg_tls_files
    reload=1
  fi
  # One source of settings: the conf.d file an earlier version of this script wrote goes.
  local stale
  stale=$(pg_sql -c "SELECT DISTINCT sourcefile FROM pg_file_settings
    WHERE sourcefile LIKE '%/conf.d/91-sbp-test-tls.conf'")
  if [ -n "$stale" ]; then
    as_root rm -f "$stale"
    reload=1
  fi
  local want="on|$dir/ca.crt|$dir/server.crt|$dir/server.key"
  local stored
  stored=$(pg_sql -c "SELECT coalesce(max(setting) FILTER (WHERE name = 'ssl'), '')
      || '|' || coalesce(max(setting) FILTER (WHERE name = 'ssl_ca_file'), '')
      || '|' || coalesce(max(setting) FILTER (WHERE name = 'ssl_cert_file'), '')
      || '|' || coalesce(max(setting) FILTER (WHERE name = 'ssl_key_file'), '')
    FROM pg_file_settings WHERE sourcefile LIKE '%/postgresql.auto.conf'")
  if [ "$stored" != "$want" ]; then
    pg_sql -c "ALTER SYSTEM SET ssl = on" -c "ALTER SYSTEM SET ssl_ca_file = '$dir/ca.crt'" \
      -c "ALTER SYSTEM SET ssl_cert_file = '$dir/server.crt'" \
      -c "ALTER SYSTEM SET ssl_key_file = '$dir/server.key'"
    reload=1
  fi
  local running
  running=$(pg_sql -c "SELECT current_setting('ssl') || '|' || current_setting('ssl_ca_file')
    || '|' || current_setting('ssl_cert_file') || '|' || current_setting('ssl_key_file')")
  if [ "$running" != "$want" ]; then reload=1; fi
  # A reload loads new TLS files too; connections already open keep theirs.
  if [ "$reload" = 1 ]; then
    pg_sql -c "SELECT pg_reload_conf()" >/dev/null
  fi
  # The server presents the test certificate (a reload that could not load it keeps the old one).
  if ! wait_for "PostgreSQL's test certificate" "openssl s_client -starttls postgres -connect 127.0.0.1:5432 \
      -CAfile '$dir/ca.crt' -verify_hostname localhost -verify_return_error </dev/null"; then
    echo "services: PostgreSQL does not present $dir/server.crt; see its log" >&2
    return 1
  fi
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

# The fuzz targets' libFuzzer (checked by scripts/test.sh) is C++.
ensure_cxx() {
  if command -v c++ >/dev/null; then return 0; fi
  echo "services: installing g++" >&2
  apt_install g++
}

ensure_postgres
ensure_postgres_tls
ensure_redis
ensure_python3
ensure_cxx
echo "services: PostgreSQL (TLS: $PG_TLS_DIR/ca.crt) and Redis are up; python3 is present" >&2
