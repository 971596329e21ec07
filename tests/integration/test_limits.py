"""Limits with real prefork workers: the runtime cap and the busy-wait budget.

* ``capped`` (max_runtime=2, lost_max_retries=0) renews forever; the renewer must take its
  lease away at the cap (within one renew interval), interrupt it, and the task must end FAILURE
  with LeaseLostError(reason="max_runtime"); the next waiter gets the resource by cap + ttl.
* ``no_retries`` (max_retries=0) waits for a resource the test holds for ~2 s: busy waits are
  re-queued on their own budget, so it still ends SUCCESS once the test releases.
* ``user_retry`` calls ``self.retry()``: the lease goes with the retry, so the re-run claims at
  once with a newer fence instead of waiting on its own lock (celery-once PR #37); the negative
  control defeats the release and sees the re-run wait.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_lease import LeaseBusyError, LeaseLostError, Owner
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 1.0
RENEW_INTERVAL = TTL / 3
MAX_RUNTIME = 2.0  # capped's max_runtime
HOLD = 2.0  # how long the test keeps no_retries' resource busy


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_runtime_cap_takes_the_lease_and_fails_the_task(
    it_app, start_worker, store_env, events, queue, kind
):
    """A body that would run forever loses its lease at max_runtime and ends FAILURE."""
    env = {**store_env(kind), "CL_TTL": str(TTL)}
    start_worker(env, queue=queue)
    store = worker_store(env)
    waiter = Owner.new("next-waiter")
    result = it_app.capped.apply_async((0,), queue=queue)
    start = events.wait(ev="start", res=0)
    acquired_at = None
    try:
        while acquired_at is None:  # the next waiter polls for the resource
            assert time.time() < start["t"] + MAX_RUNTIME + 10 * TTL, "never released"
            try:
                lease = store.acquire("capped-0", waiter, TTL)
            except LeaseBusyError:
                time.sleep(0.02)
            else:
                acquired_at = time.time()
                store.release(lease)
        wait_for(lambda: result.state == "FAILURE", 30, "the capped task to fail")
    finally:
        store.close()
    stop = events.wait(ev="interrupted", res=0)
    held = stop["t"] - start["t"]
    print(
        f"store={kind}: interrupted {held:.3f}s after start (cap {MAX_RUNTIME}s); next waiter "
        f"acquired {acquired_at - start['t']:.3f}s after start"
    )
    assert stop["reason"] == "max_runtime"
    assert abs(held - MAX_RUNTIME) <= RENEW_INTERVAL
    # The lease stayed renewed up to the cap (not lost early), then was freed promptly.
    assert MAX_RUNTIME - RENEW_INTERVAL <= acquired_at - start["t"] <= MAX_RUNTIME + TTL
    exc = result.result
    assert isinstance(exc, LeaseLostError), repr(exc)
    assert exc.reason == "max_runtime"
    assert exc.fence == start["fence"]
    failure = events.wait(ev="failure", task=start["task"])
    assert (failure["exc"], failure["reason"]) == ("LeaseLostError", "max_runtime")
    assert not events.where(ev="retry")  # lost_max_retries=0: no re-run
    assert len(events.where(ev="start", res=0)) == 1


def busy_waits(events: Any, task_id: str) -> list[dict[str, Any]]:
    """A task's busy waits: its retries and its copies re-queued unretried."""
    return events.where(ev="retry", task=task_id) + events.where(ev="requeued", task=task_id)


def test_busy_waits_do_not_use_the_retry_budget(it_app, start_worker, store_env, events, queue):
    """max_retries=0, resource busy for ~2 s: several busy waits, then SUCCESS."""
    env = {**store_env("redis"), "CL_TTL": str(TTL)}
    start_worker(env, queue=queue)
    store = worker_store(env)
    holder = store.acquire("busy-0", Owner.new("test-holder"), 5.0)
    try:
        result = it_app.no_retries.apply_async((0,), queue=queue)
        held_since = time.monotonic()
        # (the first busy wait is a retry; a copy that waited already and is refused again is
        # re-queued and ends IGNORED, so the state stays RETRY: "requeued")
        wait_for(
            lambda: len(busy_waits(events, result.id)) >= 2,
            30,
            "two busy waits",
        )
        assert result.state == "RETRY"
        wait_for(lambda: time.monotonic() - held_since >= HOLD, 10, "the hold to last")
        assert store.release(holder)
        fence = result.get(timeout=30)
    finally:
        store.close()
    retries = busy_waits(events, result.id)
    print(f"{len(retries)} busy waits while held, then fence {fence} > {holder.fence}")
    assert result.state == "SUCCESS"
    assert fence > holder.fence
    assert {e["exc"] for e in retries} == {"LeaseBusyError"}
    assert len(retries) > 1  # more re-queues than max_retries=0 would ever allow
    assert not events.where(ev="failure")


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_a_user_retry_frees_the_resource_for_its_own_next_run(
    it_app, start_worker, store_env, events, queue, kind
):
    """self.retry() inside the body: released with the retry, re-run at once, newer fence."""
    env = {**store_env(kind), "CL_TTL": "3"}
    start_worker(env, queue=queue)
    result = it_app.user_retry.apply_async((0,), queue=queue)
    fence = result.get(timeout=30)
    store = worker_store(env)
    try:
        assert store.get("uretry-0") is None  # nothing left behind
    finally:
        store.close()
    starts = events.where(ev="start", res=0, task=result.id)
    retries = events.where(ev="retry", task=result.id)
    print(f"store={kind}: runs {[(e['retries'], e['fence']) for e in starts]}, retries {retries}")
    assert [e["retries"] for e in starts] == [0, 1]
    assert fence == starts[1]["fence"] > starts[0]["fence"]
    # The earlier attempt ended without completing: the re-run knows (and may reconcile).
    assert starts[1]["previous_fence"] == starts[0]["fence"]
    assert [e["exc"] for e in retries] == ["Retry"]  # the user's own; no busy wait on itself
    assert not events.where(ev="failure")


def test_negative_control_a_lease_left_behind_on_retry_is_caught(
    it_app, start_worker, store_env, events, queue
):
    """With the release defeated, the same checks see the re-run wait on its own lease."""
    env = {**store_env("redis"), "CL_TTL": "1"}
    start_worker(env, queue=queue)
    result = it_app.user_retry.apply_async((1,), {"leak": True}, queue=queue)
    result.get(timeout=30)  # completes once the leaked lease expires
    retries = events.where(ev="retry", task=result.id)
    assert "LeaseBusyError" in [e["exc"] for e in retries], retries
    with pytest.raises(AssertionError):
        assert [e["exc"] for e in retries] == ["Retry"]


def test_worker_command_line_options_set_the_lease_defaults(
    it_app, start_worker, store_env, events, queue, tmp_path
):
    """--lease-store-url, --lease-ttl and --lease-max-runtime override the app's settings."""
    redis_env = store_env("redis")
    # The app's own settings point elsewhere: a SQLite file and a 1 s ttl.
    env = {**redis_env, "CL_STORE": f"sqlite:///{tmp_path}/other.db", "CL_TTL": "1"}
    worker = start_worker(
        env,
        queue=queue,
        extra_args=(
            f"--lease-store-url={redis_env['CL_STORE']}",
            "--lease-ttl=7.5",
            "--lease-max-runtime=120",
        ),
    )
    seen = it_app.lease_settings_seen.apply_async((0,), queue=queue).get(timeout=30)
    print(f"seen by the task: {seen}")
    assert seen["ttl"] == 7.5
    assert seen["max_runtime"] == 120.0
    assert seen["store"].startswith("redis://") and seen["store"].endswith("/1"), seen
    # (the app's tasks run with --lease-ttl but the few that set a ttl of their own)
    assert "ready (ttl 7.5s for " in worker.log()
    assert "; 1s for tests.integration.eo_tasks." in worker.log()


def test_on_busy_fail_and_skip(it_app, start_worker, store_env, events, queue):
    """on_busy="fail": FAILURE naming the holder, told as skip's is; "skip": FAILURE saying
    it was skipped and why (a caller's get() returns instead of waiting forever), logged, the
    body never ran."""
    env = {**store_env("redis"), "CL_TTL": str(TTL)}
    worker = start_worker(env, queue=queue)
    store = worker_store(env)
    holder = store.acquire("onbusy-0", Owner.new("test-holder"), 30)
    try:
        failed = it_app.busy_fails.apply_async((0,), queue=queue)
        with pytest.raises(LeaseBusyError, match="test-holder"):
            failed.get(timeout=30)
        skipped = it_app.busy_skips.apply_async((0,), queue=queue)
        with pytest.raises(LeaseBusyError, match="test-holder") as caught:
            skipped.get(timeout=30)  # on main: PENDING forever, a TimeoutError after 30 s
    finally:
        store.release(holder)
        store.close()
    assert failed.state == "FAILURE"
    # an expected outcome: one WARNING line, no task failure raised (no traceback)
    assert f"{failed.id}] failed" in worker.log()
    assert not events.where(ev="failure", task=failed.id)
    assert skipped.state == "FAILURE"
    assert str(caught.value).startswith("skipped (on_busy='skip'): resource 'onbusy-0' is held")
    assert caught.value.resource == "onbusy-0"
    assert caught.value.holder_label.startswith("test-holder")
    assert f"{skipped.id}] skipped" in worker.log()
    assert not events.where(ev="failure", task=skipped.id)  # ignored: no task failure raised
    assert not events.where(ev="enter", res=0)  # neither body ran
    assert not events.where(ev="retry")  # and neither waited
