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

        @lease_task(app=app, resource="lost:{n}")
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

        @lease_task(app=app, resource="lost:{n}")
        def task(n):
            get_store(app).force_release(current_lease().resource)
            current_lease().guard()

        caplog.set_level(logging.INFO)
        result = task.apply((1,))
        assert result.result.reason == "force_released"
        failure = [r.getMessage() for r in caplog.records if r.name == "celery.app.trace"]
        assert "no live holder now" in failure[0]
