"""``celery -A proj lease ...``: inspect and manage leases from the command line.

Registered through the ``celery.commands`` entry point, so Celery loads it like its own
``celery list``: ``ctx.obj.app`` is the app named by ``-A`` and the store is that app's
``lease_store_url``. Commands print human tables by default and JSON with ``--json``. On an
error they print one line (``Error: ...``) to stderr and exit non-zero: 1 when the store failed
or refused, 2 for bad input or settings (a bad resource name, no ``lease_store_url``).
"""

from __future__ import annotations

import click
from celery.bin.base import handle_preload_options

from ._cli_check import (  # REDIS_ACL: what init-schema prints for Redis, read from here
    REDIS_ACL,  # noqa: F401
    check,
    init_schema,
)
from ._cli_common import prefix_of
from ._cli_inspect import ls, show, stats
from ._cli_manage import release, sweep_command
from ._names import holder_task_id

__all__ = ["holder_task_id", "lease", "prefix_of"]


@click.group(name="lease")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def lease(ctx: click.Context) -> None:
    """Inspect and manage celery_lease leases (the app's lease_store_url)."""


# Each command lives with the ones like it (_cli_inspect, _cli_check, _cli_manage); a group
# lists its commands sorted by name, so the order here changes nothing.
for _command in (ls, show, stats, check, init_schema, release, sweep_command):
    lease.add_command(_command)
