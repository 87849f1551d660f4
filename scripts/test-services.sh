#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on loopback: use them when running, start them when
# installed but stopped, install them with apt-get when absent (fresh Debian).
# Prints the variables the test run needs (source-able `export …` lines) on stdout.
set -euo pipefail
log() { echo "test-services: $*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  log "installing $* with apt-get"
  as_root apt-get update -qq >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
redis_up() { [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = PONG ]; }

if [ -z "${ORRERY_TEST_DATABASE_URL:-}" ]; then
  if ! command -v pg_ctlcluster >/dev/null; then apt_install postgresql; fi
  if ! pg_up; then
    for version in $(ls /etc/postgresql 2>/dev/null); do
      log "starting PostgreSQL $version"
      as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
    done
    for _ in $(seq 1 30); do pg_up && break; sleep 1; done
    pg_up || { log "PostgreSQL does not answer on 127.0.0.1:5432"; exit 1; }
  fi
  # A fresh Debian cluster asks for a password over TCP: when ours is refused, give the postgres
  # role the known test password through the local socket (peer authentication as postgres).
  if ! PGPASSWORD=postgres psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1; then
    log "setting the postgres role's test password"
    as_root runuser -u postgres -- psql -q -c "ALTER ROLE postgres PASSWORD 'postgres'" >&2
  fi
fi

if [ -z "${ORRERY_TEST_REDIS_URL:-}" ]; then
  if ! command -v redis-server >/dev/null; then apt_install redis-server; fi
  if ! redis_up; then
    log "starting Redis"
    mkdir -p /tmp/orrery-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --dir /tmp/orrery-redis --logfile /tmp/orrery-redis/redis.log >&2
    for _ in $(seq 1 20); do redis_up && break; sleep 0.5; done
    redis_up || { log "Redis does not answer on 127.0.0.1:6379"; exit 1; }
  fi
fi

# Headless Chromium for the browser tests, from Debian's package (never a tool's own download).
if ! command -v chromium >/dev/null; then apt_install chromium; fi

# Containers for the agents' image jobs: podman with runc (crun refuses hosts whose cgroups mix
# v1 and v2), and busybox-static, the root file system the tests build their local image from.
missing=()
for tool in podman runc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || missing+=(busybox-static)
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

# A throwaway database per run: pytest-django creates test_<name> and drops it afterwards.
echo "export DATABASE_URL='${ORRERY_TEST_DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:5432/orrery_$$}'"
echo "export REDIS_URL='${ORRERY_TEST_REDIS_URL:-redis://127.0.0.1:6379/9}'"
