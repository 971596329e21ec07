"""A waiter's copies after one of them ran (real workers, issue 10, review of the failed-copy
check): the task's final state must be the state of the run that happened, and no copy runs
the body again.

A refused waiter has copies sharing its task id: the woken copy (published by the release) and
the back-stop copy (a countdown, re-sent at each refusal). The scenarios: a failed waiter's
back-stop copy refused while the next waiter holds the resource; a task id re-sent by its user
after it failed; another task id sharing the identity running between the copies; a SystemExit
in a prefork child; a worker killed between the release and Celery's FAILURE.
"""

from __future__ import annotations

import time
import uuid

import pytest
from celery import chord

from tests.conftest import unique
from tests.integration.harness import backend_meta
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]

SLACK = 30.0


@pytest.mark.parametrize(
    ("kind", "pool", "check"),
    [
        ("redis", "threads", "on"),
        ("postgres", "prefork", "on"),
        ("redis", "threads", "read-off"),
        ("redis", "threads", "off"),
    ],
)
def test_a_failed_waiters_refused_copy_does_not_store_retry_over_its_failure(
    it_app, start_worker, store_env, events, queue, coord, kind, pool, check
):
    """Holder, failing waiter F, second waiter S. F's woken copy fails (FAILURE stored), the
    release hands the resource to S; F's back-stop copy is refused while S holds it. That
    refusal must not store RETRY over F's FAILURE (backends protect only SUCCESS), and F's
    later copies end unrun: F's final state is its FAILURE, with its exception.
    ``read-off``: the back-stop copy's read of the backend (which ends it before its claim
    here) switched off: the refused copy alone must not store RETRY. Negative control
    (``off``: that read off too, and a refused copy re-queued with Retry as a message's first
    refusal is): the run's exception is lost (RETRY stored over it). Failed before: RETRY
    for ever (redis, sqlite, postgres).
    """
    env = {**store_env(kind), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    if check in ("read-off", "off"):
        env["CL_FINISHED_READ"] = "off"
    if check == "off":
        env["CL_REFUSED_COPY"] = "retry"
    start_worker(env, queue=queue, pool=pool, concurrency=4)
    n = unique("rf")
    go = events.key_for("go")
    holder = it_app.fifo_gate.apply_async((n, 0, go), queue=queue)  # holds until told
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_fail.apply_async((n, 1, 0.1), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    second = it_app.fifo_hold.apply_async((n, 2, 5.0), queue=queue)  # next in the wait list
    events.wait(ev="retry", task=second.id)
    coord.rpush(go, 1)
    assert holder.get(timeout=60) == 0
    assert second.get(timeout=60) == 2
    time.sleep(5)  # every copy of the waiter has come back by now
    meta = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = [(e["run"], e["woken"]) for e in events.where(ev="enter", res=n, k=1)]
    assert len(runs) == 1, runs
    if check == "off":
        # RETRY stored over the FAILURE; a later copy, dropped, stores a LeaseError FAILURE
        # (without that too: RETRY for ever): the run's exception is lost either way.
        assert str(meta["result"]) != "body run 1", meta
        return
    assert meta["status"] == "FAILURE", meta
    assert str(meta["result"]) == "body run 1", meta


@pytest.mark.parametrize("busy", [False, True])
def test_a_task_id_sent_again_after_its_failure_runs(
    it_app, start_worker, store_env, events, queue, busy
):
    """A user sends a task id that ran and failed again (a fresh message: retries 0). Sent
    while the resource is free it runs; sent while it is busy, it waits, and its copy (which
    counts its waits) must run too, not be taken for a copy of the earlier failed execution.
    """
    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    start_worker(env, queue=queue, pool="threads", concurrency=3)
    n = unique("rs")
    task_id = str(uuid.uuid4())
    it_app.fifo_fail.apply_async((n, 1, 0.05), queue=queue, task_id=task_id)
    wait_for(
        lambda: backend_meta(it_app.app, [task_id])[task_id]["status"] == "FAILURE",
        SLACK,
        "the first run's failure",
    )
    if busy:
        holder = it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)
        events.wait(ev="enter", res=n, k=0)
    it_app.fifo_fail.apply_async((n, 1, 0.05), queue=queue, task_id=task_id)  # sent again
    wait_for(lambda: len(events.where(ev="enter", res=n, k=1)) >= 2, SLACK, "the second run")
    if busy:
        assert holder.get(timeout=60) == 0
    time.sleep(4)  # its other copy has come back by now
    assert [e["run"] for e in events.where(ev="enter", res=n, k=1)] == [1, 2]
    meta = backend_meta(it_app.app, [task_id])[task_id]
    assert (meta["status"], str(meta["result"])) == ("FAILURE", "body run 2"), meta


@pytest.mark.parametrize(
    ("kind", "second", "check"),
    [
        ("redis", "fails", "on"),
        ("redis", "succeeds", "on"),
        ("redis", "fails", "off"),
    ],
)
def test_a_copy_after_another_task_id_sharing_the_identity_ran_does_not_run(
    it_app, start_worker, store_env, events, queue, kind, second, check
):
    """X and Y share an identity (an identity template). X waits; its woken copy runs and
    fails. Then Y runs (a new submission: allowed) and fails or succeeds. X's back-stop copy
    finds the identity's record naming Y's run: it must neither run X's body again (before:
    X ran twice, its FAILURE replaced) nor end with Y's recorded result (before: X flipped
    FAILURE -> SUCCESS and both its link_error and its link ran). Negative control (``off``:
    the back-stop copy's read of the result backend switched off): X runs twice.
    """
    env = {**store_env(kind), "CL_TTL": "2", "CL_BACKOFF_CAP": "3.0"}
    if check == "off":
        env["CL_FINISHED_READ"] = "off"
    start_worker(env, queue=queue, pool="threads", concurrency=4)
    n = unique("si")
    it_app.fifo_hold.apply_async((n, 0, 1.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    x = it_app.shared_maybe.apply_async(
        (n, "a", "X", 0.1, True),
        queue=queue,
        link=it_app.note_callback.s(label="X-link").set(queue=queue),
        link_error=it_app.note_callback.s(label="X-errback").set(queue=queue),
    )
    events.wait(ev="retry", task=x.id)
    events.wait(ev="enter", res=n, tag="X")  # X's woken copy (fails 0.1 s later)
    wait_for(
        lambda: backend_meta(it_app.app, [x.id])[x.id]["status"] == "FAILURE",
        SLACK,
        "X's failure",
    )
    y = it_app.shared_maybe.apply_async((n, "a", "Y", 0.05, second == "fails"), queue=queue)
    events.wait(ev="enter", res=n, tag="Y")
    time.sleep(6)  # X's back-stop copy (3 s after its refusal) has come back by now
    runs = [(e["tag"], e["run"]) for e in events.where(ev="enter", res=n) if "tag" in e]
    if check == "off":
        assert [r for r in runs if r[0] == "X"] == [("X", 1), ("X", 2)], runs
        return
    assert [r for r in runs if r[0] == "X"] == [("X", 1)], runs
    meta = backend_meta(it_app.app, [x.id, y.id])
    assert (meta[x.id]["status"], str(meta[x.id]["result"])) == ("FAILURE", "X body run 1")
    assert meta[y.id]["status"] == ("FAILURE" if second == "fails" else "SUCCESS"), meta
    callbacks = [e["label"] for e in events.where(ev="callback")]
    assert callbacks == ["X-errback"], callbacks


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_copy_after_a_systemexit_failure_does_not_run(
    it_app, start_worker, store_env, events, queue, check
):
    """A waiter's woken copy ends its body with SystemExit in a prefork child (Celery's
    defaults: acks early, no reject on worker lost): Celery stores FAILURE (WorkerLostError)
    and nothing redelivers. Its back-stop copy must not run the body again (before: 'run 2',
    SUCCESS over the FAILURE). Negative control (``off``: the back-stop copy's read of the
    result backend switched off): 'run 2'."""
    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    if check == "off":
        env["CL_FINISHED_READ"] = "off"
    start_worker(env, queue=queue, pool="prefork", concurrency=3)
    n = unique("se")
    it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    x = it_app.exit_once.apply_async((n, "X"), queue=queue)
    events.wait(ev="retry", task=x.id)
    events.wait(ev="enter", res=n, tag="X", timeout=SLACK)
    wait_for(
        lambda: backend_meta(it_app.app, [x.id])[x.id]["status"] == "FAILURE",
        SLACK,
        "the WorkerLostError failure",
    )
    time.sleep(5)  # the back-stop copy has come back by now
    runs = [e["run"] for e in events.where(ev="enter", res=n) if e.get("tag") == "X"]
    if check == "off":
        assert runs == [1, 2], runs
        return
    assert runs == [1], runs
    meta = backend_meta(it_app.app, [x.id])[x.id]
    assert meta["status"] == "FAILURE", meta
    assert type(meta["result"]).__name__ == "WorkerLostError", meta


def test_a_worker_killed_after_the_failed_release_leaves_a_failure(
    it_app, start_worker, store_env, events, queue, tmp_path
):
    """The woken copy of a waiter fails; its release records 'failed' and the pool process is
    killed before Celery stores the FAILURE (failpoint before_wake=kill). Its message comes
    back (acks late, reject on worker lost) as a hand-off copy, and so do its back-stops: they
    must not run the body again, and the task must end FAILURE (before: RETRY for ever)."""
    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    qa, qb = queue + "a", queue + "b"
    start_worker(env, queue=qa, pool="threads", concurrency=3)
    start_worker(
        {
            **env,
            "CELERY_LEASE_FAILPOINTS": "before_wake=kill",
            "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
            "CL_EARLY_WAKE": "0",  # (these failpoints stop a wake sent after the release)
        },
        queue=qb,
        pool="prefork",
        concurrency=2,
    )
    n = unique("cr")
    holder = it_app.fifo_hold.apply_async((n, 0, 1.5), queue=qa)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_fail.apply_async((n, 1, 0.1), queue=qb)
    events.wait(ev="retry", task=waiter.id)
    nxt = it_app.fifo_hold.apply_async((n, 2, 0.2), queue=qa)
    events.wait(ev="retry", task=nxt.id)
    assert holder.get(timeout=60) == 0
    wait_for(
        lambda: backend_meta(it_app.app, [waiter.id])[waiter.id]["status"] == "FAILURE",
        SLACK,
        "a FAILURE stored for the waiter",
    )
    time.sleep(3)
    assert [e["run"] for e in events.where(ev="enter", res=n, k=1)] == [1]
    meta = backend_meta(it_app.app, [waiter.id])[waiter.id]
    assert meta["status"] == "FAILURE", meta
    assert "already ran and failed" in str(meta["result"]), meta


@pytest.mark.parametrize(
    ("crash", "track_started"),
    [("kill", False), ("none", False), ("none-read-off", False), ("none", True)],
)
def test_a_chord_member_killed_after_the_failed_release_fails_its_chord(
    it_app, start_worker, store_env, events, queue, tmp_path, crash, track_started
):
    """A chord member waits (hand-off), its woken copy fails and the pool process is killed
    after the release recorded 'failed' and before Celery marked the failure (failpoint
    before_wake=kill). The copy dropped as a copy of the failed execution must mark it as
    Celery would: the chord fails (its callback FAILURE, not PENDING for ever) and the
    member's link_error runs, once (before: a FAILURE stored with store_result only, no chord
    part return, no errback). Controls (no kill): the run's own failure ran the errback, the
    dropped copies must not run it again, with task_track_started too (Celery stored STARTED
    over the FAILURE for the copy: the FAILURE is stored again, without errbacks), and with
    the back-stop copy's read before its claim switched off (``none-read-off``: the copy is
    dropped after its claim and finds the run's FAILURE)."""
    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    if crash == "none-read-off":
        env["CL_FINISHED_READ"] = "off"
    if track_started:
        env["CL_TRACK_STARTED"] = "1"
    qa, qb = queue + "a", queue + "b"
    start_worker(env, queue=qa, pool="threads", concurrency=3)
    failpoints = {
        "CELERY_LEASE_FAILPOINTS": "before_wake=kill" if crash == "kill" else "",
        "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
        "CL_EARLY_WAKE": "0",  # (these failpoints stop a wake sent after the release)
    }
    start_worker({**env, **failpoints}, queue=qb, pool="prefork", concurrency=2)
    n = unique("cc")
    holder = it_app.fifo_hold.apply_async((n, 0, 1.5), queue=qa)
    events.wait(ev="enter", res=n, k=0)
    member = it_app.fifo_fail.s(n, 1, 0.1).set(
        queue=qb, link_error=it_app.note_callback.s(label="member-err").set(queue=qa)
    )
    other = it_app.plain_step.s(n, 9, 0.0).set(queue=qa)
    body = it_app.note_callback.s(label="chord").set(queue=qa)
    result = chord([member, other])(body)
    member_id = result.parent.results[0].id
    events.wait(ev="retry", task=member_id)
    nxt = it_app.fifo_hold.apply_async((n, 2, 0.2), queue=qa)
    events.wait(ev="retry", task=nxt.id)
    assert holder.get(timeout=60) == 0
    wait_for(
        lambda: backend_meta(it_app.app, [result.id])[result.id]["status"] == "FAILURE",
        SLACK,
        "the chord's callback marked failed",
    )
    time.sleep(4)  # every copy of the member has come back by now
    assert [e["run"] for e in events.where(ev="enter", res=n, k=1)] == [1]
    assert [e["label"] for e in events.where(ev="callback")] == ["member-err"]
    meta = backend_meta(it_app.app, [member_id])[member_id]
    assert meta["status"] == "FAILURE", meta
    if crash == "kill" or track_started:
        assert "already ran and failed" in str(meta["result"]), meta
    else:
        assert str(meta["result"]) == "body run 1", meta


def test_without_a_result_backend_a_dropped_copy_logs_no_error(
    it_app, start_worker, store_env, events, queue
):
    """No result backend (Celery's DisabledBackend): a failed waiter's other copy is dropped
    unrun and quietly, with nothing to read or store (before: every dropped copy logged an
    ERROR with a traceback, "storing the failure failed", AttributeError from
    DisabledBackend)."""
    env = {**store_env("redis"), "CL_TTL": "1", "CL_BACKOFF_CAP": "1.0", "CL_NO_BACKEND": "1"}
    worker = start_worker(env, queue=queue, pool="threads", concurrency=4)
    n = unique("nb")
    it_app.fifo_hold.apply_async((n, 0, 1.5), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_fail.apply_async((n, 1, 0.1), queue=queue)

    def ended() -> list[str]:
        states = [e["state"] for e in events.where(ev="postrun", task=waiter.id)]
        return states[states.index("FAILURE") :] if "FAILURE" in states else []

    wait_for(lambda: "IGNORED" in ended(), SLACK, "the dropped copy")
    assert [e["run"] for e in events.where(ev="enter", res=n, k=1)] == [1]
    log = worker.log()
    assert "storing the failure failed" not in log
    assert "DisabledBackend" not in log
