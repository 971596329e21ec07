"""A PostgreSQL backend that stops answering starves no renewal but its own call's.

The test pauses (SIGSTOP) the server process behind the renewer's connection, found in
``pg_stat_activity``, on a PostgreSQL that this test started: the kernel still acknowledges
every byte, so neither the server's statement timeout nor TCP notices; the call waits. Leases
held before the pause and leases claimed during it (on other connections, which answer) must
keep renewing: the renewal is sent again on another lane after one interval, and the renewal
thread keeps time meanwhile.

Negative control: ``Renewer(lanes=1)``, one thread for every store call, loses them all (before
lanes, one I/O thread did the same: every lease claimed later was lost although the database
was fine).

Also: the store's connections carry client-side bounds (connect timeout, TCP user timeout,
keepalives) for the failures the kernel does notice, a dead host or a dropped network.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from celery_lease import Owner
from celery_lease._renewer import Renewer
from celery_lease.stores.sql import SQLLeaseStore
from tests.conftest import missing, unique
from tests.tooling.servers import PostgresServer, wait_for

pytestmark = [pytest.mark.chaos_ci]

TTL = 1.5
INTERVAL = TTL / 3
MARGIN = TTL / 4
RENEW_MARK = "req (i, resource, token, fence, ttl)"  # in the renewal statement only


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own: the only kind whose processes a test may pause."""
    try:
        server = PostgresServer()
    except FileNotFoundError as exc:
        missing(str(exc))
    with server:
        yield server


def _renewer_backends(store: SQLLeaseStore) -> list[int]:
    """PIDs of the server processes whose last statement was a renewal of this store."""
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT pid, query FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        ).fetchall()
    return [pid for pid, query in rows if RENEW_MARK in (query or "") and store.sql.table in query]


def _pause_while_idle(store: SQLLeaseStore, pid: int) -> bool:
    """SIGSTOP ``pid`` if it is idle (waiting for its client); else let it go on, return False.

    Stopped mid-statement, a backend could hold a buffer lock that every other backend waits
    for, without a timeout: the whole server would hang, not one connection. Stopped while its
    reported state is idle (stable once it is stopped), it holds none.
    """
    os.kill(pid, signal.SIGSTOP)
    state = None
    try:
        with store.engine.connect() as conn:
            state = conn.exec_driver_sql(
                "SELECT state FROM pg_stat_activity WHERE pid = %(pid)s", {"pid": pid}
            ).scalar()
    finally:
        if state != "idle":
            os.kill(pid, signal.SIGCONT)
    return state == "idle"


def run(pg: PostgresServer, renewer: Renewer) -> tuple[dict[str, str], list]:
    """Pause the renewer's backend, claim 3 leases meanwhile; returns the losses and leases."""
    store = SQLLeaseStore(url=pg.url, table_prefix=f"{unique('pause')}_", statement_timeout=30)
    lost: dict[str, str] = {}
    paused: list[int] = []

    def hold(resource: str):
        lease = store.acquire(resource, Owner.new("w"), TTL)
        lease.margin = MARGIN
        renewer.hold(
            lease,
            interval=INTERVAL,
            max_runtime=60,
            on_lost=lambda h, e: lost.setdefault(h.lease.resource, e.reason),
        )
        return lease

    try:
        first = hold("before-the-pause")
        wait_for(lambda: _renewer_backends(store), 10, "a renewal on the renewer's connection")
        backends = _renewer_backends(store)
        assert len(backends) == 1, backends  # one connection renews: the one to pause
        wait_for(lambda: _pause_while_idle(store, backends[0]), 10, "the backend paused idle")
        paused.append(backends[0])
        paused_at = time.monotonic()
        during = [hold(f"claimed-during-the-pause-{i}") for i in range(3)]
        wait_for(lambda: time.monotonic() > paused_at + 2 * TTL or len(lost) == 4, 10, "two ttls")
        for lease in (first, *during):  # kept means: renewed after the pause began
            if lease.resource not in lost and lease.sent_monotonic <= paused_at:
                lost[lease.resource] = "not renewed since the pause"
        return lost, during
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        renewer.shutdown()
        store.close()


def test_a_paused_backend_does_not_starve_the_other_renewals(pg):
    """0 of the 3 leases claimed during the pause are lost, nor the one held before it."""
    lost, _ = run(pg, Renewer())
    print(f"lost: {lost}")
    assert not lost


def test_negative_control_one_lane_loses_the_leases_claimed_during_the_pause(pg):
    lost, during = run(pg, Renewer(lanes=1))
    print(f"lost: {lost}")
    assert sum(lease.resource in lost for lease in during) == 3


def test_connections_carry_client_side_timeouts_and_keepalives(pg):
    """libpq gets connect_timeout, tcp_user_timeout and keepalives from statement_timeout."""
    store = SQLLeaseStore(url=pg.url, table_prefix=f"{unique('tcp')}_", statement_timeout=6)
    try:
        with store.engine.connect() as conn:
            params = conn.connection.dbapi_connection.info.get_parameters()
            timeout = conn.exec_driver_sql("SHOW statement_timeout").scalar()
    finally:
        store.close()
    print(params)
    assert timeout == "6s"
    assert params["connect_timeout"] == "6"
    assert params["tcp_user_timeout"] == "6000"
    assert params["keepalives"] == "1"
    assert params["keepalives_idle"] == "6"
    assert params["keepalives_interval"] == "2"
    assert params["keepalives_count"] == "3"
