"""Hand-off on release with real workers (issue 10): FIFO order, no overlap, the back-stop.

Waiters are made to arrive one at a time: each is sent only once the one before was refused
(its RETRY is reported), so the arrival order is known. With the hand-off (on by default),
bodies run in that order; without it (``lease_handoff=False``, or ``identity=False``: the
back-off alone, the negative controls) later arrivals overtake earlier ones. A releaser
SIGKILLed after its release and before it sends the head waiter's message (failpoint
``before_wake``) leaves the waiter to its back-stop copy: it still runs, exactly once. A burst
past the wait list's cap, with a grace woken copies often miss, never waits for a back-stop.
"""

from __future__ import annotations

import pytest

from tests.conftest import unique
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAITERS = 5
ENV = {"CL_TTL": "2.0", "CL_BACKOFF_BASE": "0.05", "CL_BACKOFF_CAP": "3.0"}  # hand-off: default


def _queue_up(task, events, queue, n, first_hold=1.5, hold=0.2):
    """Send a holder, then WAITERS tasks, each once the one before was refused."""
    results = [task.apply_async((n, 0, first_hold), queue=queue)]
    events.wait(ev="enter", res=n, k=0)
    for k in range(1, WAITERS + 1):
        results.append(task.apply_async((n, k, hold), queue=queue))
        events.wait(ev="retry", task=results[-1].id)
    return results


def _order(events, n, results):
    wait_for(lambda: all(r.state == "SUCCESS" for r in results), 90, "every task to succeed")
    mine = [e for e in events.all() if e.get("res") == n and e["ev"] in ("enter", "exit")]
    inside, overlaps = 0, 0
    for e in mine:
        inside += 1 if e["ev"] == "enter" else -1
        overlaps += inside > 1
    return [e["k"] for e in mine if e["ev"] == "enter"], overlaps


#: The stores the FIFO test and its negative control run on (the other tests: Redis only, as
#: they test the task's side, which is the same on every store; CI time is short).
STORES = ["redis", pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"]


@pytest.mark.parametrize("kind", STORES)
def test_waiters_run_in_arrival_order_without_overlap(
    it_app, start_worker, store_env, events, queue, kind
):
    """On every store: the wait list, not the back-off, decides the order."""
    env = {**store_env(kind), **ENV}
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("f")
    results = _queue_up(it_app.fifo_hold, events, queue, n)
    order, overlaps = _order(events, n, results)
    assert overlaps == 0
    assert order == list(range(WAITERS + 1)), f"bodies ran in the order {order}"
    assert [r.get(timeout=5) for r in results] == list(range(WAITERS + 1))
    store = worker_store(env)
    try:
        assert store.waiters(f"fifo-{n}") == []  # every waiter left the list when it ran
    finally:
        store.close()


@pytest.mark.parametrize(
    ("kind", "off"),
    [
        ("redis", "lease_handoff=False"),
        ("redis", "identity=False"),
        # (one SQL store: the back-off is the same code on both, and CI time is short)
        pytest.param("postgres", "lease_handoff=False", marks=pytest.mark.postgres),
    ],
)
def test_negative_control_with_the_back_off_alone_later_arrivals_overtake(
    it_app, start_worker, store_env, events, queue, kind, off
):
    """The off switch, or no identity without its polling place (CL_POLLING=0, as before issue
    32): no wait list; the jittered back-off lets later arrivals in first. (With its polling
    place, a task without identity keeps its turn: tests/integration/test_handoff_line.py.)"""
    env = {**store_env(kind), **ENV}
    if off == "lease_handoff=False":
        env["CL_HANDOFF"] = "0"
    else:
        env["CL_POLLING"] = "0"
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=3)
    task = it_app.fifo_hold if off == "lease_handoff=False" else it_app.fifo_hold_backoff
    orders = []
    for _ in range(3):  # (a jittered back-off keeps the order by chance now and then)
        n = unique("f")
        order, overlaps = _order(events, n, _queue_up(task, events, queue, n))
        assert overlaps == 0
        orders.append(order)
        if order != list(range(WAITERS + 1)):
            break
    assert orders[-1] != list(range(WAITERS + 1)), f"the back-off alone kept FIFO order: {orders}"


def test_a_waiter_still_runs_once_when_its_releaser_dies_before_waking_it(
    it_app, start_worker, store_env, events, queue, tmp_path
):
    """SIGKILL between release and wake: the waiter's back-stop copy runs it, exactly once.

    The killed worker had reserved the back-stop copy (a countdown message): a short
    visibility timeout lets the broker hand it to the other worker.
    """
    env = {**store_env("redis"), **ENV, "CL_VISIBILITY": "4"}
    killer = {
        **env,
        "CELERY_LEASE_FAILPOINTS": "before_wake=kill",
        "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
        "CL_EARLY_WAKE": "0",  # (these failpoints stop a wake sent after the release)
    }
    start_worker(killer, queue=queue, pool="threads", concurrency=2)
    n = unique("f")
    holder = it_app.fifo_hold.apply_async((n, 0, 1.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.1), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    events.wait(ev="exit", res=n, k=0)  # the holder releases, then its worker is killed
    start_worker(env, queue=queue, pool="threads", concurrency=2)  # picks up the back-stop
    assert waiter.get(timeout=60) == 1
    wait_for((tmp_path / "once.before_wake").exists, 5, "the failpoint to fire")
    entered = [e for e in events.where(ev="enter", res=n) if e["k"] == 1]
    assert len(entered) == 1, f"the waiter's body ran {len(entered)} times"
    del holder


BURST = 24
#: A 0.05 s grace (woken copies often miss it, and back-off claims then beat them to the free
#: resource), a wait list of 4 (the other 20 tasks poll with the back-off), and back-stop copies
#: 60 s after each refused claim (no sooner than the ttl).
BURST_ENV = {
    "CL_TTL": "60",
    "CL_BACKOFF_BASE": "0.05",
    "CL_BACKOFF_CAP": "60",
    "CL_WAIT_CAP": "4",
    "CL_HANDOFF_GRACE": "0.05",
}
#: Well below the 60 s a task left to its back-stop copy needs (24 x 0.05 s of bodies).
BURST_DEADLINE = 30.0


@pytest.mark.parametrize("kind", ["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_burst_past_the_cap_with_a_short_grace_never_waits_for_the_back_stop(
    it_app, start_worker, store_env, events, queue, kind
):
    """24 tasks at once on one resource: every one runs, once, long before a back-stop copy
    could run it. Before (issue 10): a woken waiter beaten to the resource, or too late for
    its grace, stayed marked woken, no release woke it again, and it ran only from its
    back-stop copy 60 s later (seen: this test timed out)."""
    env = {**store_env(kind), **BURST_ENV}
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=4)
    n = unique("b")
    results = [it_app.fifo_hold.apply_async((n, k, 0.05), queue=queue) for k in range(BURST)]
    wait_for(
        lambda: len(events.where(ev="exit", res=n)) >= BURST,
        BURST_DEADLINE,
        f"all {BURST} tasks of the burst to run",
    )
    order, overlaps = _order(events, n, results)
    assert overlaps == 0
    assert sorted(order) == list(range(BURST)), f"bodies ran {order}"
