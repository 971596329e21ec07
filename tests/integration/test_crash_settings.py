"""The crash-recovery settings getting-started shows, with real prefork workers (issue 33.4).

With ``task_acks_late``, ``task_reject_on_worker_lost`` and a broker ``visibility_timeout``
not far above the lease ttl, a worker starts without a warning and a step whose pool process
is SIGKILLed runs again, once, taking the dead owner's lease over. Without
``task_reject_on_worker_lost`` and with kombu's default visibility timeout (an hour), the
worker warns about each, exactly once, at start, and the killed step ends FAILURE
(``WorkerLostError``) and never runs again: the negative control of the first.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import redis

from tests.conftest import unique
from tests.integration.harness import wait_queue_idle, worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 1.0
NO_REJECT = "without task_reject_on_worker_lost"
VISIBILITY = "broker's visibility_timeout is"


def _kill_the_step(it_app: Any, worker: Any, coord: redis.Redis, events: Any, queue: str):
    """Send crash_once, SIGKILL the pool process running its first run; returns the result
    and the fence that run held."""
    n = unique("k")
    result = it_app.crash_once.apply_async((n,), queue=queue)
    raw = wait_for(lambda: coord.get(events.key_for(f"ready:{n}")), 30, "the step to start")
    pid = int(raw)
    assert worker.owns(pid), f"pid {pid} is not a pool process of the worker"
    (start,) = events.where(ev="start", res=n)
    os.kill(pid, signal.SIGKILL)
    return n, result, start["fence"]


def test_documented_settings_start_quietly_and_a_killed_step_runs_again_once(
    it_app, start_worker, store_env, events, coord, queue
):
    """No warning at start; the step's second run recovers the killed one's lease and is its
    last."""
    env = {**store_env("redis"), "CL_TTL": str(TTL), "CL_VISIBILITY": "10"}
    worker = start_worker(env, queue=queue, concurrency=1)
    log = worker.log()
    assert NO_REJECT not in log
    assert VISIBILITY not in log
    n, result, fence = _kill_the_step(it_app, worker, coord, events, queue)
    outcome = result.get(timeout=60)
    assert outcome["recovered"] is True
    assert outcome["previous_fence"] == fence
    assert [e["attempt"] for e in events.where(ev="start", res=n)] == [1, 2]
    assert [e["attempt"] for e in events.where(ev="done", res=n)] == [2]


def test_without_them_each_is_warned_once_and_a_killed_step_is_lost(
    it_app, start_worker, store_env, events, coord, queue
):
    """Each warning names its setting exactly once; the killed step ends FAILURE
    (WorkerLostError), logged with its resource and fence, and is never run again, though its
    lease is free within the ttl. Started without a warning before."""
    env = {**store_env("redis"), "CL_TTL": str(TTL), "CL_REJECT_ON_WORKER_LOST": "0"}
    worker = start_worker(env, queue=queue, concurrency=1)
    log = worker.log()
    assert log.count(NO_REJECT) == 1, log
    assert log.count(VISIBILITY) == 1, log
    assert "the Redis broker's visibility_timeout is 3600s (kombu's default)" in log
    n, result, fence = _kill_the_step(it_app, worker, coord, events, queue)
    wait_for(lambda: result.state == "FAILURE", 30, "the killed step's FAILURE")
    assert type(result.result).__name__ == "WorkerLostError"
    # The main process says which lease the dead step held (Celery's own line names no task).
    # Not said before.
    lost = wait_for(
        lambda: [line for line in worker.log().splitlines() if " worker_lost: " in line],
        10,
        "the worker_lost line",
    )
    assert len(lost) == 1, lost
    assert f"task tests.integration.worker_app.crash_once[{result.id}] worker_lost: " in lost[0]
    assert f"resource=crash-{n} fence={fence} " in lost[0]
    assert 'action="FAILURE stored, the step does not run again"' in lost[0]
    assert 'fix="task_reject_on_worker_lost = True"' in lost[0]
    store = worker_store(env)
    try:
        wait_for(
            lambda: (info := store.get(f"crash-{n}")) is None or info.expired,
            10 * TTL,
            "the dead owner's lease to expire",
        )
    finally:
        store.close()
    wait_queue_idle(redis.Redis.from_url(os.environ["CL_BROKER"]), queue, timeout=30)
    assert [e["attempt"] for e in events.where(ev="start", res=n)] == [1]
    assert result.state == "FAILURE"
    assert worker.log().count(NO_REJECT) == 1  # (once per worker, not per task run)
