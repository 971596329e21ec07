"""A real worker's lease names its task and arguments in ``celery lease ls`` and ``show``.

The unit tests (tests/test_task.py ``TestHolderLabel``) push a request by hand; this proves the
worker's own request carries the argument text the sender recorded (Celery's ``argsrepr`` and
``kwargsrepr`` message headers) into the holder label, and that the CLI reads it back.
"""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import lease_here
from tests.conftest import unique

pytestmark = [pytest.mark.integration, pytest.mark.redis]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_ls_and_show_name_a_workers_task_and_arguments(
    it_app, start_worker, store_env, events, coord, queue, pool
):
    """While a worker's task holds its lease, ls --json and show give its task id, name and
    arguments as the sender recorded them. Failed before: no task name nor arguments."""
    env = store_env("redis")
    start_worker(env, queue=queue, pool=pool, concurrency=1)
    n, go = unique("h"), unique("go")
    result = it_app.touch_together.apply_async((n, go), {"timeout": 60.0}, queue=queue)
    cli_env = {"CLI_STORE": env["CL_STORE"], "CLI_PREFIX": env["CL_PREFIX"].rstrip(":")}
    try:
        events.wait(ev="waiting", res=n, timeout=60)
        done = lease_here("ls", "--json", "--prefix", f"conn-{n}", env=cli_env)
        assert done.returncode == 0, done.stderr
        (row,) = [r for r in json.loads(done.stdout) if r["resource"] == f"conn-{n}"]
        assert row["task_id"] == result.id
        assert row["task"] == it_app.touch_together.name
        assert row["args"] == f"({n!r}, {go!r}) {{'timeout': 60.0}}"
        shown = lease_here("show", f"conn-{n}", env=cli_env)
        assert f"task:        {it_app.touch_together.name}\n" in shown.stdout, shown.stdout
    finally:
        coord.rpush(go, "go")
    assert result.get(timeout=60) > 0  # (its fence)
