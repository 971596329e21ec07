"""Every waiter in one line, and publish order when asked (issue 32 item 2, issue 33 item 6).

A waiter that cannot have its message kept for a wake (``identity=False``: nothing tells two
copies of it apart; a message over ``lease_handoff_max_payload``; a full list) polls in a place
of its own in the wait list: while its place comes up, the free resource is held for it, so a
steady stream of listed later arrivals no longer overtakes it. Negative control
(``CL_POLLING=0``: such a waiter is not listed, as before): the listed later arrivals run first.

``order="publish"``: steps of one account published in order, refused while the account is
busy and claimed by two workers in whatever order their claims reach the store, run in the
order they were published. Negative control: the default order (arrival) mixes them up. Also
with the publisher's clock 50 ms ahead of the store's (F7); negative control: the stores
without their tolerance for publish times ahead of their clock (the rule before) run the later
one first.
"""

from __future__ import annotations

import pytest

from celery_lease import _clock
from tests.conftest import unique
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {"CL_TTL": "5", "CL_BACKOFF_BASE": "0.05", "CL_BACKOFF_CAP": "5", "CL_HANDOFF_GRACE": "0.5"}
LATER = 8  # listed arrivals after the waiter that cannot be woken


def _entered(events, n):
    return [e["k"] for e in events.all() if e.get("res") == n and e["ev"] == "enter"]


def _stream_behind(it_app, events, queue, n, first):
    """H holds; ``first`` (k=1) arrives and is refused; then LATER listed waiters, each once the
    one before was refused. Returns all results."""
    results = [it_app.fifo_hold.apply_async((n, 0, 1.0), queue=queue)]
    events.wait(ev="enter", res=n, k=0)
    results.append(first.apply_async((n, 1, 0.1), queue=queue))
    events.wait(ev="retry", task=results[-1].id)
    for k in range(2, LATER + 2):
        results.append(it_app.fifo_hold.apply_async((n, k, 0.1), queue=queue))
        events.wait(ev="retry", task=results[-1].id)
    return results


@pytest.mark.parametrize("polling", ["on", "off"])
def test_a_waiter_without_identity_keeps_its_turn(
    it_app, start_worker, store_env, events, queue, polling
):
    env = {**store_env("redis"), **ENV}
    if polling == "off":
        env["CL_POLLING"] = "0"
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("l")
    results = _stream_behind(it_app, events, queue, n, it_app.fifo_hold_backoff)
    wait_for(lambda: all(r.state == "SUCCESS" for r in results), 90, "every task to succeed")
    order = _entered(events, n)
    if polling == "off":  # not listed: every listed later arrival goes first
        assert order.index(1) > 2, f"the unlisted waiter ran at {order.index(1)} of {order}"
    else:
        assert order[:2] == [0, 1], f"bodies ran {order}: the polling waiter was overtaken"
        assert sorted(order) == list(range(LATER + 2))


BACKLOG = 100  # plain tasks of 0.3 s queued behind the waiters: about 5 s for two workers


@pytest.mark.parametrize("route", ["wake queue", "own"])
def test_a_polling_waiter_keeps_its_turn_behind_a_backlog(
    it_app, start_worker, store_env, events, queue, coord, route
):
    """Listed waiters' wakes skip a backlog of their task queue through its wake queue; a
    polling waiter's copies went to the back of the task queue, missed the turn held for them
    and were overtaken by the listed later arrivals (a review saw it run 4th to 9th of 9).
    They go through the wake queue too. Negative control (``own``: through the task queue):
    overtaken."""
    env = {**store_env("redis"), **ENV}
    if route == "own":
        env["CL_POLL_ROUTE"] = "own"
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("l")
    go = events.key_for("go-h")
    results = [it_app.fifo_gate.apply_async((n, 0, go), queue=queue)]
    events.wait(ev="enter", res=n, k=0)
    results.append(it_app.fifo_hold_backoff.apply_async((n, 1, 0.1), queue=queue))
    events.wait(ev="retry", task=results[-1].id)
    for k in range(2, LATER + 2):
        results.append(it_app.fifo_hold.apply_async((n, k, 0.1), queue=queue))
        events.wait(ev="retry", task=results[-1].id)
    backlog = [
        it_app.plain_step.apply_async((f"{n}-b", k, 0.3), queue=queue) for k in range(BACKLOG)
    ]
    # The polling waiter comes back every 50 ms or so: once it was refused again after the
    # backlog was queued, its next copy is behind the backlog (or in the wake queue). (Its
    # first refusal stored RETRY; each later poll ends IGNORED: "requeued".)
    polls = len(events.where(ev="requeued", task=results[1].id))
    wait_for(
        lambda: len(events.where(ev="requeued", task=results[1].id)) > polls,
        10,
        "the polling waiter to come back after the backlog was queued",
    )
    coord.rpush(go, 1)  # H releases while the backlog is queued
    wait_for(lambda: all(r.state == "SUCCESS" for r in results), 120, "every waiter to succeed")
    order = _entered(events, n)
    if route == "own":
        assert order.index(1) > 1, f"the polling waiter ran at {order.index(1)} of {order}"
    else:
        assert order[:2] == [0, 1], f"bodies ran {order}: the polling waiter was overtaken"
    assert sorted(order) == list(range(LATER + 2))
    for result in backlog:
        result.forget()


def test_a_waiter_whose_message_is_too_big_keeps_its_turn(
    it_app, start_worker, store_env, events, queue
):
    """The same for a message over lease_handoff_max_payload (a big argument)."""
    env = {**store_env("redis"), **ENV, "CL_HANDOFF_MAX_PAYLOAD": "600"}
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("l")
    results = [it_app.fifo_hold.apply_async((n, 0, 1.0), queue=queue)]
    events.wait(ev="enter", res=n, k=0)
    results.append(it_app.fifo_blob.apply_async((n, 1, "x" * 1000), queue=queue))
    events.wait(ev="retry", task=results[-1].id)
    for k in range(2, LATER + 2):
        results.append(it_app.fifo_hold.apply_async((n, k, 0.1), queue=queue))
        events.wait(ev="retry", task=results[-1].id)
    wait_for(lambda: all(r.state == "SUCCESS" for r in results), 90, "every task to succeed")
    order = _entered(events, n)
    assert order[:2] == [0, 1], f"bodies ran {order}: the polling waiter was overtaken"


STEPS = 16


@pytest.mark.parametrize("order", ["publish", "arrival"])
def test_steps_run_in_the_order_they_were_published(
    it_app, start_worker, store_env, events, queue, order
):
    """STEPS steps of one account published at once while it is busy, claimed by two workers
    of three threads each. With order="publish" they run in publish order; the negative control
    (arrival order) mixes them up in at least one of three tries."""
    env = {**store_env("redis"), **ENV}
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    task = it_app.fifo_ordered if order == "publish" else it_app.fifo_hold
    orders = []
    for _ in range(1 if order == "publish" else 3):
        n = unique("o")
        holder = it_app.fifo_hold.apply_async((n, 0, 2.0), queue=queue)
        events.wait(ev="enter", res=n, k=0)
        steps = [task.apply_async((n, k, 0.02), queue=queue) for k in range(1, STEPS + 1)]
        wait_for(
            lambda steps=steps: all(r.state == "SUCCESS" for r in steps), 90, "the steps to end"
        )
        orders.append(_entered(events, n)[1:])
        if orders[-1] != list(range(1, STEPS + 1)):
            break
        del holder
    if order == "publish":
        assert orders[0] == list(range(1, STEPS + 1)), f"steps ran {orders[0]}"
    else:
        assert orders[-1] != list(range(1, STEPS + 1)), f"arrival order kept it: {orders}"


@pytest.mark.parametrize("tolerance", ["kept", "none"])
def test_publish_order_holds_with_the_publishers_clock_ahead(
    it_app, start_worker, store_env, events, queue, monkeypatch, tolerance
):
    """The publishing process's clock runs 50 ms ahead of the store's. H holds; A is published
    first with a countdown (its claim arrives 0.5 s later), B right after it (its claim arrives
    first); both are refused while H holds, and A runs before B. Negative control
    (CL_SINCE_SKEW=0: a publish time ahead of the store's clock counts as now, as before): B
    runs first in at least one of three tries (9 of 9 at 20 ms in the review)."""
    env = {**store_env("redis"), **ENV}
    if tolerance == "none":
        env["CL_SINCE_SKEW"] = "0"
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    real = _clock.wall
    monkeypatch.setattr(_clock, "wall", lambda: real() + 0.05)  # (stamps celery_lease_published_at)
    orders = []
    for _ in range(3 if tolerance == "none" else 2):
        n = unique("s")
        it_app.fifo_hold.apply_async((n, 0, 2.0), queue=queue)
        events.wait(ev="enter", res=n, k=0)
        a = it_app.fifo_ordered.apply_async((n, 1, 0.05), queue=queue, countdown=0.5)
        b = it_app.fifo_ordered.apply_async((n, 2, 0.05), queue=queue)
        events.wait(ev="retry", task=b.id)  # (both refused while H holds)
        events.wait(ev="retry", task=a.id)
        wait_for(lambda a=a, b=b: a.state == b.state == "SUCCESS", 60, "A and B to succeed")
        orders.append(_entered(events, n))
        if orders[-1] == [0, 2, 1]:
            break
    if tolerance == "none":
        assert [0, 2, 1] in orders, f"the negative control kept publish order: {orders}"
    else:
        assert orders == [[0, 1, 2]] * 2, f"bodies ran {orders} (published: [0, 1, 2])"
