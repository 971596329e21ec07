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
from tests.integration.harness import worker_store
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


#: The renew interval (ttl / 3, +-20 %) far from every bound below: a pass over the wait lists
#: (the first 16-24 s after a worker starts) and a back-stop copy (60 s) come too late to pass
#: for a turn check. What passes the turn on within the bound is the turn check alone.
NO_PASS = {**ENV, "CL_TTL": "60"}


def _held_with_waiters(it_app, events, queue, n, *waiters):
    """The holder (k=0) holds ``fifo-<n>`` until the test lets it go; each waiter task of
    ``waiters`` (k=1, 2, ...) is refused and listed. Returns the holder's go key and the
    waiters' results."""
    go = f"go-{n}"
    holder = it_app.fifo_gate.apply_async((n, 0, go), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    results = []
    for k, task in enumerate(waiters, 1):
        results.append(task.apply_async((n, k, 0.1), queue=queue))
        events.wait(ev="retry", task=results[-1].id)
    del holder
    return go, results


def _revoke(it_app, result):
    """Revoke a task and wait until the worker says it will drop it."""
    replies = it_app.app.control.revoke(result.id, reply=True, timeout=10, limit=1)
    assert replies, "no worker acknowledged the revoke"


def _let_go(coord, events, go, n):
    """Let the holder end; when it ended (its exit report)."""
    coord.rpush(go, 1)
    return events.wait(ev="exit", res=n, k=0, timeout=60)["t"]


def _enter_within(events, n, k, since, bound):
    """Wait up to ``bound`` seconds after ``since`` for waiter ``k`` to enter; its delay, or
    None when it did not (the wait is bounded: a control does not sit out a ttl)."""
    try:
        enter = events.wait(ev="enter", res=n, k=k, timeout=max(0.1, since + bound - time.time()))
    except TimeoutError:
        return None
    return enter["t"] - since


#: W2 of the recycled-pool test below: the grace (2 s), the turn check's slack and, with the
#: check kept in the exiting pool process, that process's exit and its replacement's start
#: before W2 has a slot (2.1-2.2 s on an idle box; over 5 s seen on a loaded CI box). A pass
#: (16-24 s after start) or the back-stop (ttl 60 s) would be far later.
RECYCLED_BOUND = 9.0


@pytest.mark.parametrize("exit_turns", ["handed", "kept", "off"])
def test_a_dropped_head_passes_on_though_the_releasing_pool_process_exits(
    it_app, start_worker, store_env, events, coord, queue, exit_turns
):
    """Prefork, two pool processes recycled after each task (``--max-tasks-per-child=1``),
    grace 2 s: H holds; W1 (revoked), W2 and W3 wait; then a plain task takes the other pool
    slot for the rest of the test. The pool process that released H exits right after it,
    the turn check of W1's wake pending: it hands the check to the worker's main process,
    which wakes W2 once W1's grace is over. ``kept`` (``CL_HAND_OVER=0``): each pool process
    runs its own checks before it exits: W2 is on time too (how soon W3 follows either way is
    printed, not asserted: speed). Negative control ``off`` (``CL_EXIT_TURNS=0``): the check
    dies with the process; nobody wakes W2. Before: W2 started 9-12 s after the holder ended
    (ttl 30), or at its back-stop."""
    grace = 2.0
    env = {**store_env("redis"), **NO_PASS, "CL_HANDOFF_GRACE": str(grace)}
    env.update({"kept": {"CL_HAND_OVER": "0"}, "off": {"CL_EXIT_TURNS": "0"}}.get(exit_turns, {}))
    start_worker(
        env, queue=queue, pool="prefork", concurrency=2, extra_args=("--max-tasks-per-child=1",)
    )
    n = unique("t")
    go, (w1, w2, _) = _held_with_waiters(it_app, events, queue, n, *[it_app.fifo_hold] * 3)
    # (one pool slot left for the waiters: the other runs this until the test is over)
    it_app.plain_step.apply_async((f"busy-{n}", 0, 12.0), queue=queue)
    events.wait(ev="enter", res=f"busy-{n}", k=0)
    _revoke(it_app, w1)
    ended = _let_go(coord, events, go, n)
    if exit_turns == "off":
        # (from the release as the store saw it, and W2 alone: a rehearsal's loaded box
        # released more than 1.5 s after the holder's exit report, so W1's own wake was still
        # within its grace when the control looked)
        released = _released_at(env, n)
        woken = _woken_at(env, n, released + grace + 1.5)
        assert w2.id not in woken and not events.where(ev="enter", res=n, k=2), woken
        return
    gap = _enter_within(events, n, 2, ended, RECYCLED_BOUND)
    assert gap is not None, f"W2 did not start within {RECYCLED_BOUND}s of the holder's end"
    w2_ended = events.wait(ev="exit", res=n, k=2, timeout=30)["t"]
    w3_gap = events.wait(ev="enter", res=n, k=3, timeout=30)["t"] - w2_ended
    # (how soon W3 follows, handed over or kept, is speed, not safety: printed, not asserted;
    # a loaded box took 2.8-5 s either way)
    print(f"{exit_turns}: W2 {gap:.2f}s after the holder, W3 {w3_gap:.2f}s after W2")
    assert not events.where(ev="enter", res=n, k=1), "the dropped waiter ran"


def _released_at(env, n):
    """When the lease on ``fifo-<n>`` was seen gone from the store (wall clock; polls)."""
    store = worker_store(env)
    try:
        wait_for(lambda: store.get(f"fifo-{n}") is None, 30, "the holder's release")
        return time.time()
    finally:
        store.close()


def _woken_at(env, n, when):
    """The waiters of ``fifo-<n>`` woken at ``when`` (wall clock; waits until then)."""
    time.sleep(max(0.0, when - time.time()))
    store = worker_store(env)
    try:
        return [w.identity for w in store.waiters(f"fifo-{n}") if w.woken]
    finally:
        store.close()


@pytest.mark.parametrize("due", ["hold", "grace"])
def test_a_dropped_polling_head_passes_the_turn_when_its_hold_ends(
    it_app, start_worker, store_env, events, coord, queue, due
):
    """P (``identity=False``: a polling place) waits ahead of W2 and is revoked. H's release
    gives P its turn, held two graces (it polls once a grace). The turn check runs when that
    hold ends and wakes W2. Negative control (``CL_POLL_TURN_GRACES=1``: the check one grace
    after the wake, as before): it finds P's hold still in flight and nothing checks again;
    nobody wakes W2 (a pass would, 16-24 s later). Before: W2 started 3.9-6.4 s (ttl 30) or
    16-17 s (ttl 60) late."""
    env = {**store_env("redis"), **NO_PASS}
    if due == "grace":
        env["CL_POLL_TURN_GRACES"] = "1"
    start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("t")
    waiters = (it_app.fifo_hold_backoff, it_app.fifo_hold)
    go, (polling, _w2) = _held_with_waiters(it_app, events, queue, n, *waiters)
    _revoke(it_app, polling)
    ended = _let_go(coord, events, go, n)
    if due == "grace":  # (the hold ended 2 s after the wake: a check would have run by 3.5 s)
        woken = _woken_at(env, n, ended + 2.0 + 1.5)
        assert not woken and not events.where(ev="enter", res=n, k=2), woken
        return
    gap = _enter_within(events, n, 2, ended, BOUND)  # (two graces of 1 s, the slack, W2's trip)
    assert gap is not None, f"W2 did not start within {BOUND}s of the holder's end"
    assert not events.where(ev="enter", res=n, k=1), "the revoked polling waiter ran"
