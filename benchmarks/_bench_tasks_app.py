"""The Celery app that ``bench_tasks.py`` runs in a real prefork worker (and publishes from).

Configured entirely from ``CELERY_LEASE_BENCH_*`` environment variables set by the benchmark,
so the worker subprocess and the publishing process build the same app. Every task is a no-op
taking ``(i, run)``: ``i`` numbers the task within a run (the lease resource is ``bench-{i}``,
so no two tasks of a run contend; it is also the ``unique=`` variants' key, free again once
the run is drained), ``run`` tags the run (it keeps celery-once and
celery-singleton keys unique per run). Results are ignored for every task.

Timing is the worker's own: ``task_prerun`` / ``task_postrun`` (sent around ``Task.__call__``,
so around the lease claim and release too) keep, per pool process and run, the first start, the
last end and the count, in memory. After a run the benchmark sends ``bench.report`` tasks on the
control queue; each writes its process's figures to the report Redis. Nothing is written per
task, so the measurement adds no round trip.

``CELERY_LEASE_BENCH_PROFILE=<dir>`` (bench-only) runs ``cProfile`` around the tasks named in
``CELERY_LEASE_BENCH_PROFILE_TASKS`` (comma list; all bench tasks when empty), from prerun to
postrun, in each pool process; ``bench.report`` dumps the stats to ``<dir>/<pid>.prof``. The
profiler's clock is wall time, or the process's CPU time with
``CELERY_LEASE_BENCH_PROFILE_CLOCK=cpu`` (then waiting for a server costs nothing).
"""

from __future__ import annotations

import cProfile
import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

import celery_lease
from celery_lease import current_lease, lease_task
from celery_lease.metrics import snapshot as lease_metrics

env = os.environ
PREFIX = "CELERY_LEASE_BENCH_"
LOCK_TTL = 60  # seconds: the lease ttl (60 s default), celery-once and celery-singleton alike

app = Celery("celery_lease_bench_tasks", broker=env.get(f"{PREFIX}BROKER", "memory://"))
app.conf.update(
    task_ignore_result=True,
    result_backend=None,
    # Acked after the task returns: an empty queue with no unacked message means every task
    # is done. (Kombu's Redis transport records and clears every delivery in its unacked hash,
    # early or late ack alike, so this costs no extra round trip.)
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    task_default_queue=env.get(f"{PREFIX}CONTROL_QUEUE", "celery"),
    worker_hijack_root_logger=True,
    lease_store_url=env.get(f"{PREFIX}REDIS_STORE", ""),
    lease_key_prefix=env.get(f"{PREFIX}KEY_PREFIX", "celery_lease_bench:"),
    lease_table_prefix=env.get(f"{PREFIX}TABLE_PREFIX", "celery_lease_bench_"),
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {
            "url": env.get(f"{PREFIX}LOCKS", "redis://127.0.0.1:6379/1"),
            "default_timeout": LOCK_TTL,
        },
    },
    singleton_backend_url=env.get(f"{PREFIX}LOCKS", "redis://127.0.0.1:6379/1"),
    singleton_key_prefix="celery_lease_bench_singleton:",
    singleton_lock_expiry=LOCK_TTL,
)

PG_STORE = env.get(f"{PREFIX}PG_STORE", "")
RESOURCE = "bench-{i}"


# -- the variants ---------------------------------------------------------------------------
@app.task(name="bench.plain", ignore_result=True)
def plain(i: int, run: str) -> None:
    """Plain Celery: the baseline."""


@lease_task(
    resource=RESOURCE, identity=False, app=app, name="bench.lease_redis", ignore_result=True
)
def lease_redis(i: int, run: str) -> None:
    """A lease on the Redis store, no identity."""


@lease_task(resource=RESOURCE, app=app, name="bench.lease_redis_id", ignore_result=True)
def lease_redis_id(i: int, run: str) -> None:
    """A lease on the Redis store, identity on (the default: the task id)."""


@lease_task(resource=RESOURCE, app=app, name="bench.lease_redis_id_effect", ignore_result=True)
def lease_redis_id_effect(i: int, run: str) -> None:
    """Identity on and one ledgered effect (2 more store round trips)."""
    current_lease().effect("e")(lambda: 1)


@lease_task(
    resource=RESOURCE,
    unique="until_executed",
    app=app,
    name="bench.lease_redis_unique",
    ignore_result=True,
)
def lease_redis_unique(i: int, run: str) -> None:
    """unique="until_executed" on the Redis store (identity on): a lock taken at publish and
    given back when the execution ends, besides the run's claim and release."""


if PG_STORE:

    @lease_task(
        resource=RESOURCE,
        identity=False,
        store_url=PG_STORE,
        app=app,
        name="bench.lease_pg",
        ignore_result=True,
    )
    def lease_pg(i: int, run: str) -> None:
        """A lease on the PostgreSQL store, no identity."""

    @lease_task(
        resource=RESOURCE, store_url=PG_STORE, app=app, name="bench.lease_pg_id", ignore_result=True
    )
    def lease_pg_id(i: int, run: str) -> None:
        """A lease on the PostgreSQL store, identity on."""

    @lease_task(
        resource=RESOURCE,
        store_url=PG_STORE,
        app=app,
        name="bench.lease_pg_id_effect",
        ignore_result=True,
    )
    def lease_pg_id_effect(i: int, run: str) -> None:
        """PostgreSQL, identity on and one ledgered effect."""
        current_lease().effect("e")(lambda: 1)

    @lease_task(
        resource=RESOURCE,
        unique="until_executed",
        store_url=PG_STORE,
        app=app,
        name="bench.lease_pg_unique",
        ignore_result=True,
    )
    def lease_pg_unique(i: int, run: str) -> None:
        """unique="until_executed" on the PostgreSQL store (identity on)."""


# celery-once takes its lock in apply_async (at enqueue) and clears it in after_return.
@app.task(
    base=QueueOnce,
    once={"graceful": False, "keys": ["i", "run"], "timeout": LOCK_TTL},
    name="bench.once",
    ignore_result=True,
)
def once(i: int, run: str) -> None:
    """celery-once (QueueOnce, Redis backend)."""


# celery-singleton takes its lock in apply_async and deletes it in on_success/on_failure.
@app.task(base=Singleton, name="bench.singleton", ignore_result=True)
def singleton(i: int, run: str) -> None:
    """celery-singleton (Singleton, Redis backend)."""


BENCH_TASKS = frozenset(name for name in app.tasks if name.startswith("bench.")) - {"bench.report"}


# -- the worker's own timing ------------------------------------------------------------------
# run -> [first start, last end, tasks done, tasks not SUCCESS] (time.monotonic(), one clock
# for every process on the machine)
_stats: dict[str, list[Any]] = {}
_profile_dir = env.get(f"{PREFIX}PROFILE", "")
_profile_tasks = frozenset(filter(None, env.get(f"{PREFIX}PROFILE_TASKS", "").split(",")))
_profiler: cProfile.Profile | None = None
_report_client: redis.Redis | None = None
_report_pid: int | None = None


@signals.task_prerun.connect
def _prerun(task: Any = None, args: Any = None, **_: Any) -> None:
    name = task.name
    if name not in BENCH_TASKS:
        return
    run = args[1]
    stats = _stats.get(run)
    if stats is None:
        now = time.monotonic()
        _stats[run] = [now, now, 0, 0]
    if _profile_dir and (not _profile_tasks or name in _profile_tasks):
        global _profiler  # noqa: PLW0603 - one profiler per pool process, made on first use
        if _profiler is None:
            cpu = env.get(f"{PREFIX}PROFILE_CLOCK", "") == "cpu"
            _profiler = cProfile.Profile(time.process_time) if cpu else cProfile.Profile()
        _profiler.enable()


@signals.task_postrun.connect
def _postrun(task: Any = None, args: Any = None, state: Any = None, **_: Any) -> None:
    if task.name not in BENCH_TASKS:
        return
    if _profiler is not None:
        _profiler.disable()
    stats = _stats[args[1]]
    stats[1] = time.monotonic()
    stats[2] += 1
    if state != "SUCCESS":
        stats[3] += 1


def _reporter() -> redis.Redis:
    global _report_client, _report_pid  # noqa: PLW0603 - remade after fork
    if _report_client is None or _report_pid != os.getpid():
        _report_client = redis.Redis.from_url(env[f"{PREFIX}REPORT"], socket_timeout=10)
        _report_pid = os.getpid()
    return _report_client


@app.task(name="bench.report", ignore_result=True)
def report(run: str, key: str) -> None:
    """Write this pool process's figures for ``run`` (and its lease counters) to ``key``."""
    stats = _stats.get(run)
    payload = {
        "pid": os.getpid(),
        "first_start": None if stats is None else stats[0],
        "last_end": None if stats is None else stats[1],
        "done": 0 if stats is None else stats[2],
        "failed": 0 if stats is None else stats[3],
        "metrics": lease_metrics(),
        "celery_lease_file": celery_lease.__file__,
    }
    if _profiler is not None:
        _profiler.dump_stats(os.path.join(_profile_dir, f"{os.getpid()}.prof"))
    _reporter().hset(key, str(os.getpid()), json.dumps(payload))
