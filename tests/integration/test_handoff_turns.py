"""The turn goes on when a woken waiter never claims (issue 27, item 1; invariant 16).

H holds ``fifo-<n>``; W1 then W2 wait. W1's woken copy is dropped by Celery without claiming:
revoked (``app.control.revoke``), expired (``expires=``), or failed by a ``before_start`` that
raises. The releaser's turn check wakes W2 once W1's grace is over: W2 runs about a grace
after H ends, not a ttl later from its back-stop copy. Negative control: with the turn checks
and passes switched off (``CL_PASS_THE_TURN=0``), W2 waits for its back-stop copy.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import unique
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 12.0
#: The back-stop copy of a waiter runs no sooner than the ttl after its refused claim.
ENV = {
    "CL_TTL": str(TTL),
    "CL_BACKOFF_BASE": "0.05",
    "CL_BACKOFF_CAP": "30",
    "CL_HANDOFF_GRACE": "1.0",
}
#: W2 starts within the grace (1 s), the turn check's slack and a loaded box's delays of H's
#: end; its back-stop copy would start it about a ttl (12 s) after its refused claim.
BOUND = 5.0


def _enter_after_exit(events, n, k, holder_k=0):
    exit_ = events.wait(ev="exit", res=n, k=holder_k, timeout=60)
    enter = events.wait(ev="enter", res=n, k=k, timeout=60)
    return enter["t"] - exit_["t"]


def _queue_up(it_app, task, events, queue, n, w1_options):
    holder = task.apply_async((n, 0, 2.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    w1 = task.apply_async((n, 1, 0.1), queue=queue, **w1_options)
    events.wait(ev="retry", task=w1.id)
    w2 = task.apply_async((n, 2, 0.1), queue=queue)
    events.wait(ev="retry", task=w2.id)
    return holder, w1, w2


@pytest.mark.parametrize("drop", ["revoked", "expired", "before_start"])
def test_a_dropped_head_passes_the_turn_within_its_grace(
    it_app, start_worker, store_env, events, queue, drop
):
    env = {**store_env("redis"), **ENV}
    start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("t")
    task = it_app.fifo_hold_refusing if drop == "before_start" else it_app.fifo_hold
    options = {"expires": 1.0} if drop == "expired" else {}  # (seconds from now)
    holder, w1, w2 = _queue_up(it_app, task, events, queue, n, options)
    if drop == "revoked":
        it_app.app.control.revoke(w1.id)
    gap = _enter_after_exit(events, n, 2)
    assert gap < BOUND, f"W2 started {gap:.1f}s after the holder ended (the back-stop: ~{TTL}s)"
    assert w2.get(timeout=30) == 2
    assert not events.where(ev="enter", res=n, k=1), "the dropped waiter ran"
    del holder


def test_negative_control_without_turn_checks_the_next_waiter_waits_for_its_back_stop(
    it_app, start_worker, store_env, events, queue
):
    env = {**store_env("redis"), **ENV, "CL_PASS_THE_TURN": "0"}
    start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("t")
    holder, w1, _w2 = _queue_up(it_app, it_app.fifo_hold, events, queue, n, {})
    it_app.app.control.revoke(w1.id)
    gap = _enter_after_exit(events, n, 2)
    assert gap > BOUND, f"W2 started {gap:.1f}s after the holder ended without turn checks"
    del holder


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_dead_holders_waiter_runs_within_a_pass(
    it_app, start_worker, store_env, events, queue, pool
):
    """The holder's whole worker is SIGKILLed mid-body: its lease runs out (ttl) and a pass
    over the wait lists by the other worker (every renew interval; in a prefork worker, by its
    pool processes) wakes the waiter, though its back-stop copy sits unacked in the dead
    worker (a visibility timeout of an hour)."""
    env = {**store_env("redis"), **ENV, "CL_TTL": "6"}
    doomed = start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("t")
    holder = it_app.fifo_hold.apply_async((n, 0, 60.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.1), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    killed = time.time()
    doomed.kill()
    start_worker(env, queue=queue, pool=pool, concurrency=2)
    enter = events.wait(ev="enter", res=n, k=1, timeout=60)
    # ttl 6 s; the renew interval (2 s) with its jitter; the hand-off grace (1 s); startup.
    assert enter["t"] - killed < 6 + 2.4 + 1 + 8, f"{enter['t'] - killed:.1f}s after the kill"
    wait_for(lambda: len(events.where(ev="exit", res=n, k=1)) == 1, 30, "the waiter to end")
    del holder
