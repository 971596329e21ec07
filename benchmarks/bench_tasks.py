"""Worker-side cost of a leased Celery task next to a plain one and to celery-once/-singleton.

Runs no-op tasks through a real Redis broker and one real prefork worker (``-c 2``): for each
variant (plain Celery; ``@lease_task`` on the Redis and PostgreSQL stores, identity off and on,
with and without one ledgered effect, and ``unique="until_executed"``; celery-once;
celery-singleton) it fills a fresh queue
first, then lets the worker consume it (``add_consumer``) and measures the worker side only:

* tasks/s from the tasks' own timing (first ``task_prerun`` to last ``task_postrun``, kept in
  memory by each pool process and reported after the run);
* CPU microseconds per task: user+sys of the worker process tree (the celery parent and its pool
  children), the redis-server (broker and lease store) and the PostgreSQL server processes
  (postmaster and all its backends, also those that came and went), read from /proc/<pid>/stat
  before and after the run;
* the whole-system CPU microseconds per task: the worker-side figure plus the enqueue (this
  process publishing, and redis-server and PostgreSQL meanwhile). celery-once,
  celery-singleton and the ``unique=`` variants take their lock at publish time, so the
  worker-side figure alone flatters them; both are reported, each as a ratio to plain Celery
  measured in the same repeat.

Variants run interleaved (``A B C ... | ... C B A | A B C ...``) and every figure is the median
over the repeats; ratios to plain Celery are medians of per-repeat ratios. It is a measurement,
not a test: it prints PASS/FAIL per target and always exits 0 (130 when interrupted). See
``benchmarks/README.md`` for how to run it and how to read the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.tooling.servers and benchmarks.* live in the repository
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_stores import (  # noqa: E402 - needs ROOT on sys.path
    BenchInterrupted,
    cpu_busy,
    cpu_times,
    sigterm_as_interrupt,
)
from benchmarks.bench_stores import environment as base_environment  # noqa: E402

APP_MODULE = "benchmarks._bench_tasks_app"
ENV_PREFIX = "CELERY_LEASE_BENCH_"
KEY_PREFIX = "celery_lease_bench:"
TABLE_PREFIX = "celery_lease_bench_"
PG_DATABASE = "celery_lease_bench"
LOCK_PATTERNS = ("qo_bench.once_*", "celery_lease_bench_singleton:*")
CONCURRENCY = 2
CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SETTLE = 0.3  # seconds between the last publish and the run (let the broker's AOF settle)
POLL = 0.005  # seconds between queue-drain checks
IDLE_SECONDS = 3.0  # idle CPU of the measured processes, measured once after the warm-up
RUN_TIMEOUT = 300.0  # a run that makes no progress for this long fails
REDIS_CPU_TARGET = 1.10
PG_CPU_TARGET = 1.25
IDENTITY_CPU_TARGET = 1.10
WHOLE_CPU_TARGET = 1.18  # issue 10: whole-system CPU of a leased no-op task on Redis vs plain
COMPONENTS = ("worker_parent", "worker_pool", "redis", "postgres")


@dataclass(frozen=True)
class Variant:
    key: str
    task: str
    label: str
    needs_postgres: bool = False
    lease: bool = False


VARIANTS = (
    Variant("plain", "bench.plain", "plain Celery task"),
    Variant("redis", "bench.lease_redis", "lease, Redis store, identity off", lease=True),
    Variant(
        "postgres",
        "bench.lease_pg",
        "lease, PostgreSQL store, identity off",
        needs_postgres=True,
        lease=True,
    ),
    Variant("redis_id", "bench.lease_redis_id", "lease, Redis, identity on", lease=True),
    Variant(
        "redis_id_effect",
        "bench.lease_redis_id_effect",
        "lease, Redis, identity on + 1 effect",
        lease=True,
    ),
    Variant(
        "postgres_id",
        "bench.lease_pg_id",
        "lease, PostgreSQL, identity on",
        needs_postgres=True,
        lease=True,
    ),
    Variant(
        "postgres_id_effect",
        "bench.lease_pg_id_effect",
        "lease, PostgreSQL, identity on + 1 effect",
        needs_postgres=True,
        lease=True,
    ),
    Variant(
        "redis_unique",
        "bench.lease_redis_unique",
        "lease, Redis, identity on, unique=until_executed",
        lease=True,
    ),
    Variant(
        "postgres_unique",
        "bench.lease_pg_unique",
        "lease, PostgreSQL, identity on, unique=until_executed",
        needs_postgres=True,
        lease=True,
    ),
    Variant("once", "bench.once", "celery-once QueueOnce (Redis)"),
    Variant("singleton", "bench.singleton", "celery-singleton Singleton (Redis)"),
)
BY_KEY = {v.key: v for v in VARIANTS}


# -- CPU of process trees, from /proc -----------------------------------------------------------
def proc_table() -> dict[int, tuple[int, int, int]]:
    """Every process: pid -> (ppid, own utime+stime, reaped children's cutime+cstime), ticks."""
    table: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:  # gone meanwhile
            continue
        fields_ = text.rsplit(b")", 1)[1].split()
        # after the command: state ppid ... utime(11) stime(12) cutime(13) cstime(14)
        table[int(entry.name)] = (
            int(fields_[1]),
            int(fields_[11]) + int(fields_[12]),
            int(fields_[13]) + int(fields_[14]),
        )
    return table


def descendants(table: dict[int, tuple[int, int, int]], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def tree_ticks(table: dict[int, tuple[int, int, int]], root: int | None) -> int:
    """CPU ticks of ``root`` and all its descendants, live or exited and reaped.

    A live process counts its own time plus the time of the children it has reaped, so a
    PostgreSQL backend that exited during a run is still counted (in the postmaster's cutime).
    """
    if root is None or root not in table:
        return 0
    return sum(table[pid][1] + table[pid][2] for pid in (root, *descendants(table, root)))


@dataclass
class CpuSnapshot:
    at: float
    ticks: dict[str, int]
    machine: list[int]
    bench: float  # this process's own user+sys seconds (publishing, polling)

    @classmethod
    def take(cls, pids: dict[str, int | None]) -> CpuSnapshot:
        table = proc_table()
        worker = pids.get("worker")
        ticks = {
            "redis": tree_ticks(table, pids.get("redis")),
            "postgres": tree_ticks(table, pids.get("postgres")),
            "worker_parent": 0,
            "worker_pool": 0,
        }
        if worker is not None and worker in table:
            _, own, reaped = table[worker]
            ticks["worker_parent"] = own
            ticks["worker_pool"] = reaped + sum(
                table[pid][1] + table[pid][2] for pid in descendants(table, worker)
            )
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cls(time.monotonic(), ticks, cpu_times(), usage.ru_utime + usage.ru_stime)

    def seconds_since(self, before: CpuSnapshot) -> dict[str, float]:
        return {k: (self.ticks[k] - before.ticks[k]) / CLOCK_TICK for k in self.ticks}


# -- the worker -----------------------------------------------------------------------------------
class BenchWorker:
    """One ``celery worker -P prefork -c 2`` process on the bench app, stopped by its PID."""

    def __init__(self, env: dict[str, str], control_queue: str, name: str, logdir: str) -> None:
        self.name = name
        self.hostname = f"{name}@{socket.gethostname()}"
        self.logfile = Path(logdir) / f"{name}.log"
        self.env = {
            **os.environ,
            **env,
            # The repository (as the working directory is): the worker imports the celery_lease
            # next to this benchmarks/ directory, also when celery loads its CLI plugins.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            APP_MODULE,
            "worker",
            "-P",
            "prefork",
            "-c",
            str(CONCURRENCY),
            "-Q",
            control_queue,
            "-n",
            f"{name}@%h",  # a known name, so control commands reach this worker only
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
            f"--logfile={self.logfile}",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, app: Any, timeout: float = 90.0) -> None:
        with open(self.logfile.with_suffix(".err"), "wb") as stderr:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=stderr
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.proc.returncode}:\n{self.log()}")
            if app.control.ping(destination=[self.hostname], timeout=0.5):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not answer a ping in {timeout:.0f}s")

    def log(self) -> str:
        parts = []
        for path in (self.logfile, self.logfile.with_suffix(".err")):
            with contextlib.suppress(OSError):
                parts.append(path.read_text(errors="replace")[-4000:])
        return "\n".join(parts)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM); SIGKILL it and its pool children if it hangs."""
        if self.proc is None:
            return
        children = descendants(proc_table(), self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *children]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


# -- one run ---------------------------------------------------------------------------------------
@dataclass
class Run:
    variant: str
    rep: int  # -1: warm-up
    tasks: int
    wall: float = 0.0  # first task start to last task done (the worker's own clock)
    window: float = 0.0  # CPU snapshot to snapshot
    cpu: dict[str, float] = field(default_factory=dict)  # seconds per component
    enqueue_seconds: float = 0.0
    enqueue_cpu: dict[str, float] = field(default_factory=dict)  # bench process, redis
    machine_busy: float = float("nan")
    steal: float = float("nan")
    others: float = float("nan")  # fraction of all CPUs used by processes not measured here
    failed: int = 0
    claims: int = 0
    releases: int = 0
    leftover_locks: int = 0
    timing: str = "tasks"  # "tasks", or "window" when the pool reports were incomplete

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu.values())

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.wall if self.wall > 0 else float("nan")

    @property
    def cpu_us_per_task(self) -> float:
        return self.cpu_total / self.tasks * 1e6

    @property
    def whole_us_per_task(self) -> float:
        """Enqueue + worker + servers: what the system spends per task, lock at publish too."""
        return (self.cpu_total + sum(self.enqueue_cpu.values())) / self.tasks * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "rep": self.rep,
            "tasks": self.tasks,
            "wall_seconds": self.wall,
            "tasks_per_s": self.tasks_per_s,
            "cpu_us_per_task": self.cpu_us_per_task,
            "whole_us_per_task": self.whole_us_per_task,
            "cpu_us_per_task_by_component": {k: v / self.tasks * 1e6 for k, v in self.cpu.items()},
            "cpu_seconds": self.cpu,
            "window_seconds": self.window,
            "enqueue_seconds": self.enqueue_seconds,
            "enqueue_cpu_us_per_task": {
                k: v / self.tasks * 1e6 for k, v in self.enqueue_cpu.items()
            },
            "machine_busy": self.machine_busy,
            "cpu_steal": self.steal,
            "others_busy": self.others,
            "failed": self.failed,
            "lease_claims": self.claims,
            "lease_releases": self.releases,
            "leftover_locks": self.leftover_locks,
            "timing": self.timing,
        }


class Bench:
    """The servers' PIDs, the worker, the publishing app and the run protocol."""

    def __init__(
        self, app: Any, worker: BenchWorker, urls: dict[str, str], pids: dict[str, int | None]
    ) -> None:
        import redis

        self.app = app
        self.worker = worker
        self.pids = pids
        self.broker = redis.Redis.from_url(urls["broker"])
        self.locks = redis.Redis.from_url(urls["locks"])
        self.report = redis.Redis.from_url(urls["report"])
        self.control_queue = worker.env[f"{ENV_PREFIX}CONTROL_QUEUE"]
        self.last_metrics: dict[str, dict[str, float]] = {}
        self.counter = 0
        self.worker_celery_lease: str | None = None  # the package the pool processes import

    def close(self) -> None:
        for client in (self.broker, self.locks, self.report):
            with contextlib.suppress(Exception):
                client.close()

    def snapshot(self) -> CpuSnapshot:
        return CpuSnapshot.take({**self.pids, "worker": self.worker.pid})

    def publish(self, variant: Variant, n: int, run: str, queue: str) -> None:
        task = self.app.tasks[variant.task]
        with self.app.producer_or_acquire() as producer:
            for i in range(n):
                task.apply_async((i, run), queue=queue, producer=producer)

    def wait_drained(self, queue: str, n: int) -> None:
        """Until the queue is empty and nothing is unacked (acks_late: every task is done)."""
        last_left, last_change = None, time.monotonic()
        while True:
            pipe = self.broker.pipeline(transaction=False)
            pipe.llen(queue)
            pipe.hlen("unacked")
            queued, unacked = pipe.execute()
            left = queued + unacked
            if left == 0:
                return
            now = time.monotonic()
            if left != last_left:
                last_left, last_change = left, now
            elif now - last_change > RUN_TIMEOUT:
                raise RuntimeError(f"{left} of {n} tasks made no progress in {RUN_TIMEOUT:.0f}s")
            if not self.worker.alive():
                raise RuntimeError(f"the worker died during the run:\n{self.worker.log()}")
            time.sleep(POLL)

    def collect(self, run: str, n: int) -> list[dict[str, Any]]:
        """Ask the pool processes for their figures until they account for all ``n`` tasks."""
        key = f"{KEY_PREFIX}report:{run}"
        reports: dict[str, dict[str, Any]] = {}
        report_task = self.app.tasks["bench.report"]
        for _ in range(10):
            for _ in range(2 * CONCURRENCY):
                report_task.apply_async((run, key), queue=self.control_queue)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                reports = {
                    pid.decode(): json.loads(raw) for pid, raw in self.report.hgetall(key).items()
                }
                if sum(r["done"] for r in reports.values()) >= n:
                    self.report.delete(key)
                    return list(reports.values())
                time.sleep(0.05)
        self.report.delete(key)
        return list(reports.values())

    def count_locks(self) -> int:
        return sum(
            sum(1 for _ in self.locks.scan_iter(match=pattern, count=1000))
            for pattern in LOCK_PATTERNS
        )

    def count_unique_locks(self, variant: Variant) -> int:
        """The ``unique=`` locks left in the variant's lease store after its run (up to 1000)."""
        store = self.app.tasks[variant.task]._compiled().current_store()
        return len(store.list(prefix="unique:", limit=1000).leases)

    def run(self, variant: Variant, n: int, rep: int) -> Run:
        self.counter += 1
        run_tag = uuid.uuid4().hex[:8]
        queue = f"celery_lease_bench.{variant.key}.{self.counter}"  # fresh: no stale BRPOP
        result = Run(variant.key, rep, n)
        s0 = self.snapshot()
        self.publish(variant, n, run_tag, queue)
        s1 = self.snapshot()
        result.enqueue_seconds = s1.at - s0.at
        enqueue = s1.seconds_since(s0)
        result.enqueue_cpu = {
            "bench": s1.bench - s0.bench,
            "redis": enqueue["redis"],
            "postgres": enqueue["postgres"],  # (a PostgreSQL unique= lock is taken at publish)
        }
        time.sleep(SETTLE)
        before = self.snapshot()
        self.app.control.add_consumer(
            queue, destination=[self.worker.hostname], reply=True, timeout=5.0, limit=1
        )
        self.wait_drained(queue, n)
        after = self.snapshot()
        self.app.control.cancel_consumer(
            queue, destination=[self.worker.hostname], reply=True, timeout=5.0, limit=1
        )
        result.window = after.at - before.at
        result.cpu = after.seconds_since(before)
        busy, steal = cpu_busy(before.machine, after.machine)
        result.machine_busy, result.steal = busy, steal
        ncpu = os.cpu_count() or 1
        ours = result.cpu_total + (after.bench - before.bench)
        result.others = busy - ours / (result.window * ncpu) if result.window > 0 else float("nan")
        reports = self.collect(run_tag, n)
        done = sum(r["done"] for r in reports)
        result.failed = sum(r["failed"] for r in reports) + max(0, n - done)
        starts = [r["first_start"] for r in reports if r["first_start"] is not None]
        ends = [r["last_end"] for r in reports if r["last_end"] is not None]
        if done == n and starts and ends:
            result.wall = max(ends) - min(starts)
        else:  # the reports did not cover every task: fall back to the CPU window
            result.wall, result.timing = result.window, "window"
        for r in reports:
            self.worker_celery_lease = r.get("celery_lease_file") or self.worker_celery_lease
            pid = str(r["pid"])
            previous = self.last_metrics.get(pid, {})
            now_metrics = r["metrics"]
            result.claims += int(
                now_metrics.get("celery_lease_claims_total", 0)
                - previous.get("celery_lease_claims_total", 0)
            )
            result.releases += int(
                now_metrics.get("celery_lease_releases_total", 0)
                - previous.get("celery_lease_releases_total", 0)
            )
            self.last_metrics[pid] = now_metrics
        if variant.key in ("once", "singleton"):
            result.leftover_locks = self.count_locks()
        elif variant.key.endswith("_unique"):
            result.leftover_locks = self.count_unique_locks(variant)
        return result

    def idle(self, seconds: float) -> dict[str, float]:
        """CPU per second of the measured processes while nothing runs (the floor of a run)."""
        before = self.snapshot()
        time.sleep(seconds)
        after = self.snapshot()
        elapsed = after.at - before.at
        return {k: v / elapsed * 1e6 for k, v in after.seconds_since(before).items()}


def check_run(variant: Variant, run: Run) -> list[str]:
    """What went wrong in a run (a failed task, a missing claim, a lock left behind)."""
    problems = []
    if run.failed:
        problems.append(f"{run.failed} of {run.tasks} tasks failed or were not seen")
    expected = run.tasks if variant.lease else 0
    if run.claims != expected or run.releases != expected:
        problems.append(
            f"lease claims/releases {run.claims}/{run.releases}, expected {expected}/{expected}"
        )
    if run.leftover_locks:
        problems.append(f"{run.leftover_locks} lock keys left behind")
    if run.timing != "tasks":
        problems.append("the pool reports did not cover every task: timed by the CPU window")
    return problems


# -- servers ---------------------------------------------------------------------------------------
def start_redis(stack: contextlib.ExitStack, env: dict[str, Any]) -> tuple[str, int]:
    from tests.tooling.servers import RedisServer

    server = RedisServer(appendonly=True, appendfsync="everysec")
    stack.callback(server.close)
    server.start()
    assert server.proc is not None
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        env["redis_server"] = client.info("server").get("redis_version")
        env["redis_config"] = {
            k: v
            for name in ("appendonly", "appendfsync", "maxmemory-policy", "save")
            for k, v in client.config_get(name).items()
        }
    finally:
        client.close()
    base = server.url.rsplit("/", 1)[0]
    return base, server.proc.pid


def start_postgres(stack: contextlib.ExitStack, env: dict[str, Any]) -> tuple[str, int | None]:
    import psycopg

    from celery_lease.stores.sql import SQLLeaseStore
    from tests.tooling.servers import PostgresServer

    server = PostgresServer()
    stack.callback(server.close)
    server.start()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {PG_DATABASE}")
    url = server.url.rsplit("/", 1)[0] + f"/{PG_DATABASE}"
    SQLLeaseStore(url=url, table_prefix=TABLE_PREFIX).close()  # the worker finds the tables
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        env["postgres_server"] = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        env["postgres_config"] = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("fsync", "synchronous_commit", "wal_sync_method", "shared_buffers")
        }
    return url, server.pid


# -- results ---------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    clean = [v for v in values if v == v]  # drop NaN
    return statistics.median(clean) if clean else None


def summarize(runs: list[Run], variants: list[Variant]) -> list[dict[str, Any]]:
    timed = [r for r in runs if r.rep >= 0]
    plain = {r.rep: r for r in timed if r.variant == "plain"}
    rows = []
    for variant in variants:
        mine = [r for r in timed if r.variant == variant.key]
        if not mine:
            continue
        ratios = [r.cpu_us_per_task / plain[r.rep].cpu_us_per_task for r in mine if r.rep in plain]
        whole = [
            r.whole_us_per_task / plain[r.rep].whole_us_per_task for r in mine if r.rep in plain
        ]
        speed = [r.tasks_per_s / plain[r.rep].tasks_per_s for r in mine if r.rep in plain]
        rows.append(
            {
                "variant": variant.key,
                "label": variant.label,
                "task": variant.task,
                "repeats": len(mine),
                "tasks_per_s": _median([r.tasks_per_s for r in mine]),
                "tasks_per_s_min": min(r.tasks_per_s for r in mine),
                "tasks_per_s_max": max(r.tasks_per_s for r in mine),
                "tasks_per_s_ratio_to_plain": _median(speed),
                "cpu_us_per_task": _median([r.cpu_us_per_task for r in mine]),
                "cpu_us_per_task_min": min(r.cpu_us_per_task for r in mine),
                "cpu_us_per_task_max": max(r.cpu_us_per_task for r in mine),
                "cpu_us_per_task_by_component": {
                    k: _median([r.cpu.get(k, 0.0) / r.tasks * 1e6 for r in mine])
                    for k in COMPONENTS
                },
                "cpu_ratio_to_plain": _median(ratios),
                "cpu_ratio_to_plain_min": min(ratios) if ratios else None,
                "cpu_ratio_to_plain_max": max(ratios) if ratios else None,
                "cpu_ratio_to_plain_runs": ratios,
                "enqueue_cpu_us_per_task": _median(
                    [sum(r.enqueue_cpu.values()) / r.tasks * 1e6 for r in mine]
                ),
                "whole_us_per_task": _median([r.whole_us_per_task for r in mine]),
                "whole_ratio_to_plain": _median(whole),
                "whole_ratio_to_plain_min": min(whole) if whole else None,
                "whole_ratio_to_plain_max": max(whole) if whole else None,
                "whole_ratio_to_plain_runs": whole,
                "others_busy_median": _median([r.others for r in mine]),
            }
        )
    return rows


def paired_ratio(
    runs: list[Run], num: str, den: str, whole: bool = False
) -> tuple[float | None, list[float]]:
    """The median over repeats of num's CPU/task over den's, each pair from the same repeat
    (``whole``: the whole-system figure, enqueue included)."""
    by = {(r.variant, r.rep): r for r in runs if r.rep >= 0}

    def figure(run: Run) -> float:
        return run.whole_us_per_task if whole else run.cpu_us_per_task

    ratios = [
        figure(by[(num, rep)]) / figure(by[(den, rep)])
        for (variant, rep) in by
        if variant == num and (den, rep) in by
    ]
    return _median(ratios), ratios


def evaluate_targets(runs: list[Run]) -> list[dict[str, Any]]:
    specs = [
        ("redis", "plain", REDIS_CPU_TARGET, "Redis store CPU/task <= 1.10 x plain Celery"),
        ("redis", "once", 1.0, "Redis store CPU/task <= celery-once's"),
        ("postgres", "plain", PG_CPU_TARGET, "PostgreSQL store CPU/task <= 1.25 x plain Celery"),
        (
            "redis_id",
            "redis",
            IDENTITY_CPU_TARGET,
            "Redis identity on: CPU/task <= 1.10 x identity off",
        ),
        (
            "redis_id_effect",
            "redis",
            IDENTITY_CPU_TARGET,
            "Redis identity on + 1 effect: CPU/task <= 1.10 x identity off",
        ),
        (
            "redis_id",
            "plain",
            WHOLE_CPU_TARGET,
            "whole system (enqueue + worker + servers): Redis store, identity on, CPU/task "
            "<= 1.18 x plain Celery",
        ),
        ("redis_id", "once", 1.0, "whole system: Redis store, identity on <= celery-once's"),
        (
            "redis_id",
            "singleton",
            1.0,
            "whole system: Redis store, identity on <= celery-singleton's",
        ),
        # issue 28: a lock at publish as the peers take one, and the run's lease besides
        (
            "redis_unique",
            "once",
            1.0,
            "whole system: Redis store, unique=until_executed <= celery-once's",
        ),
        (
            "redis_unique",
            "singleton",
            1.0,
            "whole system: Redis store, unique=until_executed <= celery-singleton's",
        ),
    ]
    targets = []
    for num, den, limit, text in specs:
        value, ratios = paired_ratio(runs, num, den, whole=text.startswith("whole"))
        targets.append(
            {
                "target": text,
                "numerator": num,
                "denominator": den,
                "limit": limit,
                "value": value,
                "ratio_runs": ratios,
                "pass": value is not None and value <= limit,
            }
        )
    return targets


def informational_ratios(runs: list[Run]) -> list[dict[str, Any]]:
    pairs = [
        ("postgres_id", "postgres"),
        ("postgres_id_effect", "postgres"),
        ("redis_id_effect", "redis_id"),
        ("redis", "singleton"),
        ("redis_unique", "redis_id"),
        ("postgres_unique", "postgres_id"),
        ("once", "plain"),
        ("singleton", "plain"),
    ]
    out = []
    for num, den in pairs:
        value, ratios = paired_ratio(runs, num, den)
        if value is not None:
            out.append({"numerator": num, "denominator": den, "value": value, "runs": ratios})
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def print_table(rows: list[dict[str, Any]], idle: dict[str, float]) -> None:
    header = (
        f"{'variant':19} {'tasks/s':>8} {'CPU us/task':>11} {'x plain':>7} {'(min-max)':>11}"
        f"  {'parent':>6} {'pool':>6} {'redis':>6} {'pg':>5}  {'enqueue':>7}"
        f"  {'whole':>6} {'x plain':>7} {'(min-max)':>11}"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        parts = row["cpu_us_per_task_by_component"]
        spread = (
            f"{row['cpu_ratio_to_plain_min']:.2f}-{row['cpu_ratio_to_plain_max']:.2f}"
            if row["cpu_ratio_to_plain"] is not None
            else "-"
        )
        whole_spread = (
            f"{row['whole_ratio_to_plain_min']:.2f}-{row['whole_ratio_to_plain_max']:.2f}"
            if row["whole_ratio_to_plain"] is not None
            else "-"
        )
        print(
            f"{row['variant']:19} {_fmt(row['tasks_per_s'], ',.0f'):>8} "
            f"{_fmt(row['cpu_us_per_task'], ',.0f'):>11} "
            f"{_fmt(row['cpu_ratio_to_plain'], '.3f'):>7} {spread:>11}  "
            f"{_fmt(parts['worker_parent'], '.0f'):>6} {_fmt(parts['worker_pool'], '.0f'):>6} "
            f"{_fmt(parts['redis'], '.0f'):>6} {_fmt(parts['postgres'], '.0f'):>5}  "
            f"{_fmt(row['enqueue_cpu_us_per_task'], '.0f'):>7}  "
            f"{_fmt(row['whole_us_per_task'], ',.0f'):>6} "
            f"{_fmt(row['whole_ratio_to_plain'], '.3f'):>7} {whole_spread:>11}"
        )
    print(
        "tasks/s: median over repeats, first task start to last task done (the pool processes' "
        "own clock);\nCPU us/task: user+sys of worker parent + pool + redis-server + PostgreSQL "
        "processes over the run,\nmedian; x plain: median of per-repeat ratios to plain Celery; "
        "parent/pool/redis/pg: the CPU split\n(medians, us/task); enqueue: CPU us/task of "
        "publishing (this process + redis + PostgreSQL), not part\nof the worker-side figure; "
        "whole: worker-side + enqueue CPU us/task (the whole system: celery-once,\n"
        "celery-singleton and unique= lock at publish), x plain: median of per-repeat ratios "
        "to plain's whole figure. "
        f"Idle floor of the measured processes: {sum(idle.values()):,.0f} us per second."
    )


def environment() -> dict[str, Any]:
    from importlib import metadata

    env = base_environment()
    for dist in ("celery", "kombu", "billiard", "celery-once", "celery-singleton", "hiredis"):
        try:
            env[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist.replace("-", "_")] = None
    env["clock_tick_hz"] = CLOCK_TICK
    with contextlib.suppress(ImportError):
        import prometheus_client  # noqa: F401 - only whether celery_lease mirrors metrics

        env["prometheus_client_installed"] = True
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Worker-side tasks/s and CPU per task of leased Celery tasks, next to plain "
        "Celery, celery-once and celery-singleton."
    )
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per run")
    parser.add_argument("--repeats", type=int, default=6, help="runs per variant (interleaved)")
    parser.add_argument(
        "--warmup-tasks", type=int, default=300, help="tasks of the untimed first run per variant"
    )
    parser.add_argument(
        "--variants",
        default=",".join(v.key for v in VARIANTS),
        help="comma list of " + ",".join(v.key for v in VARIANTS),
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(BY_KEY)
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {list(BY_KEY)}")
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")  # every ratio is to plain Celery
    if args.tasks < 1 or args.repeats < 1 or args.warmup_tasks < 0:
        parser.error("--tasks and --repeats must be >= 1, --warmup-tasks >= 0")
    return args


def _print_run(run: Run) -> None:
    label = "warm-up" if run.rep < 0 else f"rep {run.rep + 1}"
    print(
        f"    {label:7}  {run.variant:19} {run.tasks_per_s:8,.0f} tasks/s "
        f"{run.cpu_us_per_task:7,.0f} us/task CPU  (machine {run.machine_busy:4.0%} busy, "
        f"others {max(0.0, run.others):4.0%}, {run.steal:3.0%} steal)"
    )


@contextlib.contextmanager
def bench_env(values: dict[str, str]) -> Iterator[None]:
    """Set the app's environment variables in this process too (it publishes with that app)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    env = environment()
    run_id = uuid.uuid4().hex[:8]
    runs: list[Run] = []
    problems: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    idle: dict[str, float] = {}
    interrupted = False
    variants = [BY_KEY[k] for k in args.variants]
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        try:
            print("== servers")
            redis_base, redis_pid = start_redis(stack, env)
            pg_url, pg_pid = "", None
            if any(v.needs_postgres for v in variants):
                try:
                    pg_url, pg_pid = start_postgres(stack, env)
                except Exception as exc:
                    if isinstance(exc, BenchInterrupted):
                        raise
                    errors["postgres"] = traceback.format_exc()
                    print(f"!! PostgreSQL variants skipped: {type(exc).__name__}: {exc}")
                    variants = [v for v in variants if not v.needs_postgres]
            urls = {
                "broker": f"{redis_base}/0",
                "store": f"{redis_base}/1",
                "locks": f"{redis_base}/2",
                "report": f"{redis_base}/3",
            }
            control_queue = f"celery_lease_bench.control.{run_id}"
            values = {
                f"{ENV_PREFIX}BROKER": urls["broker"],
                f"{ENV_PREFIX}REDIS_STORE": urls["store"],
                f"{ENV_PREFIX}LOCKS": urls["locks"],
                f"{ENV_PREFIX}REPORT": urls["report"],
                f"{ENV_PREFIX}PG_STORE": pg_url,
                f"{ENV_PREFIX}CONTROL_QUEUE": control_queue,
                f"{ENV_PREFIX}KEY_PREFIX": KEY_PREFIX,
                f"{ENV_PREFIX}TABLE_PREFIX": TABLE_PREFIX,
            }
            stack.enter_context(bench_env(values))
            import importlib

            app = importlib.import_module(APP_MODULE).app
            logdir = tempfile.mkdtemp(prefix="celery-lease-bench-tasks-")
            # (runs after the worker stopped) keep the worker's log only when something failed
            stack.callback(
                lambda: None if errors or problems else shutil.rmtree(logdir, ignore_errors=True)
            )
            worker = BenchWorker(values, control_queue, f"bench-{run_id}", logdir)
            stack.callback(worker.stop)
            print(f"== worker (logs in {logdir})")
            worker.start(app)
            bench = Bench(app, worker, urls, {"redis": redis_pid, "postgres": pg_pid})
            stack.callback(bench.close)
            if args.warmup_tasks:
                print(f"== warm-up: {args.warmup_tasks} tasks per variant")
                for variant in variants:
                    run = bench.run(variant, args.warmup_tasks, -1)
                    runs.append(run)
                    _print_run(run)
                    for problem in check_run(variant, run):
                        problems.setdefault(variant.key, []).append(f"warm-up: {problem}")
            env["worker_pythonpath"] = worker.env["PYTHONPATH"]
            env["worker_celery_lease_file"] = bench.worker_celery_lease
            idle = bench.idle(IDLE_SECONDS)
            print(f"== idle floor: {sum(idle.values()):,.0f} us CPU per second ({idle})")
            print(f"== {args.repeats} repeats x {len(variants)} variants x {args.tasks} tasks")
            for rep in range(args.repeats):
                # A B C ... | ... C B A: a linear drift of the machine hits every variant alike
                order = variants if rep % 2 == 0 else variants[::-1]
                for variant in order:
                    run = bench.run(variant, args.tasks, rep)
                    runs.append(run)
                    _print_run(run)
                    for problem in check_run(variant, run):
                        problems.setdefault(variant.key, []).append(f"rep {rep + 1}: {problem}")
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping the worker and the servers", file=sys.stderr)
        except Exception:
            errors["run"] = traceback.format_exc()
            print(f"!! the benchmark failed:\n{errors['run']}", file=sys.stderr)
    env["loadavg_end"] = os.getloadavg()
    rows = summarize(runs, variants)
    targets = evaluate_targets(runs)
    info = informational_ratios(runs)
    print_table(rows, idle)
    if info:
        print(
            "other CPU ratios (median of per-repeat pairs): "
            + ", ".join(f"{r['numerator']}/{r['denominator']} {r['value']:.3f}" for r in info)
        )
    timed = [r for r in runs if r.rep >= 0]
    if timed:
        others = [r.others for r in timed if r.others == r.others]
        print(
            f"noise: machine busy {min(r.machine_busy for r in timed):.0%}-"
            f"{max(r.machine_busy for r in timed):.0%} during runs; other processes used "
            f"{max(0.0, min(others, default=0)):.0%}-{max(0.0, max(others, default=0)):.0%} "
            f"(median {max(0.0, _median(others) or 0):.0%}) of the CPUs; load average "
            f"{env['loadavg_start'][0]:.2f} at start, {env['loadavg_end'][0]:.2f} at end"
        )
    print("\ntargets (a measurement: the exit status is 0 either way)")
    for target in targets:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        verdict = "n/a " if target["value"] is None else "PASS" if target["pass"] else "FAIL"
        print(f"  {verdict}  {target['target']}: {value} (limit {target['limit']:.2f})")
    for key, found in problems.items():
        print(f"!! {key}: " + "; ".join(found), file=sys.stderr)
    for key, error in errors.items():
        print(f"\n{key} did not run:\n{error}", file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"\nwall time {elapsed:.0f}s")
    if args.json:
        report = {
            "environment": env,
            "settings": {
                "tasks": args.tasks,
                "repeats": args.repeats,
                "warmup_tasks": args.warmup_tasks,
                "variants": [v.key for v in variants],
                "concurrency": CONCURRENCY,
                "pool": "prefork",
                "task_acks_late": True,
                "ignore_result": True,
                "settle_seconds": SETTLE,
                "poll_seconds": POLL,
                "targets": {
                    "redis_vs_plain": REDIS_CPU_TARGET,
                    "postgres_vs_plain": PG_CPU_TARGET,
                    "identity_vs_leased": IDENTITY_CPU_TARGET,
                },
            },
            "idle_us_per_second": idle,
            "results": rows,
            "runs": [r.as_dict() for r in runs],
            "targets": targets,
            "other_ratios": info,
            "problems": problems,
            "errors": errors,
            "interrupted": interrupted,
            "wall_seconds": elapsed,
        }
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
