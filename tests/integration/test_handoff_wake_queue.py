"""Wake queues with real workers (issue 10): a woken waiter's message goes to the wake queue of
the task queue its copy came from (``Q.lease-wake``), which the workers consuming Q consume too.

So it does not wait behind Q's backlog (the resource is held idle for it meanwhile), and it
behaves as if sent on its own route: a ``retry()`` with or without ``queue=`` /
``exchange=`` / ``routing_key=``, its busy re-queue (back-stop) and its next wake go where they
would have gone without the wake queue. The consumers of Q and of its wake queue are the same
workers: a worker that stops consuming Q (``cancel_consumer``, a warm shutdown seen late by a
prefork child) gets none of Q's wakes, and a wake is never stranded in one worker's queue (a
waker SIGKILLed right after it sent the wake). Each test here catches one defect an
adversarial review reproduced against the earlier route through the waking worker's own queue
(``worker_direct``): (a) retry(queue=) then later copies sent on a stale route; (b) wakes to a
drained worker; (c) retry(exchange=, routing_key=) overridden; (d) a busy re-queue after
retry(queue=) back on the old queue; (e) a prefork child waking into its stopping worker's
queue; (f) a wake stranded in a killed worker's queue.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import redis

from celery_lease._app import wake_queue
from tests.conftest import unique
from tests.integration.harness import ROOT
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {
    "CL_TTL": "2.0",
    "CL_BACKOFF_BASE": "0.05",
    "CL_BACKOFF_CAP": "3.0",
    "CL_REPORT_STARTS": "1",  # a "start" event for every copy a worker starts
}
WAKE = ".lease-wake"
BACKLOG = 40


def node(worker) -> str:
    return f"{worker.name}@{socket.gethostname()}"


def queues_of(app, worker) -> set[str]:
    """The queues ``worker`` consumes now (its answer to ``inspect active_queues``), asked
    again while it does not answer (a loaded CI box once left a 5 s inspect unanswered)."""
    name = node(worker)

    def answer() -> tuple[list[dict]] | None:  # (a 1-tuple: an empty list is an answer too)
        replies = app.app.control.inspect(destination=[name], timeout=5).active_queues() or {}
        return (replies[name],) if name in replies else None

    (queues,) = wait_for(answer, 60, f"{name} to answer inspect active_queues")
    return {q["name"] for q in queues}


def _entered(events, n, k):
    return [e for e in events.where(ev="enter", res=n) if e["k"] == k]


@pytest.mark.parametrize("on", [True, False], ids=["wake_queue", "negative_control"])
def test_a_woken_waiter_does_not_wait_behind_the_queues_backlog(
    it_app, start_worker, store_env, events, queue, on
):
    """One worker, a holder, a refused waiter, then a backlog of plain messages queued behind
    it: the woken copy comes through the wake queue and runs before the backlog ends.
    Negative control (``lease_handoff_wake_queue=False``): it goes to the back of the queue
    and runs after the whole backlog."""
    env = {**store_env("redis"), **ENV, "CL_WAKE_QUEUE": "1" if on else "0"}
    worker = start_worker(env, queue=queue, pool="threads", concurrency=2)
    assert (queue + WAKE in queues_of(it_app, worker)) == on
    n = unique("d")
    # the holder holds long enough for the whole backlog to be published on a loaded box, and
    # the backlog (run one at a time by the second thread) outlasts the hold by about 3 s
    it_app.fifo_hold.apply_async((n, 0, 3.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.05), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    for k in range(BACKLOG):  # queued behind the waiter's refused claim, before its wake
        it_app.plain_step.apply_async((n, 100 + k, 0.15), queue=queue)
    released = [e for e in events.where(ev="exit", res=n) if e["k"] == 0]
    assert not released, "the holder ended before the backlog was queued: the test proves nothing"
    assert waiter.get(timeout=60) == 1
    wait_for(lambda: len(events.where(ev="enter", res=n)) >= BACKLOG + 2, 60, "the backlog")
    entered = [e for e in events.all() if e.get("res") == n and e["ev"] == "enter"]
    (woken,) = [e for e in entered if e["k"] == 1]
    after = [e["k"] for e in entered[entered.index(woken) + 1 :]]
    if on:
        assert woken["via"] == queue + WAKE, woken
        assert after, "the woken waiter ran after the whole backlog"
    else:
        assert woken["via"] is None, woken
        assert after == [], f"the woken waiter ran before backlog messages {after}"


@pytest.mark.parametrize(
    "how", ["queue", "exchange"], ids=["retry_queue_a_d", "retry_exchange_routing_key_c"]
)
def test_a_woken_copys_retry_and_its_later_copies_go_where_the_retry_sent_it(
    it_app, start_worker, store_env, events, queue, how
):
    """(a), (c), (d): worker A consumes Q alone, worker B another queue R alone. A waiter sent
    on Q is woken through Q's wake queue, then retries itself onto R (``queue=R``, or
    ``exchange=R, routing_key=R``: Celery binds R by its own name). The retried copy comes to
    B, finds the resource held by the next waiter and is listed again: its back-stop copy and
    its wake must go to R (its wake through R's wake queue), never back to Q, which only A
    consumes. Every copy after the retry is started by B.

    The ttl is long enough that the back-stop copy of the probe's first refusal comes after
    all this: that copy (of the attempt before the retry) would re-arm the probe's place with
    its own message, and the wake would go to it (it ends without running the body).
    """
    env = {**store_env("redis"), **ENV, "CL_TTL": "5.0"}
    other = unique("r")
    a = start_worker(env, queue=queue, pool="threads", concurrency=2)
    b = start_worker(env, queue=other, pool="threads", concurrency=2)
    n = unique("a")
    it_app.fifo_hold.apply_async((n, 0, 0.8), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    retry_to = {"queue": other} if how == "queue" else {"exchange": other, "routing_key": other}
    probe = it_app.route_probe.apply_async((n, 1, 0.05), {"retry_to": retry_to}, queue=queue)
    events.wait(ev="retry", task=probe.id)
    second = it_app.fifo_hold.apply_async((n, 2, 1.0), queue=queue)  # holds when probe retries
    events.wait(ev="retry", task=second.id)
    assert probe.get(timeout=60) == 1
    assert second.get(timeout=30) == 2
    runs = _entered(events, n, 1)
    first, last = runs[0], runs[-1]
    assert first["via"] == queue + WAKE and first["host"] == node(a), first
    assert last["retries"] == 1 and last["host"] == node(b), last
    assert last["via"] == other + WAKE, f"the retried copy was not woken through R's: {last}"
    # As the body sees it: the route the retry sent it on.
    if how == "queue":
        assert (last["ex"], last["rk"]) == ("", other), last
    else:
        assert (last["ex"], last["rk"]) == (other, other), last
    # (d) its busy re-queue (the back-stop copy, countdown >= the ttl) goes to R too.

    def copies_on_r():
        return [
            e for e in events.where(ev="start", task=probe.id) if e["retries"] and e["rk"] == other
        ]

    wait_for(lambda: len(copies_on_r()) >= 2, 40, "the refused copy and its back-stop copy on R")
    later = [e for e in events.where(ev="start", task=probe.id) if e["retries"]]
    assert {e["host"] for e in later} == {node(b)}, later
    assert len(runs) == 2, f"the body ran {len(runs)} times: {runs}"


def test_a_worker_that_cancelled_the_queue_gets_none_of_its_wakes(
    it_app, start_worker, store_env, events, queue
):
    """(b): worker A consumes Q and H, worker B Q. ``cancel_consumer(Q)`` on A cancels Q's
    wake queue there too. A holder on H (run by A) releases while a waiter refused on Q (by
    B) waits: its wake is run by B, the one worker still consuming Q."""
    env = {**store_env("redis"), **ENV}
    held = unique("h")
    a = start_worker(env, queue=f"{queue},{held}", pool="threads", concurrency=2)
    b = start_worker(env, queue=queue, pool="threads", concurrency=2)
    assert {queue, queue + WAKE, held, held + WAKE} <= queues_of(it_app, a)
    it_app.app.control.cancel_consumer(queue, destination=[node(a)], reply=True, timeout=10)
    wait_for(lambda: queue not in queues_of(it_app, a), 20, "A to stop consuming Q")
    assert queues_of(it_app, a) == {held, held + WAKE}, "Q's wake queue outlived Q on A"
    assert {queue, queue + WAKE} <= queues_of(it_app, b)
    n = unique("b")
    it_app.fifo_hold.apply_async((n, 0, 1.0), queue=held)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.05), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    assert waiter.get(timeout=60) == 1
    (woken,) = _entered(events, n, 1)
    assert woken["via"] == queue + WAKE and woken["host"] == node(b), woken
    # And add_consumer puts it back, wake queue and all.
    it_app.app.control.add_consumer(queue, destination=[node(a)], reply=True, timeout=10)
    wait_for(lambda: queue + WAKE in queues_of(it_app, a), 20, "A to consume Q's wake queue")


def test_a_prefork_child_waking_during_its_workers_warm_shutdown_wakes_a_live_consumer(
    it_app, start_worker, store_env, events, queue
):
    """(e): a prefork child does not see its worker's warm shutdown. A holder runs in worker
    A's child (A consumes Q and H; B consumes Q); a waiter is refused; A is asked to stop while
    the holder runs. The child releases and wakes: the wake goes to Q's wake queue, which B
    consumes, so the waiter runs woken, within its grace, not from its back-stop later."""
    env = {**store_env("redis"), **ENV}
    held = unique("h")
    a = start_worker(env, queue=f"{queue},{held}", pool="prefork", concurrency=2)
    b = start_worker(env, queue=queue, pool="threads", concurrency=2)
    n = unique("e")
    it_app.fifo_hold.apply_async((n, 0, 2.5), queue=held)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.05), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    a.request_stop()  # warm: the child finishes the holder, releases and wakes
    assert waiter.get(timeout=60) == 1
    (woken,) = _entered(events, n, 1)
    assert woken["via"] == queue + WAKE and woken["host"] == node(b), woken
    a.wait_stopped(30)


def test_a_wake_sent_by_a_worker_killed_right_after_is_not_stranded(
    it_app, start_worker, store_env, events, queue, tmp_path
):
    """(f): the waker (worker A, one slot, busy with the holder it took from its other queue H,
    so it fetches nothing more) is SIGKILLed right after it sent the wake (failpoint
    ``after_wake``). The wake is in Q's wake queue, shared by every consumer of Q, so worker B
    runs the waiter woken, not from its back-stop copy."""
    env = {**store_env("redis"), **ENV}
    killer = {
        **env,
        "CELERY_LEASE_FAILPOINTS": "after_wake=kill",
        "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
        "CL_EARLY_WAKE": "0",  # (these failpoints stop a wake sent after the release)
    }
    held = unique("h")
    start_worker(killer, queue=f"{queue},{held}", pool="threads", concurrency=1)
    b = start_worker(env, queue=queue, pool="threads", concurrency=2)
    n = unique("k")
    it_app.fifo_hold.apply_async((n, 0, 1.0), queue=held)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.05), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    assert waiter.get(timeout=60) == 1
    (woken,) = _entered(events, n, 1)
    assert woken["via"] == queue + WAKE and woken["host"] == node(b), woken


@pytest.mark.parametrize("handoff", [False, True], ids=["handoff_off", "negative_control"])
def test_no_wake_queues_without_hand_off(it_app, start_worker, store_env, queue, handoff):
    """``lease_handoff=False`` (and no task turning it on): no waiter is ever woken, so the
    worker consumes no wake queue. Negative control (hand-off on): it does."""
    env = {**store_env("redis"), **ENV, "CL_HANDOFF": "1" if handoff else "0"}
    worker = start_worker(env, queue=queue, pool="threads", concurrency=1)
    consumed = queues_of(it_app, worker)
    assert queue in consumed
    assert (queue + WAKE in consumed) == handoff, consumed


@pytest.mark.parametrize(
    "order", ["priority", "priority_added", "sorted", "round_robin"], ids=lambda o: o
)
def test_a_wake_comes_before_its_queues_under_the_redis_queue_order(
    it_app, start_worker, store_env, events, order
):
    """Redis ``queue_order_strategy``: a worker consumes Q1 then Q2, a waiter on Q1 is woken
    while Q2 has a backlog. "priority" serves the queues in the order consumed: each wake
    queue comes right before its task queue, so the wake runs before Q2's backlog ends (it
    was served after all of them, behind Q2's backlog). priority_added: the worker consumes
    Q2, then Q1 by ``add_consumer`` (after Q2, so the backlog is put on Q1 itself): Q1's wake
    queue is moved right before Q1. "sorted" would serve Q1.lease-wake after Q1 (by name): no
    wake queues, the wake takes the waiter's route (Q1, ahead of Q2 anyway)."""
    strategy = order.removesuffix("_added")
    env = {**store_env("redis"), **ENV, "CL_TTL": "5.0", "CL_QUEUE_ORDER": strategy}
    q1, q2 = unique("q1"), unique("q2")
    if order == "priority_added":
        worker = start_worker(env, queue=q2, pool="threads", concurrency=2)
        it_app.app.control.add_consumer(q1, destination=[node(worker)], reply=True, timeout=5)
    else:
        worker = start_worker(env, queue=f"{q1},{q2}", pool="threads", concurrency=2)
    wait_for(lambda: q1 in queues_of(it_app, worker), 30, "consuming q1")
    consumed = queues_of(it_app, worker)
    assert (q1 + WAKE in consumed) == (strategy != "sorted"), consumed
    n = unique("o")
    it_app.fifo_hold.apply_async((n, 0, 1.0), queue=q1)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.05), queue=q1)
    events.wait(ev="retry", task=waiter.id)
    behind = q1 if order == "priority_added" else q2
    for k in range(BACKLOG):
        it_app.plain_step.apply_async((n, 100 + k, 0.05), queue=behind)
    assert waiter.get(timeout=60) == 1
    wait_for(lambda: len(events.where(ev="enter", res=n)) >= BACKLOG + 2, 60, "the backlog")
    entered = [e for e in events.all() if e.get("res") == n and e["ev"] == "enter"]
    (woken,) = [e for e in entered if e["k"] == 1]
    assert woken["via"] == (None if strategy == "sorted" else q1 + WAKE), woken
    assert entered[entered.index(woken) + 1 :], "the woken waiter ran after the whole backlog"


@pytest.mark.parametrize("named", [True, False], ids=["wake_queue_named", "negative_control"])
def test_celery_purge_empties_a_wake_queue_it_is_given(it_app, queue, named):
    """``celery purge`` empties the app's task queues only (a wake queue is not one): the
    docs (tasks.md) say to name the wake queues, ``-Q q,q.lease-wake``. A message waiting in
    each; the named ones are emptied. Negative control (``-Q q``): the wake stays."""
    broker = redis.Redis.from_url(os.environ["CL_BROKER"])
    n = unique("p")
    it_app.plain_step.apply_async((n, 0, 0.0), queue=queue)
    it_app.plain_step.apply_async((n, 1, 0.0), queue=wake_queue(queue + WAKE))
    assert (broker.llen(queue), broker.llen(queue + WAKE)) == (1, 1)
    names = f"{queue},{queue}{WAKE}" if named else queue
    purge = [sys.executable, "-m", "celery", "-A", "tests.integration.worker_app", "purge"]
    done = subprocess.run(
        [*purge, "-f", "-Q", names],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert broker.llen(queue) == 0
    assert broker.llen(queue + WAKE) == (0 if named else 1), done.stdout
