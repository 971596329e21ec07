"""Failpoint crash matrix with real workers: a kill at any of the six sites, one execution.

A "faulty" prefork worker runs with every failpoint site set to ``kill``
(``CELERY_LEASE_FAILPOINTS``) and ``CELERY_LEASE_FAILPOINTS_ONCE``: a ``task_prerun`` hook
points the once-marker at the trial (``<dir>/trial-<n>``) and the test pre-creates the markers
of the five sites the trial does not target, so each trial's pool child dies exactly once, at
its site. The task (acks_late, reject_on_worker_lost) applies ledgered effect ``a``,
checkpoints, holds long enough for a renewal, applies ledgered effect ``b``, checkpoints; its
``reconcile_effect`` hook looks at the sink itself. The dead child's message is requeued by the
worker (reject_on_worker_lost); the faulty worker has stopped consuming the trial queue by then
(remote control), so a second, clean worker (no failpoints) picks it up.

``inside_reconcile`` is only reached by a recovered run: for those trials the test first plays
an earlier owner that claimed the identity, recorded effect ``a``'s intent and crashed before
recording it done -- applying the effect at the sink in a seeded half of the trials, not in the
other -- so the faulty worker's run is recovered and dies in reconciliation, and the clean one
must reconcile (receipt from the sink, or REDO).

Each trial ends as one execution would: effects ``a`` and ``b`` applied exactly once at the
sink, the task SUCCESS with a result made of the sink's own records, the identity done and the
lease released. Trials run 20 at a time on distinct resources; a trial whose faulty child lost
its lease to load before reaching its site (seen once: its renewal thread starved past the
self-fence deadline) must end as one execution too, and is replaced so that each site is killed
at least 10 times. The negative controls take the
ledger away (a body without identity at ``inside_release``) or make reconciliation blind (a
hook that always answers REDO at ``after_effect_before_ledger``): effects double, and the sink
count and the history checker both say so.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter
from typing import Any

import pytest

from celery_lease import Owner
from celery_lease._failpoints import SITES as ALL_SITES
from tests.conftest import unique
from tests.integration.harness import Worker, worker_store
from tests.tooling import history
from tests.tooling.history import check, load

pytestmark = [pytest.mark.integration, pytest.mark.chaos_ci, pytest.mark.slow]

TTL = 2.0  # the faulty child's lease must outlive 20 children starting at once on 2 cores
RUNS_PER_SITE = 10
BATCH = 20
RENEW_HOLD = 1.0  # > ttl/3: a renewal (inside_renew) happens during the hold
# before_wake and after_wake fire only when a release hands the resource to a waiter; these
# trials run on distinct resources, so they never fire here (tests/integration/test_handoff*.py
# kill there).
SITES = tuple(
    site
    for site in ALL_SITES
    # (the hand-off's sites, and a give-up's, are not on a lone task's path: their own tests)
    if site not in ("before_wake", "after_wake", "after_early_wake", "before_give_up")
)
ALL_KILL = ",".join(f"{site}=kill" for site in SITES)


def node(worker: Worker) -> str:
    return f"{worker.name}@{socket.gethostname()}"


def control(app: Any, action: str, queue: str, worker: Worker) -> None:
    """add_consumer / cancel_consumer on one worker, waiting for its reply."""
    replies = getattr(app.control, action)(
        queue, destination=[node(worker)], reply=True, timeout=10
    )
    assert replies and node(worker) in replies[0], f"{action} {queue}: no reply {replies}"


class Matrix:
    """One store's faulty and clean workers, the sink, and the trials run so far."""

    def __init__(self, it_app, make_sink, start_worker, store_env, events, coord, tmp_path,
                 request, kind):  # fmt: skip
        self.app = it_app
        self.events = events
        self.coord = coord
        self.once = tmp_path / "once"
        self.once.mkdir()
        (tmp_path / "history").mkdir()
        self.env = {
            **store_env(kind),
            "CL_TTL": str(TTL),
            "CL_HISTORY": str(tmp_path / "history"),
            "CL_SINK_NAME": unique("sink"),
            "CL_FP_ONCE_DIR": str(self.once),
        }
        if kind == "postgres":
            self.env["CL_SINK"] = request.getfixturevalue("postgres_server").url
        self.sink = make_sink(self.env)
        self.store = worker_store(self.env)  # (also creates the tables before the workers start)
        request.addfinalizer(self.store.close)
        faulty_env = {**self.env, "CELERY_LEASE_FAILPOINTS": ALL_KILL}
        self.faulty = start_worker(
            faulty_env, queue=unique("idle"), concurrency=BATCH, wait=False, name=unique("faulty")
        )
        self.clean = start_worker(
            self.env, queue=unique("idle"), concurrency=6, wait=False, name=unique("clean")
        )
        self.faulty.wait_ready()
        self.clean.wait_ready()
        self.run = unique("fp")
        self.trials: list[dict[str, Any]] = []

    def task_id(self, trial: int) -> str:
        return f"{self.run}-{trial}"

    def crashed_earlier_owner(self, trial: int, applied: bool) -> int:
        """Play an owner that began effect ``a`` and died before recording it done."""
        lease = self.store.acquire(
            f"fp-{trial}", Owner.new("earlier-owner"), 0.2, identity=self.task_id(trial)
        )
        history.record(self.env["CL_HISTORY"], op="acquire", resource=lease.resource,
                       fence=lease.fence)  # fmt: skip
        assert self.store.effect_begin(lease, "a") == ("new", None, None)
        if applied:
            payload = {"trial": trial, "key": "a", "fence": lease.fence, "pid": 0}
            self.sink.append(f"fp-{trial}:a", payload)
            history.record(self.env["CL_HISTORY"], op="effect", idem=f"fp-{trial}:a",
                           result="ok", fence=lease.fence)  # fmt: skip
        return lease.fence  # never released: it expires

    def batch(self, task: Any, plan: list[tuple[int, str]], rng: random.Random) -> None:
        """Run trials ``[(trial, site)]`` at once: faulty worker first, clean one after."""
        queue = unique("fpq")
        expire_by = time.monotonic()
        for trial, site in plan:
            for other in SITES:
                if other != site:
                    (self.once / f"trial-{trial}.{other}").touch()
            if site == "inside_renew":  # held back until the body's hold (eo_tasks)
                (self.once / f"trial-{trial}.inside_renew").touch()
                (self.once / f"trial-{trial}.inside_renew.at-hold").touch()
            record: dict[str, Any] = {"trial": trial, "site": site, "task": task}
            if site == "inside_reconcile":
                record["earlier_applied"] = rng.random() < 0.5
                record["earlier_fence"] = self.crashed_earlier_owner(
                    trial, record["earlier_applied"]
                )
                expire_by = time.monotonic() + 0.3
            hold = RENEW_HOLD if site == "inside_renew" else 0.1
            record["result"] = task.apply_async(
                (trial, hold), queue=queue, task_id=self.task_id(trial)
            )
            self.trials.append(record)
        control(self.app.app, "add_consumer", queue, self.faulty)
        deadline = time.monotonic() + 60
        wanted = {t for t, _ in plan}
        while {e["trial"] for e in self.events.where(ev="prerun")} & wanted != wanted:
            assert time.monotonic() < deadline, "the faulty worker did not take every trial"
            time.sleep(0.05)
        preruns = [e for e in self.events.where(ev="prerun") if e["trial"] in wanted]
        assert all(self.faulty.owns(e["pid"]) for e in preruns), preruns
        # Every trial sits in a faulty child: stop the faulty worker from taking more, let the
        # clean one take whatever comes back, then let the faulty children run (and die).
        control(self.app.app, "cancel_consumer", queue, self.faulty)
        control(self.app.app, "add_consumer", queue, self.clean)
        while time.monotonic() < expire_by:  # the earlier owners' leases have expired
            time.sleep(0.05)
        self.coord.mset({self.events.key_for(f"go:{t}"): 1 for t, _ in plan})
        for record in self.trials[-len(plan) :]:
            record["value"] = record["result"].get(timeout=90)


def fired(matrix: Matrix, record: dict[str, Any]) -> bool:
    """Whether the trial's site fired (its once-marker was created, right before the kill)."""
    marker = matrix.once / f"trial-{record['trial']}.{record['site']}"
    held_back = marker.with_name(f"{marker.name}.at-hold")  # never armed: the pre-made marker
    return marker.exists() and not held_back.exists()


def run_matrix(matrix: Matrix, seed: int) -> None:
    """RUNS_PER_SITE kills at each site, in batches of BATCH trials on distinct resources.

    Under load a faulty child can lose its lease (no renewal within ttl - margin: its renewal
    thread starved) before its body reaches the site; such a trial still has to end as one
    execution (checked), and a top-up batch replaces it so that every site gets its kills.
    """
    rng = random.Random(seed)
    plan = [(n, SITES[n % len(SITES)]) for n in range(RUNS_PER_SITE * len(SITES))]
    rng.shuffle(plan)
    for start in range(0, len(plan), BATCH):
        matrix.batch(matrix.app.eo.failpoint_job, plan[start : start + BATCH], rng)
    for _ in range(2):
        kills = Counter(r["site"] for r in matrix.trials if fired(matrix, r))
        missing = [site for site in SITES for _ in range(RUNS_PER_SITE - kills[site])]
        if not missing:
            return
        first = max(r["trial"] for r in matrix.trials) + 1
        top_up = [(first + k, site) for k, site in enumerate(missing)]
        matrix.batch(matrix.app.eo.failpoint_job, top_up, rng)


def check_trial(matrix: Matrix, record: dict[str, Any], log: list[dict[str, Any]]) -> str:
    """Assert one trial ended as one execution; returns how the clean worker finished it."""
    t, site = record["trial"], record["site"]
    result = record["result"]
    assert result.state == "SUCCESS", (t, site, result.state)
    firsts = {key: matrix.sink.first(f"fp-{t}:{key}") for key in ("a", "b")}
    assert record["value"] == {"trial": t, **firsts}, (t, site, record["value"], firsts)
    info = matrix.store.identity_get(f"fp-{t}", matrix.task_id(t))
    assert info is not None and info.state == "done", (t, site, info)
    assert matrix.store.get(f"fp-{t}") is None, f"trial {t}: lease left behind"
    starts = [e for e in log if e["ev"] == "start" and e["trial"] == t]
    clean = [e for e in starts if matrix.clean.owns(e["pid"])]
    reconciles = [e for e in log if e["ev"] == "reconcile" and e["trial"] == t]
    if not fired(matrix, record):  # the lease was lost to load before the site was reached
        return "not killed: lease lost first"
    if site == "after_ledger_before_ack":
        # Completed and recorded before the kill: the redelivery is a duplicate, not a run.
        assert not clean, (t, site, starts)
        return "duplicate"
    assert len(clean) == 1 and clean[0]["recovered"], (t, site, starts)
    if site == "after_effect_before_ledger":
        assert [(e["key"], e["found"]) for e in reconciles] == [("a", True)], reconciles
        return "reconciled: found"
    if site == "inside_reconcile":
        found = record["earlier_applied"]
        assert [(e["key"], e["found"]) for e in reconciles] == [("a", found)], reconciles
        # The recovered run reports the dead faulty run (it took over its expired lease).
        return f"reconciled: {'found' if found else 'REDO'}"
    assert not reconciles, (t, site, reconciles)
    return f"recovered, checkpoints {clean[0]['checkpoints']}"


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_a_kill_at_any_failpoint_ends_as_one_execution(
    it_app, make_sink, start_worker, store_env, events, coord, tmp_path, request, kind
):
    """6 sites x 10 runs: each effect applied once at the sink, SUCCESS, identity done."""
    matrix = Matrix(
        it_app, make_sink, start_worker, store_env, events, coord, tmp_path, request, kind
    )
    seed = random.randrange(1 << 30)
    print(f"seed={seed} N={RUNS_PER_SITE} per site x {len(SITES)} sites store={kind} ttl={TTL}")
    started = time.monotonic()
    run_matrix(matrix, seed)
    elapsed = time.monotonic() - started
    log = events.all()
    counts = matrix.sink.counts()
    outcomes = {r["trial"]: check_trial(matrix, r, log) for r in matrix.trials}
    report = check(load(matrix.env["CL_HISTORY"]))
    assert set(counts.values()) == {1} and len(counts) == 2 * len(matrix.trials), counts
    report.assert_clean()
    lost = matrix.faulty.log().count("exited with 'signal 9 (SIGKILL)'")
    per_site: dict[str, Counter[str]] = {site: Counter() for site in SITES}
    for record in matrix.trials:
        per_site[record["site"]][outcomes[record["trial"]]] += 1
    kills = Counter(r["site"] for r in matrix.trials if fired(matrix, r))
    for site, outcome in per_site.items():
        print(f"  {site:27s} {kills[site]} runs killed there: {dict(outcome)}")
    print(
        f"{len(matrix.trials)} trials, {lost} pool children SIGKILLed in the faulty worker, "
        f"{sum(counts.values())} effects at the sink (2 per trial), history "
        f"{report.events} events clean; {elapsed:.1f}s"
    )
    assert all(kills[site] >= RUNS_PER_SITE for site in SITES), kills
    assert lost == sum(kills.values())  # one death per fired trial, at its site


def test_negative_control_without_ledger_or_with_blind_reconcile_effects_double(
    it_app, make_sink, start_worker, store_env, events, coord, tmp_path, request
):
    """No ledger (kill in release) or a blind REDO hook (kill before done): doubled effects."""
    matrix = Matrix(
        it_app, make_sink, start_worker, store_env, events, coord, tmp_path, request, "redis"
    )
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed={seed} N=3+3")
    matrix.batch(it_app.eo.failpoint_plain, [(n, "inside_release") for n in range(3)], rng)
    matrix.batch(
        it_app.eo.failpoint_blind, [(n, "after_effect_before_ledger") for n in range(3, 6)], rng
    )
    counts = matrix.sink.counts()
    report = check(load(matrix.env["CL_HISTORY"]))
    doubled = sorted(k for k, v in counts.items() if v > 1)
    print(f"doubled at the sink: {doubled}; checker: {report.violations[:2]}")
    # Without the ledger both effects repeat; with a blind hook effect a repeats.
    assert {f"fp-{n}:{k}" for n in range(3) for k in "ab"} <= set(doubled)
    assert {f"fp-{n}:a" for n in range(3, 6)} <= set(doubled)
    with pytest.raises(AssertionError, match="took effect 2 times"):
        report.assert_clean()
