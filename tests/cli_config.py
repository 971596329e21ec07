"""The app ``tests/cli_app.py`` gives ``celery -A tests.cli_app lease``, built from a mapping.

Separate from ``tests/cli_app.py`` so in-process CLI tests (``tests/cli_helpers.py``) can build
one app per target without importing that module, whose ``on_expired`` hooks would then stay
registered for the rest of the test session.
"""

from __future__ import annotations

from collections.abc import Mapping

from celery import Celery


def make_app(env: Mapping[str, str]) -> Celery:
    """An app configured from ``env`` the way ``tests/cli_app.py`` documents it."""
    app = Celery("cli_app", broker="memory://", backend="cache+memory://")
    if env.get("CLI_STORE"):
        app.conf.update(
            lease_store_url=env["CLI_STORE"],
            lease_key_prefix=env.get("CLI_PREFIX", "celery_lease") + ":",
            lease_table_prefix=env.get("CLI_PREFIX", "celery_lease") + "_",
            # Short, so a sweeper's claim left by a failed cleanup expires within the test.
            lease_ttl=float(env.get("CLI_TTL", "60")),
        )
    return app
