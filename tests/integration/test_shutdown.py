"""Cold shutdown with a lease held (a deploy that does not wait; PEERS #1, locks stuck after a
worker is stopped).

A prefork worker's cold shutdown (SIGQUIT) terminates its pool process mid-body; the body
unwinds through the task's try/finally, which releases the lease. The unacked message goes back
to the broker, and the next worker runs it at once, under a newer fence, instead of waiting out
the ttl. (A threads-pool worker waits for its bodies to end even on a cold shutdown, so there
the lease is released normally.) Negative control: a SIGKILL leaves no chance to unwind, and
the same check sees the lease left behind until its ttl.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 30.0  # long: a lease released at shutdown cannot be mistaken for one that expired
BODY = 20.0  # the slow call outlasts the shutdown


def check_released(info) -> None:
    assert info is None, f"the lease was left behind: {info}"


def test_cold_shutdown_releases_the_held_lease(it_app, start_worker, store_env, events, queue):
    env = {**store_env("redis"), "CL_TTL": str(TTL)}
    first = start_worker(env, queue=queue, concurrency=1)
    store = worker_store(env)
    try:
        it_app.slow_call.apply_async((0, BODY), queue=queue)
        start = events.wait(ev="start", res=0)
        sent = time.monotonic()
        first.proc.send_signal(signal.SIGQUIT)
        first.proc.wait(30)
        took = time.monotonic() - sent
        info = store.get("slow-0")
        print(f"worker exited {took:.2f}s after SIGQUIT; lease afterwards: {info}")
        check_released(info)
        assert took < BODY  # stopped mid-body, not after it
        # The message was not acked: the next worker runs it now, under a newer fence.
        second = start_worker(env, queue=queue, concurrency=1)
        rerun = wait_for(
            lambda: [e for e in events.where(ev="start", res=0) if e["fence"] != start["fence"]],
            30,
            "the re-run on the next worker",
        )[0]
        # The re-run's body has most of BODY to go: a warm shutdown at teardown would wait
        # for it (15 s, then SIGKILL). Nothing more is checked on this worker.
        second.kill()
    finally:
        store.close()
    assert rerun["fence"] > start["fence"]
    assert rerun["t"] - start["t"] < TTL  # it did not wait for the old lease to expire


def test_negative_control_a_killed_worker_leaves_the_lease_behind(
    it_app, start_worker, store_env, events, queue
):
    env = {**store_env("redis"), "CL_TTL": str(TTL)}
    first = start_worker(env, queue=queue, concurrency=1)
    store = worker_store(env)
    try:
        it_app.slow_call.apply_async((1, BODY), queue=queue)
        start = events.wait(ev="start", res=1)
        first.kill()
        info = store.get("slow-1")
    finally:
        store.close()
    assert info is not None and info.fence == start["fence"] and not info.expired
    with pytest.raises(AssertionError, match="left behind"):
        check_released(info)
