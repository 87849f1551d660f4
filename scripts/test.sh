#!/usr/bin/env bash
# The whole suite on the real services. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/test-services.sh)"
export ORRERY_DATA_DIR="${ORRERY_DATA_DIR:-$(mktemp -d)}"
echo "Testing against ${DATABASE_URL%%@*}@… and $REDIS_URL"
exec .venv/bin/python -m pytest --create-db "$@"
