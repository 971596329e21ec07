"""An early copy at its waiter's last allowed wait, its place re-armed during the waker's body
(Redis, issue 10).

L's claim names W (its message counting 4 waits) as the waiter its release wakes; while L's
body runs, W's back-stop copy is refused and re-arms W's place with a message counting 5, the
last allowed (busy_max_waits=5). L's release sends W's early copy, still counting 4. The woken
copies miss their grace behind a backlog, another task takes the resource, and W's next
back-stop copy (counting 5) is refused and gives up: FAILURE is stored, its errbacks run. The
early copy is delivered after that: it must end unrun, not run the body and store SUCCESS over
the FAILURE. Its claim reads the count its own place held (``Lease.own_wake``) and, at the last
wait, the result backend. Before the fix the early copy ran the body. Negative control: with
the place's count ignored, the body runs after the FAILURE.

Real Redis store; Celery's in-memory broker (its queue read back) and cache backend; each copy
runs as a worker runs it (the task called with its message's request).
"""

from __future__ import annotations

import uuid
import warnings

import pytest
from celery import Celery, states
from celery.exceptions import DuplicateTaskNameWarning, Ignore

import celery_lease._task as task_module
from celery_lease import LeaseBusyError, Owner, _clock, lease_task
from celery_lease._app import get_store
from celery_lease._task import EARLY_HEADER, LISTED_HEADER, WAITS_HEADER
from tests.conftest import unique
from tests.tooling.servers import wait_for

pytestmark = pytest.mark.redis

MAX_WAITS = 5


@pytest.fixture
def setup(request):
    server = request.getfixturevalue("redis_server")
    app = Celery(unique("lastwait"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = server.url
    app.conf.lease_key_prefix = f"{unique('cl')}:"
    app.conf.lease_handoff_wake_queue = False
    app.conf.task_always_eager = False
    app.queue = unique("q")  # (the in-memory broker's queues outlive the app)
    runs: list[dict] = []

    @lease_task(app=app, resource="r-{i}", busy_max_waits=MAX_WAITS, name=unique("lastwait.t"))
    def t(i):
        runs.append(dict(t.request.headers or {}))
        return i

    with warnings.catch_warnings():
        # (finalizing takes in every shared task other tests defined, some under one name)
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)
        app.finalize()
    store = get_store(app)
    store.handoff_grace = 0.05
    t.w_id = str(uuid.uuid4())  # (the cache backend outlives the app: a task id per test)
    try:
        yield app, t, store, runs
    finally:
        store.close()


def request_of(task, headers):
    return {
        "id": task.w_id,
        "args": (1,),
        "kwargs": {},
        "headers": headers,
        "delivery_info": {"exchange": "", "routing_key": task.app.queue},
        "retries": 0,
        "is_eager": False,
        "called_directly": False,
    }


def payload_of(task, waits):
    """The wake message W's copy lists after ``waits`` refused claims (it counts one more)."""
    task.push_request(**request_of(task, {WAITS_HEADER: waits, LISTED_HEADER: 1_800_000_000}))
    try:
        payload, _ = task._wake_payload(task.request, (1,), {}, task.lease_settings)
    finally:
        task.pop_request()
    return payload


def wait(store, who, payload):
    with pytest.raises(LeaseBusyError) as busy:
        store.acquire("r-1", Owner.new(who), 30, identity=who, wait=payload, wait_ttl=60)
    assert busy.value.position


def drain(app):
    """The messages sent, as their headers (read off the in-memory queue)."""
    out = []
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(app.queue)) is not None:
            out.append(message.headers)
    return out


def deliver(task, headers):
    """Run one copy of W as a worker runs it; returns "ran" or "ignored"."""
    ours = {k: v for k, v in headers.items() if k.startswith("celery_lease")}
    task.push_request(**request_of(task, ours))
    try:
        task(1)
    except Ignore:
        return "ignored"
    finally:
        task.pop_request()
    return "ran"


def early_copy_after_give_up(app, task, store):
    """The steps above; returns what W's early copy did."""
    x = store.acquire("r-1", Owner.new("x"), 30, identity="x")
    wait(store, "l", '{"task": "other", "args": [], "kwargs": {}, "options": {}}')
    wait(store, task.w_id, payload_of(task, 3))
    assert store.release(x)
    lease = store.acquire("r-1", Owner.new("l"), 30, identity="l", early_wake=True)
    assert lease.next_wake == payload_of(task, 3)
    wait(store, task.w_id, payload_of(task, 4))  # W's back-stop copy: re-armed, counting 5
    task._release(lease, "done", None, held_since=_clock.monotonic(), early=True)
    copies = drain(app)
    assert [c.get(WAITS_HEADER) for c in copies] == [4]  # the early copy alone
    assert copies[0].get(EARLY_HEADER) is not None
    # The woken copy misses its grace (a backlog); another task takes the resource.
    deadline = _clock.monotonic() + 5
    while True:
        try:
            y = store.acquire("r-1", Owner.new("y"), 30, identity="y")
            break
        except LeaseBusyError:
            assert _clock.monotonic() < deadline, "the hold for W never ended"
    with pytest.raises(LeaseBusyError, match="gave up after 5 busy waits") as gave_up:
        deliver(task, {WAITS_HEADER: MAX_WAITS, LISTED_HEADER: 1_800_000_000})
    task.backend.mark_as_failure(task.w_id, gave_up.value)  # (as the worker stores it)
    store.release(y)
    drain(app)
    return deliver(task, copies[0])


def test_an_early_copy_ends_unrun_after_its_back_stop_gave_up(setup):
    app, task, store, runs = setup
    assert early_copy_after_give_up(app, task, store) == "ignored"
    assert runs == []
    assert task.backend.get_task_meta(task.w_id, cache=False)["status"] == states.FAILURE
    wait_for(lambda: store.waiters("r-1") == [], 5, "W's place to leave the list")


def test_an_early_copy_at_the_last_wait_still_runs_when_nothing_gave_up(setup):
    """The place counts the last wait but no copy gave up (PENDING): the early copy runs."""
    app, task, store, runs = setup
    x = store.acquire("r-1", Owner.new("x"), 30, identity="x")
    wait(store, task.w_id, payload_of(task, 3))
    assert store.release(x)  # (W is woken; its copy is lost)
    drain(app)
    wait_for(lambda: not store.waiters("r-1")[0].woken, 5, "W's grace to pass")
    lease = store.acquire("r-1", Owner.new("l"), 30, identity="l", early_wake=True)
    assert lease.next_wake is None  # W was woken once already: not named again
    wait(store, task.w_id, payload_of(task, 4))  # re-armed, counting 5
    early = {WAITS_HEADER: 4, LISTED_HEADER: 1_800_000_000, EARLY_HEADER: 3}
    early[task_module.WOKEN_HEADER] = _clock.wall()
    task._release(lease, "done", None)
    drain(app)
    assert deliver(task, early) == "ran"
    assert len(runs) == 1


def test_negative_control_without_the_places_count_the_body_runs_after_failure(setup, monkeypatch):
    app, task, store, runs = setup
    monkeypatch.setattr(task_module, "_listed_waits", lambda payload: 0)
    assert early_copy_after_give_up(app, task, store) == "ran"
    assert len(runs) == 1
