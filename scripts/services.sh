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

# Made once: a test CA; the server's certificate from it for localhost, 127.0.0.1 and ::1 (key
# owned by postgres, 0600); a client certificate from it (key owned by whoever runs the tests,
# 0600), which the server verifies when presented (ssl_ca_file); and a second, unrelated CA (its
# certificate only), which the tests must see refused. The server is pointed at them by a conf.d
# file and reloaded (TLS settings need no restart); trust auth stays as it is.
ensure_postgres_tls() {
  local version conf dir=$PG_TLS_DIR
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  conf="/etc/postgresql/$version/main/conf.d/91-sbp-test-tls.conf"
  local files=(ca.crt ca.key server.crt server.key client.crt client.key wrong-ca.crt)
  local missing=0 reload=0 f
  for f in "${files[@]}"; do as_root test -s "$dir/$f" || missing=1; done
  if [ "$missing" = 1 ]; then
    reload=1
    echo "services: making the PostgreSQL test certificates in $dir" >&2
    command -v openssl >/dev/null || apt_install openssl
    local tmp owner
    owner=${SUDO_USER:-$(id -un)}
    tmp=$(as_root mktemp -d)
    as_root bash -euo pipefail -c '
      cd "$1"
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
    ' _ "$tmp"
    as_root chown postgres:postgres "$tmp/server.key"
    as_root chown "$owner" "$tmp/client.key"
    as_root chmod 0755 "$tmp"
    as_root rm -rf "$dir"
    as_root mv "$tmp" "$dir"
  fi
  local want
  want=$(printf "%s\n" "# scripts/services.sh: the test CA's certificate (see ensure_postgres_tls)" \
    "ssl = on" "ssl_cert_file = '$dir/server.crt'" "ssl_key_file = '$dir/server.key'" \
    "ssl_ca_file = '$dir/ca.crt'")
  if [ "$(as_root cat "$conf" 2>/dev/null || true)" != "$want" ]; then
    printf "%s\n" "$want" | as_root tee "$conf" >/dev/null
    as_root chmod 0644 "$conf"
    reload=1
  fi
  # A reload loads new TLS files too; connections already open keep theirs.
  if [ "$reload" = 1 ]; then
    psql -h 127.0.0.1 -U postgres -tAc "SELECT pg_reload_conf()" >/dev/null
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

ensure_postgres
ensure_postgres_tls
ensure_redis
ensure_python3
echo "services: PostgreSQL (TLS: $PG_TLS_DIR/ca.crt) and Redis are up; python3 is present" >&2
