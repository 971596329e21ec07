"""A lease interrupt that lands inside a store call made by the body (FenceGate.admit, guard()).

Found by the paused-owner scenario on PostgreSQL: when the renewal thread declares the lease
lost while the body is inside a SQL store call, the interrupt (an exception raised by the
SIGUSR1 handler in the body's thread) leaves psycopg's connection in the middle of a command.
``SQLLeaseStore._run`` only handles driver errors, so the connection goes back to the pool as it
is and every later statement on it fails with "another command is already in progress": the
next execution of the task in that process fails with LeaseStoreError instead of running.

The interrupt is now held back while a store call runs (``shielded``) and a connection
interrupted anyway is dropped. This test reproduces the situation deterministically with a
real solo worker: a PostgreSQL session holds the gate row's lock so that the body's ``admit``
blocks inside psycopg, the test force-releases the lease, the renewer sees the loss and sends
the interrupt mid-call. The re-run in the same process must then admit normally.
"""

from __future__ import annotations

import psycopg
import pytest

from celery_lease import FenceGate
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


def _libpq_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def test_an_interrupt_inside_a_gate_call_leaves_the_store_usable(
    it_app, start_worker, store_env, events, queue, postgres_server
):
    """The body is interrupted inside FenceGate.admit; its re-run in that process still admits."""
    # ttl 3: under load a renewal arriving after a 1 s ttl ran out made the reason "expired"
    env = {**store_env("postgres"), "CL_TTL": "3.0"}
    start_worker(env, queue=queue, pool="solo")  # one process: the re-run reuses its pool
    table = f"{env['CL_TABLE_PREFIX']}fence_gate"
    gate = FenceGate(env["CL_STORE"], table_prefix=env["CL_TABLE_PREFIX"])
    store = worker_store(env)
    url = _libpq_url(postgres_server.url)
    with psycopg.connect(url, autocommit=True) as monitor, psycopg.connect(url) as blocker:
        gate.admit("gated-0", 0)  # the row the blocker locks
        blocker.execute(f'SELECT fence FROM "{table}" WHERE key = %s FOR UPDATE', ("gated-0",))
        result = it_app.gated_write.apply_async((0,), queue=queue)
        first = events.wait(ev="admitting", attempt=1)

        def admit_waits_for_the_lock() -> bool:
            row = monitor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE %s",
                (f"%{table}%",),
            ).fetchone()
            return bool(row and row[0])

        wait_for(admit_waits_for_the_lock, 10, "the body's admit to block on the row lock")
        assert store.force_release("gated-0") is not None
        # The renewer finds the lease released and interrupts the body inside admit().
        retry = events.wait(ev="retry", task=first["task"])
        assert retry["exc"] == "LeaseLostError"
        assert retry["reason"] == "force_released"
        assert not events.where(ev="write", attempt=1)
        blocker.rollback()
    try:
        # Expected: the re-run (same process) admits its newer fence and succeeds. Today it fails
        # with LeaseStoreError "another command is already in progress" (xfail above).
        fence = result.get(timeout=30)
        assert fence > first["fence"]
        assert gate.highest("gated-0") == fence
    finally:
        gate.close()
        store.close()
