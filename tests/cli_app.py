"""The app that ``tests/test_cli.py`` and ``tests/test_sweeper.py`` run ``celery lease`` against.

Configured from the environment: ``CLI_STORE`` (empty: an app with no lease settings),
``CLI_PREFIX`` (Redis key prefix and SQL table prefix, so each test has its own leases).
"""

from __future__ import annotations

import os

from celery import Celery

env = os.environ
app = Celery("cli_app", broker="memory://", backend="cache+memory://")
if env.get("CLI_STORE"):
    app.conf.update(
        lease_store_url=env["CLI_STORE"],
        lease_key_prefix=env.get("CLI_PREFIX", "celery_lease") + ":",
        lease_table_prefix=env.get("CLI_PREFIX", "celery_lease") + "_",
    )
