"""unique= with real workers: when each mode gives its publish lock back, and that no lock
outlives its ttl (a killed worker, a purged queue), a revoked copy's key freed when a worker
drops it, retry() keeping the key, a canvas of unique members, and on_busy="fail" told
quietly. The publishing side alone is in tests/test_unique.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain, group

from celery_lease import AlreadyQueuedError
from celery_lease._app import override_store
from celery_lease._settings import forget_resolved_settings
from tests.conftest import unique
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def publish_to(store_env: Any) -> Iterator[Any]:
    """``publish_to(kind)``: the workers' store env for ``kind``; the test process publishes
    (takes its locks) in that same store."""
    opened: list[Any] = []

    def make(kind: str) -> dict[str, str]:
        env = store_env(kind)
        store = worker_store(env)
        opened.append(store)
        cm = override_store(store)
        cm.__enter__()
        opened.append(cm)
        return env

    yield make
    for item in reversed(opened):
        if hasattr(item, "__exit__"):
            item.__exit__(None, None, None)
        else:
            item.close()


def _free(task: Any, n: str, queue: str, timeout: float, *more: Any) -> float:
    """Poll until a copy of ``task`` for ``n`` may be published again; how long that took."""
    started = time.monotonic()

    def published() -> bool:
        try:
            task.apply_async((n, *more), queue=queue)
        except AlreadyQueuedError:
            return False
        return True

    wait_for(published, timeout, f"the unique key of {task.name} for {n} to be free")
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("kind", "mode", "held_while_running"),
    [
        ("redis", "uq_executed", True),
        ("postgres", "uq_executed", True),
        ("sqlite", "uq_executed", True),
        ("redis", "uq_executing", False),  # the controls: released when the body starts
        ("redis", "uq_and_while", False),
    ],
)
def test_each_mode_holds_the_key_as_it_says(
    it_app, start_worker, publish_to, events, queue, kind, mode, held_while_running
):
    """A copy is refused from publish on; while the first runs, only until_executed still
    refuses one; once it ended, every mode but until_expired publishes again."""
    env = publish_to(kind)
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    task = getattr(it_app, mode)
    n, go = unique("u"), events.key_for(unique("go"))
    first = task.apply_async((n, go), countdown=1.0, queue=queue)
    with pytest.raises(AlreadyQueuedError) as refused:  # queued: refused in every mode
        task.apply_async((n,), queue=queue)
    assert refused.value.task_id == first.id
    events.wait(ev="enter", res=n, task=first.id)
    if held_while_running:
        with pytest.raises(AlreadyQueuedError):
            task.apply_async((n,), queue=queue)
        _push(events, go)
        assert first.get(timeout=30) == n
        print(f"{kind} {mode}: free {_free(task, n, queue, 10):.3f}s after the result")
    else:
        second = task.apply_async((n, go), queue=queue)  # published while the first runs
        _push(events, go, 2)
        assert first.get(timeout=30) == n and second.get(timeout=30) == n


def _push(events: Any, go: str, times: int = 1) -> None:
    for _ in range(times):
        events.client.rpush(go, 1)


def test_until_expired_holds_the_key_for_its_ttl_after_the_execution(
    it_app, start_worker, publish_to, events, queue, monkeypatch
):
    env = publish_to("redis")
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    monkeypatch.setattr(it_app.uq_expired, "lease_unique_ttl", 3.0)
    forget_resolved_settings()
    n = unique("u")
    started = time.monotonic()
    assert it_app.uq_expired.apply_async((n,), queue=queue).get(timeout=30) == n
    with pytest.raises(AlreadyQueuedError):  # ended, and still held: a throttle
        it_app.uq_expired.apply_async((n,), queue=queue)
    _free(it_app.uq_expired, n, queue, 10)
    assert 2.5 <= time.monotonic() - started <= 8


def test_a_failure_ends_the_execution_and_gives_the_key_back(
    it_app, start_worker, publish_to, queue
):
    env = publish_to("redis")
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    n = unique("u")
    failed = it_app.uq_executed.apply_async((n, "", True), queue=queue)
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    _free(it_app.uq_executed, n, queue, 10)


def test_retry_keeps_the_key_until_the_retried_execution_ends(
    it_app, start_worker, publish_to, events, queue
):
    env = publish_to("postgres")
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    n = unique("u")
    result = it_app.uq_retrying.apply_async((n, 2.0), queue=queue)
    events.wait(ev="enter", res=n, retries=0)
    with pytest.raises(AlreadyQueuedError) as refused:  # waiting out its retry's countdown
        it_app.uq_retrying.apply_async((n, 2.0), queue=queue)
    assert refused.value.task_id == result.id
    assert result.get(timeout=30) == n
    assert len(events.where(ev="enter", res=n)) == 2
    _free(it_app.uq_retrying, n, queue, 10, 0.1)


@pytest.mark.parametrize("release", ["on", "off"])
def test_a_revoked_copy_gives_its_key_back_when_a_worker_drops_it(
    it_app, start_worker, publish_to, events, queue, release
):
    """Revoked while its countdown runs: the worker drops it at its eta and frees its key,
    long before its ttl (60 s). Negative control (off): the key stays held."""
    env = publish_to("redis")
    if release == "off":
        env["CL_UNIQUE_REVOKE"] = "0"
    worker = start_worker(env, queue=queue, pool="threads", concurrency=2)
    n = unique("u")
    queued = it_app.uq_executed.apply_async((n,), countdown=1.5, queue=queue)
    it_app.app.control.revoke(queued.id)
    wait_for(lambda: "revoked" in worker.log().lower() and queued.id in worker.log(), 30, "drop")
    if release == "on":
        _free(it_app.uq_executed, n, queue, 5)
        return
    time.sleep(1.0)  # (the control: a second after the drop, it is still held)
    with pytest.raises(AlreadyQueuedError):
        it_app.uq_executed.apply_async((n,), queue=queue)


def test_a_killed_workers_key_frees_itself_within_its_ttl(
    it_app, start_worker, publish_to, events, queue, monkeypatch
):
    """SIGKILL of the whole worker while its until_executed copy runs: nobody gives the key
    back, and it is free again once its ttl (4 s) ran out, never held for good."""
    env = publish_to("sqlite")
    worker = start_worker(env, queue=queue, pool="threads", concurrency=2)
    monkeypatch.setattr(it_app.uq_executed, "lease_unique_ttl", 4.0)
    forget_resolved_settings()
    n, go = unique("u"), events.key_for(unique("go"))
    it_app.uq_executed.apply_async((n, go), queue=queue)
    events.wait(ev="enter", res=n)
    published = time.monotonic()
    worker.kill()
    with pytest.raises(AlreadyQueuedError):
        it_app.uq_executed.apply_async((n,), queue=queue)
    _free(it_app.uq_executed, n, queue, 15)
    assert time.monotonic() - published <= 4.0 + 5.0


def test_a_purged_copy_frees_its_key_by_its_ttl(it_app, publish_to, queue, monkeypatch):
    """No worker ever sees it: the queue is purged; its key is free once its ttl ran out."""
    publish_to("redis")
    monkeypatch.setattr(it_app.uq_executed, "lease_unique_ttl", 2.0)
    forget_resolved_settings()
    n = unique("u")
    it_app.uq_executed.apply_async((n,), queue=queue)
    with it_app.app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge(queue) == 1
    with pytest.raises(AlreadyQueuedError):
        it_app.uq_executed.apply_async((n,), queue=queue)
    assert _free(it_app.uq_executed, n, queue, 10) <= 2.0 + 3.0


def test_a_group_of_unique_members(it_app, start_worker, publish_to, events, queue):
    """Members with their own keys run; a member whose key another holds is refused when
    the group is applied. (The first member of c holds its key until the test says go: on a
    loaded box it ran and gave the key back before the second was published, once in CI.)"""
    env = publish_to("redis")
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    a, b = unique("u"), unique("u")
    members = group(it_app.uq_executed.s(a), it_app.uq_executed.s(b)).apply_async(queue=queue)
    assert sorted(members.get(timeout=30)) == sorted([a, b])
    c, go = unique("u"), events.key_for(unique("go"))
    try:
        with pytest.raises(AlreadyQueuedError):
            group(it_app.uq_executed.s(c, go), it_app.uq_executed.s(c, go)).apply_async(queue=queue)
    finally:
        _push(events, go)


def test_on_busy_fail_is_told_in_one_warning_without_a_traceback(
    it_app, start_worker, publish_to, events, queue
):
    env = publish_to("redis")
    worker = start_worker(env, queue=queue, pool="threads", concurrency=2)
    n, go = unique("u"), events.key_for(unique("go"))
    holder = it_app.uq_fail_busy.apply_async((n, go), queue=queue)
    events.wait(ev="enter", res=n)
    refused = it_app.uq_fail_busy.apply_async((n,), queue=queue)
    wait_for(lambda: refused.state == "FAILURE", 30, "the refused copy to fail")
    _push(events, go)
    assert holder.get(timeout=30) == n
    assert "is held by" in str(refused.result)
    lines = [line for line in worker.log().splitlines() if refused.id in line]
    print("\n".join(lines))
    assert not any("Traceback" in line or " ERROR" in line for line in lines), lines
    assert sum(" WARNING" in line for line in lines) <= 1, lines
    assert "Traceback" not in worker.log()


def test_a_chain_whose_next_step_has_the_same_key_runs_through(
    it_app, start_worker, publish_to, queue
):
    """The next step is published from inside the step before it (Celery's tracer, before
    after_return): the step gives its key back when its body ends, so the next one takes it.
    Before: step 1 ended FAILURE (AlreadyQueuedError), step 2 never ran, the key stayed held
    for its ttl. And a result read is no head start: the key is free once get() returns."""
    env = publish_to("redis")
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    n = unique("u")
    step = it_app.uq_executed.si(n).set(queue=queue)
    steps = chain(step, step.clone()).apply_async()
    assert steps.get(timeout=30) == n and steps.parent.get(timeout=30) == n
    refused = 0
    for _ in range(5):
        try:
            again = it_app.uq_executed.apply_async((n,), queue=queue)
        except AlreadyQueuedError:
            refused += 1
            break
        again.get(timeout=30)
    assert refused == 0
