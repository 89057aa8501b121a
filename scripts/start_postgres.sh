#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the store's tests, and print the URL to test against.
#   eval "$(bash scripts/start_postgres.sh)"      # exports TUNE_PROMPTS_TEST_PG_URL
#   bash scripts/start_postgres.sh --stop         # stops the server and deletes its data
# Installs PostgreSQL from Debian's packages when it is missing (needs root). The server runs as
# the postgres user on 127.0.0.1 only, on a free port, with trust auth for TCP from 127.0.0.1 and no
# Unix socket, fsync off (its data is thrown away), in $TUNE_PROMPTS_PG_DIR (default
# ${TMPDIR:-/tmp}/tune-prompts-pg). Run again while it is up, it prints the same URL; a dead or
# half-made server there is replaced. Only the export line and a comment go to stdout; progress
# goes to stderr.
set -euo pipefail
DIR=${TUNE_PROMPTS_PG_DIR:-${TMPDIR:-/tmp}/tune-prompts-pg}
DB=tune_prompts_test
say() { echo "[start_postgres] $*" >&2; }

bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  if [ -n "$d" ] && [ -x "$d/initdb" ]; then echo "$d"; return; fi
  d=$(command -v initdb 2>/dev/null) && dirname "$(readlink -f "$d")"
}

# initdb and postgres refuse to run as root: as root, run them as the postgres user.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

BIN=$(bindir || true)
if [ "${1:-}" = "--stop" ]; then
  if [ -n "$BIN" ] && [ -f "$DIR/data/postmaster.pid" ]; then
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >&2 || true
  fi
  rm -rf "$DIR"
  say "stopped; removed $DIR"
  exit 0
fi

if [ -z "$BIN" ]; then
  [ "$(id -u)" = 0 ] || { say "PostgreSQL is not installed; run as root or: apt-get install -y postgresql"; exit 1; }
  say "installing PostgreSQL from Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q postgresql >&2
  BIN=$(bindir) || { say "no initdb after installing postgresql"; exit 1; }
fi

url() { echo "postgresql://postgres@127.0.0.1:$1/$DB"; }
print_env() {
  echo "export TUNE_PROMPTS_TEST_PG_URL=$(url "$1")"
  echo "# stop it with: bash $(readlink -f "$0") --stop   (data in $DIR)"
}

# Already running here (a second call in the same CI job): print the same URL.
if [ -f "$DIR/port" ] && as_pg "$BIN/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1 \
   && "$BIN/pg_isready" -q -h 127.0.0.1 -p "$(cat "$DIR/port")"; then
  say "already running on port $(cat "$DIR/port")"
  print_env "$(cat "$DIR/port")"
  exit 0
fi
if [ -f "$DIR/data/postmaster.pid" ]; then
  as_pg "$BIN/pg_ctl" -D "$DIR/data" -m immediate -w stop >/dev/null 2>&1 || true
fi
rm -rf "$DIR"
mkdir -p "$DIR"
[ "$(id -u)" = 0 ] && chown postgres: "$DIR"
chmod 700 "$DIR"

say "initdb in $DIR/data ($("$BIN/postgres" --version))"
as_pg "$BIN/initdb" -D "$DIR/data" -U postgres -A trust -E UTF8 --locale=C --no-sync >"$DIR/initdb.log" 2>&1 \
  || { cat "$DIR/initdb.log" >&2; exit 1; }
# Trust only TCP from 127.0.0.1; no other host and no Unix socket can connect.
echo "host all all 127.0.0.1/32 trust" | as_pg tee "$DIR/data/pg_hba.conf" >/dev/null

for attempt in 1 2 3; do
  # A free port: bound and released here, so another process could take it before the server does: retry.
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  as_pg tee "$DIR/data/conf.d.conf" >/dev/null <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = ''
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
  grep -q "^include 'conf.d.conf'" "$DIR/data/postgresql.conf" \
    || echo "include 'conf.d.conf'" | as_pg tee -a "$DIR/data/postgresql.conf" >/dev/null
  if as_pg "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 start >&2; then
    break
  fi
  say "start on port $port failed (attempt $attempt): $(tail -n 3 "$DIR/server.log" 2>/dev/null | tr '\n' ' ')"
  [ "$attempt" = 3 ] && exit 1
done
echo "$port" >"$DIR/port"
"$BIN/psql" -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -c "CREATE DATABASE $DB" >&2
say "running on 127.0.0.1:$port, database $DB"
print_env "$port"
