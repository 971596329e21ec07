"""A redelivery that arrives while the original still runs, then the original's worker dies.

The sequence the exactly-once guide warns about, reproduced with real workers on a Redis broker
with a 2 s visibility timeout:

1. worker A runs ``long_original(n)`` (acks_late): it applies ledgered step 1, then keeps
   working under its renewed lease;
2. after the visibility timeout the Redis transport moves the unacked message back to the queue
   (and drops it from ``unacked``); worker B receives it, finds the resource busy under A's live
   lease, and the duplicate must be *re-armed* (re-queued with the same task id, countdown) --
   acking it and forgetting it would leave no copy of the task anywhere;
3. the test SIGKILLs worker A, parent and pool child (nothing is acked, nothing requeued).

The task must still complete exactly once: B's re-check claims the expired lease as a recovered
run, step 1 comes back from the ledger (not applied again), step 2 is applied once, the task
ends SUCCESS. The negative control sets ``on_busy="skip"`` and turns the duplicate re-arm off in
the workers (``CL_DUPLICATE_REARM=off``: the duplicate is acked and dropped, as before a busy
duplicate was re-armed whatever ``on_busy`` says): after the kill nothing ever completes the task.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tests.conftest import unique
from tests.integration.harness import Worker, prepare_store
from tests.tooling.history import check, load
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.chaos_ci, pytest.mark.slow]

TTL = 1.0  # the tasks' lease ttl
VISIBILITY = 2.0
TRIALS = 2  # per store, concurrently, one worker A each


def _setup(make_sink: Any, store_env: Any, kind: str, tmp_path: Any, request: Any) -> Any:
    env = {
        **store_env(kind),
        "CL_VISIBILITY": str(VISIBILITY),
        "CL_HISTORY": str(tmp_path / "history"),
        "CL_SINK_NAME": unique("sink"),
    }
    (tmp_path / "history").mkdir()
    if kind == "postgres":
        env["CL_SINK"] = request.getfixturevalue("postgres_server").url
    prepare_store(env)
    return env, make_sink(env)


def run_until_kill(
    it_app: Any,
    start_worker: Any,
    events: Any,
    coord: Any,
    queue: str,
    env: dict[str, str],
    task: Any,
    rng: random.Random,
) -> tuple[list[Any], list[Worker], Worker, dict[int, dict[str, Any]]]:
    """Steps 1-3 for TRIALS tasks: returns results, the A workers (killed), B, and per trial
    the original's start event and the duplicate's busy re-arm."""
    workers_a = [start_worker(env, queue=queue, concurrency=1, wait=False) for _ in range(TRIALS)]
    for worker in workers_a:
        worker.wait_ready()
    results = [task.apply_async((n,), queue=queue) for n in range(TRIALS)]
    owner: dict[int, Worker] = {}
    for n in range(TRIALS):
        pid = int(wait_for(lambda n=n: coord.get(events.key_for(f"ready:{n}")), 30, "ready"))
        owner[n] = next(w for w in workers_a if w.owns(pid))
    assert len({id(w) for w in owner.values()}) == TRIALS  # one original per worker A
    # B starts only now, so it cannot take an original: what it gets is a redelivery.
    worker_b = start_worker(env, queue=queue, concurrency=2)
    seen: dict[int, dict[str, Any]] = {}
    for n in range(TRIALS):
        start = events.wait(ev="start", res=n, attempt=1)
        assert owner[n].owns(start["pid"])
        seen[n] = {"start": start}
    deadline = time.monotonic() + 30
    while len(seen) > sum("killed" in s for s in seen.values()):
        for n, result in enumerate(results):
            if "killed" in seen[n]:
                continue
            if "busy" not in seen[n]:
                busy = [
                    e
                    for e in events.where(ev="retry", task=result.id)
                    if e["exc"] == "LeaseBusyError" and worker_b.owns(e["pid"])
                ]
                skipped = f"{result.id}] skipped" in worker_b.log()
                if busy or skipped:
                    seen[n]["busy"] = busy[0] if busy else {"skipped": True}
                    seen[n]["busy_seen_at"] = time.monotonic()
                    # The original keeps running (and renewing) a random while longer.
                    seen[n]["kill_due"] = time.monotonic() + rng.uniform(0, 0.5 * TTL)
            elif time.monotonic() >= seen[n]["kill_due"]:
                seen[n]["killed_at"] = time.monotonic()
                seen[n]["killed"] = owner[n].kill()  # parent and pool child, by PID
        assert time.monotonic() < deadline, f"no redelivery reached worker B: {seen}"
        time.sleep(0.02)
    return results, workers_a, worker_b, seen


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_a_redelivered_duplicate_is_rearmed_and_completes_after_the_original_dies(
    it_app, make_sink, start_worker, store_env, events, coord, queue, tmp_path, request, kind
):
    """Redelivered under a live lease, original worker SIGKILLed: completes exactly once."""
    env, sink = _setup(make_sink, store_env, kind, tmp_path, request)
    seed = random.randrange(1 << 30)
    print(f"seed={seed} N={TRIALS} store={kind} ttl={TTL} visibility={VISIBILITY}")
    results, _, worker_b, seen = run_until_kill(
        it_app, start_worker, events, coord, queue, env, it_app.eo.long_original,
        random.Random(seed),
    )  # fmt: skip
    outcomes = [r.get(timeout=60) for r in results]
    done_at = time.monotonic()
    counts = sink.counts()
    report = check(load(env["CL_HISTORY"]))
    for n, (result, outcome) in enumerate(zip(results, outcomes, strict=True)):
        original = seen[n]["start"]
        assert result.state == "SUCCESS"
        assert counts[f"redeliv-{n}:step1"] == 1, counts
        assert counts[f"redeliv-{n}:step2"] == 1, counts
        # Step 1 came back from the ledger with the original's fence; step 2 ran in the
        # recovered execution, which took over the dead owner's lease.
        assert outcome["step1"]["fence"] == original["fence"]
        assert outcome["recovered"] is True
        assert outcome["fence"] > original["fence"]
        assert outcome["step2"]["fence"] == outcome["fence"]
        starts = events.where(ev="start", res=n)
        assert [e["attempt"] for e in starts] == [1, 2], starts  # killed once, one more run
        assert all(worker_b.owns(e["pid"]) for e in starts[1:])
        assert [e["fence"] for e in events.where(ev="done", res=n)] == [outcome["fence"]]
        retries = events.where(ev="retry", task=result.id)
        assert {e["exc"] for e in retries} == {"LeaseBusyError"}, retries
        print(
            f"trial {n}: redelivered to B {seen[n]['busy']['t'] - original['t']:.2f}s after "
            f"the original started; A killed {seen[n]['killed_at'] - seen[n]['busy_seen_at']:.2f}s "
            f"after that; {len(retries)} busy re-arms in all; completed "
            f"{done_at - seen[n]['killed_at']:.2f}s after the kill with fence "
            f"{outcome['fence']} > {original['fence']}"
        )
    report.assert_clean()
    assert report.counts["effect"] == 2 * TRIALS


def test_negative_control_a_dropped_duplicate_loses_the_task(
    it_app, make_sink, start_worker, store_env, events, coord, queue, tmp_path, request
):
    """Duplicates handled as other work, on_busy="skip" acks the copy: nobody completes it."""
    env, sink = _setup(make_sink, store_env, "redis", tmp_path, request)
    env["CL_DUPLICATE_REARM"] = "off"
    seed = random.randrange(1 << 30)
    print(f"seed={seed} N={TRIALS} store=redis ttl={TTL} visibility={VISIBILITY} on_busy=skip")
    results, _, _, seen = run_until_kill(
        it_app, start_worker, events, coord, queue, env, it_app.eo.long_original_skip,
        random.Random(seed),
    )  # fmt: skip
    # Long enough for the lease to expire and for any copy left in unacked to be restored
    # (visibility timeout + a 1 s sweep) and run.
    watch = TTL + 2 * VISIBILITY + 2.0
    deadline = time.monotonic() + watch
    while time.monotonic() < deadline and not events.where(ev="done"):
        time.sleep(0.1)
    counts = sink.counts()
    print(f"watched {watch:.0f}s after the kills: {len(events.where(ev='done'))} completions")
    assert all(s["busy"] == {"skipped": True} for s in seen.values())
    assert not events.where(ev="done"), "a dropped duplicate completed: the control is broken"
    assert all(counts.get(f"redeliv-{n}:step2") is None for n in range(TRIALS))
    assert all(r.state != "SUCCESS" for r in results)
