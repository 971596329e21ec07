"""The turn checks of a process that exits, on real stores and a real Redis broker.

A turn check is scheduled after each wake a process sends (``_wakes.Waker.after_wake``); a
process that exits with one pending runs it first (``drain_turns``: a prefork pool process on
``worker_process_shutdown``, the CLI, a script at interpreter exit), bounded by about a grace,
and returns early once the woken waiter claimed. The wake messages go to a real Redis broker,
where the tests count them.
"""

from __future__ import annotations

import itertools
import json
import os
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
        # (a wait would be a grace, 2 s by default; a loaded box can take a tick or two)
        assert time.monotonic() - started < 0.5
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
        # (from before the release: the check is due a grace after its wake, and a process's
        # first wake spends part of that grace opening the broker connection)
        started = time.monotonic()
        assert release_lease(held, app=app)
        assert _sent(client, queue) == ["w1"]
        told: list[float] = []
        assert _wakes.drain_turns(on_wait=told.append) is True
        took = time.monotonic() - started
        assert GRACE - 0.05 < took < GRACE + _wakes.EXIT_SLACK + 1.0, f"{took:.2f}s"
        assert _sent(client, queue) == ["w1", "w1", "w2"]
        assert _woken(store, resource) == ["w2"]
        # Told at most once, with how long it waits. (Not always told: a drain that reaches the
        # check while the waker's own thread is running it waits for it without a word, seen
        # in CI with the drain reached 0.1 s into the grace; and a loaded box may reach the
        # drain past the grace, when nothing is left to wait for.)
        assert len(told) <= 1 and all(0 < t <= GRACE + _wakes.TURN_SLACK for t in told)

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


def _waker_threads() -> set[int | None]:
    return {t.ident for t in threading.enumerate() if t.name == "celery-lease-waker"}


def _run_loop(hub: Any, until: Any, timeout: float) -> None:
    """Drive a kombu event loop's timers and ready callbacks (``call_soon``) in this thread
    until ``until()`` or ``timeout``, as its ``create_loop`` does."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out driving the loop"
        for ready in hub._pop_ready():
            ready()
        delay = hub.fire_timers(min_delay=0.005, max_delay=0.05)
        time.sleep(min(delay or 0.005, 0.05))


class TestOnAnEventLoop:
    """A prefork worker's main process runs its passes and turn checks on its event loop
    (``Waker.run_on``), the thread that forks the pool processes: never on a thread of ours."""

    def test_the_loop_runs_the_checks_and_passes_and_no_thread_starts(
        self, waker: _wakes.Waker, broker: Any, store: Any
    ) -> None:
        """A wake's turn check and a pass run from the loop's timers, in the loop's thread."""
        from kombu.asynchronous import Hub

        app, client, queue = broker
        before = _waker_threads()
        hub = Hub()
        waker.run_on(hub)
        ran: list[str] = []
        original = _wakes.pass_turn

        def spy(*args: Any, **kwargs: Any) -> int:
            if args[1] is store:  # (not another test's waker, left running in this process)
                ran.append(f"{kwargs.get('by')} in {threading.current_thread().name}")
            return original(*args, **kwargs)

        resource = unique("r")
        held = _line_up(store, resource, queue)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_wakes, "pass_turn", spy)
            assert release_lease(held, app=app)  # (W1 never claims: its check wakes W2)
            waker.pass_every(app, 0.2, lambda: [store])
            me = threading.current_thread().name
            _run_loop(hub, lambda: f"turn in {me}" in ran and f"pass in {me}" in ran, 10)
        assert _waker_threads() <= before  # (none of this waker's)
        assert set(ran) == {f"turn in {me}", f"pass in {me}"}, ran
        assert "w2" in _sent(client, queue)
        waker.stop_passes(app)

    def test_the_passes_go_on_after_the_worker_reconnects(
        self, waker: _wakes.Waker, broker: Any, store: Any
    ) -> None:
        """A worker whose broker connection fails cancels the timer entries its loop
        registered (ours among them) and registers with the loop again once reconnected: the
        passes go on. (Before, the waker took the loop for its own and kept its cancelled
        entry as armed: no pass ran again.)"""
        from celery.worker import loops
        from kombu.asynchronous import Hub

        app, _client, _queue = broker
        hub = Hub()
        passes: list[float] = []

        def stores() -> list[Any]:
            passes.append(time.monotonic())
            return [store]

        def register() -> set[Any]:  # (as LeaseBootstep.register_with_event_loop does)
            before = loops._timer_entries(hub.timer)
            waker.run_on(hub)
            waker.pass_every(app, 0.2, stores)
            return loops._timer_entries(hub.timer) - before

        registered = register()
        _run_loop(hub, lambda: len(passes) >= 1, 10)
        loops._cancel_timer_entries(hub.timer, registered)  # (the connection failed)
        loops._cancel_timer_entries(hub.timer, loops._timer_entries(hub.timer))
        register()  # (reconnected)
        seen = len(passes)
        _run_loop(hub, lambda: len(passes) >= seen + 2, 10)
        waker.stop_passes(app)

    def test_a_check_scheduled_from_another_thread_runs_on_the_loop(
        self, waker: _wakes.Waker, broker: Any, store: Any
    ) -> None:
        """A wake sent from another thread of the main process: its turn check runs on the
        loop, on time, though no pass is due soon."""
        from kombu.asynchronous import Hub

        app, client, queue = broker
        hub = Hub()
        waker.run_on(hub)
        waker.pass_every(app, 600, lambda: [])
        resource = unique("r")
        held = _line_up(store, resource, queue)
        sender = threading.Thread(target=release_lease, args=(held,), kwargs={"app": app})
        sender.start()
        sender.join()
        assert _sent(client, queue) == ["w1"]
        _run_loop(hub, lambda: "w2" in _sent(client, queue), GRACE + 2)
        waker.stop_passes(app)

    def test_a_failing_pass_backs_off_on_the_loop(
        self, waker: _wakes.Waker, broker: Any, redis_server: Any
    ) -> None:
        """Each failed pass held the loop for its store's timeout: the next one comes after
        twice the interval, then four times, not every interval."""
        from kombu.asynchronous import Hub

        app, _client, _queue = broker
        hub = Hub()
        waker.run_on(hub)
        with TcpProxy(urlsplit(redis_server.url).port) as proxy:
            slow = store_from_url(
                proxy.url_for(redis_server.url), key_prefix=f"{unique('cl')}:", socket_timeout=0.05
            )
            try:
                proxy.blackhole()
                tried: list[float] = []

                def stores() -> list[Any]:
                    tried.append(time.monotonic())
                    return [slow]

                waker.pass_every(app, 0.1, stores)
                _run_loop(hub, lambda: len(tried) >= 3, 10)
            finally:
                waker.stop_passes(app)
                proxy.heal()
                slow.close()
        gaps = [b - a for a, b in itertools.pairwise(tried)]
        assert gaps[0] >= 0.2 and gaps[1] >= 0.4, gaps  # (0.1 s +-20 % without the back-off)


class TestPassStores:
    def test_a_pass_store_gives_up_within_its_call_timeout(self, redis_server: Any) -> None:
        """The stores a prefork worker's main process passes with wait PARENT_CALL_TIMEOUT for
        an answer, whatever the ttl (its event loop waits meanwhile): a store that stops
        answering fails the pass in about that (a reconnect's one retry included), where the
        task's store (ttl 60: 25 s) would hold it on."""
        from celery_lease import LeaseStoreError, lease_task
        from celery_lease._app import lease_stores

        with TcpProxy(urlsplit(redis_server.url).port) as proxy:
            app = Celery("pass_stores", broker="memory://")
            app.conf.update(
                lease_store_url=proxy.url_for(redis_server.url),
                lease_key_prefix=f"{unique('cl')}:",
                lease_ttl=60.0,
            )

            @lease_task(app=app, resource="r-{i}", ttl=30.0)
            def other_ttl(i: int) -> int:
                return i

            (store,) = lease_stores(app, call_timeout=0.3)  # (one per set of wait lists)
            assert store.wake_due() == []  # (connected)
            proxy.blackhole()
            started = time.monotonic()
            with pytest.raises(LeaseStoreError):
                store.wake_due()
            assert time.monotonic() - started < 3 * 0.3 + 0.3
            proxy.heal()
            assert len(lease_stores(app)) == 1  # (the tasks' own: both ttls, one set of lists)
            for made in {id(s): s for s in [*lease_stores(app), store]}.values():
                made.close()


def _connection_ids(store: Any) -> set[Any]:
    """What identifies each idle connection of ``store`` on its server: a Redis connection's
    local port, a PostgreSQL session's backend pid (read from the store's free list)."""
    idle = store._connections.free._idle
    if hasattr(store, "key_prefix"):
        return {conn._sock.getsockname()[1] for conn in idle if conn._sock is not None}
    return {conn.cursor.connection.info.backend_pid for conn in idle}


@pytest.fixture(params=["redis", "postgres"])
def pass_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The store a prefork worker's main process passes over (``lease_stores`` with its call
    timeout), of an app on a real Redis or PostgreSQL store."""
    from celery_lease._app import lease_stores
    from celery_lease._passes import PARENT_CALL_TIMEOUT

    app = Celery("pass_fork", broker="memory://")
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = request.getfixturevalue("postgres_server").url
    app.conf.update(
        lease_store_url=url,
        lease_key_prefix=f"{unique('cl')}:",
        lease_table_prefix=f"{unique('cl')}_",
    )
    (made,) = lease_stores(app, call_timeout=PARENT_CALL_TIMEOUT)
    try:
        yield made
    finally:
        made.close()


class TestFork:
    """The main process of a prefork worker passes over the wait lists, then forks pool
    processes (replacing recycled ones): a child never uses, nor closes, a connection the
    parent opened."""

    def test_a_child_forked_after_a_pass_opens_its_own_connections(self, pass_store: Any) -> None:
        store = pass_store
        store.wake_due()  # (the parent's pass: its connection stays idle in the store)
        parent = _connection_ids(store)
        assert parent
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                store.wake_due()
                store.release(store.acquire(unique("r"), Owner.new("child"), 30))
                os.write(write, json.dumps(sorted(_connection_ids(store))).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        try:
            seen = set(json.loads(os.read(read, 10000).decode()))
        finally:
            os.close(read)
            _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert seen and not seen & parent, (seen, parent)
        store.wake_due()  # the parent's connection is whole: the child never closed it
        assert _connection_ids(store) == parent


class TestHandOver:
    """A prefork pool process on its way out hands its pending turn checks to its worker's
    main process (``_passes._ParentTurns``, a pipe made before the pool forks)."""

    def test_an_exiting_child_hands_its_check_to_the_main_process(
        self, waker: _wakes.Waker, broker: Any, redis_server: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The child sends W1's wake and exits at once (it keeps no check to wait for); the
        main process runs the check when W1's grace is over, also when the child wrote it
        after the main process's loop stopped (``take_leftovers``, at its exit): W2 is woken
        and W1's missed wake sent once more."""
        from celery_lease import _app, _app_stores, _passes
        from celery_lease.stores import base

        monkeypatch.setattr(base, "DEFAULT_HANDOFF_GRACE", GRACE)
        app, client, queue = broker
        app.conf.update(lease_store_url=redis_server.url, lease_key_prefix=f"{unique('cl')}:")
        store = _app.get_store(app)
        turns = _passes._ParentTurns(app)
        try:
            resource = unique("r")
            held = _line_up(store, resource, queue)
            child = os.fork()
            if child == 0:  # pragma: no cover - runs in the child
                code = 1
                try:
                    assert release_lease(held, app=app)
                    started = time.monotonic()
                    assert _wakes.drain_turns(hand_over=turns.hand_over) is True
                    code = 0 if time.monotonic() - started < GRACE / 2 else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(child, 0)
            assert os.waitstatus_to_exitcode(status) == 0  # (it exited at once)
            assert _sent(client, queue) == ["w1"]
            turns.take_leftovers()
            assert waker._turns, "the main process has no check"
            assert _wakes.drain_turns() is True
            assert _sent(client, queue) == ["w1", "w1", "w2"]
            assert _woken(store, resource) == ["w2"]
        finally:
            os.close(turns.read_fd)
            os.close(turns.write_fd)
            for made in _app_stores._stores.get(app, {}).values():
                made.close()

    def test_checks_the_main_process_cannot_run_are_kept(
        self, broker: Any, redis_server: Any, store: Any
    ) -> None:
        """In the main process itself, or on a store the app's settings do not name (one a
        test or a script passed in), the checks come back to be run where they are."""
        from celery_lease import _passes

        app, _client, _queue = broker
        turns = _passes._ParentTurns(app)
        try:
            check = _wakes.TurnCheck(time.monotonic(), app, store, "r")
            assert turns.hand_over([check]) == [check]  # (the main process)
            turns.pid = -1  # (as in a pool process)
            assert turns.hand_over([check]) == [check]  # (a store of its own)
            with pytest.raises(BlockingIOError):  # (nothing was written)
                os.read(turns.read_fd, 100)
        finally:
            os.close(turns.read_fd)
            os.close(turns.write_fd)
