"""A hot resource: N tasks of H seconds on one resource, next to the dedicated-queue workaround.

Every leased task of a run claims the same resource. Run side by side in one sitting, per pool
(threads, prefork):

* ``lease/<store>``: ``@lease_task`` on the Redis, PostgreSQL and SQLite stores, consumed by
  ``--workers`` workers of ``--concurrency`` each (Redis broker);
* ``dedicated``: the classic workaround, a plain task on a queue of its own consumed by one
  ``-c 1`` worker (nothing can overlap, nothing waits in a store);
* ``relay``: the floor of any hand-off that travels through the broker, on the lease workers:
  a plain task that sends the next one when its body ends (as a release sends the woken
  waiter's message), with no store, no claims and no waiting copies (``--no-relay`` skips it).
  What a lease run adds to it is the store's two round trips per hand-off and the refused
  first claims of the burst.

Per run it reports the makespan (first publish to last body end), utilization (N*H/makespan),
the hand-off gap between one body's end and the next body's start (p50/p90/max), overtakes
(tasks whose body started before that of a task that arrived, i.e. made its first attempt, more
than 10 ms earlier and was still waiting; ``sure``: those where the earlier task's first claim
had even come back from the store before the later one was sent), overlaps (bodies that
started before the previous one ended: must be 0), store calls per hand-off and busy claims
per task (attempts that did not run the body). Times come from the tasks themselves (see
``_bench_hot_app``).

It is a measurement, not a test: it prints the table (and PASS/FAIL per target) and exits 0
(130 when interrupted)::

    .venv/bin/python benchmarks/bench_hot.py                       # N=20, H=0.3, all
    .venv/bin/python benchmarks/bench_hot.py --stores redis --pools threads --json /tmp/hot.json
    .venv/bin/python benchmarks/bench_hot.py -n 200 --hold 0.05 --stores redis,sqlite
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_stores import BenchInterrupted, sigterm_as_interrupt  # noqa: E402
from benchmarks.bench_stores import environment as base_environment  # noqa: E402
from benchmarks.bench_tasks import BenchWorker, bench_env  # noqa: E402

APP_MODULE = "benchmarks._bench_hot_app"
ENV_PREFIX = "CELERY_LEASE_HOT_"
TABLE_PREFIX = "celery_lease_hot_"
OVERTAKE_MARGIN = 0.010  # seconds: arrivals closer than this are a tie, not an order
UTILIZATION_TARGET = 0.95  # x the dedicated queue's, same run
GAP_P90_TARGET = 0.050  # seconds, Redis
BUSY_PER_TASK_TARGET = 1.1


class HotWorker(BenchWorker):
    """A worker of the hot app: ``-P <pool> -c <concurrency> -Q <queues>``."""

    def __init__(
        self, env: dict[str, str], queues: str, name: str, logdir: str, pool: str, concurrency: int
    ) -> None:
        super().__init__(env, queues, name, logdir)
        self.args[self.args.index("-A") + 1] = APP_MODULE
        self.args[self.args.index("-P") + 1] = pool
        self.args[self.args.index("-c") + 1] = str(concurrency)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def analyse(
    records: list[dict[str, Any]], n: int, hold: float, published_at: float
) -> dict[str, Any]:
    """Turn the tasks' attempt records into the run's figures."""
    bodies = sorted((r for r in records if r.get("start") is not None), key=lambda r: r["start"])
    arrival: dict[int, float] = {}
    answered: dict[int, float] = {}  # when the first attempt's claim came back
    for r in records:
        if r["attempt_at"] <= arrival.get(r["i"], r["attempt_at"]):
            answered[r["i"]] = r.get("answered_at") or r["attempt_at"]
        arrival[r["i"]] = min(arrival.get(r["i"], r["attempt_at"]), r["attempt_at"])
    gaps, overlaps = [], 0
    for prev, cur in itertools.pairwise(bodies):
        gap = cur["start"] - prev["end"]
        if gap < 0:
            overlaps += 1
        gaps.append(max(gap, 0.0))
    start = {r["i"]: r["start"] for r in bodies}
    overtakes = 0
    # Sure overtakes: a's refused claim had come back (so the store had queued it) before b's
    # claim was sent. An overtake that is not sure may be two claims in flight at once, their
    # order at the store unknown (a round trip under load, a first connection's handshake).
    sure = sum(
        1
        for b in bodies
        if any(
            answered[a["i"]] + OVERTAKE_MARGIN < arrival[b["i"]]
            and b["start"] < a["start"]
            and a["start"] > arrival[b["i"]]
            for a in bodies
        )
    )
    for b in bodies:
        for a in bodies:
            if (
                arrival[a["i"]] + OVERTAKE_MARGIN < arrival[b["i"]]
                and b["start"] < a["start"]
                and a["start"] > arrival[b["i"]]  # a was still waiting when b arrived
            ):
                overtakes += 1
                break
    ran = len(start)
    makespan = (max(r["end"] for r in bodies) - published_at) if bodies else float("nan")
    attempts = len(records)
    calls = sum(int(r.get("calls") or 0) for r in records)
    return {
        "tasks": n,
        "ran": ran,
        "bodies": len(bodies),  # > ran: a body ran twice
        "makespan": makespan,
        "utilization": n * hold / makespan if bodies else float("nan"),
        "gap_p50": percentile(gaps, 0.5),
        "gap_p90": percentile(gaps, 0.9),
        "gap_max": max(gaps) if gaps else None,
        "overlaps": overlaps,
        "overtakes": overtakes,
        "overtakes_sure": sure,
        "attempts": attempts,
        "busy_per_task": (attempts - len(bodies)) / n,
        "store_calls": calls,
        "store_calls_per_handoff": calls / max(1, len(bodies) - 1),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, urls: dict[str, str], logdir: str) -> None:
        import importlib

        import redis

        self.args = args
        self.urls = urls
        self.logdir = logdir
        self.app = importlib.import_module(APP_MODULE).app
        self.report = redis.Redis.from_url(urls["report"])
        self.run_id = uuid.uuid4().hex[:6]

    def run(self, task: str, queue: str, label: str, pool: str) -> dict[str, Any]:
        n, hold = self.args.n, self.args.hold
        run = f"{self.run_id}-{pool}-{label.replace('/', '-')}"
        published_at = time.time()
        if label == "relay":  # each task sends the next: only the first is published
            self.app.send_task(task, args=(0, run, hold, n), queue=queue)
        else:
            for i in range(n):
                self.app.send_task(task, args=(i, run, hold), queue=queue)
        deadline = time.monotonic() + self.args.timeout
        key = f"hot:{run}"
        records: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            raw = self.report.lrange(key, 0, -1)
            records = [json.loads(x) for x in raw]
            done = {r["i"] for r in records if r.get("start") is not None}
            if len(done) >= n:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # late duplicates, if any, show up as extra bodies
        records = [json.loads(x) for x in self.report.lrange(key, 0, -1)]
        figures = analyse(records, n, hold, published_at)
        figures["label"] = label
        figures["timed_out"] = figures["ran"] < n
        figures["published_at"] = published_at
        figures["records"] = records  # every attempt, for a closer look (--json)
        return figures


def start_servers(stack: contextlib.ExitStack, env: dict[str, Any], stores: list[str]) -> dict:
    from tests.tooling.servers import RedisServer

    urls: dict[str, str] = {}
    broker = RedisServer(appendonly=True, appendfsync="everysec")
    stack.callback(broker.close)
    broker.start()
    base = broker.url.rsplit("/", 1)[0]
    urls["broker"], urls["report"] = f"{base}/0", f"{base}/3"
    if "redis" in stores:
        store = RedisServer(appendonly=True, appendfsync="everysec")
        stack.callback(store.close)
        store.start()
        urls["redis"] = store.url
    if "postgres" in stores:
        from benchmarks.bench_tasks import start_postgres

        pg_url, _ = start_postgres(stack, env)
        urls["postgres"] = pg_url
        from celery_lease.stores.sql import SQLLeaseStore

        SQLLeaseStore(url=urls["postgres"], table_prefix=TABLE_PREFIX).close()
    if "sqlite" in stores:
        tmp = tempfile.mkdtemp(prefix="celery-lease-hot-")
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        urls["sqlite"] = f"sqlite:///{tmp}/leases.db"
        from celery_lease.stores.sql import SQLLeaseStore

        SQLLeaseStore(url=urls["sqlite"], table_prefix=TABLE_PREFIX).close()
    return urls


def fmt(value: Any, spec: str) -> str:
    if value is None or value != value:
        return "-"
    return format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'pool':8} {'variant':16} {'makespan':>9} {'util':>5} {'gap p50':>8} {'p90':>7} "
        f"{'max':>7} {'overtk':>6} {'sure':>4} {'overlap':>7} {'calls/ho':>8} {'busy/task':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['pool']:8} {r['label']:16} {fmt(r['makespan'], '8.2f')}s "
            f"{fmt(r['utilization'], '5.0%')} {fmt(r['gap_p50'] and r['gap_p50'] * 1e3, '6.1f')}ms"
            f" {fmt(r['gap_p90'] and r['gap_p90'] * 1e3, '5.0f')}ms"
            f" {fmt(r['gap_max'] and r['gap_max'] * 1e3, '5.0f')}ms {r['overtakes']:>6} "
            f"{r.get('overtakes_sure', 0):>4} {r['overlaps']:>7} "
            f"{fmt(r['store_calls_per_handoff'], '8.2f')} "
            f"{fmt(r['busy_per_task'], '9.2f')}"
            + ("  TIMED OUT" if r["timed_out"] else "")
            + (f"  {r['bodies'] - r['ran']} BODIES TWICE" if r["bodies"] > r["ran"] else "")
        )


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for pool in {r["pool"] for r in rows}:
        mine = [r for r in rows if r["pool"] == pool]
        base = next((r for r in mine if r["label"] == "dedicated"), None)
        for r in mine:
            if r["label"] == "dedicated":
                continue
            if r["label"] == "relay":  # a floor to read the others against, not a target
                if base is not None:
                    ratio = r["utilization"] / base["utilization"]
                    out.append(f"INFO {pool} relay: utilization {ratio:.2f} x dedicated "
                               "(the floor of a hand-off through the broker)")  # fmt: skip
                continue
            checks = [
                ("overlaps == 0", r["overlaps"] == 0),
                ("overtakes == 0", r["overtakes"] == 0),
                (
                    f"busy/task <= {BUSY_PER_TASK_TARGET}",
                    r["busy_per_task"] <= BUSY_PER_TASK_TARGET,
                ),
            ]
            if base is not None:
                ratio = r["utilization"] / base["utilization"]
                checks.append(
                    (f"utilization {ratio:.2f} x dedicated >= {UTILIZATION_TARGET}",
                     ratio >= UTILIZATION_TARGET)
                )  # fmt: skip
            if r["label"] == "lease/redis" and r["gap_p90"] is not None:
                checks.append(
                    (f"gap p90 {r['gap_p90'] * 1e3:.0f} ms <= {GAP_P90_TARGET * 1e3:.0f} ms",
                     r["gap_p90"] <= GAP_P90_TARGET)
                )  # fmt: skip
            for what, ok in checks:
                out.append(f"{'PASS' if ok else 'FAIL'} {pool} {r['label']}: {what}")
    return sorted(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("-n", type=int, default=20, help="tasks per run (20)")
    parser.add_argument("--hold", type=float, default=0.3, help="seconds per body (0.3)")
    parser.add_argument("--stores", default="redis,postgres,sqlite")
    parser.add_argument("--pools", default="threads,prefork")
    parser.add_argument("--workers", type=int, default=2, help="lease workers (2)")
    parser.add_argument("--concurrency", type=int, default=4, help="per lease worker (4)")
    parser.add_argument("--no-dedicated", action="store_true", help="skip the workaround")
    parser.add_argument(
        "--no-relay", action="store_true", help="skip the relay (the broker hand-off floor)"
    )
    parser.add_argument(
        "--no-early-wake",
        action="store_true",
        help="lease_handoff_early_wake=False: wake after the release's reply (the baseline)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run (240)")
    parser.add_argument("--json", help="write every figure and the environment here")
    args = parser.parse_args(argv)
    args.stores = [s for s in args.stores.split(",") if s]
    args.pools = [p for p in args.pools.split(",") if p]
    bad = set(args.stores) - {"redis", "postgres", "sqlite"} or set(args.pools) - {
        "threads",
        "prefork",
    }
    if bad:
        parser.error(f"unknown store or pool: {', '.join(sorted(bad))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env: dict[str, Any] = base_environment()
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    interrupted = False
    logdir = tempfile.mkdtemp(prefix="celery-lease-hot-logs-")
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        try:
            print("== servers")
            urls = start_servers(stack, env, args.stores)
            values = {
                f"{ENV_PREFIX}BROKER": urls["broker"],
                f"{ENV_PREFIX}REPORT": urls["report"],
                f"{ENV_PREFIX}REDIS_STORE": urls.get("redis", ""),
                f"{ENV_PREFIX}PG_STORE": urls.get("postgres", ""),
                f"{ENV_PREFIX}SQLITE_STORE": urls.get("sqlite", ""),
                f"{ENV_PREFIX}EARLY_WAKE": "0" if args.no_early_wake else "1",
            }
            stack.enter_context(bench_env(values))
            bench = Bench(args, urls, logdir)
            tag = bench.run_id
            for pool in args.pools:
                lease_queue, dedicated_queue = f"hot.lease.{tag}", f"hot.dedicated.{tag}"
                workers = [
                    HotWorker(values, lease_queue, f"hot{k}-{pool}-{tag}", logdir, pool,
                              args.concurrency)
                    for k in range(args.workers)
                ]  # fmt: skip
                if not args.no_dedicated:
                    workers.append(
                        HotWorker(values, dedicated_queue, f"hotded-{pool}-{tag}", logdir, pool, 1)
                    )
                try:
                    print(f"== {pool}: starting {len(workers)} workers")
                    for w in workers:
                        w.start(bench.app)
                    variants = [(f"hot.lease_{s}", lease_queue, f"lease/{s}") for s in args.stores]
                    if not args.no_relay:
                        variants.insert(0, ("hot.relay", lease_queue, "relay"))
                    if not args.no_dedicated:
                        variants.insert(0, ("hot.dedicated", dedicated_queue, "dedicated"))
                    for task, queue, label in variants:
                        print(f"-- {pool} {label}: N={args.n} H={args.hold}", flush=True)
                        row = bench.run(task, queue, label, pool)
                        row["pool"] = pool
                        rows.append(row)
                        print_table([row])
                finally:
                    for w in workers:
                        w.stop()
        except (KeyboardInterrupt, BenchInterrupted):
            interrupted = True
            print("!! interrupted")
        except Exception:
            errors["run"] = traceback.format_exc()
            print(errors["run"])
    if errors or interrupted:
        print(f"worker logs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    print(f"\n== N={args.n} H={args.hold}s, {args.workers} workers x {args.concurrency}")
    print_table(rows)
    checks = targets(rows)
    for line in checks:
        print(line)
    if args.json:
        payload = {
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "environment": env,
            "runs": rows,
            "targets": checks,
            "errors": errors,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {args.json}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
