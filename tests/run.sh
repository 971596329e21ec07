#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: makes .venv, installs the package with its test
# extras, installs redis-server when missing, then runs pytest (extra arguments go to pytest).
# Servers: reuses CELERY_LEASE_TEST_REDIS_URL / CELERY_LEASE_TEST_POSTGRES_URL when set (.ci/run
# sets them); otherwise the test session starts its own on free loopback ports and stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[all,test,bench,docs]'
bash tests/tooling/ensure_redis.sh
exec .venv/bin/python -m pytest "$@"
