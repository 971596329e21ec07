"""The Celery app that ``bench_hot.py`` runs in real workers (and publishes from).

Configured from ``CELERY_LEASE_HOT_*`` environment variables set by the benchmark, so the
worker subprocesses and the publishing process build the same app. Every task takes
``(i, run, hold)``: ``i`` is its place in the publish order, ``run`` tags the run (and names
the one resource every task of the run contends for, ``hot/<run>``), ``hold`` is how long the
body sleeps.

What each task does is written to the report Redis (its own server, never the store), one
``RPUSH`` per attempt, after the attempt ends (``task_postrun``, after the lease release):
``{"i", "pid", "attempt_at", "start", "end", "state", "calls", "answered_at"}`` where
``attempt_at`` is when the attempt called ``acquire`` (its arrival at the store, give or take
the client's own delays) and ``answered_at`` when that call's answer came back,
``start``/``end`` bracket the body (absent when the attempt did not run it) and ``calls`` counts
the lease store calls this attempt made (acquire, release, ... counted in-process by wrapping
the store methods, whatever the store). Where a hand-off's time goes: ``prerun_at`` (the worker
started the attempt), ``woken_at`` (the wake that sent it was published: its header, absent for
a copy nobody woke), ``waits``, and ``release_at``/``released_at`` (the release sent, answered).
Times are ``time.time()`` (one clock for every process on the machine).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_lease import lease_task
from celery_lease.stores.base import BaseLeaseStore

env = os.environ
PREFIX = "CELERY_LEASE_HOT_"

app = Celery("celery_lease_bench_hot", broker=env.get(f"{PREFIX}BROKER", "memory://"))
app.conf.update(
    task_ignore_result=True,
    result_backend=None,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600},
    worker_hijack_root_logger=True,
    lease_store_url=env.get(f"{PREFIX}REDIS_STORE", "") or "sqlite://",
    lease_key_prefix="celery_lease_hot:",
    lease_table_prefix="celery_lease_hot_",
    lease_handoff=True,
    lease_handoff_early_wake=env.get(f"{PREFIX}EARLY_WAKE", "1") == "1",
)

RESOURCE = "hot/{run}"
STORES = {
    "redis": env.get(f"{PREFIX}REDIS_STORE", ""),
    "postgres": env.get(f"{PREFIX}PG_STORE", ""),
    "sqlite": env.get(f"{PREFIX}SQLITE_STORE", ""),
}

_local = threading.local()
_report_client: redis.Redis | None = None
_report_pid: int | None = None


def _body(i: int, run: str, hold: float) -> None:
    _local.start = time.time()
    time.sleep(hold)
    _local.end = time.time()


for _store, _url in STORES.items():
    if _url:
        lease_task(
            resource=RESOURCE,
            store_url=_url,
            app=app,
            name=f"hot.lease_{_store}",
            ignore_result=True,
        )(_body)


@app.task(name="hot.dedicated", ignore_result=True)
def dedicated(i: int, run: str, hold: float) -> None:
    """The workaround: a plain task on a queue of its own, consumed by one ``-c 1`` worker."""
    _body(i, run, hold)


@app.task(name="hot.relay", ignore_result=True)
def relay(i: int, run: str, hold: float, n: int = 0) -> None:
    """The floor of any hand-off that travels through the broker: a plain task that sends the
    next one (``i + 1``) when its body ends, as a release sends a woken waiter's message, with
    no store and no waiting copies (only the first task is published)."""
    _body(i, run, hold)
    if i + 1 < n:
        app.signature("hot.relay", args=(i + 1, run, hold, n)).apply_async(
            queue=relay.request.delivery_info.get("routing_key")
        )


HOT_TASKS = frozenset(name for name in app.tasks if name.startswith("hot."))


# -- counting store calls --------------------------------------------------------------------
def _counted(method: Any) -> Any:
    first_claim = method.__name__ == "acquire"
    release = method.__name__ == "release"

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        _local.calls = getattr(_local, "calls", 0) + 1
        if release:
            _local.release_at = time.time()
            try:
                return method(self, *args, **kwargs)
            finally:
                _local.released_at = time.time()
        if not first_claim or getattr(_local, "claim_at", None) is not None:
            return method(self, *args, **kwargs)
        _local.claim_at = time.time()  # the attempt's arrival, as near the store as we see
        try:
            return method(self, *args, **kwargs)
        finally:
            _local.answered_at = time.time()  # the store's answer came back: it was queued

    return call


def _count_store_calls() -> None:
    from celery_lease.stores.memory import MemoryLeaseStore
    from celery_lease.stores.redis import RedisLeaseStore

    classes: list[type[BaseLeaseStore]] = [RedisLeaseStore, MemoryLeaseStore]
    try:
        from celery_lease.stores.sql import SQLLeaseStore

        classes.append(SQLLeaseStore)
    except ImportError:  # pragma: no cover - depends on the install
        pass
    # Every operation a task's attempt may send (the renewer's calls run in its own thread
    # and are not counted: at the default ttl of 60 s a short body is never renewed).
    names = ("acquire", "release", "wake", "verify", "renew", "renew_many")
    for cls in classes:
        for name in names:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_hot_counted", False):
                wrapped = _counted(method)
                wrapped._hot_counted = True  # type: ignore[attr-defined]
                setattr(cls, name, wrapped)


_count_store_calls()


# -- the report --------------------------------------------------------------------------------
def _reporter() -> redis.Redis:
    global _report_client, _report_pid  # noqa: PLW0603 - remade after fork
    if _report_client is None or _report_pid != os.getpid():
        _report_client = redis.Redis.from_url(env[f"{PREFIX}REPORT"], socket_timeout=10)
        _report_pid = os.getpid()
    return _report_client


@signals.task_prerun.connect
def _prerun(task: Any = None, **_: Any) -> None:
    if task.name not in HOT_TASKS:
        return
    _local.attempt_at = time.time()
    _local.start = _local.end = _local.claim_at = _local.answered_at = None
    _local.release_at = _local.released_at = None
    headers = getattr(task.request, "headers", None) or {}
    _local.woken_at = task.request.get("celery_lease_woken_at") or headers.get(
        "celery_lease_woken_at"
    )
    _local.waits = task.request.get("celery_lease_waits") or headers.get("celery_lease_waits")
    _local.calls = 0


@signals.task_postrun.connect
def _postrun(task: Any = None, args: Any = None, state: Any = None, **_: Any) -> None:
    if task.name not in HOT_TASKS:
        return
    i, run = args[0], args[1]
    record = {
        "i": i,
        "pid": os.getpid(),
        "attempt_at": getattr(_local, "claim_at", None) or _local.attempt_at,
        "start": _local.start,
        "end": _local.end,
        "state": state,
        "calls": getattr(_local, "calls", 0),
        "answered_at": getattr(_local, "answered_at", None),
        # where a hand-off's time goes: the wake's publish time (its header), when the worker
        # ran the attempt, and when the release was sent and came back
        "prerun_at": _local.attempt_at,
        "woken_at": getattr(_local, "woken_at", None),
        "waits": getattr(_local, "waits", None),
        "release_at": getattr(_local, "release_at", None),
        "released_at": getattr(_local, "released_at", None),
    }
    _reporter().rpush(f"hot:{run}", json.dumps(record))
