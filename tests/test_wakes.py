"""The turn checks of a process that exits, on real stores and a real Redis broker.

A turn check is scheduled after each wake a process sends (``_wakes.Waker.after_wake``); a
process that exits with one pending runs it first (``drain_turns``: a prefork pool process on
``worker_process_shutdown``, the CLI, a script at interpreter exit), bounded by about a grace,
and returns early once the woken waiter claimed. The wake messages go to a real Redis broker,
where the tests count them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery

from celery_lease import LeaseBusyError, Owner, _wakes, release_lease
from celery_lease.stores import store_from_url
from tests.conftest import make_store, own_redis_db, unique
from tests.tooling.proxy import TcpProxy

GRACE = 0.5


@pytest.fixture
def waker(monkeypatch: pytest.MonkeyPatch) -> _wakes.Waker:
    """A waker of this test alone: other tests' pending checks are not drained here."""
    fresh = _wakes.Waker()
    monkeypatch.setattr(_wakes, "_waker", fresh)
    return fresh


@pytest.fixture
def broker(redis_server: Any) -> Iterator[tuple[Celery, redis.Redis, str]]:
    """An app publishing to a real Redis broker, its client, and a queue of this test's."""
    url = redis_server.url.rsplit("/", 1)[0] + f"/{own_redis_db(0)}"
    app = Celery("wakes_unit", broker=url)
    client = redis.Redis.from_url(url)
    queue = unique("q")
    try:
        yield app, client, queue
    finally:
        client.delete(queue)
        client.close()


def _payload(queue: str, who: str) -> str:
    """A waiter's wake message: a task sent again to ``queue``."""
    options = {"task_id": f"id-{who}", "queue": queue}
    return json.dumps({"task": "wakes_unit.wait", "args": [who], "kwargs": {}, "options": options})


def _line_up(store: Any, resource: str, queue: str) -> Any:
    """Hold ``resource`` with waiters w1 and w2 listed behind; the holder's lease."""
    held = store.acquire(resource, Owner.new("holder"), 30)
    for who in ("w1", "w2"):
        with pytest.raises(LeaseBusyError):
            store.acquire(resource, Owner.new(who), 30, identity=who, wait=_payload(queue, who))
    return held


def _woken(store: Any, resource: str) -> list[str]:
    return [w.identity for w in store.waiters(resource) if w.woken]


def _sent(client: redis.Redis, queue: str) -> list[str]:
    """The waiters whose wake reached the broker's queue, in order."""
    return [json.loads(raw)["headers"]["id"][3:] for raw in reversed(client.lrange(queue, 0, -1))]


@pytest.fixture(params=["redis", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made = make_store(request.param, request, tmp_path)
    made.handoff_grace = GRACE
    try:
        yield made
    finally:
        made.close()


class TestExitTurns:
    def test_nothing_pending_returns_at_once(self, waker: _wakes.Waker) -> None:
        """A process that sent no wake exits without waiting or starting a thread."""
        started = time.monotonic()
        assert _wakes.drain_turns() is True
        assert time.monotonic() - started < 0.05
        assert not [t for t in threading.enumerate() if t.name == _wakes.EXIT_THREAD]

    def test_a_dropped_wake_is_passed_on_before_exit(
        self, waker: _wakes.Waker, broker: Any, store: Any
    ) -> None:
        """W1's wake is never claimed: the exiting process waits for its grace, then wakes W2
        (and sends W1's missed wake once more, invariant 16), and tells ``on_wait`` once that
        it waits."""
        app, client, queue = broker
        resource = unique("r")
        held = _line_up(store, resource, queue)
        assert release_lease(held, app=app)
        assert _sent(client, queue) == ["w1"]
        told: list[float] = []
        started = time.monotonic()
        assert _wakes.drain_turns(on_wait=told.append) is True
        took = time.monotonic() - started
        assert GRACE - 0.1 < took < GRACE + _wakes.EXIT_SLACK, f"{took:.2f}s"
        assert _sent(client, queue) == ["w1", "w1", "w2"]
        assert _woken(store, resource) == ["w2"]
        assert len(told) == 1 and 0 < told[0] <= GRACE + _wakes.TURN_SLACK

    def test_a_claimed_wake_needs_no_wait(
        self, waker: _wakes.Waker, broker: Any, store: Any
    ) -> None:
        """W1 claims at once: the check is moot, the process exits without sitting out the
        grace, and nobody else is woken."""
        app, client, queue = broker
        resource = unique("r")
        held = _line_up(store, resource, queue)
        assert release_lease(held, app=app)
        store.acquire(resource, Owner.new("w1"), 30, identity="w1")
        told: list[float] = []
        started = time.monotonic()
        assert _wakes.drain_turns(on_wait=told.append) is True
        assert time.monotonic() - started < GRACE / 2
        assert _sent(client, queue) == ["w1"] and not told

    def test_negative_control_without_exit_turns_the_wake_stays_dropped(
        self, waker: _wakes.Waker, broker: Any, store: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With EXIT_TURNS off, the process exits at once and W2 stays unwoken."""
        monkeypatch.setattr(_wakes, "EXIT_TURNS", False)
        app, client, queue = broker
        resource = unique("r")
        held = _line_up(store, resource, queue)
        assert release_lease(held, app=app)
        assert _wakes.drain_turns() is True
        time.sleep(GRACE + 0.2)  # (the grace is over: only a check or a pass would wake W2)
        assert _sent(client, queue) == ["w1"]
        assert _woken(store, resource) == []

    def test_a_store_that_does_not_answer_cannot_hold_the_exit(
        self, waker: _wakes.Waker, broker: Any, redis_server: Any
    ) -> None:
        """The store stops answering (partition) after the wake: the process gives up about a
        grace and EXIT_SLACK later, though each store call would wait 30 s."""
        app, _client, queue = broker
        with TcpProxy(urlsplit(redis_server.url).port) as proxy:
            store = _store_via(proxy, redis_server.url)
            try:
                resource = unique("r")
                held = _line_up(store, resource, queue)
                assert release_lease(held, app=app)
                proxy.blackhole()
                started = time.monotonic()
                assert _wakes.drain_turns() is False
                took = time.monotonic() - started
                assert took < GRACE + _wakes.TURN_SLACK + _wakes.EXIT_SLACK + 0.3, f"{took:.2f}s"
            finally:
                proxy.heal()
                store.close()


def _store_via(proxy: TcpProxy, url: str) -> Any:
    """A Redis store reached through ``proxy``, whose calls wait 30 s for an answer."""
    made = store_from_url(proxy.url_for(url), key_prefix=f"{unique('cl')}:", socket_timeout=30)
    made.handoff_grace = GRACE
    return made
