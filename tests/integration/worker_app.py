"""The Celery app that the integration tests run in real ``celery worker`` processes.

Configured entirely from the environment (``CL_*`` variables set by the test harness), so each
test can point its workers at its own store, queue and coordination keys. Task bodies report to
the test through a coordination Redis (``CL_COORD``): an append-only event list (a single list
gives a total order of enter/exit events across processes), readiness flags and go signals.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery

from celery_lease import (
    FenceGate,
    LeaseLostError,
    StaleFenceError,
    current_lease,
    lease_task,
)

env = os.environ
app = Celery("lease_it", broker=env.get("CL_BROKER", "memory://"))
app.conf.update(
    result_backend=env.get("CL_BACKEND", env.get("CL_BROKER", "cache+memory://")),
    lease_store_url=env.get("CL_STORE", "memory://"),
    lease_ttl=float(env.get("CL_TTL", "1.0")),
    lease_key_prefix=env.get("CL_PREFIX", "celery_lease:"),
    lease_table_prefix=env.get("CL_TABLE_PREFIX", "celery_lease_"),
    lease_busy_backoff_base=float(env.get("CL_BACKOFF_BASE", "0.05")),
    lease_busy_backoff_cap=float(env.get("CL_BACKOFF_CAP", "0.3")),
    lease_lost_retry_delay=float(env.get("CL_LOST_DELAY", "0.2")),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=env.get("CL_QUEUE", "celery"),
    result_expires=600,
)

_coord: redis.Redis | None = None
_coord_pid: int | None = None
_gate: FenceGate | None = None


def coord() -> redis.Redis:
    """This process's client of the coordination Redis (remade after fork)."""
    global _coord, _coord_pid  # noqa: PLW0603
    if _coord is None or _coord_pid != os.getpid():
        _coord = redis.Redis.from_url(env["CL_COORD"], socket_timeout=10)
        _coord_pid = os.getpid()
    return _coord


def gate() -> FenceGate:
    global _gate  # noqa: PLW0603
    if _gate is None:
        _gate = FenceGate(
            env.get("CL_GATE", env.get("CL_STORE", "memory://")),
            **_prefix_options(env.get("CL_GATE", env.get("CL_STORE", ""))),
        )
    return _gate


def _prefix_options(url: str) -> dict[str, Any]:
    if url.startswith("redis"):
        return {"key_prefix": env.get("CL_PREFIX", "celery_lease:")}
    if url.startswith(("postgresql", "sqlite")):
        return {"table_prefix": env.get("CL_TABLE_PREFIX", "celery_lease_")}
    return {}


def report(kind: str, **fields: Any) -> None:
    fields.update(ev=kind, pid=os.getpid(), t=time.time())
    coord().rpush(env["CL_EVENTS"], json.dumps(fields))


def wait_for_key(key: str, timeout: float = 60.0, poll: float = 0.002) -> None:
    """Busy-poll a coordination key without touching the lease (a paused owner's view)."""
    deadline = time.monotonic() + timeout
    client = coord()
    while not client.exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(key)
        time.sleep(poll)


@lease_task(app=app, resource="res-{n}", bind=True)
def exclusive(self: Any, n: int, hold: float = 0.05) -> int:
    """Reports enter/exit with its fence around a short hold of resource res-<n>."""
    lease = current_lease()
    assert self.request.lease is lease
    report("enter", res=n, fence=lease.fence, task=self.request.id)
    completed = False
    try:
        time.sleep(hold)
        completed = True
    finally:
        # Also when the body is interrupted (lease lost under load): it has stopped acting
        # before the lease is released, so the exit is still ordered before the next enter.
        report("exit", res=n, fence=lease.fence, task=self.request.id, completed=completed)
    return lease.fence


@lease_task(app=app, resource="paused-{trial}", bind=True)
def paused_writer(self: Any, trial: int, role: str, use_gate: bool = True) -> int:
    """Checks its lease, tells the test it is about to write, waits for "go", then writes.

    The test SIGSTOPs this process between the check and the write (the classic paused owner).
    With ``use_gate`` the write goes through a FenceGate; without it (the negative control) the
    body also ignores the loss signal, as an owner paused mid-write would.
    """
    lease = current_lease()
    key = f"paused-{trial}"
    report("start", trial=trial, role=role, fence=lease.fence, task=self.request.id)
    lease.check()
    if role == "first" and not coord().exists(f"{env['CL_EVENTS']}:done:{trial}"):
        coord().set(f"{env['CL_EVENTS']}:ready:{trial}", os.getpid())
        try:
            wait_for_key(f"{env['CL_EVENTS']}:go:{trial}")
        except LeaseLostError:
            if use_gate:
                report("self_fenced", trial=trial, role=role, fence=lease.fence)
                raise
            wait_for_key(f"{env['CL_EVENTS']}:go:{trial}")
    if use_gate:
        try:
            gate().admit(key, lease.fence)
        except StaleFenceError:
            report("rejected", trial=trial, role=role, fence=lease.fence)
            raise
    report("write", trial=trial, role=role, fence=lease.fence)
    coord().set(f"{env['CL_EVENTS']}:done:{trial}", 1)
    return lease.fence


@lease_task(app=app, resource="slow-{n}", bind=True)
def slow_call(self: Any, n: int, seconds: float) -> dict[str, Any]:
    """Blocks like a slow model call, longer than the ttl; reports how it ended."""
    lease = current_lease()
    report(
        "start",
        res=n,
        fence=lease.fence,
        task=self.request.id,
        attempt=int(self.request.get("celery_lease_lost_retries") or 0),
    )
    try:
        time.sleep(seconds)
    except LeaseLostError as exc:
        report("interrupted", res=n, fence=lease.fence, reason=getattr(exc, "reason", None))
        raise
    report("done", res=n, fence=lease.fence)
    return {"fence": lease.fence, "expires_at": lease.expires_at.isoformat()}


@lease_task(app=app, resource="crash-{n}", bind=True)
def crash_once(self: Any, n: int) -> dict[str, Any]:
    """First run: waits to be SIGKILLed by the test. Later runs: complete."""
    lease = current_lease()
    attempt = coord().incr(f"{env['CL_EVENTS']}:attempts:{n}")
    report("start", res=n, fence=lease.fence, attempt=attempt, recovered=lease.recovered)
    if attempt == 1:
        coord().set(f"{env['CL_EVENTS']}:ready:{n}", os.getpid())
        time.sleep(60)
    report("done", res=n, fence=lease.fence, attempt=attempt)
    return {
        "fence": lease.fence,
        "recovered": lease.recovered,
        "previous_fence": lease.previous_fence,
    }


@lease_task(app=app, resource="busy-{n}", bind=True, max_retries=0)
def no_retries(self: Any, n: int) -> int:
    """max_retries=0: busy waits must not use up the user's retry budget."""
    return current_lease().fence


@lease_task(app=app, resource="threads-{n}", bind=True)
def count_renewers(self: Any, n: int, hold: float) -> int:
    """Holds a lease while others run; reports the renewal threads in this process."""
    report("enter", res=n)
    deadline = time.monotonic() + hold
    counts = []
    while time.monotonic() < deadline:
        counts.append(sum(1 for t in threading.enumerate() if t.name == "celery-lease-renewer"))
        time.sleep(0.05)
    report("renewers", res=n, max=max(counts), min=min(counts))
    return max(counts)
