"""A waiter that retries keeps its place in the wait list (real workers, issue 10).

A refused waiter A is listed with its wake message and re-queued as a back-stop copy (a
countdown of the lease ttl). Its woken copy runs attempt 0 and calls ``self.retry()``; the
retry's message is refused while the next waiter H holds the resource and lists attempt 1.
Then the back-stop copy of attempt 0, sent before the retry, is refused too. That refusal must
not re-arm A's place with attempt 0's message: H's release must wake attempt 1, which runs
from that wake. Before, it woke attempt 0's copy, which ended unrun (superseded), and attempt
1 ran only from its own back-stop copy, a lease ttl after its refusal, the resource idle
meanwhile.

Timeline (seconds from A's first refusal; ttl 6): the holder releases at 1, A's woken copy
retries with a 2 s countdown and hands the resource to H (held until ~7.6); attempt 1 is
refused at ~3 (its back-stop copy due at ~9); attempt 0's back-stop copy is refused at ~6.
"""

from __future__ import annotations

import pytest

from tests.conftest import unique

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {"CL_TTL": "6", "CL_BACKOFF_BASE": "0.05", "CL_BACKOFF_CAP": "30"}


def _run(it_app, start_worker, store_env, events, queue, kind, env_extra):
    env = {**store_env(kind), **ENV, **env_extra}
    start_worker(env, queue=queue, pool="threads", concurrency=4)
    n = unique("rw")
    holder = it_app.fifo_hold.apply_async((n, 0, 1.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_retry_once.apply_async((n, 1, 2.0), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    second = it_app.fifo_hold.apply_async((n, 2, 6.5), queue=queue)
    events.wait(ev="retry", task=second.id)
    assert waiter.get(timeout=60) == 1
    assert holder.get(timeout=30) == 0 and second.get(timeout=30) == 2
    runs = events.where(ev="enter", res=n, k=1)
    released = events.where(ev="exit", res=n, k=2)[0]["t"]
    after = [round(e["t"] - released, 2) for e in runs if e["retries"] == 1]
    return [(e["retries"], bool(e["woken"])) for e in runs], after


@pytest.mark.parametrize("kind", ["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_retried_waiter_is_woken_by_the_next_release(
    it_app, start_worker, store_env, events, queue, kind
):
    """Attempt 1 runs from H's wake (woken), once; attempt 0's back-stop copy ends unrun.
    Failed before: [(0, True), (1, False)], attempt 1 ran ~1.4 s (its back-stop) after H's
    release instead of at once."""
    runs, after = _run(it_app, start_worker, store_env, events, queue, kind, {})
    assert runs == [(0, True), (1, True)], f"runs {runs}; attempt 1 ran {after} s after release"


def test_negative_control_without_the_attempt_the_old_copy_takes_the_wake(
    it_app, start_worker, store_env, events, queue
):
    """The stores not told the claim's attempt (patched in the worker): attempt 0's back-stop
    copy re-arms A's place with its own message, takes H's wake and ends unrun; attempt 1
    runs from its back-stop copy."""
    runs, after = _run(
        it_app, start_worker, store_env, events, queue, "redis", {"CL_WAIT_ATTEMPT": "off"}
    )
    assert runs == [(0, True), (1, False)], f"runs {runs}; attempt 1 ran {after} s after release"
