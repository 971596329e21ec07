#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: makes .venv, installs the package with its test
# extras, installs redis-server and rabbitmq-server when missing, then runs pytest in several
# processes (extra arguments go to pytest).
# Servers: reuses CELERY_LEASE_TEST_REDIS_URL / CELERY_LEASE_TEST_POSTGRES_URL /
# CELERY_LEASE_TEST_RABBITMQ_DIR when set (.ci/run sets them); otherwise the test session starts
# its own on free loopback ports and stops them (one RabbitMQ node for all its processes).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[all,test,bench,docs]'
bash tests/tooling/ensure_redis.sh
bash tests/tooling/ensure_rabbitmq.sh
# Most of the suite waits on real workers and servers (one process keeps a 2-core machine below
# half busy), so it runs in CELERY_LEASE_TEST_PROCESSES processes (3; 0 for one process, or
# pass -n 0), tests handed out as processes free up. Tests that must not share a server's
# state with others running at once get their own (tests/conftest.py, own_redis_db).
exec .venv/bin/python -m pytest -n "${CELERY_LEASE_TEST_PROCESSES:-3}" --dist worksteal "$@"
