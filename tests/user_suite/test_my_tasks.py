"""What a user's own suite looks like with celery_lease.testing (run by tests/test_testing.py).

Public names only: celery_lease and celery_lease.testing."""

from __future__ import annotations

import datetime
import time

import pytest
from freezegun import freeze_time

from celery_lease.testing import assert_no_stale_write_accepted, paused_renewals, send_twice

from .myapp import SENT, STEPS, drive_browser, research, send_invoice


def test_eager_task_claims_in_the_test_store(eager, lease_store):
    assert send_invoice.delay(17).get() == 1
    assert send_invoice.delay(17).get() == 2
    assert lease_store.get("invoice:17") is None  # released after each run


def test_worker_task_claims_in_the_test_store(worker, lease_store):
    assert send_invoice.delay(17).get(timeout=10) == 1
    assert SENT == [(17, 1)]
    assert lease_store.get("invoice:17") is None


def test_a_message_delivered_twice_runs_once(eager, lease_store):
    first, second = send_twice(send_invoice, (17,))
    assert first.get() == second.get() == 1
    assert SENT == [(17, 1)]


def test_a_takeover_after_a_crash_continues_from_the_checkpoints(eager, lease_store):
    from celery_lease import Owner

    # A worker claimed the job, checkpointed "plan", then crashed without release.
    crashed = lease_store.acquire("agent/j1", Owner.fresh("crashed"), 60, identity="job-j1")
    crashed.checkpoint("plan")
    lease_store.expire("agent/j1")
    research.apply_async(("j1",), headers={"idempotency_key": "job-j1"}).get()
    assert STEPS == [("search", True), ("write", True)]


def test_a_frozen_wall_clock_does_not_move_a_lease(eager, lease_store):
    with freeze_time(datetime.datetime(2030, 1, 1)):
        assert drive_browser.delay(1, 1.5).get() == "done"  # longer than the 1 s ttl


def test_paused_renewals_lose_the_lease_and_the_task_runs_again(worker, lease_store):
    result = drive_browser.delay(2, 2.0)
    with paused_renewals():
        deadline = time.monotonic() + 10
        while result.state != "RETRY":  # the body was stopped and the task sent again
            assert time.monotonic() < deadline, f"still {result.state} after 10 s"
            time.sleep(0.05)
    assert result.get(timeout=15) == "done"  # the re-run keeps its lease alive


def test_a_busy_resource_is_not_run(eager, lease_store):
    from celery_lease import LeaseBusyError, Owner

    lease_store.acquire("invoice:17", Owner.fresh("another worker"), 60)
    with pytest.raises(LeaseBusyError, match="another worker"):
        send_invoice.delay(17).get()  # eager fails fast; a worker would wait and retry
    assert SENT == []


def test_stale_writes_are_refused_at_the_gate(eager, lease_store):
    from celery_lease import FenceGate, StaleFenceError

    assert send_invoice.delay(17).get() == 1
    assert send_invoice.delay(17).get() == 2
    gate = FenceGate(store=lease_store)
    gate.admit("invoice:17", 2)
    with pytest.raises(StaleFenceError):
        gate.admit("invoice:17", 1)  # the first holder, come back late
    lease_store.assert_no_stale_write_accepted()
    assert_no_stale_write_accepted(SENT)
