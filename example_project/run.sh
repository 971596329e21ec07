#!/usr/bin/env bash
# The main job on the embedded default (SQLite, no servers): makes .venv, installs the package,
# runs the example project end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/python -m example_project.run
