"""What one sweeper run costs when it reclaims 1,000 expired leases, next to few and many live.

The sweeper finds expired leases through the stores' expiry index (``list(expired_only=True)``)
under each prefix with an ``on_expired`` hook, so its cost should follow the expired leases, not
the live ones. This fills a store with ``--expired`` expired, never released leases and
``--live`` live ones (1k and 100k by default) under the *same* prefix, registers a no-op hook on
it, and times ``run_sweep(limit=--expired)``: list, claim, hook, release for every expired lease
(the records part, ``sweep_expired``, is ``bench_sweep.py``). Leases are written in bulk in the
store's own format (100k claims through ``acquire`` would take minutes and measure nothing new).

Run it on an otherwise idle machine::

    .venv/bin/python benchmarks/bench_sweep_leases.py              # starts its own servers
    .venv/bin/python benchmarks/bench_sweep_leases.py --stores redis --json out.json

A measurement, not a test: it exits 0 whatever the figures are. On servers you pass in it uses
keys starting with ``celery_lease_sweepl`` and tables starting with ``celery_lease_sweepl_``,
and deletes them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402

import celery_lease  # noqa: E402 - ROOT first
from benchmarks.bench_sweep import store_urls  # noqa: E402 - one way to get the servers
from celery_lease import _sweeper  # noqa: E402
from celery_lease.stores import RedisLeaseStore, SQLLeaseStore  # noqa: E402

BATCH = 2000
TOKEN = "ab" * 16


def redis_now_us(store: RedisLeaseStore) -> int:
    seconds, micros = store.client.time()
    return int(seconds) * 1_000_000 + int(micros)


def redis_fill(store: RedisLeaseStore, names: list[str], expires_us: int) -> None:
    pipe = store.client.pipeline(transaction=False)
    for i, resource in enumerate(names):
        keys = store._key_names[store.shard_of(resource)]
        record = f"{TOKEN} {i + 1} {expires_us - 2_000_000} {expires_us} bench@host:1:t{i}"
        pipe.hset(keys["leases"], resource, record)
        pipe.zadd(keys["expiry"], {resource: expires_us})
        pipe.hset(keys["fences"], resource, i + 1)
        if i % BATCH == BATCH - 1:
            pipe.execute()
    pipe.execute()


def redis_drop(store: RedisLeaseStore) -> None:
    for shard in store._key_names:
        store.client.delete(*shard.values())


def sql_now_us(store: SQLLeaseStore) -> int:
    conn = store.engine.raw_connection()
    try:
        cursor = conn.cursor()
        cursor.execute(f"SELECT {store.sql.now}")
        return int(cursor.fetchone()[0])
    finally:
        conn.close()


def sql_fill(store: SQLLeaseStore, names: list[str], expires_us: int) -> None:
    table = store.leases_table
    rows = [
        {
            "resource": resource,
            "owner_token": TOKEN,
            "owner_label": f"bench@host:1:t{i}",
            "fence": i + 1,
            "acquired_us": expires_us - 2_000_000,
            "expires_us": expires_us,
        }
        for i, resource in enumerate(names)
    ]
    with store.engine.begin() as conn:
        for start in range(0, len(rows), BATCH):
            conn.execute(table.insert(), rows[start : start + BATCH])
    if store.dialect == "postgresql":
        with store.engine.connect() as conn:
            conn.exec_driver_sql(f"ANALYZE {table.name}")
            conn.commit()


def sql_drop(store: SQLLeaseStore) -> None:
    with store.engine.begin() as conn:
        store.metadata.drop_all(conn)


def measure(kind: str, url: str, live: int, expired: int) -> dict[str, Any]:
    tag = f"l{uuid.uuid4().hex[:8]}"
    if kind == "redis":
        store: Any = RedisLeaseStore(url=url, key_prefix=f"celery_lease_sweepl{tag}:")
        now_us, fill, drop = redis_now_us, redis_fill, redis_drop
    else:
        store = SQLLeaseStore(url=url, table_prefix=f"celery_lease_sweepl_{tag}_")
        now_us, fill, drop = sql_now_us, sql_fill, sql_drop
    app = Celery("bench_sweep_leases", broker="memory://")
    app.conf.lease_store_url = url
    saved = list(_sweeper._hooks)
    hooked: list[str] = []
    celery_lease.on_expired("job/")(lambda expired: hooked.append(expired.resource))
    try:
        started = time.monotonic()
        now = now_us(store)
        fill(store, [f"job/live{i}" for i in range(live)], now + 86_400_000_000)
        fill(store, [f"job/gone{i}" for i in range(expired)], now - 1_000_000)
        filled = time.monotonic() - started
        t0 = time.perf_counter()
        report = celery_lease.run_sweep(app, store=store, limit=expired)
        elapsed = time.perf_counter() - t0
        return {
            "store": kind,
            "live": live,
            "expired": expired,
            "reclaimed": len(report.reclaimed),
            "hooks_run": len(hooked),
            "seconds": elapsed,
            "ms_per_lease": elapsed * 1000 / max(1, len(report.reclaimed)),
            "fill_seconds": filled,
        }
    finally:
        _sweeper._hooks[:] = saved
        with contextlib.suppress(Exception):
            drop(store)
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis,postgres", help="comma list: redis,postgres")
    parser.add_argument("--live", default="1000,100000", help="live leases, comma list")
    parser.add_argument("--expired", type=int, default=1000, help="expired leases to reclaim")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    lives = [int(n) for n in args.live.split(",")]
    results = []
    with contextlib.ExitStack() as stack:
        urls = store_urls(stack, stores, args.redis_url, args.postgres_url)
        print(f"{'store':<9} {'live':>8} {'reclaimed':>9} {'run s':>7} {'ms/lease':>9}")
        for kind in stores:
            for live in lives:
                row = measure(kind, urls[kind], live, args.expired)
                results.append(row)
                print(
                    f"{kind:<9} {live:>8} {row['reclaimed']:>9} {row['seconds']:>7.2f} "
                    f"{row['ms_per_lease']:>9.2f}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
