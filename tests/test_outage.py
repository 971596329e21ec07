"""A lease store outage: "refused" said when it is true, a budget of its own, a calm log.

Refusals are real: a port on 127.0.0.1 where nothing listens, and a redis-server this test
starts and stops. The task-level budget runs the task as a worker would (not eager), against a
store URL that refuses every connection.
"""

from __future__ import annotations

import logging
import pickle
import time

import pytest
from celery import Celery
from celery.exceptions import Ignore, Retry

from celery_lease import LeaseConfigError, LeaseStoreError, Owner, lease_task
from celery_lease import _outage as outage
from celery_lease._message import STORE_DOWN_HEADER, STORE_WAITS_HEADER, WAITS_HEADER
from celery_lease._settings import LeaseSettings
from celery_lease._wakes import WOKEN_HEADER
from celery_lease.stores import store_from_url
from tests.conftest import unique
from tests.tooling.servers import RedisServer, free_port


@pytest.fixture
def refusing_url():
    """A Redis URL on 127.0.0.1 where nothing listens: every connection is refused."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture(autouse=True)
def _no_outage_left():
    yield
    outage.down.clear()


class TestRefused:
    def test_a_refused_redis_connection_says_refused(self, refusing_url):
        store = store_from_url(refusing_url)
        try:
            with pytest.raises(LeaseStoreError) as caught:
                store.acquire("r", Owner.new("me"), 5)
        finally:
            store.close()
        assert caught.value.refused
        assert "refused the connection" in str(caught.value)
        assert "the outcome is unknown" not in str(caught.value)

    def test_a_refused_postgres_connection_says_refused(self):
        store = store_from_url(
            f"postgresql+psycopg://app:secret@127.0.0.1:{free_port()}/db", create_tables=False
        )
        try:
            with pytest.raises(LeaseStoreError) as caught:
                store.acquire("r", Owner.new("me"), 5)
        finally:
            store.close()
        assert caught.value.refused
        assert "refused the connection" in str(caught.value)
        assert "secret" not in str(caught.value)

    def test_a_refused_postgres_connection_at_table_creation_says_refused(self):
        """Making the store (which creates its tables) on a refused connection fails at once,
        saying refused, instead of retrying it for 30 s as if two workers raced to CREATE."""
        with pytest.raises(LeaseStoreError) as caught:
            store_from_url(f"postgresql+psycopg://app:secret@127.0.0.1:{free_port()}/db")
        assert caught.value.refused, caught.value
        assert "refused the connection" in str(caught.value)
        assert "secret" not in str(caught.value)

    def test_a_refused_redis_cluster_at_first_contact_says_refused(self, refusing_url):
        """The cluster client reads the slot map when the store is made: refused says so."""
        with pytest.raises(LeaseStoreError) as caught:
            store_from_url(refusing_url, cluster=True)
        assert caught.value.refused, caught.value
        assert "could not reach the Redis cluster" in str(caught.value)

    def test_a_call_that_may_have_been_sent_stays_unknown(self, tmp_path):
        """The server stops under a held connection: that call's outcome is unknown (its
        retry's refusal must not hide that); the next call is refused."""
        try:
            server = RedisServer(tmp_path / "redis").start()
        except FileNotFoundError as exc:
            pytest.skip(str(exc))
        store = store_from_url(server.url)
        try:
            store.acquire("warm", Owner.new("me"), 5)  # a connection is held now
            server.stop()
            with pytest.raises(LeaseStoreError) as first:
                store.acquire("r", Owner.new("me"), 5)
            with pytest.raises(LeaseStoreError) as second:
                store.acquire("r", Owner.new("me"), 5)
        finally:
            store.close()
            server.close()
        assert not first.value.refused, first.value
        assert "the outcome is unknown" in str(first.value)
        assert second.value.refused, second.value

    def test_the_error_survives_pickling_and_rebuilding(self):
        error = LeaseStoreError("store refused", True)
        for copy in (type(error)(*error.args), pickle.loads(pickle.dumps(error))):
            assert copy.refused is True
            assert str(copy) == "store refused"
        assert LeaseStoreError("unknown").refused is False


class TestBudget:
    @pytest.fixture
    def app(self, refusing_url):
        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        app.conf.lease_store_url = refusing_url
        app.conf.lease_ttl = 5
        app.conf.lease_busy_max_waits = 1
        return app

    @staticmethod
    def _deliver(task, headers):
        """Run the task as a worker would (not eager, not direct) with these headers."""
        task.push_request(
            id=unique("task"),
            args=(1,),
            kwargs={},
            is_eager=False,
            called_directly=False,
            delivery_info={},
            headers=headers,
        )
        try:
            return task(1)
        finally:
            task.pop_request()

    def test_the_store_down_budget_is_not_the_busy_budget(self, app, monkeypatch):
        """Busy waits spent (5000 > busy_max_waits=1): a store outage still waits. A copy that
        waited already is sent again without storing RETRY over what another copy of it may
        have stored (Ignore), and as a back-stop copy, not a woken one (its woken mark goes)."""

        @lease_task(app=app, resource="r:{n}")
        def task(n):
            raise AssertionError("no body runs without a lease")

        sent = []
        make = task.signature_from_request

        def signature_from_request(*args, **kwargs):
            sent.append(make(*args, **kwargs))
            return sent[-1]

        monkeypatch.setattr(task, "signature_from_request", signature_from_request)
        with pytest.raises(Ignore, match="sent again in") as caught:
            self._deliver(task, {WAITS_HEADER: 5000, WOKEN_HEADER: time.time()})
        assert isinstance(caught.value.__cause__, LeaseStoreError)
        headers = sent[0].options["headers"]
        assert headers[STORE_WAITS_HEADER] == 1
        assert time.time() - 5 < headers[STORE_DOWN_HEADER] <= time.time()
        assert WOKEN_HEADER not in headers and headers[WAITS_HEADER] == 5000

    def test_past_the_budget_the_task_fails_saying_refused_and_why(self, app):
        @lease_task(app=app, resource="r:{n}", store_down_max_wait=30)
        def task(n):
            raise AssertionError("no body runs without a lease")

        since = time.time() - 31
        with pytest.raises(LeaseStoreError) as caught:
            self._deliver(task, {STORE_DOWN_HEADER: since, STORE_WAITS_HEADER: 9})
        assert caught.value.refused
        message = str(caught.value)
        assert "refuses connections" in message
        assert "lease_store_down_max_wait=30s" in message

    def test_the_last_wait_ends_at_the_budget(self, app):
        """A backoff longer than what is left of the budget is cut to it."""

        @lease_task(app=app, resource="r:{n}", store_down_max_wait=30, busy_backoff_base=60)
        def task(n):
            raise AssertionError("no body runs without a lease")

        since = time.time() - 29.5
        with pytest.raises(Retry) as caught:
            self._deliver(task, {STORE_DOWN_HEADER: since, STORE_WAITS_HEADER: 9})
        assert caught.value.sig.options["countdown"] <= 0.5
        assert caught.value.sig.options["headers"][STORE_DOWN_HEADER] == since

    def test_a_store_that_cannot_be_made_waits_on_the_same_budget(self, app):
        """PostgreSQL refusing connections when the task first makes its store: the task is
        sent again on the store-down budget (not failed), no half-made store is kept, and
        past the budget it fails saying refused."""
        app.conf.lease_store_url = f"postgresql+psycopg://app:secret@127.0.0.1:{free_port()}/db"

        @lease_task(app=app, resource="r:{n}", store_down_max_wait=30)
        def task(n):
            raise AssertionError("no body runs without a lease")

        with pytest.raises(Retry) as caught:
            self._deliver(task, {})
        assert isinstance(caught.value.exc, LeaseStoreError)
        assert caught.value.exc.refused, caught.value.exc
        assert caught.value.sig.options["headers"][STORE_WAITS_HEADER] == 1
        assert task._compiled().store is None  # made again at the next attempt
        assert list(outage.down) == [app.conf.lease_store_url.replace("secret", "***")]

        with pytest.raises(LeaseStoreError) as failed:
            self._deliver(task, {STORE_DOWN_HEADER: time.time() - 31, STORE_WAITS_HEADER: 9})
        assert failed.value.refused
        assert "refuses connections" in str(failed.value)
        assert "lease_store_down_max_wait=30s" in str(failed.value)
        assert "secret" not in str(failed.value)

    def test_the_setting_is_validated(self):
        assert LeaseSettings.resolve(None).store_down_max_wait == 600.0
        with pytest.raises(LeaseConfigError, match="lease_store_down_max_wait"):
            LeaseSettings.resolve(None, {"store_down_max_wait": 0})


class TestReporting:
    def test_one_warning_per_interval_and_one_line_when_back(self, caplog):
        """100 failed claims: one warning (refused, the budget); back: one INFO with the count."""
        error = LeaseStoreError("Redis lease store redis://x refused the connection", True)
        with caplog.at_level(logging.INFO, logger="celery_lease._outage"):
            for _ in range(100):
                outage.claim_failed("redis://x", error, 600.0)
            outage.claim_succeeded("redis://x")
            outage.claim_succeeded("redis://x")  # nothing more to say
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        infos = [r for r in caplog.records if r.levelno == logging.INFO]
        assert len(warnings) == 1
        assert "refuses connections" in warnings[0].getMessage()
        assert "lease_store_down_max_wait=600s" in warnings[0].getMessage()
        assert len(infos) == 1
        assert "100 claims failed" in infos[0].getMessage()
        assert not outage.down

    def test_the_warning_repeats_after_the_interval(self, caplog, monkeypatch):
        """With the interval spent, the next failure warns again with the count since."""
        error = LeaseStoreError("boom")
        with caplog.at_level(logging.WARNING, logger="celery_lease._outage"):
            outage.claim_failed("redis://y", error, 600.0)
            outage.claim_failed("redis://y", error, 600.0)
            monkeypatch.setattr(outage, "REPORT_EVERY", 0.0)
            outage.claim_failed("redis://y", error, 600.0)
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2
        assert "is failing: 1 claim failed" in messages[0]
        assert "2 claims failed" in messages[1]
