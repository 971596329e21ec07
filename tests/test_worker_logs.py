"""Log lines a person can act on (issue 33, item 5), in one process with Celery's own tracer.

What a real worker prints at start and when a pool process is killed is checked with real
workers in tests/integration/test_crash_settings.py.
"""

from __future__ import annotations

import logging
import time

import pytest
from celery import Celery

from celery_lease import LeaseLostError, current_lease, lease_task
from celery_lease import _eventlog as eventlog
from celery_lease._app import get_store
from celery_lease._errors import LeaseStoreError
from tests.conftest import unique


@pytest.fixture
def app():
    """An app whose leases live in the memory store (made once per app)."""
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = "memory://"
    app.conf.lease_ttl = 5
    eventlog.reset()
    yield app
    eventlog.reset()


def lease_lines(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == eventlog.LOGGER and getattr(r, "lease", {}).get("event") == event
    ]


class TestLostHolder:
    """The lost lease's message says "no live holder now" only when the store said so."""

    def test_a_lease_lost_to_failing_renewals_does_not_claim_nobody_holds_it(
        self, app, caplog, monkeypatch
    ):
        """Renewals fail until the self-fence deadline: the owner never asked the store who
        holds the resource now. Said "no live holder now" before."""
        app.conf.lease_ttl = 0.6
        store = get_store(app)

        def renewals_fail(leases, ttl=None):
            raise LeaseStoreError("the store does not answer")

        monkeypatch.setattr(store, "renew_many", renewals_fail)

        @lease_task(app=app, resource="lost:{n}", shared=False)
        def task(n):
            lease = current_lease()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                lease.check()  # raises once the self-fence deadline has passed
                time.sleep(0.02)
            raise AssertionError("the lease was never lost")

        caplog.set_level(logging.INFO)
        result = task.apply((1,))
        assert isinstance(result.result, LeaseLostError)
        assert result.result.reason in ("renew_failed", "self_fenced")
        failure = [r.getMessage() for r in caplog.records if r.name == "celery.app.trace"]
        assert failure and "lost:1" in failure[0]
        assert "no live holder now" not in caplog.text
        assert "who holds it now is not known here" in failure[0]

    def test_a_force_released_lease_says_nobody_holds_it(self, app, caplog):
        """Positive control: the store read the record and found none."""

        @lease_task(app=app, resource="lost:{n}", shared=False)
        def task(n):
            get_store(app).force_release(current_lease().resource)
            current_lease().guard()

        caplog.set_level(logging.INFO)
        result = task.apply((1,))
        assert result.result.reason == "force_released"
        failure = [r.getMessage() for r in caplog.records if r.name == "celery.app.trace"]
        assert "no live holder now" in failure[0]


def body(n):
    return n


def start_worker_step(app: Celery, pool: object = None) -> None:
    """Run the lease bootstep's start as a worker's main process does."""
    from types import SimpleNamespace

    from celery_lease._app import LeaseBootstep

    worker = SimpleNamespace(app=app, pool_cls=pool, concurrency=2, max_concurrency=None)
    LeaseBootstep(worker).start(worker)


def ready_line(caplog: pytest.LogCaptureFixture) -> str:
    (line,) = [r.getMessage() for r in caplog.records if " ready (" in r.getMessage()]
    return line


class TestReadyLine:
    """The worker's "store ... ready" line shows each lease task's ttl, not the app's alone."""

    def test_tasks_with_their_own_ttl_are_named_with_it(self, app, caplog):
        """Two tasks override the app's 5 s: the line says 15 s and names the one left at 5 s.
        Said "ready (ttl 5s)" before, the app's lease_ttl, which no task here runs with but
        one."""

        @lease_task(app=app, resource="a:{n}", name="proj.plain", shared=False)
        def plain(n):
            return n

        @lease_task(app=app, resource="b:{n}", ttl=15, name="proj.browse", shared=False)
        def browse(n):
            return n

        @lease_task(app=app, resource="c:{n}", ttl=15, name="proj.pay", shared=False)
        def pay(n):
            return n

        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        line = ready_line(caplog)
        assert line.endswith("ready (ttl 15s for 2 lease tasks; 5s for proj.plain)"), line

    def test_one_ttl_for_all_is_said_once(self, app, caplog):
        """Every task runs with the app's ttl: one figure and the count."""
        for n in range(4):
            lease_task(app=app, resource="r:{n}", name=f"proj.t{n}", shared=False)(body)
        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        assert ready_line(caplog).endswith("ready (ttl 5s for all 4 lease tasks)")

    def test_no_lease_task_says_so(self, app, caplog):
        """A worker whose app registered no lease task (yet) does not pretend it has."""
        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        assert ready_line(caplog).endswith("ready (no lease tasks registered; lease_ttl 5s)")

    def test_many_names_are_cut(self, app, caplog):
        """Past three names a group says how many more."""
        for n in range(6):
            lease_task(app=app, resource="r:{n}", name=f"proj.long{n}", shared=False)(body)
        for n in range(5):
            lease_task(app=app, resource="s:{n}", ttl=1, name=f"proj.short{n}", shared=False)(body)
        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        assert ready_line(caplog).endswith(
            "ready (ttl 5s for 6 lease tasks; 1s for proj.short0, proj.short1, proj.short2 "
            "and 2 more)"
        )
