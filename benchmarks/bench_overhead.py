"""What a leased task costs on top of Celery's own execution, split into round trips and the rest.

``bench_tasks.py`` measures whole workers, where the machine's noise is as large as the effect
(ratios move by 0.1 between runs on a busy 2-core box). This script takes the worker, the broker
and the pool out: in one process it runs each task through the tracer a worker uses
(``celery.app.trace.build_tracer``), back to back, and counts

* client CPU: this process's user+sys time (``time.process_time``) per task;
* server CPU: Redis's own ``used_cpu_user + used_cpu_sys`` (``INFO cpu``), and the user+sys time
  of the PostgreSQL postmaster and all its processes (``/proc``), per task;

for plain Celery, the lease variants, and the *floor*: the same number of round trips done
directly with the driver the store uses (Redis: ``SET NX PX`` then ``DEL``; PostgreSQL: a
one-row ``UPDATE ... RETURNING`` then an ``UPDATE``, autocommit). ``added`` is a variant's
client+server CPU minus plain Celery's; ``beyond floor`` is what remains after the round trips
themselves: the library's own work (Python and its Lua/SQL logic).

Run it on an otherwise idle machine::

    .venv/bin/python benchmarks/bench_overhead.py                 # starts its own servers
    .venv/bin/python benchmarks/bench_overhead.py --json /tmp/overhead.json --tasks 5000
    .venv/bin/python benchmarks/bench_overhead.py --stores redis --redis-url redis://127.0.0.1:6380/0

A measurement, not a test: it exits 0 whatever the figures are.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_tasks import CLOCK_TICK, proc_table, tree_ticks  # noqa: E402 - ROOT first

KEY_PREFIX = "celery_lease_overhead:"
TABLE_PREFIX = "celery_lease_overhead_"
FLOOR_TABLE = "celery_lease_overhead_floor"
FLOOR_TRIPS = 2  # round trips per task in a floor run (claim, release)


# -- server CPU ---------------------------------------------------------------------------------
class ServerCpu:
    """Reads the CPU seconds the store servers have used so far."""

    def __init__(self, redis_url: str | None, postgres_pid: int | None) -> None:
        import redis

        self.redis = redis.Redis.from_url(redis_url) if redis_url else None
        self.postgres_pid = postgres_pid

    def read(self) -> dict[str, float]:
        out = {}
        if self.redis is not None:
            info = self.redis.info("cpu")
            out["redis"] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        if self.postgres_pid is not None:
            out["postgres"] = tree_ticks(proc_table(), self.postgres_pid) / CLOCK_TICK
        return out


# -- the tasks ----------------------------------------------------------------------------------
def build_app(redis_url: str | None, postgres_url: str | None) -> Any:
    from celery import Celery

    from celery_lease import current_lease, lease_task

    app = Celery("celery_lease_overhead", broker="memory://")
    app.conf.update(
        task_ignore_result=True,
        lease_store_url=redis_url or postgres_url,
        lease_key_prefix=KEY_PREFIX,
        lease_table_prefix=TABLE_PREFIX,
    )

    @app.task(name="o.plain", ignore_result=True)
    def plain(i: int, run: str) -> None:
        """Plain Celery."""

    def effect_body(i: int, run: str) -> None:
        current_lease().effect("e")(lambda: 1)

    def no_body(i: int, run: str) -> None:
        """No-op."""

    for store, url in (("redis", redis_url), ("postgres", postgres_url)):
        if not url:
            continue
        common = {"resource": "o-{run}-{i}", "app": app, "store_url": url, "ignore_result": True}
        lease_task(name=f"o.{store}", identity=False, **common)(no_body)
        lease_task(name=f"o.{store}_id", **common)(no_body)
        lease_task(name=f"o.{store}_id_effect", **common)(effect_body)
    app.finalize()
    return app


def tracer_runner(app: Any, name: str) -> Callable[[int], None]:
    from celery.app.trace import build_tracer

    task = app.tasks[name]
    tracer = build_tracer(name, task, app=app, eager=False, propagate=False)

    def run(n: int) -> None:
        tag = uuid.uuid4().hex[:10]
        calls = []
        for i in range(n):
            tid = str(uuid.uuid4())
            request = {
                "id": tid,
                "task": name,
                "hostname": "bench@localhost",
                "delivery_info": {"redelivered": False},
            }
            calls.append((tid, (i, tag), {}, request))
        for tid, args, kwargs, request in calls:  # prepared above: only execution is timed
            info = tracer(tid, args, kwargs, request)
            if info[0] is not None and info[0].state != "SUCCESS":
                raise RuntimeError(f"{name} ended {info[0].state}: {info[0].retval!r}")

    return run


def redis_floor(url: str) -> Callable[[int], None]:
    """Two round trips per task on one held connection: SET NX PX, then DEL."""
    import redis

    client = redis.Redis.from_url(url)
    conn = client.connection_pool.get_connection()

    def run(n: int) -> None:
        tag = uuid.uuid4().hex[:10]
        for i in range(n):
            key = f"{KEY_PREFIX}floor:{tag}:{i}"
            conn.send_command("SET", key, "0123456789abcdef0123456789abcdef", "NX", "PX", 60000)
            conn.read_response()
            conn.send_command("DEL", key)
            conn.read_response()

    return run


def postgres_floor(url: str) -> Callable[[int], None]:
    """Two autocommit statements per task: UPDATE ... RETURNING to claim, UPDATE to release."""
    import psycopg
    from sqlalchemy.engine import make_url

    sa_url = make_url(url)
    conn = psycopg.connect(
        host=sa_url.host,
        port=sa_url.port,
        user=sa_url.username,
        password=sa_url.password,
        dbname=sa_url.database,
        autocommit=True,
    )
    conn.execute(
        f'CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (resource text COLLATE "C" PRIMARY KEY, '
        "owner_token text, fence bigint NOT NULL, expires_us bigint NOT NULL)"
    )
    rows = 256
    with conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {FLOOR_TABLE} VALUES (%s, NULL, 0, 0) ON CONFLICT DO NOTHING",
            [(f"r{i}",) for i in range(rows)],
        )
    claim = (
        f"UPDATE {FLOOR_TABLE} SET owner_token = %s, fence = fence + 1, expires_us = "
        "(extract(epoch from clock_timestamp()) * 1000000)::bigint + 60000000 "
        "WHERE resource = %s RETURNING fence"
    )
    release = f"UPDATE {FLOOR_TABLE} SET owner_token = NULL WHERE resource = %s AND fence = %s"

    def run(n: int) -> None:
        for i in range(n):
            resource = f"r{i % rows}"
            fence = conn.execute(claim, ("0123456789abcdef", resource)).fetchone()[0]  # type: ignore[index]
            conn.execute(release, (resource, fence))

    return run


# -- measuring ----------------------------------------------------------------------------------
def measure(run: Callable[[int], None], n: int, servers: ServerCpu) -> dict[str, float]:
    before, c0 = servers.read(), time.process_time()
    run(n)
    c1, after = time.process_time(), servers.read()
    out = {"client": (c1 - c0) / n * 1e6}
    for name in after:
        out[name] = (after[name] - before[name]) / n * 1e6
    out["total"] = sum(out.values())
    return out


def start_servers(
    stack: contextlib.ExitStack,
    stores: list[str],
    redis_url: str | None,
    postgres_url: str | None,
) -> tuple[str | None, str | None, int | None]:
    """The Redis and PostgreSQL URLs to use for ``stores``: the given ones, or servers started
    here (stopped when ``stack`` closes); and the started PostgreSQL's pid (None otherwise)."""
    postgres_pid = None
    if "redis" not in stores:
        redis_url = None
    elif not redis_url:
        from tests.tooling.servers import RedisServer

        server = RedisServer(appendonly=True, appendfsync="everysec")
        stack.callback(server.close)
        server.start()
        redis_url = server.url
    if "postgres" not in stores:
        postgres_url = None
    elif not postgres_url:
        from tests.tooling.servers import PostgresServer

        pg = PostgresServer()
        stack.callback(pg.close)
        pg.start()
        postgres_url = pg.url
        postgres_pid = pg.pid
    return redis_url, postgres_url, postgres_pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis,postgres", help="comma list: redis,postgres")
    parser.add_argument("--tasks", type=int, default=3000, help="task executions per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant (interleaved)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    bad = set(stores) - {"redis", "postgres"}
    if bad:
        parser.error(f"unknown store(s) {sorted(bad)}: choose from redis, postgres")

    with contextlib.ExitStack() as stack:
        redis_url, postgres_url, postgres_pid = start_servers(
            stack, stores, args.redis_url, args.postgres_url
        )
        app = build_app(redis_url, postgres_url)
        servers = ServerCpu(redis_url, postgres_pid)
        runs: dict[str, Callable[[int], None]] = {"plain": tracer_runner(app, "o.plain")}
        floors: dict[str, str] = {}  # variant -> its floor (2 round trips a task)
        if redis_url:
            runs["redis_floor"] = redis_floor(redis_url)
            for suffix in ("", "_id", "_id_effect"):
                runs[f"redis{suffix}"] = tracer_runner(app, f"o.redis{suffix}")
                floors[f"redis{suffix}"] = "redis_floor"
        if postgres_url:
            runs["postgres_floor"] = postgres_floor(postgres_url)
            for suffix in ("", "_id", "_id_effect"):
                runs[f"postgres{suffix}"] = tracer_runner(app, f"o.postgres{suffix}")
                floors[f"postgres{suffix}"] = "postgres_floor"
        for run in runs.values():  # warm up: connections, scripts, tables, caches
            run(min(300, args.tasks))
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                samples[name].append(measure(run, args.tasks, servers))
        medians = {
            name: {k: statistics.median(s[k] for s in rows) for k in rows[0]}
            for name, rows in samples.items()
        }
        plain = medians["plain"]["total"]
        print(
            f"CPU microseconds per task execution, median of {args.repeats} runs of "
            f"{args.tasks} (client = this process; server = redis-server / PostgreSQL)\n"
        )
        print(
            f"{'variant':18} {'client':>8} {'server':>8} {'total':>8} {'added':>8} "
            f"{'beyond floor':>13}"
        )
        report: dict[str, Any] = {"tasks": args.tasks, "repeats": args.repeats, "variants": {}}
        for name, row in medians.items():
            server = row["total"] - row["client"]
            added = (
                row["total"] - plain if not name.endswith("_floor") and name != "plain" else None
            )
            floor = floors.get(name)
            # an effect adds two round trips (intent, done): twice the floor
            trips = 2 * FLOOR_TRIPS if name.endswith("_effect") else FLOOR_TRIPS
            beyond = (
                added - medians[floor]["total"] * trips / FLOOR_TRIPS
                if added is not None and floor
                else None
            )
            print(
                f"{name:18} {row['client']:8.1f} {server:8.1f} {row['total']:8.1f} "
                f"{'' if added is None else f'{added:8.1f}':>8} "
                f"{'' if beyond is None else f'{beyond:13.1f}':>13}"
            )
            report["variants"][name] = {
                **row,
                "server": server,
                "added_over_plain": added,
                "beyond_floor": beyond,
                "round_trips": (2 * FLOOR_TRIPS if name.endswith("_effect") else FLOOR_TRIPS)
                if floor
                else None,
                "runs": samples[name],
            }
        print(
            "\nadded: total minus plain Celery's; beyond floor: added minus the same round trips "
            "done directly with the driver (floor rows: 2 round trips a task; the _effect "
            "variants make 4).\nA worker's "
            "plain-Celery task costs about 1,000-1,300 us of CPU on a 2-core box (bench_tasks.py), "
            "so 10 % of it is about 100-130 us."
        )
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
