"""A lease interrupt that lands inside ``fenced_update``: the task must go to RETRY.

Found by the lost-update scenario on PostgreSQL (test_lost_update.py): the renewer declared the
lease lost while the body was inside ``celery_lease.fencing.fenced_update``; the interrupt
(raised by the SIGUSR1 handler in the body's thread) landed inside psycopg while it waited for
the server, leaving the connection with a command in progress. The transaction's rollback
(``engine.begin()`` exiting on the exception, as in docs/fencing.md) then failed with
``OperationalError: another command is already in progress``, which replaced the
``LeaseInterrupt``: the task ended FAILURE instead of RETRY, and with acks_late the message was
acked -- the work dropped, contrary to the documented "lease lost while running -> RETRY".
``fenced_update`` and ``fenced_hset`` now hold the interrupt back until the driver call
returns, as the store calls and the FenceGate do (test_interrupted_store_call.py).

Reproduced deterministically: a PostgreSQL session holds the row lock, so the body's
``fenced_update`` blocks inside psycopg; the test force-releases the lease and waits until the
renewer has found it released (and interrupted the body), then lets the row go. The documented
outcome: RETRY (LeaseLostError, reason ``force_released``), then SUCCESS with a newer fence. Before
the fix the execution ended FAILURE with the OperationalError (asserted message below).
"""

from __future__ import annotations

import psycopg
import pytest

from tests.conftest import unique
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


def _libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def test_an_interrupt_inside_fenced_update_sends_the_task_to_retry(
    it_app, make_sink, start_worker, store_env, events, queue, postgres_server, request
):
    """The body is interrupted inside fenced_update: RETRY (LeaseLostError), then SUCCESS."""
    env = {
        **store_env("postgres"),
        "CL_TTL": "1.0",
        "CL_SINK": postgres_server.url,
        "CL_SINK_NAME": unique("sink"),
    }
    sink = make_sink(env)
    table = sink.counter_table.name
    store = worker_store(env)
    request.addfinalizer(store.close)
    worker = start_worker(env, queue=queue, pool="solo")
    url = _libpq_url(postgres_server.url)
    with psycopg.connect(url, autocommit=True) as monitor, psycopg.connect(url) as blocker:
        blocker.execute(f'SELECT value FROM "{table}" WHERE id = 1 FOR UPDATE')
        result = it_app.eo.fenced_row_write.apply_async((0,), queue=queue)
        first = events.wait(ev="writing", attempt=1)

        def update_waits_for_the_lock() -> bool:
            row = monitor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE %s",
                (f"%UPDATE%{table}%",),  # (a WITH ... FOR UPDATE CTE first, since d52a24c)
            ).fetchone()
            return bool(row and row[0])

        wait_for(update_waits_for_the_lock, 10, "fenced_update to block on the row lock")
        assert store.force_release("row-0") is not None
        # The renewer finds the lease released and interrupts the body inside psycopg.
        wait_for(lambda: 'action="interrupt the body"' in worker.log(), 10, "the loss")
        blocker.rollback()
    outcome = wait_for(
        lambda: (
            events.where(ev="retry", task=first["task"])
            or events.where(ev="failure", task=first["task"])
        ),
        20,
        "the interrupted execution to end",
    )[0]
    print(f"the interrupted execution ended: {outcome}")
    assert outcome["ev"] == "retry", f"{outcome['exc']} instead of RETRY: {result.result!r}"
    assert (outcome["exc"], outcome["reason"]) == ("LeaseLostError", "force_released")
    fence = result.get(timeout=30)
    assert fence > first["fence"]
