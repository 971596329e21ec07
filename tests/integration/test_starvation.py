"""Heartbeat starvation: a task body holds the GIL longer than its ttl.

``gil_hog`` runs one C call (a backtracking regular expression) for about 3x the ttl: the
renewal thread cannot run, so the lease expires in the store, and no interrupt can land. The
test takes the resource over as soon as the store shows the lease expired and commits through
the fence gate, as the next owner would. When the hog returns, the loss interrupt, its
``lease.check()`` or, for a body that swallows both, the fence gate must stop its commit, and
the task must not end SUCCESS. Negative control: a body that swallows the interrupt and skips
the gate commits with its stale fence, and the same check sees it.
"""

from __future__ import annotations

import pytest

from celery_lease import FenceGate, Owner
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 1.0
HOG = 3 * TTL


def _run(it_app, start_worker, store_env, events, queue, n, **options):
    """Start the hog, take its resource over once the store shows the lease expired, and
    return (the hog's writes, how its task ended)."""
    env = {**store_env("redis"), "CL_TTL": str(TTL)}
    start_worker(env, queue=queue, concurrency=1)
    store = worker_store(env)
    gate = FenceGate(env["CL_STORE"], key_prefix=env["CL_PREFIX"])
    resource = f"hog-{n}"
    try:
        result = it_app.gil_hog.apply_async((n, HOG), options, queue=queue)
        start = events.wait(ev="start", res=n)
        wait_for(lambda: store.get(resource).expired, 3 * HOG, "the starved lease to expire")
        newer = store.acquire(resource, Owner.new("next-owner"), 30)
        gate.admit(resource, newer.fence)  # the next owner's commit
        wait_for(lambda: result.state in ("SUCCESS", "FAILURE"), 3 * HOG + 30, "the hog's end")
        store.release(newer)
    finally:
        gate.close()
        store.close()
    # The store saw no renewal during the hog: the lease expired and was taken over from it.
    assert newer.previous_fence == start["fence"] and newer.fence > start["fence"]
    writes = events.where(ev="write", res=n)
    if result.state == "FAILURE":  # (its failure event is reported after the state is stored)
        events.wait(task=result.id, ev="failure", timeout=10)
    ended = events.where(task=result.id, ev="failure") or [{"ev": result.state}]
    print(f"options={options}: writes {writes}; ended {ended[0]}")
    return writes, result, ended[0]


def check_no_stale_commit(writes, result) -> None:
    assert not writes, f"the starved owner committed with a stale fence: {writes}"
    assert result.state == "FAILURE"


def test_a_starved_owner_does_not_commit(it_app, start_worker, store_env, events, queue):
    writes, result, ended = _run(it_app, start_worker, store_env, events, queue, 0)
    check_no_stale_commit(writes, result)
    assert ended["exc"] == "LeaseLostError"  # stopped by the interrupt or its own check


def test_the_gate_alone_refuses_a_starved_owner(it_app, start_worker, store_env, events, queue):
    """A body that swallows the interrupt and never checks: the fence gate refuses it."""
    writes, result, ended = _run(it_app, start_worker, store_env, events, queue, 1, check=False)
    check_no_stale_commit(writes, result)
    assert events.where(ev="refused", res=1)  # the gate said no (StaleFenceError)
    assert ended["exc"] == "LeaseLostError"  # and the task ends as a lost lease


def test_negative_control_without_check_or_gate_the_stale_commit_happens(
    it_app, start_worker, store_env, events, queue
):
    writes, result, _ = _run(
        it_app, start_worker, store_env, events, queue, 2, check=False, gated=False
    )
    with pytest.raises(AssertionError, match="stale fence"):
        check_no_stale_commit(writes, result)
