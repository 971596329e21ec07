"""Hand-off edge cases with real workers (issue 10): the store forgets the wait list, and the
wait list is full.

A store restarted without persistence loses the holder's lease and the whole wait list: no
release will ever wake the waiters. Their back-stop copies (each refused claim of a listed
waiter is re-sent with a countdown of ``min(lease_busy_backoff_cap, max(backoff, lease_ttl))``)
must still run every task, exactly once. A wait list at its cap turns the claims beyond it to
the back-off: they must still run, exactly once, and their refusals say they were not listed.
Body runs are counted from the coordination Redis (the session server), which the restarted
store server does not touch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import missing, unique
from tests.integration.harness import backend_meta, wait_success, worker_store
from tests.tooling.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]

TTL = 1.0
BACKOFF_CAP = 2.0
#: The longest countdown of a listed waiter's back-stop copy: min(cap, max(backoff, ttl)).
BACKSTOP = min(BACKOFF_CAP, max(TTL, 0.05))
HOLD = 0.1
#: Margin for a loaded 2-core CI box (worker scheduling, countdown messages' ETA polling).
SLACK = 20.0


@pytest.fixture
def private_redis(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, without AOF or RDB: a restart forgets everything."""
    try:
        server = RedisServer(tmp_path / "store", appendonly=False)
    except FileNotFoundError as exc:
        missing(str(exc))
    server.start()
    yield server
    server.close()


def _completed(events: Any, n: str) -> Counter[int]:
    """How many times each task's body ran to its end (its exit report)."""
    return Counter(e["k"] for e in events.where(ev="exit", res=n))


TASKS = 8


@pytest.mark.parametrize("backstop", ["on", "off"])
def test_a_store_restart_without_persistence_loses_no_waiting_task(
    it_app, start_worker, events, queue, private_redis, backstop
):
    """The wait list and the lease vanish: every task still runs its body once, via back-stops.

    Bound: a listed waiter's back-stop copy comes at most BACKSTOP (2 s: the backoff cap) after
    its refused claim; then the tasks queue again in the new list and run HOLD each. Negative
    control (``off``: the back-stop copy comes 10 minutes later; no setting does this, the
    worker app patches it): no waiter runs, the restart lost them all.
    """
    env = {
        "CL_STORE": private_redis.url,
        "CL_PREFIX": f"{unique('rs')}:",
        "CL_TTL": str(TTL),
        "CL_BACKOFF_BASE": "0.05",
        "CL_BACKOFF_CAP": str(BACKOFF_CAP),
        "CL_BACKSTOP": backstop,
    }
    for _ in range(2):
        start_worker(env, queue=queue, pool="threads", concurrency=4)
    n = unique("r")
    holder = it_app.fifo_hold.apply_async((n, 0, 3.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiters = [it_app.fifo_hold.apply_async((n, k, HOLD), queue=queue) for k in range(1, TASKS)]
    store = worker_store(env)
    try:
        wait_for(
            lambda: len(store.waiters(f"fifo-{n}")) == TASKS - 1,
            SLACK,
            f"all {TASKS - 1} waiters to be listed",
        )
        private_redis.restart()  # SIGKILL; started again empty
        assert store.waiters(f"fifo-{n}") == []
        assert store.get(f"fifo-{n}") is None  # the holder's lease is gone too
    finally:
        store.close()
    ids = [r.id for r in (holder, *waiters)]
    del holder, waiters  # (an AsyncResult left to the end of the session warns as it goes)
    if backstop == "off":
        # The holder still ends (its lost lease is retried at once); past every back-stop
        # bound after it, no waiter has run: nothing else would ever run them.
        wait_success(it_app.app, ids[:1], TTL + 3.0 + SLACK)
        deadline = BACKSTOP + TTL + 2.0
        with pytest.raises(TimeoutError):
            wait_success(it_app.app, ids[1:], deadline)
        assert _completed(events, n) == Counter([0]), _completed(events, n)
        return
    deadline = BACKSTOP + TTL + TASKS * (HOLD + BACKSTOP) + SLACK
    metas = wait_success(it_app.app, ids, deadline)
    assert [metas[i]["result"] for i in ids] == list(range(TASKS))
    # The holder lost its lease with the store: it may have been interrupted and run again.
    # Every body ran to its end exactly once.
    assert _completed(events, n) == Counter(range(TASKS)), _completed(events, n)


CAP = 2
OVER = 3


def test_a_full_wait_list_gives_the_claims_beyond_it_polling_places_and_loses_none(
    it_app, start_worker, events, queue, private_redis
):
    """Wait list cap 2, five waiters: the first two are listed with their messages, the other
    three get polling places (invariant 12), are told the list had no room for their message,
    and run from their places in arrival order; every body runs exactly once. Before (issue
    32, item 2): those three were refused unlisted and listed later arrivals overtook them."""
    env = {
        "CL_STORE": private_redis.url,
        "CL_PREFIX": f"{unique('cap')}:",
        "CL_TTL": str(TTL),
        "CL_BACKOFF_BASE": "0.05",
        "CL_BACKOFF_CAP": str(BACKOFF_CAP),
        "CL_WAIT_CAP": str(CAP),
    }
    start_worker(env, queue=queue, pool="threads", concurrency=CAP + OVER + 1)
    n = unique("c")
    sent = [it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)]
    events.wait(ev="enter", res=n, k=0)
    refusals = []
    for k in range(1, CAP + OVER + 1):  # one at a time: the list's order is the sending order
        sent.append(it_app.fifo_hold.apply_async((n, k, HOLD), queue=queue))
        refusals.append(events.wait(ev="retry", task=sent[-1].id))
    ids = [r.id for r in sent]
    del sent
    assert [r["position"] for r in refusals] == list(range(1, CAP + OVER + 1)), refusals
    # The refusals beyond the cap say why they poll (no log line or metric told a full list
    # from no list before).
    full = "its wait list had no room for its message (wait_cap "
    assert [full in r["message"] for r in refusals] == [False] * CAP + [True] * OVER, [
        r["message"] for r in refusals
    ]
    deadline = TTL + (CAP + OVER + 1) * (HOLD + BACKSTOP) + SLACK
    metas = wait_success(it_app.app, ids, deadline)
    assert [metas[i]["result"] for i in ids] == list(range(CAP + OVER + 1))
    assert _completed(events, n) == Counter(range(CAP + OVER + 1)), _completed(events, n)
    entered = [e["k"] for e in events.all() if e.get("res") == n and e["ev"] == "enter"]
    assert entered == list(range(CAP + OVER + 1)), f"bodies ran {entered}"


def test_a_back_stop_copy_of_a_retried_attempt_does_not_run_it_again(
    it_app, start_worker, store_env, events, queue
):
    """A refused waiter's back-stop copies (every ~0.3 s, the back-off cap) outlive its woken
    copy, which runs attempt 0 and calls self.retry(countdown=3): the next back-stop copy of
    attempt 0 finds the resource free and must end unrun; attempt 1 runs once.
    Failed before: attempt 0's body ran again (entries [0, 0, ..., 1])."""
    n = unique("rb")
    start_worker({**store_env("redis"), "CL_TTL": "2"}, queue=queue)
    holder = it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)
    wait_for(lambda: events.where(ev="enter", res=n, k=0), 30, "the holder to enter")
    waiter = it_app.fifo_retry_once.apply_async((n, 1, 3.0), queue=queue)
    assert waiter.get(timeout=60) == 1 and holder.get(timeout=60) == 0
    # (every copy of attempt 0 queued before the retry has come back by now: 0.3 s apart)
    runs = [e["retries"] for e in events.where(ev="enter", res=n, k=1)]
    assert runs == [0, 1]


@pytest.mark.parametrize(
    ("first", "check"),
    [("woken", "on"), ("back-stop", "on"), ("woken", "off"), ("woken", "track_started")],
)
def test_a_copy_of_a_failed_execution_does_not_run_it_again(
    it_app, start_worker, store_env, events, queue, tmp_path, first, check
):
    """A refused waiter has two copies: its woken copy and its back-stop copy (a countdown,
    1 s after each refused claim here: the back-off cap). Whichever claims first runs the body
    and fails with an ordinary exception; the other must end unrun (IGNORED), leaving the
    FAILURE of the run that happened, with its exception.

    ``woken``: the holder releases 1.5 s in and wakes the waiter at once; its next back-stop
    copy comes ~0.5 s after the woken copy failed. ``back-stop``: the holder's worker sleeps
    2.5 s between its release and the wake (failpoint ``before_wake``), so the back-stop copy
    claims the free resource first and the woken copy comes after its failure. Negative
    control (``off``: the check patched out in the worker): the back-stop copy runs the body
    again and its FAILURE is stored over the first. ``track_started``: Celery stores STARTED
    over the FAILURE before the dropped copy's claim; a FAILURE naming the earlier failure is
    stored again (before: STARTED for ever).
    Failed before: the body ran twice (runs 1 and 2; the second FAILURE stored over the first).
    """
    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    if check == "off":  # (and the back-stop's read of the result backend, which sees it too)
        env["CL_FAILED_COPY"] = "run"
        env["CL_FINISHED_READ"] = "off"
    if check == "track_started":
        env["CL_TRACK_STARTED"] = "1"
    if first == "back-stop":
        env["CELERY_LEASE_FAILPOINTS"] = "before_wake=sleep:2.5"
        env["CELERY_LEASE_FAILPOINTS_ONCE"] = str(tmp_path / "once")
        env["CL_EARLY_WAKE"] = "0"  # (the failpoint stops a wake sent after the release)
    start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("fc")
    holder = it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_fail.apply_async((n, 1, 0.1), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    assert holder.get(timeout=60) == 0

    def ended() -> list[str]:
        """How the copies ended from the first run's end on (a copy refused before it while
        the run held the resource was re-queued: RETRY, or IGNORED after a first wait)."""
        states = [e["state"] for e in events.where(ev="postrun", task=waiter.id)]
        after = states[states.index("FAILURE") :] if "FAILURE" in states else []
        return [s for s in after if s != "RETRY"]

    # Both copies end: the one that ran, and the other (a second run before the fix).
    wait_for(lambda: len(ended()) >= 2, SLACK, "both copies to end")
    entered = events.where(ev="enter", res=n, k=1)
    meta = backend_meta(it_app.app, [waiter.id])[waiter.id]
    if check == "off":
        assert [(e["run"], e["woken"]) for e in entered] == [(1, True), (2, False)], entered
        assert ended()[:2] == ["FAILURE", "FAILURE"], ended()
        assert str(meta["result"]) == "body run 2", meta
        return
    assert [(e["run"], e["woken"]) for e in entered] == [(1, first == "woken")], entered
    assert ended()[:2] == ["FAILURE", "IGNORED"], ended()
    assert meta["status"] == "FAILURE", meta
    if check == "track_started":
        assert type(meta["result"]).__name__ == "LeaseError", meta
        assert "already ran and failed" in str(meta["result"]), meta
        return
    assert (type(meta["result"]), str(meta["result"])) == (ValueError, "body run 1"), meta


@pytest.mark.parametrize(("check", "pause"), [("on", 0), ("on", 3), ("off", 0)])
def test_a_late_woken_copy_of_a_succeeded_waiter_does_not_run_its_success_path_again(
    it_app, start_worker, store_env, events, queue, tmp_path, check, pause
):
    """The holder's worker sleeps 2.5 s between its release and the wake (failpoint
    ``before_wake``), so the waiter's back-stop copy (a countdown of 1 s, the back-off cap)
    claims the free resource first, runs the body and succeeds, and its ``link`` runs. The
    woken copy comes after: its claim finds the identity done; it must end unrun, not end
    SUCCESS again (which runs ``link`` a second time, and a chain's next step). ``pause``:
    the copy that ran also sleeps 3 s between its release and Celery storing its SUCCESS
    (failpoint ``after_ledger_before_ack``; Celery sends link before it stores), so the woken
    copy reads RETRY and must look again later (review 1). Negative control (``off``: the
    result backend read patched out in the worker): ``link`` runs twice.
    Failed before: callbacks ["link", "link"] with the body run once (with the pause, also
    after the first fix)."""
    failpoints = "before_wake=sleep:2.5"
    if pause:
        failpoints += f",after_ledger_before_ack=sleep:{pause}"
    env = {
        **store_env("redis"),
        "CL_TTL": "2",
        "CL_BACKOFF_CAP": "1.0",
        "CELERY_LEASE_FAILPOINTS": failpoints,
        "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
        "CL_EARLY_WAKE": "0",  # (these failpoints stop a wake sent after the release)
    }
    if check == "off":
        env["CL_FINISHED_READ"] = "off"
    worker = start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("ld")
    holder = it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async(
        (n, 1, 0.1), queue=queue, link=it_app.note_callback.si(label="link").set(queue=queue)
    )
    events.wait(ev="retry", task=waiter.id)
    assert holder.get(timeout=60) == 0
    assert waiter.get(timeout=60) == 1

    def callbacks() -> list[str]:
        return [e["label"] for e in events.where(ev="callback")]

    if check == "off":
        wait_for(lambda: len(callbacks()) >= 2, SLACK, "the second link")
        assert callbacks() == ["link", "link"]
        assert len(events.where(ev="enter", res=n, k=1)) == 1
        return
    wait_for(callbacks, SLACK, "the run's link")
    dropped = "dropped a copy of a finished task"
    # (the copy decides before it ends: a second link would only be sent as it returned)
    wait_for(lambda: dropped in worker.log(), SLACK, "the woken copy to end unrun")
    assert callbacks() == ["link"]
    assert len(events.where(ev="enter", res=n, k=1)) == 1
    assert backend_meta(it_app.app, [waiter.id])[waiter.id]["status"] == "SUCCESS"
