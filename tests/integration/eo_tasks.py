"""Exactly-once tasks for the integration tests: ledgered effects on a sink the test can count.

Imported by ``worker_app`` (so real workers register these tasks) and by the tests (to publish
them and to read the sink, :class:`tests.integration.sink.Sink`). Configured from the
environment like the rest of the app (``CL_SINK``, ``CL_SINK_NAME``, ``CL_HISTORY``: see
:mod:`tests.integration.sink`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from celery import signals

from celery_lease import REDO, Lease, current_lease, lease_task, shielded
from celery_lease.fencing import fenced_update
from tests.integration.sink import Sink, hist, record_acquire
from tests.integration.worker_app import app, coord, report, wait_for_key

__all__ = ["Sink", "sink"]

env = os.environ

# -- the sink of this process ----------------------------------------------------------------------
_sink: Sink | None = None


def sink() -> Sink:
    global _sink  # noqa: PLW0603
    if _sink is None:
        _sink = Sink(env.get("CL_SINK", ""), env.get("CL_SINK_NAME", "sink"))
    return _sink


def apply_effect(idem: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Append ``payload`` as one application of effect ``idem`` and record it in the history.

    One step for a lease interrupt (held back until both are done), so the history never misses
    an application that took place.
    """
    with shielded():
        sink().append(idem, payload)
        hist(op="effect", idem=idem, result="ok", fence=payload.get("fence"))
    return payload


# -- duplicates ------------------------------------------------------------------------------------
def _dup_body(task: Any, n: int, hold: float, ledger: bool) -> dict[str, Any]:
    lease = current_lease()
    record_acquire(lease)
    time.sleep(hold)
    request = task.request
    idem = (
        lease.identity
        or request.get("idempotency_key")
        or (request.headers or {}).get("idempotency_key")
        or request.id
    )

    def apply() -> dict[str, Any]:
        payload = {"n": n, "fence": lease.fence, "pid": os.getpid(), "task": task.request.id}
        return apply_effect(idem, payload)

    receipt = lease.effect("append")(apply) if ledger else apply()
    return {"n": n, "identity": lease.identity, "fence": lease.fence, "receipt": receipt}


@lease_task(app=app, resource="dup-{n}", bind=True, ttl=3.0)
def dup_effect(self: Any, n: int, hold: float = 0.0) -> dict[str, Any]:
    """One ledgered append per identity (the idempotency_key header, else the task id)."""
    return _dup_body(self, n, hold, ledger=True)


@lease_task(app=app, resource="dup-{n}", bind=True, ttl=3.0, identity=False)
def dup_plain(self: Any, n: int, hold: float = 0.0) -> dict[str, Any]:
    """Negative control: no identity, no ledger; every delivery appends."""
    return _dup_body(self, n, hold, ledger=False)


# -- a redelivery while the original runs, then the original's worker dies -----------------------
def _redelivery_body(task: Any, n: int) -> dict[str, Any]:
    lease = current_lease()
    attempt = coord().incr(f"{env['CL_EVENTS']}:attempts:{n}")
    report(
        "start",
        res=n,
        fence=lease.fence,
        attempt=attempt,
        recovered=lease.recovered,
        task=task.request.id,
    )
    idem = f"redeliv-{n}"

    def step(name: str) -> dict[str, Any]:
        payload = {"step": name, "fence": lease.fence, "pid": os.getpid()}
        return apply_effect(f"{idem}:{name}", payload)

    first = lease.effect("step1")(lambda: step("step1"))
    if attempt == 1:
        coord().set(f"{env['CL_EVENTS']}:ready:{n}", os.getpid())
        time.sleep(120)  # the test kills this worker meanwhile
    second = lease.effect("step2")(lambda: step("step2"))
    report("done", res=n, fence=lease.fence, attempt=attempt)
    return {"fence": lease.fence, "recovered": lease.recovered, "step1": first, "step2": second}


@lease_task(app=app, resource="redeliv-{n}", bind=True, ttl=1.0)
def long_original(self: Any, n: int) -> dict[str, Any]:
    """Step 1, then a long wait (first attempt), then step 2; both ledgered."""
    return _redelivery_body(self, n)


@lease_task(app=app, resource="redeliv-{n}", bind=True, ttl=1.0, on_busy="skip")
def long_original_skip(self: Any, n: int) -> dict[str, Any]:
    """Negative control (with ``CL_DUPLICATE_REARM=off``): a busy duplicate is acked."""
    return _redelivery_body(self, n)


# -- the failpoint matrix -------------------------------------------------------------------------
def fp_reconcile(key: str, lease: Lease) -> Any:
    """Look at the sink: did the earlier owner's effect ``key`` take place?"""
    trial = int(lease.resource.rsplit("-", 1)[1])
    with shielded():  # (a driver call: see Sink._increment_sql)
        found = sink().first(f"fp-{trial}:{key}")
    report("reconcile", trial=trial, key=key, found=found is not None, fence=lease.fence)
    return REDO if found is None else found


def _arm_held_back_failpoint() -> None:
    """Arm ``inside_renew`` if the test held it back until here (``<marker>.at-hold``).

    The first renewal is due an interval after the claim was sent: with 20 trials starting at
    once on 2 cores it could fall inside effect ``a`` instead of the hold that follows it. Held
    back until here, the renewal it kills is one during the hold, after ``a`` was recorded.
    """
    once = os.environ.get("CELERY_LEASE_FAILPOINTS_ONCE")
    if not once or not os.path.exists(f"{once}.inside_renew.at-hold"):
        return
    # The note first, then the marker: the renewal thread may fire between the two unlinks
    # (os.unlink lets go of the GIL). In the other order it found the marker gone and the
    # note still there, killed the child, and the test counted a death at no armed site.
    os.unlink(f"{once}.inside_renew.at-hold")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{once}.inside_renew")  # the marker that held it back: now it may fire


def _failpoint_body(task: Any, trial: int, hold: float) -> dict[str, Any]:
    lease = current_lease()
    record_acquire(lease)
    report(
        "start",
        trial=trial,
        fence=lease.fence,
        recovered=lease.recovered,
        state=lease.identity_state,
        checkpoints=sorted(lease.checkpoints),
        task=task.request.id,
    )

    def apply(key: str) -> dict[str, Any]:
        payload = {"trial": trial, "key": key, "fence": lease.fence, "pid": os.getpid()}
        return apply_effect(f"fp-{trial}:{key}", payload)

    a = lease.effect("a")(lambda: apply("a"))
    lease.checkpoint("a", a)
    _arm_held_back_failpoint()
    time.sleep(hold)
    b = lease.effect("b")(lambda: apply("b"))
    lease.checkpoint("b", b)
    report("done", trial=trial, fence=lease.fence)
    return {"trial": trial, "a": a, "b": b}


@lease_task(app=app, resource="fp-{trial}", bind=True, reconcile_effect=fp_reconcile)
def failpoint_job(self: Any, trial: int, hold: float = 0.1) -> dict[str, Any]:
    """Effect a, checkpoint, a hold (a renewal happens), effect b, checkpoint."""
    return _failpoint_body(self, trial, hold)


@lease_task(app=app, resource="fp-{trial}", bind=True, reconcile_effect=lambda key, lease: REDO)
def failpoint_blind(self: Any, trial: int, hold: float = 0.1) -> dict[str, Any]:
    """Negative control: a reconcile hook that never looks and always answers REDO."""
    return _failpoint_body(self, trial, hold)


@lease_task(app=app, resource="fp-{trial}", bind=True, identity=False)
def failpoint_plain(self: Any, trial: int, hold: float = 0.1) -> dict[str, Any]:
    """Negative control: the same effects without identity or ledger."""
    lease = current_lease()
    record_acquire(lease)
    out: dict[str, Any] = {"trial": trial}
    for key in ("a", "b"):
        payload = {"trial": trial, "key": key, "fence": lease.fence, "pid": os.getpid()}
        out[key] = apply_effect(f"fp-{trial}:{key}", payload)
        time.sleep(hold / 2)
    return out


@signals.task_prerun.connect
def _arm_failpoints_once(
    sender: Any = None, task_id: Any = None, args: Any = None, **_: Any
) -> None:
    """On a worker with failpoints: a once-marker per trial, and wait for the test's "go".

    ``CELERY_LEASE_FAILPOINTS_ONCE`` is read at each hit, so pointing it at this trial's marker
    path before the task runs makes every armed site fire at most once per trial (the test
    pre-creates the markers of the sites a trial does not target).
    """
    once_dir = env.get("CL_FP_ONCE_DIR")
    if not once_dir or not env.get("CELERY_LEASE_FAILPOINTS") or sender is None:
        return
    if sender.name not in (failpoint_job.name, failpoint_blind.name, failpoint_plain.name):
        return
    trial = int(args[0])
    os.environ["CELERY_LEASE_FAILPOINTS_ONCE"] = f"{once_dir}/trial-{trial}"
    report("prerun", trial=trial, task=task_id)
    wait_for_key(f"{env['CL_EVENTS']}:go:{trial}", timeout=120, poll=0.02)


# -- one counter, many executors, a pausing nemesis -----------------------------------------------
def counter_reconcile(key: str, lease: Lease) -> Any:
    """Did the earlier owner's increment land? Stamp the fence, then read the applied record
    (see Sink.fence_then_applied: looked at first, a frozen owner's write could land after)."""
    i = int(key.split(":", 1)[1])
    found = sink().fence_then_applied(i, lease)
    hist(op="reconcile", i=i, found=len(found))
    return REDO if not found else found[0]


def plain_counter_reconcile(key: str, lease: Lease) -> Any:
    """The negative control's: the applied record, read without a stamp (no fences there)."""
    i = int(key.split(":", 1)[1])
    with shielded():  # (a driver call: see Sink._increment_sql)
        found = sink().applied(i)
    hist(op="reconcile", i=i, found=len(found))
    return REDO if not found else found[0]


def _increment(task: Any, i: int, fenced: bool, window: float) -> dict[str, Any]:
    lease = current_lease()
    record_acquire(lease)
    return lease.effect(f"inc:{i}")(
        lambda: sink().increment(i, lease, fenced=fenced, window=window)
    )


@lease_task(
    app=app,
    resource="counter",
    bind=True,
    reconcile_effect=counter_reconcile,
    lost_max_retries=50,
    busy_max_waits=5000,
)
def fenced_increment(self: Any, i: int, window: float = 0.01) -> dict[str, Any]:
    """Increment ``i`` of the shared counter: a ledgered, fenced read-modify-write."""
    return _increment(self, i, True, window)


@lease_task(
    app=app,
    resource="counter",
    bind=True,
    reconcile_effect=plain_counter_reconcile,
    lost_max_retries=50,
    busy_max_waits=5000,
)
def plain_increment(self: Any, i: int, window: float = 0.01) -> dict[str, Any]:
    """Negative control: the same increment with a plain (unfenced) read and write."""
    return _increment(self, i, False, window)


@signals.task_prerun.connect
def _report_delivery(sender: Any = None, task_id: Any = None, task: Any = None, **_: Any) -> None:
    """Count each delivery of a duplicate-scenario task, and whether the broker redelivered it."""
    if sender is None or sender.name not in (dup_effect.name, dup_plain.name):
        return
    request = task.request
    redelivered = bool(
        (request.delivery_info or {}).get("redelivered") or request.get("redelivered")
    )
    key = f"{env['CL_EVENTS']}:deliveries"
    pipe = coord().pipeline(transaction=False)
    pipe.hincrby(key, "total", 1)
    if redelivered:
        pipe.hincrby(key, "redelivered", 1)
        pipe.sadd(f"{key}:redelivered", task_id)
    pipe.execute()


# -- a fenced SQL write interrupted mid-statement -------------------------------------------------
@lease_task(app=app, resource="row-{n}", bind=True)
def fenced_row_write(self: Any, n: int) -> int:
    """One fenced_update of the sink's counter row, the way the fencing guide shows it."""
    lease = current_lease()
    attempt = coord().incr(f"{env['CL_EVENTS']}:attempts:row-{n}")
    report("writing", res=n, fence=lease.fence, attempt=attempt, task=self.request.id)
    table = sink().counter_table
    with sink().engine.begin() as conn:
        fenced_update(conn, table, table.c.id == 1, {"value": attempt}, lease)
    report("written", res=n, fence=lease.fence, attempt=attempt)
    return lease.fence


@signals.task_success.connect
def _report_increment(sender: Any = None, result: Any = None, **_: Any) -> None:
    """Report each increment the worker saw succeed (right before it acks the message).

    The lost-update test counts acknowledged increments here rather than in the result
    backend, whose guard against overwriting SUCCESS is a read then a write: a stale execution
    of the same task id (one that re-armed itself and was then paused) can store RETRY over
    SUCCESS (reported, with the run that showed it, in the test's module docstring).
    """
    if sender is None or sender.name not in (fenced_increment.name, plain_increment.name):
        return
    coord().hset(f"{env['CL_EVENTS']}:success", sender.request.id, json.dumps(result))
