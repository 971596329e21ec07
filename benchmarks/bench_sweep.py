"""What ``sweep_expired()`` costs per 1000 records removed, next to few and many live records.

Identity, ledger and checkpoint records past their retention are removed through each table's
expiry index, so the cost should follow what is removed, not what is kept. This fills a store
with ``--expired`` records whose retention has passed (an identity with its checkpoints and one
ledger entry per run) next to ``--live`` records still kept (1k and 200k by default), then calls
``sweep_expired(limit=1000)`` until nothing is left, and reports the milliseconds per 1000
records removed (median over the full calls) for each live count. The records are written in
bulk straight into the store's keys and tables, in the store's own format (writing 200k through
``acquire``/``release`` would take minutes and measures nothing new).

Run it on an otherwise idle machine::

    .venv/bin/python benchmarks/bench_sweep.py                       # starts its own servers
    .venv/bin/python benchmarks/bench_sweep.py --stores redis --live 1000,200000 --expired 20000
    .venv/bin/python benchmarks/bench_sweep.py --postgres-url postgresql+psycopg://u@h:5432/db

A measurement, not a test: it exits 0 whatever the figures are. On servers you pass in it uses
keys starting with ``celery_lease_sweep`` and tables starting with ``celery_lease_sweep_``, and
deletes them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

from celery_lease.stores import RedisLeaseStore, SQLLeaseStore  # noqa: E402 - ROOT first

LIMIT = 1000
BATCH = 2000
DAY_US = 86_400 * 1_000_000


def redis_fill(store: RedisLeaseStore, runs: int, expires_us: int, tag: str) -> None:
    """``runs`` identities (with checkpoints) and ledger entries expiring at ``expires_us``."""
    pipe = store.client.pipeline(transaction=False)
    for i in range(runs):
        resource = f"{tag}/r{i}"
        keys = store._key_names[store.shard_of(resource)]
        member = f"{resource}|job"
        pipe.hset(keys["ids"], member, f"done\n1\ntok\nlabel\n{i}")
        pipe.zadd(keys["ids_exp"], {member: expires_us})
        pipe.hset(keys["ckpt"], member, '1\n{"step": 1}')
        pipe.hset(keys["ledger"], f"{member}|charge", "done\n1\ntok\n{}")
        pipe.zadd(keys["ledger_exp"], {f"{member}|charge": expires_us})
        if i % BATCH == BATCH - 1:
            pipe.execute()
    pipe.execute()


def redis_now_us(store: RedisLeaseStore) -> int:
    seconds, micros = store.client.time()
    return int(seconds) * 1_000_000 + int(micros)


def redis_drop(store: RedisLeaseStore) -> None:
    for shard in store._key_names:
        store.client.delete(*shard.values())


def sql_fill(store: SQLLeaseStore, runs: int, expires_us: int, tag: str) -> None:
    """The same in the SQL tables, one INSERT ... SELECT generate_series per table."""
    tables = {kind: store.tables[kind].name for kind in ("ids", "ckpt", "ledger")}
    statements = [
        f"""INSERT INTO {tables["ids"]}
            (resource, identity, state, fence, owner_token, owner_label, result, expires_us)
            SELECT %(tag)s || '/r' || g, 'job', 'done', 1, 'tok', 'label', g::text, %(exp)s
            FROM generate_series(0, %(n)s - 1) AS g""",
        f"""INSERT INTO {tables["ckpt"]} (resource, identity, fence, data, expires_us)
            SELECT %(tag)s || '/r' || g, 'job', 1, '{{"step": 1}}', %(exp)s
            FROM generate_series(0, %(n)s - 1) AS g""",
        f"""INSERT INTO {tables["ledger"]}
            (resource, identity, key, state, fence, owner_token, receipt, expires_us)
            SELECT %(tag)s || '/r' || g, 'job', 'charge', 'done', 1, 'tok', '{{}}', %(exp)s
            FROM generate_series(0, %(n)s - 1) AS g""",
    ]
    conn = store.engine.raw_connection()
    try:
        cursor = conn.cursor()
        cursor.execute("SET statement_timeout = 0")  # the store's connections have 5 s
        for sql in statements:
            cursor.execute(sql, {"tag": tag, "exp": expires_us, "n": runs})
        conn.commit()
        cursor.execute("ANALYZE")
        conn.commit()
    finally:
        conn.close()


def sql_now_us(store: SQLLeaseStore) -> int:
    conn = store.engine.raw_connection()
    try:
        cursor = conn.cursor()
        cursor.execute(f"SELECT {store.sql.now}")
        return int(cursor.fetchone()[0])
    finally:
        conn.close()


def sql_drop(store: SQLLeaseStore) -> None:
    with store.engine.begin() as conn:
        store.metadata.drop_all(conn)


def measure(kind: str, url: str, live: int, expired_runs: int) -> dict[str, Any]:
    """Fill, then sweep until nothing is left; the ms per 1000 removed of each full call."""
    tag = f"s{uuid.uuid4().hex[:8]}"
    if kind == "redis":
        store: Any = RedisLeaseStore(url=url, key_prefix=f"celery_lease_sweep{tag}:")
        fill, now_us, drop = redis_fill, redis_now_us, redis_drop
    else:
        store = SQLLeaseStore(url=url, table_prefix=f"celery_lease_sweep_{tag}_")
        fill, now_us, drop = sql_fill, sql_now_us, sql_drop
    try:
        started = time.monotonic()
        now = now_us(store)
        fill(store, live, now + DAY_US, f"{tag}live")
        fill(store, expired_runs, now - 1_000_000, f"{tag}old")
        filled = time.monotonic() - started
        store.sweep_expired(limit=1)  # connection, script
        per_1000: list[float] = []
        removed_total = 1
        while True:
            t0 = time.perf_counter()
            removed = store.sweep_expired(limit=LIMIT)
            elapsed = time.perf_counter() - t0
            removed_total += removed
            if removed == LIMIT:
                per_1000.append(elapsed * 1000)
            if removed < LIMIT:
                break
        left = store.sweep_expired(limit=LIMIT)
        return {
            "store": kind,
            "live_runs": live,
            "expired_runs": expired_runs,
            "removed": removed_total,
            "left_after": left,
            "calls": len(per_1000),
            "ms_per_1000_median": statistics.median(per_1000) if per_1000 else None,
            "ms_per_1000_p90": (
                statistics.quantiles(per_1000, n=10)[-1] if len(per_1000) >= 10 else None
            ),
            "fill_seconds": filled,
        }
    finally:
        with contextlib.suppress(Exception):
            drop(store)
        store.close()


def store_urls(
    stack: contextlib.ExitStack[Any], stores: list[str], redis_url: str | None, pg_url: str | None
) -> dict[str, str]:
    """A URL per store kind: the one given, or a server started here (closed by ``stack``)."""
    urls: dict[str, str] = {}
    if "redis" in stores:
        urls["redis"] = redis_url or ""
        if not urls["redis"]:
            from tests.tooling.servers import RedisServer

            server = RedisServer(appendonly=True, appendfsync="everysec")
            stack.callback(server.close)
            urls["redis"] = server.start().url
    if "postgres" in stores:
        urls["postgres"] = pg_url or ""
        if not urls["postgres"]:
            from tests.tooling.servers import PostgresServer

            pg = PostgresServer()
            stack.callback(pg.close)
            urls["postgres"] = pg.start().url
    return urls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis,postgres", help="comma list: redis,postgres")
    parser.add_argument("--live", default="1000,200000", help="live runs kept, comma list")
    parser.add_argument("--expired", type=int, default=20000, help="expired runs to sweep")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    lives = [int(n) for n in args.live.split(",")]
    results = []
    with contextlib.ExitStack() as stack:
        urls = store_urls(stack, stores, args.redis_url, args.postgres_url)
        print(f"{'store':<9} {'live runs':>10} {'removed':>8} {'ms/1000 median':>15} {'p90':>7}")
        for kind in stores:
            for live in lives:
                row = measure(kind, urls[kind], live, args.expired)
                results.append(row)
                p90 = row["ms_per_1000_p90"]
                print(
                    f"{kind:<9} {live:>10} {row['removed']:>8} "
                    f"{row['ms_per_1000_median']:>15.1f} "
                    f"{'' if p90 is None else f'{p90:.1f}':>7}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
