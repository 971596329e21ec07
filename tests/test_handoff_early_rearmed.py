"""The early wake when the waiter it named was re-armed during the body (Redis, issue 10).

L's claim names W as the waiter a release would wake, and L's release sends W's wake early.
Meanwhile W's back-stop copy was refused and re-armed W's place: the place's message now counts
one more wait. The release hands the resource to W with that message; it is the same
execution, whose woken copy (the early one) is already out, so the releaser sends no second
copy: with no result backend to tell it was a duplicate, that copy would end with the recorded
result and run the task's link callbacks again. Also at W's last allowed wait: the early copy's
claim reads the count W's place holds.

Real Redis store; the broker is Celery's in-memory transport, whose queue is counted. Negative
control: with the check off, the release sends the second copy.
"""

from __future__ import annotations

import warnings

import pytest
from celery import Celery
from celery.exceptions import DuplicateTaskNameWarning

from celery_lease import LeaseBusyError, Owner, _clock, _execution, lease_task
from celery_lease._app import get_store
from celery_lease._message import LISTED_HEADER, WAITS_HEADER, wake_payload
from tests.conftest import unique

pytestmark = pytest.mark.redis

W_ID = "0f0e0d0c-1111-2222-3333-444455556666"


@pytest.fixture
def setup(request):
    server = request.getfixturevalue("redis_server")
    app = Celery(unique("rearmed"), broker="memory://")
    app.conf.lease_store_url = server.url
    app.conf.lease_key_prefix = f"{unique('cl')}:"
    app.conf.lease_handoff_wake_queue = False
    app.conf.task_always_eager = False
    app.queue = unique("q")  # (the in-memory broker's queues outlive the app)

    @lease_task(app=app, resource="r-{i}", busy_max_waits=5, name=unique("rearmed.t"))
    def t(i):
        return i

    with warnings.catch_warnings():
        # (finalizing takes in every shared task other tests defined, some under one name)
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)
        app.finalize()
    store = get_store(app)
    try:
        yield app, t, store
    finally:
        store.close()


def payload_of(task, waits):
    """The wake message W's copy lists after ``waits`` refused claims (it counts one more)."""
    task.push_request(
        id=W_ID,
        args=(1,),
        kwargs={},
        headers={WAITS_HEADER: waits, LISTED_HEADER: 1_800_000_000},
        delivery_info={"exchange": "", "routing_key": task.app.queue},
        retries=0,
    )
    try:
        payload, _ = wake_payload(task, task._compiled(), task.request, (1,), {})
    finally:
        task.pop_request()
    return payload


def wait(store, who, payload):
    with pytest.raises(LeaseBusyError) as busy:
        store.acquire("r-1", Owner.new(who), 30, identity=who, wait=payload, wait_ttl=60)
    assert busy.value.position


def queued(app):
    with app.connection_for_read() as conn:
        return conn.default_channel.queue_declare(app.queue, passive=True).message_count


def hand_over(app, task, store, waits_before, waits_after):
    """X holds; L and then W wait; X releases (L is woken) and L claims, naming W; W's place
    is re-armed by a copy that waited ``waits_after`` times; L's release wakes W early.
    Returns the number of W's messages sent."""
    x = store.acquire("r-1", Owner.new("x"), 30, identity="x")
    wait(store, "l", '{"task": "other", "args": [], "kwargs": {}, "options": {}}')
    wait(store, W_ID, payload_of(task, waits_before))
    assert store.release(x)
    lease = store.acquire("r-1", Owner.new("l"), 30, identity="l", early_wake=True)
    assert lease.next_wake == payload_of(task, waits_before)
    wait(store, W_ID, payload_of(task, waits_after))  # the back-stop copy, refused: re-armed
    _execution.release(task, lease, "done", None, held_since=_clock.monotonic(), early=True)
    return queued(app)


def test_a_rearmed_waiter_gets_one_woken_copy(setup):
    app, task, store = setup
    assert hand_over(app, task, store, 1, 2) == 1


def test_at_its_last_allowed_wait_too(setup):
    """The early copy's claim reads its place's count (5: busy_max_waits) and the result
    backend then, as a woken copy carrying that count does (test_handoff_early_stale_count)."""
    app, task, store = setup
    assert hand_over(app, task, store, 3, 4) == 1


def test_negative_control_without_the_check_the_release_sends_a_second_copy(setup, monkeypatch):
    app, task, store = setup
    monkeypatch.setattr(_execution, "rearmed_wake", lambda early, payload: False)
    assert hand_over(app, task, store, 1, 2) == 2
