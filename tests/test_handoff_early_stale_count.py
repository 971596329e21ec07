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

Three ways the early copy's claim finds its place's count missing or stale, each failed before
(the body ran after the FAILURE): the place lapsed while the copy sat behind a backlog, or the
claim's reply was lost and the claim sent again (the first run took the place off the list):
no place is found, so the copy reads the result backend; or the list's byte budget was full
when the re-arm's message grew a digit (9 to 10 waits): the re-arm's payload replaces the old
one all the same (``REARM_GROWTH``). Negative controls for each.

Real Redis store; Celery's in-memory broker (its queue read back) and cache backend; each copy
runs as a worker runs it (the task called with its message's request).
"""

from __future__ import annotations

import uuid
import warnings

import pytest
from celery import Celery, states
from celery.exceptions import DuplicateTaskNameWarning, Ignore

from celery_lease import LeaseBusyError, Owner, _clock, _copies, _execution, lease_task
from celery_lease._app import get_store
from celery_lease._message import LISTED_HEADER, WAITS_HEADER, wake_payload
from celery_lease._wakes import EARLY_HEADER, WOKEN_HEADER
from celery_lease.stores.base import REARM_GROWTH
from celery_lease.stores.redis import scripts as lua
from celery_lease.stores.redis.connection import Script
from tests.conftest import unique
from tests.tooling.servers import wait_for

pytestmark = pytest.mark.redis

MAX_WAITS = 5


@pytest.fixture
def setup(request):
    """The app, W's task (``busy_max_waits`` MAX_WAITS, or the indirect parameter), its store
    and W's body runs."""
    max_waits = getattr(request, "param", MAX_WAITS)
    server = request.getfixturevalue("redis_server")
    app = Celery(unique("lastwait"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = server.url
    app.conf.lease_key_prefix = f"{unique('cl')}:"
    app.conf.lease_handoff_wake_queue = False
    app.conf.task_always_eager = False
    app.queue = unique("q")  # (the in-memory broker's queues outlive the app)
    runs: list[dict] = []

    @lease_task(app=app, resource="r-{i}", busy_max_waits=max_waits, name=unique("lastwait.t"))
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
    t.max_waits = max_waits
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
        payload, _ = wake_payload(task, task._compiled(), task.request, (1,), {})
    finally:
        task.pop_request()
    return payload


def wait(store, who, payload, kept=60.0):
    with pytest.raises(LeaseBusyError) as busy:
        store.acquire("r-1", Owner.new(who), 30, identity=who, wait=payload, wait_ttl=kept)
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


class LostReply:
    """The store's claim script as a dropped connection runs it: the first run's reply is
    lost and redis-py sends the same claim again."""

    def __init__(self, script):
        self.script, self.calls = script, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            self.script(*args, **kwargs)  # ran on the server; its reply never came back
        return self.script(*args, **kwargs)


#: KEPT: W's places kept this long (wait_ttl), so they can lapse within a test.
KEPT = 1.0


def early_copy_after_give_up(app, task, store, how="re-armed"):
    """The steps above; returns what W's early copy did. ``how`` its claim finds its place:
    re-armed (as the module's first paragraph tells), "lapsed" (kept KEPT, gone when the copy
    is delivered), "lost reply" (the claim sent again), "full budget" (the list's payloads
    use every byte of wait_bytes_cap when W's re-arm grows its message)."""
    last = task.max_waits
    kept = KEPT if how == "lapsed" else 60.0
    other = '{"task": "other", "args": [], "kwargs": {}, "options": {}}'
    x = store.acquire("r-1", Owner.new("x"), 30, identity="x")
    wait(store, "l", other)
    wait(store, task.w_id, payload_of(task, last - 2), kept)
    assert store.release(x)
    lease = store.acquire("r-1", Owner.new("l"), 30, identity="l", early_wake=True)
    assert lease.next_wake == payload_of(task, last - 2)
    if how == "full budget":
        store.wait_bytes_cap = len(payload_of(task, last - 2))  # W's message, no byte more
        assert len(payload_of(task, last - 1)) > store.wait_bytes_cap
    wait(store, task.w_id, payload_of(task, last - 1), kept)  # back-stop: re-armed, the last
    _execution.release(task, lease, "done", None, held_since=_clock.monotonic(), early=True)
    copies = drain(app)
    assert [c.get(WAITS_HEADER) for c in copies] == [last - 1]  # the early copy alone
    assert copies[0].get(EARLY_HEADER) is not None
    # The woken copy misses its grace (a backlog); another task takes the resource.
    deadline = _clock.monotonic() + 5
    while True:
        try:
            y = store.acquire("r-1", Owner.new("y"), 30, identity="y")
            break
        except LeaseBusyError:
            assert _clock.monotonic() < deadline, "the hold for W never ended"
    with pytest.raises(LeaseBusyError, match=f"gave up after {last} busy waits") as gave_up:
        deliver(task, {WAITS_HEADER: last, LISTED_HEADER: 1_800_000_000})
    task.backend.mark_as_failure(task.w_id, gave_up.value)  # (as the worker stores it)
    store.release(y)
    drain(app)
    if how == "lapsed":
        wait_for(lambda: store.waiters("r-1") == [], 5, "W's place to lapse")
    if how == "lost reply":
        store._acquire = LostReply(store._acquire)
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
    early[WOKEN_HEADER] = _clock.wall()
    _execution.release(task, lease, "done", None)
    drain(app)
    assert deliver(task, early) == "ran"
    assert len(runs) == 1


def test_negative_control_without_the_places_count_the_body_runs_after_failure(setup, monkeypatch):
    app, task, store, runs = setup
    monkeypatch.setattr(_copies, "listed_waits", lambda payload: 0)
    assert early_copy_after_give_up(app, task, store) == "ran"
    assert len(runs) == 1


@pytest.mark.parametrize("how", ["lapsed", "lost reply"])
def test_an_early_copy_that_finds_no_place_of_its_own_reads_the_backend(setup, how):
    app, task, store, runs = setup
    assert early_copy_after_give_up(app, task, store, how) == "ignored"
    assert runs == []
    assert task.backend.get_task_meta(task.w_id, cache=False)["status"] == states.FAILURE


@pytest.mark.parametrize("how", ["lapsed", "lost reply"])
def test_negative_control_trusting_the_carried_count_runs_the_body_after_failure(
    setup, monkeypatch, how
):
    app, task, store, runs = setup
    monkeypatch.setattr(_copies, "own_count_unknown", lambda request, lease: False)
    assert early_copy_after_give_up(app, task, store, how) == "ran"
    assert len(runs) == 1


@pytest.mark.parametrize("setup", [10], indirect=True)  # (9 to 10: a digit more)
def test_an_early_copy_counts_a_re_arm_that_grew_past_a_full_budget(setup):
    app, task, store, runs = setup
    assert early_copy_after_give_up(app, task, store, "full budget") == "ignored"
    assert runs == []
    assert task.backend.get_task_meta(task.w_id, cache=False)["status"] == states.FAILURE


@pytest.mark.parametrize("setup", [10], indirect=True)  # (9 to 10: a digit more)
def test_negative_control_without_the_growth_allowance_the_body_runs_after_failure(setup):
    app, task, store, runs = setup
    allowance = f" then cap = cap + {REARM_GROWTH} * #wl end"
    assert allowance in lua.ACQUIRE, "the claim script changed: update this test"
    store._acquire = Script(store._connections, lua.ACQUIRE.replace(allowance, " then end"))
    assert early_copy_after_give_up(app, task, store, "full budget") == "ran"
    assert len(runs) == 1
