"""A release that PostgreSQL turns away for contention is sent again: the outcome gets recorded.

Seen in CI (the lost-update counter on PostgreSQL, stop 37): an acknowledged increment's
identity stayed ``running`` for good. With its ttl of 1 s a worker's store calls time out after
0.42 s (``ttl - margin - renew_interval``), and PostgreSQL's lock timeout is the same: on one
hot lease row, under load, a release that waited that long for the row's lock was cancelled.
The release logged "could not release" and gave up; Celery stored the body's SUCCESS, but the
identity's ``done`` was never written, so a later delivery of the task id would have run as a
recovered takeover instead of ending with the recorded result.

A statement PostgreSQL cancels for a lock or statement timeout, a deadlock or a serialization
failure did not happen (autocommit: it rolled back), so trying it again is safe; the store marks
such errors ``LeaseStoreError.transient`` and the release is sent again a few times.

Here a second session holds the identity row's lock while the body ends, so the release waits
on it until its lock timeout (1 s here) cancels it; once that first try is over, the session lets
go. Before the change the identity stayed ``running``; now the next try records ``done``.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from celery import Celery

from celery_lease import current_lease, lease_task
from celery_lease._app import get_store
from celery_lease._codec import decode
from celery_lease.stores import store_from_url
from tests.conftest import unique

pytestmark = pytest.mark.postgres


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.fixture
def pg_app(postgres_server):
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    prefix = f"{unique('rc')}_"
    # The tables are made with the default timeouts (DDL under a loaded CI may take a while);
    # the app's store then cancels a statement (and a lock wait) after 1 s.
    store_from_url(postgres_server.url, table_prefix=prefix).close()
    app.conf.update(
        lease_store_url=postgres_server.url,
        lease_table_prefix=prefix,
        lease_ttl=5,
        lease_store_options={"statement_timeout": 1.0},
    )
    yield app, prefix, _libpq(postgres_server.url)
    get_store(app).close()


class _Blocker:
    """A session that locks the identity row while the body runs and lets go once the
    release's first try has waited on that lock and ended (cancelled by its lock timeout)."""

    def __init__(self, url: str, table: str) -> None:
        self.url, self.table = url, table
        self.monitor = psycopg.connect(url, autocommit=True)
        self.blocker = psycopg.connect(url)
        self.first_wait: object = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def lock(self, resource: str, identity: str) -> None:
        self.blocker.execute(
            f'SELECT 1 FROM "{self.table}" WHERE resource = %s AND identity = %s FOR UPDATE',
            (resource, identity),
        )
        self.thread = threading.Thread(target=self._let_go_after_first_try, daemon=True)
        self.thread.start()

    def _waiting(self) -> list[tuple[object]]:
        return self.monitor.execute(
            "SELECT query_start FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query ILIKE %s AND pid <> pg_backend_pid()",
            (f"%{self.table}%",),
        ).fetchall()

    def _let_go_after_first_try(self) -> None:
        try:
            deadline = time.monotonic() + 20
            while not (rows := self._waiting()):
                assert time.monotonic() < deadline, "the release never waited on the lock"
                time.sleep(0.005)
            self.first_wait = rows[0][0]
            while any(row[0] == self.first_wait for row in self._waiting()):
                assert time.monotonic() < deadline, "the release's first try never ended"
                time.sleep(0.005)
        except BaseException as exc:  # (reported by the test)
            self.error = exc
        finally:
            self.blocker.rollback()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(30)
        self.blocker.close()
        self.monitor.close()


@pytest.mark.parametrize("retries", [True, False], ids=["sent_again", "negative_control"])
def test_a_release_cancelled_by_a_lock_timeout_is_sent_again_and_records_done(
    pg_app, caplog, monkeypatch, retries
):
    """Negative control: without the tries again (``RELEASE_RETRY_PAUSES`` empty) the
    identity stays ``running`` and the lease is left to expire, as before the change."""
    app, prefix, url = pg_app
    if not retries:
        monkeypatch.setattr("celery_lease._execution.RELEASE_RETRY_PAUSES", ())
    blocker = _Blocker(url, f"{prefix}identities")

    @lease_task(app=app, resource="rc:{n}", bind=True, shared=False, name=unique("proj.rc"))
    def step(self, n):
        blocker.lock(f"rc:{n}", self.request.id)  # (the claim marked the row running)
        return {"n": n, "fence": current_lease().fence}

    try:
        result = step.apply((1,))
    finally:
        blocker.close()
    assert blocker.error is None, blocker.error
    assert blocker.first_wait is not None  # the release did wait, and its first try ended
    assert result.successful(), result.traceback
    info = get_store(app).identity_get("rc:1", result.id)
    held = get_store(app).get("rc:1")
    if not retries:
        assert info is not None and info.state == "running", info
        assert held is not None and held.fence == info.fence, held  # left to expire
        return
    assert info is not None and info.state == "done", (info, caplog.text[-2000:])
    assert decode(info.result) == result.get()
    assert held is None, held  # released, not left to expire
