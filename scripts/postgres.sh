#!/usr/bin/env bash
# Install (Debian) and start a throwaway PostgreSQL on 127.0.0.1:5433 for the shared-storage study test.
# Prints the URL to use as `--storage`. `postgres.sh stop` stops it (and nothing else) if it runs.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/pg_ctl > /dev/null 2>&1; then
  apt-get update -qq > /dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql > /dev/null
fi
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/pg_ctl | tail -n 1)")
DATA=${PGDATA_DIR:-/tmp/dflash-lab-pg}
PORT=${PGPORT_TEST:-5433}
if [ "${1:-}" = stop ]; then
  if su postgres -c "$BIN/pg_ctl -D $DATA status" > /dev/null 2>&1; then
    su postgres -c "$BIN/pg_ctl -D $DATA -m fast -w stop" > /dev/null
  fi
  exit 0
fi
if ! su postgres -c "$BIN/pg_ctl -D $DATA status" > /dev/null 2>&1; then
  rm -rf "$DATA" && mkdir -p "$DATA" && chown postgres "$DATA"
  su postgres -c "$BIN/initdb -D $DATA -A trust -U postgres" > /dev/null
  su postgres -c "$BIN/pg_ctl -D $DATA -o '-p $PORT -k /tmp -c listen_addresses=127.0.0.1' -l $DATA/log -w start" > /dev/null
fi
psql -h 127.0.0.1 -p "$PORT" -U postgres -tc "SELECT 1 FROM pg_database WHERE datname = 'optuna'" | grep -q 1 \
  || psql -h 127.0.0.1 -p "$PORT" -U postgres -c "CREATE DATABASE optuna" > /dev/null
echo "postgresql://postgres@127.0.0.1:$PORT/optuna"
