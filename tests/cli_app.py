"""The app that ``tests/test_cli.py`` and ``tests/test_sweeper.py`` run ``celery lease`` against.

Configured from the environment: ``CLI_STORE`` (empty: an app with no lease settings),
``CLI_PREFIX`` (Redis key prefix and SQL table prefix, so each test has its own leases),
``CLI_TTL`` (the lease ttl) and ``CLI_MARKS`` (a directory the ``on_expired`` hooks write to).
"""

from __future__ import annotations

import os
from pathlib import Path

import celery_lease
from tests.cli_config import make_app

env = os.environ
app = make_app(env)

# Cleanup hooks for tests/test_sweeper.py: each leaves a mark file in CLI_MARKS.
# "fragile/" fails while the file "broken" exists there.


@celery_lease.on_expired("disposable/")
def close_disposable(expired: celery_lease.ExpiredLease) -> None:
    _mark(expired)


@celery_lease.on_expired("fragile/")
def close_fragile(expired: celery_lease.ExpiredLease) -> None:
    if (Path(env["CLI_MARKS"]) / "broken").exists():
        raise RuntimeError(f"profile of {expired.resource} is locked")
    _mark(expired)


def _mark(expired: celery_lease.ExpiredLease) -> None:
    marks = Path(env["CLI_MARKS"])
    marks.mkdir(exist_ok=True)
    name = expired.resource.replace("/", "_")
    (marks / name).write_text(f"{expired.holder_label}\n{expired.fence}\n{expired.lease.fence}\n")
