#!/usr/bin/env bash
# The main job on the embedded default (SQLite store and broker, no servers): makes .venv and
# installs the package the first time, then runs the demo (extra arguments go to it, e.g.
# --store redis://127.0.0.1:6379/0 --broker redis://127.0.0.1:6379/1).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
if ! .venv/bin/python -c "import celery_lease, celery, sqlalchemy" 2>/dev/null; then
  echo "installing celery_lease into .venv (first run only) ..."
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
exec .venv/bin/python -m example_project.run "$@"
