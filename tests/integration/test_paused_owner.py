"""A paused owner with real prefork workers: a stale owner's write never lands.

Each trial: worker A runs ``paused_writer(trial, "first")``, whose body checks its lease, tells
the test it is about to write and waits for "go". The test SIGSTOPs that pool child for 1.5-3x
the ttl; meanwhile worker B (another queue) takes the expired lease over and writes through the
FenceGate. Then the test sets "go" and SIGCONTs the child, which races its renewal thread: the
body either reaches the gate first (rejected: StaleFenceError) or is interrupted first (self-
fence: LeaseLostError). Either way the execution goes to RETRY with LeaseLostError and the re-run
writes with a newer fence. Trials run in concurrent batches on distinct resources. Ten more
trials per store have the body ignore the loss signal, so that the gate alone must refuse it.

The history check (every accepted write to a key carries a fence >= every earlier accepted
write's) is shown to catch stale writes by the negative control, which turns the gate off.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest

from celery_lease import FenceGate
from tests.conftest import unique
from tests.integration.harness import (
    check_fenced_writes,
    sigstop_outside_store,
    wait_results,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos_ci, pytest.mark.slow]

TTL = 1.0
TRIALS = 10  # per store (one batch)
BATCH = 10  # trials run concurrently (one paused pool child each)
GATE_ONLY_TRIALS = 10  # per store, the body ignoring the loss signal: only the gate protects
NEGATIVE_TRIALS = 20
#: How the first execution may end: the gate refused its write, or it stopped on its own.
LOST_REASONS = {"stale_fence", "renew_failed", "self_fenced", "taken_over", "expired"}


@dataclass
class Trial:
    trial: int
    pause: float
    first: Any
    self_fence: bool = True
    pid: int | None = None
    stop_attempts: int = 0
    stopped_at: float | None = None
    second: Any = None
    resumed_at: float | None = None
    paused_for: float | None = None


def _sqlite_path(env: dict[str, str]) -> str | None:
    url = env["CL_STORE"]
    return url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None


def _gate(env: dict[str, str]) -> FenceGate:
    if env["CL_STORE"].startswith("redis"):
        return FenceGate(env["CL_STORE"], key_prefix=env["CL_PREFIX"])
    return FenceGate(env["CL_STORE"], table_prefix=env["CL_TABLE_PREFIX"])


def run_batch(
    it_app: Any,
    events: Any,
    coord: Any,
    worker_a: Any,
    env: dict[str, str],
    queues: tuple[str, str],
    trials: list[int],
    rng: random.Random,
    *,
    use_gate: bool,
    self_fence: bool = True,
) -> list[Trial]:
    """Run one batch of concurrent paused-owner trials; returns them once all resumed."""
    queue_a, queue_b = queues
    sqlite_path = _sqlite_path(env)
    batch = [
        Trial(
            trial=t,
            pause=rng.uniform(1.5, 3.0) * TTL,
            first=it_app.paused_writer.apply_async(
                (t, "first"), {"use_gate": use_gate, "self_fence": self_fence}, queue=queue_a
            ),
            self_fence=self_fence,
        )
        for t in trials
    ]
    deadline = time.monotonic() + 60
    waiting = list(batch)
    while waiting:
        # One read of each per turn: polling must not load the 2 cores the workers run on.
        readies = coord.mget([events.key_for(f"ready:{t.trial}") for t in waiting])
        written = {e["trial"] for e in events.where(ev="write", role="second")}
        for trial, raw in zip(list(waiting), readies, strict=True):
            if trial.pid is None:
                if raw is None:
                    continue
                pid = int(raw)
                assert worker_a.owns(pid), f"pid {pid} is not a pool child of worker A"
                trial.stop_attempts = sigstop_outside_store(pid, sqlite_path)
                trial.pid = pid
                trial.stopped_at = time.monotonic()
                trial.second = it_app.paused_writer.apply_async(
                    (trial.trial, "second"), {"use_gate": use_gate}, queue=queue_b
                )
                continue
            assert trial.stopped_at is not None
            if time.monotonic() < trial.stopped_at + trial.pause:
                continue
            if trial.trial not in written:
                continue
            # The newer owner has written: let the old one go on, exactly where it stopped.
            coord.set(events.key_for(f"go:{trial.trial}"), 1)
            os.kill(trial.pid, signal.SIGCONT)
            trial.resumed_at = time.monotonic()
            trial.paused_for = trial.resumed_at - trial.stopped_at
            waiting.remove(trial)
        if time.monotonic() > deadline:
            for trial in waiting:  # never leave a child stopped behind a failed test
                if trial.pid is not None:
                    os.kill(trial.pid, signal.SIGCONT)
            raise TimeoutError(f"paused-owner trials did not progress: {waiting}")
        time.sleep(0.01)
    return batch


def warm_up(it_app: Any, *targets: tuple[str, int]) -> None:
    """Run one short task in every pool child before the trials.

    So that no trial pays a cold child's first-use costs (imports, connections) under a 1 s ttl
    on a loaded 2-core machine.
    """
    results = [
        it_app.exclusive.apply_async((1_000_000 + 100 * i + j,), {"hold": 0.3}, queue=queue)
        for i, (queue, children) in enumerate(targets)
        for j in range(children)
    ]
    wait_results(results, timeout=60)


def _first(log: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [e for e in log if all(e.get(k) == v for k, v in match.items())]
    assert found, f"no event {match}"
    return found[0]


def check_trial(trial: Trial, final_fence: int, log: list[dict[str, Any]]) -> str:
    """Assert one gated trial's outcome precisely; returns how the old owner was stopped."""
    t = trial.trial
    # The paused execution is the last one that said "ready" before the second owner started:
    # an earlier one may have said it, then lost its lease under load before the test paused
    # its process, and its retry said it again (a rehearsal took the first "ready", fence 2,
    # while the second owner took over fence 3). No earlier execution reached the write: the
    # first writes only after "go", which comes once the second owner wrote.
    second_start = _first(log, ev="start", trial=t, role="second")
    readies = [
        e
        for e in log
        if e["ev"] == "ready" and e["trial"] == t and e["role"] == "first"
        and e["t"] <= second_start["t"]
    ]  # fmt: skip
    assert readies, f"trial {t}: no first execution said ready before the second started"
    ready = readies[-1]
    old, task_id = ready["fence"], ready["task"]
    newer = second_start["fence"]
    assert newer > old, f"trial {t}: the takeover fence {newer} is not above {old}"
    assert second_start["previous_fence"] == old, (
        f"trial {t}: the second owner did not take over the paused owner's expired lease: "
        f"{second_start}"
    )
    stale = [e for e in log if e["ev"] == "write" and e["trial"] == t and e["fence"] <= old]
    assert not stale, f"trial {t}: the paused owner's stale write was accepted: {stale}"
    # The first execution ended in RETRY with LeaseLostError (reported by Celery's task_retry
    # signal after the body, so a late interrupt cannot hide it).
    retries = [e for e in log if e["ev"] == "retry" and e["task"] == task_id and e["fence"] == old]
    assert len(retries) == 1, f"trial {t}: the paused execution did not go to RETRY once"
    assert retries[0]["exc"] == "LeaseLostError", f"trial {t}: {retries[0]}"
    assert retries[0]["reason"] in LOST_REASONS, f"trial {t}: {retries[0]}"
    assert not [e for e in log if e["ev"] == "failure" and e["task"] == task_id]
    # ... and later SUCCESS with a fence newer than the takeover's, written through the gate.
    assert final_fence > newer, f"trial {t}: final fence {final_fence} <= {newer}"
    assert _first(log, ev="write", trial=t, role="first", fence=final_fence)
    rejected = [e for e in log if e["ev"] == "rejected" and e["trial"] == t and e["fence"] == old]
    fenced = [e for e in log if e["ev"] == "self_fenced" and e["trial"] == t]
    if rejected or retries[0]["reason"] == "stale_fence":
        return "gate_rejected"
    assert fenced or retries[0]["reason"] in LOST_REASONS - {"stale_fence"}
    return "self_fenced"


@pytest.mark.parametrize("kind", ["redis", "postgres", "sqlite"])
def test_paused_owner_never_writes_with_a_stale_fence(
    it_app, start_worker, store_env, events, coord, queue, kind
):
    """10 SIGSTOP/SIGCONT trials: the old owner self-fences or is rejected, then re-runs.

    Then 10 more where the body ignores the loss signal, so the gate alone must reject it.
    """
    env = {**store_env(kind), "CL_TTL": str(TTL)}
    queue_b = unique("q")
    worker_a = start_worker(env, queue=queue, concurrency=BATCH, wait=False)
    worker_b = start_worker(env, queue=queue_b, concurrency=2, wait=False)
    worker_a.wait_ready()
    worker_b.wait_ready()
    warm_up(it_app, (queue, BATCH), (queue_b, 2))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    plan = [(range(b, min(TRIALS, b + BATCH)), True) for b in range(0, TRIALS, BATCH)]
    plan.append((range(TRIALS, TRIALS + GATE_ONLY_TRIALS), False))
    print(f"seed={seed} N={TRIALS}+{GATE_ONLY_TRIALS} gate-only batch={BATCH} store={kind}")
    trials: list[Trial] = []
    finals: list[int] = []
    started = time.monotonic()
    for numbers, self_fence in plan:
        batch = run_batch(
            it_app,
            events,
            coord,
            worker_a,
            env,
            (queue, queue_b),
            list(numbers),
            rng,
            use_gate=True,
            self_fence=self_fence,
        )
        finals += wait_results([t.first for t in batch], timeout=60)
        wait_results([t.second for t in batch], timeout=60)
        trials += batch
    log = events.all()
    try:
        per_key = check_fenced_writes(log)
        paths = [check_trial(t, f, log) for t, f in zip(trials, finals, strict=True)]
    except AssertionError:
        for event in log:
            print(event)
        raise
    gate = _gate(env)
    try:  # the gate's own record agrees with the history: the newest accepted write wins
        for trial in trials:
            assert gate.highest(f"paused-{trial.trial}") == max(per_key[trial.trial])
    finally:
        gate.close()
    assert all(len(per_key[t.trial]) >= 2 for t in trials)  # the takeover's and the re-run's
    assert all(t.first.state == "SUCCESS" for t in trials)
    pauses = [t.paused_for for t in trials if t.paused_for is not None]
    paused_fence = {t.trial: _first(log, ev="ready", trial=t.trial)["fence"] for t in trials}
    # Executions that lost their lease to load before they even reached the pause point.
    early = [
        e
        for e in log
        if e["ev"] == "start" and e["role"] == "first" and e["fence"] < paused_fence[e["trial"]]
    ]
    both = [p for t, p in zip(trials, paths, strict=True) if t.self_fence]
    gate_only = [p for t, p in zip(trials, paths, strict=True) if not t.self_fence]
    print(
        f"with self-fence: {both.count('self_fenced')} self-fenced, "
        f"{both.count('gate_rejected')} gate-rejected; gate only: "
        f"{gate_only.count('gate_rejected')} gate-rejected, {gate_only.count('self_fenced')} "
        f"interrupted elsewhere; pauses {min(pauses):.2f}-{max(pauses):.2f}s; "
        f"re-stops (SQLite lock held) {sum(t.stop_attempts - 1 for t in trials)}; "
        f"executions lost before the pause point {len(early)}; "
        f"{time.monotonic() - started:.1f}s"
    )
    assert len(pauses) == len(trials) and min(pauses) >= 1.5 * TTL
    # The gate-only trials really exercised the gate (not only the self-fence).
    assert gate_only.count("gate_rejected") >= 1


def test_negative_control_without_the_gate_a_stale_write_lands(
    it_app, start_worker, store_env, events, coord, queue
):
    """With the gate check off, the same trials produce stale writes, and the check sees them."""
    env = {**store_env("redis"), "CL_TTL": str(TTL)}
    queue_b = unique("q")
    worker_a = start_worker(env, queue=queue, concurrency=BATCH, wait=False)
    worker_b = start_worker(env, queue=queue_b, concurrency=2, wait=False)
    worker_a.wait_ready()
    worker_b.wait_ready()
    warm_up(it_app, (queue, BATCH), (queue_b, 2))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed={seed} N<={NEGATIVE_TRIALS} batch={BATCH} store=redis ttl={TTL} use_gate=False")
    ran = 0
    stale: list[dict[str, Any]] = []
    while ran < NEGATIVE_TRIALS and not stale:
        batch = run_batch(
            it_app,
            events,
            coord,
            worker_a,
            env,
            (queue, queue_b),
            list(range(ran, min(NEGATIVE_TRIALS, ran + BATCH))),
            rng,
            use_gate=False,
        )
        wait_results([t.first for t in batch] + [t.second for t in batch], timeout=60)
        ran += len(batch)
        log = events.all()
        olds: dict[int, int] = {}  # the paused execution's fence per trial
        for e in log:
            if e["ev"] == "ready":
                olds.setdefault(e["trial"], e["fence"])
        newest: dict[int, int] = {}
        stale = []
        for e in log:
            if e["ev"] != "write":
                continue
            if e["fence"] == olds[e["trial"]] and newest.get(e["trial"], 0) > e["fence"]:
                stale.append(e)
            newest[e["trial"]] = max(newest.get(e["trial"], 0), e["fence"])
    print(f"stale writes accepted: {len(stale)} in {ran} trials")
    assert stale, f"no stale write in {ran} trials: the scenario does not exercise the fault"
    with pytest.raises(AssertionError, match="stale write accepted"):
        check_fenced_writes(events.all())
