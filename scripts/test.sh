#!/usr/bin/env bash
# The whole suite on the real services. Extra arguments go to pytest, in one process.
#
# With no arguments the suite runs as two pytest processes at once, each on a database, a Redis
# database and a data folder of its own: most tests wait on processes they started (agents,
# Celery workers, Daphne, Slurm), so two share the cores well. Everything that touches state of
# the whole machine (the dev Slurm, the test Unix accounts, podman's image store) is in the
# second, with the fault suite and the other end-to-end tests; the first runs the rest.
# ORRERY_TEST_SERIAL=1 runs the whole suite in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/test-services.sh)"
export ORRERY_DATA_DIR="${ORRERY_DATA_DIR:-$(mktemp -d)}"
echo "Testing against ${DATABASE_URL%%@*}@… and $REDIS_URL"
if [ $# -gt 0 ] || [ "${ORRERY_TEST_SERIAL:-}" = 1 ]; then
  exec .venv/bin/python -m pytest --create-db "$@"
fi

second=(
  tests/faults
  tests/test_adapters.py
  tests/clusters/test_slurm_live.py
  tests/clusters/test_preemption_slurm_live.py
  tests/clusters/test_agent_isolation.py
  tests/clusters/test_agent_e2e.py
  tests/clusters/test_agent_faults.py
  tests/clusters/test_agent_mig_e2e.py
  tests/clusters/test_celery_pipeline.py
  tests/clusters/test_preemption_exec_e2e.py
  tests/clusters/test_preemption_exec_contract.py
  tests/clusters/test_ingest_faults.py
)
first=()
for path in "${second[@]}"; do first+=(--ignore "$path"); done

# The second process's database, Redis database and data folder: the first's, one along.
query=""; [[ "$DATABASE_URL" == *\?* ]] && query="?${DATABASE_URL#*\?}"
second_database="${DATABASE_URL%%\?*}_2$query"
redis_db="${REDIS_URL##*/}"
[[ "$redis_db" =~ ^[0-9]+$ ]] || { echo "REDIS_URL must end with a database number: $REDIS_URL" >&2; exit 2; }
second_redis="${REDIS_URL%/*}/$((redis_db + 1))"
second_data="$ORRERY_DATA_DIR/second"
mkdir -p "$second_data"

started=$SECONDS
trap 'kill 0' INT TERM
( ORRERY_TEST_PROCESS=first .venv/bin/python -m pytest --create-db "${first[@]}" 2>&1 | sed -u 's/^/[1] /' ) &
one=$!
( ORRERY_TEST_PROCESS=second DATABASE_URL="$second_database" REDIS_URL="$second_redis" ORRERY_DATA_DIR="$second_data" \
    .venv/bin/python -m pytest --create-db "${second[@]}" 2>&1 | sed -u 's/^/[2] /' ) &
two=$!
status_one=0; wait "$one" || status_one=$?
status_two=0; wait "$two" || status_two=$?
echo "The suite took $((SECONDS - started)) s: first process exit $status_one, second $status_two"
[ "$status_one" = 0 ] && [ "$status_two" = 0 ]
