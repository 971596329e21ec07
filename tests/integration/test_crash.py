"""SIGKILL mid-task with acks_late + reject_on_worker_lost, real prefork workers.

The pool child running ``crash_once`` is killed at a random moment of its renewal cycle. Its
lease is never released, so it must become claimable once its ttl runs out, and no later than
ttl + one renew interval after the kill (the last renewal can be at most one interval old).
The message is redelivered (reject_on_worker_lost) and the next execution takes the expired
lease over: recovered=True, previous_fence = the killed owner's fence, and the task ends SUCCESS.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest

from tests.integration.harness import wait_results, worker_store

pytestmark = [pytest.mark.integration, pytest.mark.chaos_ci, pytest.mark.slow]

TTL = 1.0
RENEW_INTERVAL = TTL / 3  # the default
TRIALS = 3  # per store, run concurrently on distinct resources
POLL = 0.01


@pytest.mark.parametrize("kind", ["redis", "postgres", "sqlite"])
def test_killed_owner_is_taken_over_within_ttl_and_the_task_completes(
    it_app, start_worker, store_env, events, coord, queue, kind
):
    """SIGKILL the pool child: claimable <= ttl + renew interval; redelivered run recovers."""
    env = {**store_env(kind), "CL_TTL": str(TTL)}
    worker = start_worker(env, queue=queue, concurrency=TRIALS)
    store = worker_store(env)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed={seed} N={TRIALS} store={kind} ttl={TTL}")
    results = [it_app.crash_once.apply_async((n,), queue=queue) for n in range(TRIALS)]
    pids: dict[int, int] = {}
    kill_at: dict[int, float] = {}
    killed: dict[int, dict[str, Any]] = {}
    claimable: dict[int, float] = {}
    #: Per detection: how stale it could be (time since the previous look at that resource).
    staleness: list[float] = []
    deadline = time.monotonic() + 60
    try:
        while len(claimable) < TRIALS:
            now = time.monotonic()
            assert now < deadline, f"no progress: killed={killed} claimable={claimable}"
            for n in range(TRIALS):
                if n not in pids:
                    raw = coord.get(events.key_for(f"ready:{n}"))
                    if raw is not None:
                        pids[n] = int(raw)
                        assert worker.owns(pids[n]), f"pid {pids[n]} is not a pool child"
                        # A random point of the renewal cycle (the phase of the last renewal).
                        kill_at[n] = now + rng.uniform(0, TTL)
                elif n not in killed and now >= kill_at[n]:
                    before = store.get(f"crash-{n}")
                    assert before is not None and not before.expired
                    wall, mono = time.time(), time.monotonic()
                    os.kill(pids[n], signal.SIGKILL)
                    killed[n] = {"wall": wall, "mono": mono, "fence": before.fence, "seen": []}
                    killed[n]["looked"] = mono
                elif n in killed and n not in claimable:
                    info = store.get(f"crash-{n}")
                    seen = time.monotonic()
                    record = killed[n]
                    record["seen"].append((round(seen - record["mono"], 3), info))
                    if info is not None and info.fence == record["fence"]:
                        # The dead owner's record: its expiry was set by a renewal sent before
                        # the kill, so it is at most ttl after the kill.
                        record["expires_at"] = info.expires_at.timestamp()
                    if info is None or info.expired or info.fence != record["fence"]:
                        claimable[n] = seen - record["mono"]
                        staleness.append(seen - record["looked"])
                    record["looked"] = seen
            time.sleep(POLL)
        outcomes = wait_results(results, timeout=60)
        leftovers = [store.get(f"crash-{n}") for n in range(TRIALS)]
    finally:
        store.close()
    assert leftovers == [None] * TRIALS  # every completed execution released its lease
    tolerance = max(staleness)
    bound = TTL + RENEW_INTERVAL + tolerance
    print(
        f"claimable after kill: {', '.join(f'{v:.3f}s' for v in claimable.values())} "
        f"(bound {bound:.3f}s = ttl + renew interval + {tolerance:.3f}s observation gap)"
    )
    for n in range(TRIALS):
        if claimable[n] > bound:
            for seen in killed[n]["seen"][::5]:
                print(seen)
        assert claimable[n] <= bound, f"resource crash-{n} stayed held {claimable[n]:.3f}s"
        if "expires_at" in killed[n]:
            assert killed[n]["expires_at"] <= killed[n]["wall"] + TTL + 0.05
        outcome = outcomes[n]
        assert outcome["recovered"] is True
        assert outcome["previous_fence"] == killed[n]["fence"]
        assert outcome["fence"] > killed[n]["fence"]
        assert results[n].state == "SUCCESS"
        starts = [e for e in events.all() if e["ev"] == "start" and e["res"] == n]
        assert [e["attempt"] for e in starts] == [1, 2]  # killed once, then one complete run
        assert starts[0]["fence"] == killed[n]["fence"]
        assert starts[1]["recovered"] is True
        assert [e["attempt"] for e in events.where(ev="done", res=n)] == [2]  # exactly once
