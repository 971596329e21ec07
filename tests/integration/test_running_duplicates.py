"""A redelivered copy of a running task is re-armed whatever ``on_busy`` says.

Real workers on a Redis broker with a 2 s visibility timeout:

1. worker A runs the task (acks_late, ``on_busy="skip"`` or ``"fail"``) and keeps its lease;
2. after the visibility timeout the Redis transport moves the unacked message back to the queue
   (and out of ``unacked``); worker B receives the copy and finds the resource busy under A's
   live lease, held by the *same identity* (the task id): a duplicate, not other work. It must be
   re-armed (re-queued with the same task id), not acked away (``skip``) nor stored as FAILURE
   under the id of the task that is still running (``fail``);
3. the test SIGKILLs worker A (parent and pool child): the re-armed copy is now the only one.

With the fix the task completes (SUCCESS, a recovered second run) and no FAILURE is ever stored.
The negative control (``CL_DUPLICATE_REARM=off`` in the workers: a duplicate handled like other
contention, as before the fix) shows the harm: ``skip`` acks the copy and nothing ever completes
the task; ``fail`` stores FAILURE under the running task's id while it still runs.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.harness import Worker, prepare_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.chaos_ci, pytest.mark.slow]

TTL = 1.0  # the tasks' lease ttl
VISIBILITY = 2.0


def _run_until_copy_handled(
    it_app: Any,
    start_worker: Any,
    events: Any,
    coord: Any,
    queue: str,
    env: dict[str, str],
    on_busy: str,
) -> tuple[Any, Worker, Worker, str]:
    """Steps 1-2: returns the result, workers A and B, and how B handled the copy."""
    task = getattr(it_app, f"running_duplicate_{on_busy}")
    worker_a = start_worker(env, queue=queue, concurrency=1)
    result = task.apply_async((0,), queue=queue)
    pid = int(wait_for(lambda: coord.get(events.key_for("ready:0")), 30, "the original to run"))
    assert worker_a.owns(pid)
    # B starts only now, so it cannot take the original: what it gets is the redelivered copy.
    worker_b = start_worker(env, queue=queue, concurrency=2)

    def handled() -> str | None:
        for e in events.where(task=result.id):
            if e["ev"] in ("retry", "failure") and worker_b.owns(e["pid"]):
                assert e["exc"] == "LeaseBusyError", e
                return str(e["ev"])
        log = worker_b.log()
        for told in ("skipped", "failed"):  # (stored FAILURE quietly, as an expected outcome)
            if f"{result.id}] {told}" in log:
                return told
        return None

    how = wait_for(handled, 30, "the redelivered copy to reach worker B")
    return result, worker_a, worker_b, str(how)


@pytest.mark.parametrize("rearm", ["on", "off"])
@pytest.mark.parametrize("on_busy", ["skip", "fail"])
def test_a_running_tasks_duplicate_is_rearmed_whatever_on_busy_says(
    it_app, start_worker, store_env, events, coord, queue, on_busy, rearm
):
    """skip/fail apply to other work; the copy of the running task waits and completes it."""
    env = {**store_env("redis"), "CL_VISIBILITY": str(VISIBILITY), "CL_DUPLICATE_REARM": rearm}
    prepare_store(env)
    print(f"store=redis ttl={TTL} visibility={VISIBILITY} on_busy={on_busy} rearm={rearm}")
    result, worker_a, worker_b, how = _run_until_copy_handled(
        it_app, start_worker, events, coord, queue, env, on_busy
    )
    state_while_running = result.state  # the original still runs under its live lease
    print(f"the copy was handled by worker B as {how!r}; state meanwhile {state_while_running}")
    if rearm == "off":  # the negative control: the harm the fix prevents
        if on_busy == "fail":
            assert how == "failed"
            # (the line is logged just before the FAILURE is stored)
            stored = wait_for(lambda: result.state == "FAILURE", 10, "the copy's FAILURE")
            assert stored, "no FAILURE stored: the control is broken"
            worker_a.kill()  # its body sleeps 60 s: a warm shutdown would wait 15 s for it
            return
        assert how == "skipped"
        worker_a.kill()
        watch = TTL + 2 * VISIBILITY + 2.0  # the lease expires; any unacked copy is restored
        deadline = time.monotonic() + watch
        while time.monotonic() < deadline and not events.where(ev="done"):
            time.sleep(0.1)
        print(f"watched {watch:.0f}s after the kill: {len(events.where(ev='done'))} completions")
        assert not events.where(ev="done"), "the skipped copy completed: the control is broken"
        assert result.state != "SUCCESS"
        return
    assert how == "retry"
    assert state_while_running not in ("FAILURE", "SUCCESS"), state_while_running
    worker_a.kill()
    outcome = result.get(timeout=60)
    assert result.state == "SUCCESS"
    assert outcome["attempt"] == 2 and outcome["recovered"] is True, outcome
    starts = events.where(ev="start", res=0)
    assert [e["attempt"] for e in starts] == [1, 2], starts
    assert worker_b.owns(starts[1]["pid"])
    assert not events.where(ev="failure", task=result.id)
    retries = events.where(ev="retry", task=result.id)
    assert {e["exc"] for e in retries} == {"LeaseBusyError"}, retries
    print(f"completed by worker B after {len(retries)} busy re-arms of the copy")
