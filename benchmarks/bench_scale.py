"""The lease stores with 1k, 100k and 1M live leases held: throughput, memory, renewal, sweep.

For each store and each size N (ascending; the store is filled up to the next size), with N live
leases held under ``job/live/`` (ttl one day):

- **throughput**: acquire+release cycles/s of ``--processes`` processes on their own resources
  (none of them held), in the big store and in a *baseline* store of the same kind holding 1k
  leases, run alternately (``big base | base big | ...``) so that the machine's drift cancels out
  of the ratio big/base. Target: at 1M >= 0.9.
- **memory**: Redis ``used_memory`` growth since before the fill per live lease, and ``MEMORY
  USAGE ... SAMPLES 0`` of the store's keys per live lease; PostgreSQL
  ``pg_total_relation_size`` of the lease table (heap, TOAST, indexes) per row.
- **sweep**: 1k leases under ``job/gone<N>/`` claimed with a 1 s ttl and left to expire among
  the N live, then one ``run_sweep(limit=1000)`` with a no-op ``on_expired`` hook on ``job/``
  (list the expired through the expiry index, claim, hook, release each), in the big store and
  in the baseline store (1k live). Target: big/base <= 2.
- **renew**: this process holds the first ``--renew`` leases of the fill as ``Lease`` objects and
  renews them all with ``renew_many``, as the renewer does: it sends every lease due within a
  third of the interval in one call per store (``--renew-batch 0``; the store sends it in
  batches of ``RENEW_BATCH``, 1,000, one after another); ``--renew-batch B``
  splits them. Client CPU is this process's ``time.process_time()``; server CPU is Redis ``INFO
  cpu`` (``used_cpu_sys`` + ``used_cpu_user``) or, for PostgreSQL, ``utime + stime`` from
  ``/proc/<pid>/stat`` of the postmaster and all its children (backends, WAL writer,
  checkpointer: the server must run on this machine).
- **churn** (PostgreSQL, ``--phases ...,churn``, on the largest size only): ``--processes``
  processes cycle claim+release over ``--churn-resources`` resources each for
  ``--churn-seconds`` (or ``--churn-cycles``), under the server's autovacuum settings, sampling
  the lease table's size, its dead rows and autovacuum runs every ``--churn-sample`` seconds, and
  the claim latency percentiles per sample window.

Leases are claimed through the store's own statements: the fill lets ``acquire`` build its
script call or statement and parameters, then sends them in batches (a Redis pipeline of
EVALSHA; a PostgreSQL transaction per batch of the claim statement through ``executemany``),
over ``--fill-processes`` processes, and makes the held ``Lease`` objects from the replies by
running ``acquire`` again on them. Each lease is what a real claim leaves in the store.

Run it on a machine as idle as you can get; one size step of 1M takes minutes::

    .venv/bin/python benchmarks/bench_scale.py --stores redis --sizes 1000,100000,1000000
    .venv/bin/python benchmarks/bench_scale.py --stores postgres --sizes 1000,100000
    .venv/bin/python benchmarks/bench_scale.py --stores postgres --sizes 100000 \\
        --phases churn --churn-seconds 540

A measurement, not a test: it prints PASS or FAIL per target and exits 0 either way. Without
``--redis-url`` / ``--postgres-url`` it starts its own servers (``tests/tooling/servers.py``). On
servers you pass in it uses keys starting with ``celery_lease_scale`` and tables starting with
``celery_lease_scale_``, and deletes them at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

import celery_lease  # noqa: E402 - ROOT first
from benchmarks.bench_sweep import store_urls  # noqa: E402 - one way to get the servers
from celery_lease import Owner  # noqa: E402

LONG_TTL = 86_400.0
FILL_BATCH = 1000
CYCLE_RESOURCES = 8


class _Captured(Exception):  # carries a claim's call out of acquire
    def __init__(self, call: Any) -> None:
        super().__init__()
        self.call = call


# -- stores ----------------------------------------------------------------------------------


def make_store(kind: str, url: str, tag: str) -> Any:
    if kind == "redis":
        return celery_lease.store_from_url(
            url, key_prefix=f"celery_lease_scale{tag}:", max_ttl=LONG_TTL
        )
    return celery_lease.store_from_url(
        url, table_prefix=f"celery_lease_scale_{tag}_", max_ttl=LONG_TTL
    )


def drop_store(kind: str, store: Any) -> None:
    if kind == "redis":
        client = store.client
        for shard in store._key_names:
            client.delete(*shard.values())
        meta = list(client.scan_iter(match=f"{store.key_prefix}*", count=1000))
        if meta:
            client.delete(*meta)
    else:
        with store.engine.begin() as conn:
            store.metadata.drop_all(conn)


def pg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def capture_claims(kind: str, store: Any, names: list[str], owner: Owner, ttl: float) -> list[Any]:
    """The script call (Redis: keys, args) or statement parameters (PostgreSQL) that
    ``store.acquire(name, owner, ttl)`` would send, per name: nothing is sent."""

    def grab(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(kwargs if kind == "redis" else args[1])

    calls = []
    if kind == "redis":
        real = store._acquire
        store._acquire = grab
        try:
            for name in names:
                try:
                    store.acquire(name, owner, ttl)
                except _Captured as c:
                    calls.append((c.call["keys"], c.call["args"]))
        finally:
            store._acquire = real
        return calls
    store._run_waits = lambda what, work: work(None)
    store._claim = grab
    try:
        for name in names:
            try:
                store.acquire(name, owner, ttl)
            except _Captured as c:
                calls.append([c.call[n] for n in store.sql.acquire_raw.names])
    finally:
        del store._run_waits, store._claim
    return calls


def send_claims(kind: str, store: Any, url: str, calls: list[Any]) -> list[Any]:
    """Send captured claims in batches; the replies (Redis) or rows (PostgreSQL), in order."""
    replies: list[Any] = []
    if kind == "redis":
        script = store._acquire
        script.load()
        for start in range(0, len(calls), FILL_BATCH):
            pipe = store.client.pipeline(transaction=False)
            for keys, args in calls[start : start + FILL_BATCH]:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies += pipe.execute()
        return replies
    import psycopg

    query = store.sql.acquire_raw.query
    with psycopg.connect(pg_dsn(url)) as conn:
        for start in range(0, len(calls), FILL_BATCH):
            with conn.transaction(), psycopg.RawCursor(conn) as cur:
                cur.executemany(query, calls[start : start + FILL_BATCH], returning=True)
                while True:
                    replies.append(cur.fetchone())
                    if not cur.nextset():
                        break
    return replies


def leases_from(
    kind: str, store: Any, names: list[str], owner: Owner, ttl: float, replies: list[Any]
) -> list[Any]:
    """The ``Lease`` objects ``acquire`` makes of these replies (it runs again on each)."""
    feed = iter(replies)
    if kind == "redis":
        real = store._acquire
        store._acquire = lambda **kwargs: next(feed)
        try:
            return [store.acquire(name, owner, ttl) for name in names]
        finally:
            store._acquire = real
    from celery_lease.stores.sql.rows import ClaimRow

    store._run_waits = lambda what, work: work(None)
    store._claim = lambda cursor, params: ClaimRow(*next(feed))
    try:
        return [store.acquire(name, owner, ttl) for name in names]
    finally:
        del store._run_waits, store._claim


def claimed(kind: str, reply: Any) -> bool:
    return bool(reply is not None and reply[0] == 1)


def fill_worker(kind: str, url: str, tag: str, names: list[str], ttl: float) -> int:
    """Claim ``names`` (a fill process); returns how many were claimed."""
    os.nice(0)
    store = make_store(kind, url, tag)
    try:
        owner = Owner.new(f"scale-fill-{os.getpid()}")
        replies = send_claims(kind, store, url, capture_claims(kind, store, names, owner, ttl))
        return sum(claimed(kind, r) for r in replies)
    finally:
        store.close()


def fill(kind: str, url: str, tag: str, names: list[str], ttl: float, pool: Any, procs: int) -> int:
    if not names:
        return 0
    step = max(FILL_BATCH, -(-len(names) // (procs * 4)))
    parts = [names[i : i + step] for i in range(0, len(names), step)]
    return sum(pool.starmap(fill_worker, [(kind, url, tag, p, ttl) for p in parts]))


# -- throughput --------------------------------------------------------------------------------


def cycle_worker(
    kind: str, url: str, tag: str, index: int, start_at: float, warmup: float, seconds: float
) -> float:
    """Acquire+release cycles per second on this process's own resources."""
    store = make_store(kind, url, tag)
    try:
        owner = Owner.new(f"scale-cycle-{index}")
        names = [f"cycle/{index}/{i}" for i in range(CYCLE_RESOURCES)]
        store.release(store.acquire(names[0], owner, 30.0))  # connect, load scripts
        while time.monotonic() < start_at:
            time.sleep(0.002)
        i = 0
        end_warm = start_at + warmup
        while time.monotonic() < end_warm:
            store.release(store.acquire(names[i % CYCLE_RESOURCES], owner, 30.0))
            i += 1
        count = 0
        t0 = time.monotonic()
        end = t0 + seconds
        while True:
            store.release(store.acquire(names[count % CYCLE_RESOURCES], owner, 30.0))
            count += 1
            now = time.monotonic()
            if now >= end:
                return count / (now - t0)
    finally:
        store.close()


def cycles(
    kind: str, url: str, tag: str, pool: Any, procs: int, warmup: float, seconds: float
) -> float:
    start_at = time.monotonic() + 1.0
    rates = pool.starmap(
        cycle_worker, [(kind, url, tag, i, start_at, warmup, seconds) for i in range(procs)]
    )
    return float(sum(rates))


def throughput(
    kind: str, url: str, big: str, base: str, pool: Any, args: argparse.Namespace
) -> dict[str, Any]:
    runs: list[tuple[float, float]] = []
    for r in range(args.repeats):
        order = (big, base) if r % 2 == 0 else (base, big)
        got = {
            t: cycles(kind, url, t, pool, args.processes, args.warmup, args.seconds) for t in order
        }
        runs.append((got[big], got[base]))
    ratios = [b / a for b, a in runs]
    return {
        "big_cyc_s": statistics.median(b for b, _ in runs),
        "base_cyc_s": statistics.median(a for _, a in runs),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "runs": runs,
    }


# -- memory ------------------------------------------------------------------------------------


def redis_used(store: Any) -> int:
    return int(store.client.info("memory")["used_memory"])


def memory(kind: str, store: Any, live: int, used0: int) -> dict[str, Any]:
    if kind == "redis":
        client = store.client
        by_kind: dict[str, int] = {}
        for shard in store._key_names:
            for kind_, key in shard.items():
                size = int(client.memory_usage(key, samples=0) or 0)
                by_kind[kind_] = by_kind.get(kind_, 0) + size
        sampled = sum(by_kind.values())
        used = redis_used(store)
        return {
            "memory_usage_by_kind": {k: v for k, v in by_kind.items() if v},
            "used_memory_delta": used - used0,
            "bytes_per_lease_used_memory": (used - used0) / live,
            "memory_usage_keys": sampled,
            "bytes_per_lease_memory_usage": sampled / live,
        }
    table = store.leases_table.name
    with store.engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT pg_total_relation_size(%(t)s::regclass), pg_relation_size(%(t)s::regclass),"
            " pg_indexes_size(%(t)s::regclass),"
            " (SELECT count(*) FROM " + table + ")",
            {"t": table},
        ).one()
    total, heap, indexes, rows = (int(v) for v in row)
    return {
        "table_total_bytes": total,
        "heap_bytes": heap,
        "index_bytes": indexes,
        "rows": rows,
        "bytes_per_lease": total / live,
        "bytes_per_row": total / rows,
    }


# -- server CPU --------------------------------------------------------------------------------


def pg_server_pids(store: Any) -> list[int]:
    with store.engine.connect() as conn:
        datadir = conn.exec_driver_sql("SHOW data_directory").scalar()
    master = int(Path(datadir, "postmaster.pid").read_text().split()[0])
    pids = [master]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == master:
                    pids.append(int(entry.name))
    return pids


def server_cpu(kind: str, store: Any, pids: list[int]) -> float:
    if kind == "redis":
        info = store.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def renew(kind: str, store: Any, leases: list[Any], batch: int) -> dict[str, Any]:
    pids = pg_server_pids(store) if kind == "postgres" else []
    size = batch or len(leases)
    store.renew_many(leases[:10])  # open the renewer's connection
    if kind == "postgres":
        pids = pg_server_pids(store)
    s0, c0, w0 = server_cpu(kind, store, pids), time.process_time(), time.perf_counter()
    lost = 0
    error = None
    try:
        for start in range(0, len(leases), size):
            lost += sum(r is not None for r in store.renew_many(leases[start : start + size]))
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    wall = time.perf_counter() - w0
    client = time.process_time() - c0
    server = server_cpu(kind, store, pids) - s0
    return {
        "leases": len(leases),
        "batch": size,
        "calls": -(-len(leases) // size),
        "lost": lost,
        "error": error,
        "wall_s": wall,
        "client_cpu_s": client,
        "server_cpu_s": server,
    }


# -- sweep -------------------------------------------------------------------------------------


def sweep(kind: str, url: str, store: Any, tag: str, expired: int, pool: Any, procs: int) -> dict:
    from celery import Celery

    from celery_lease import _sweeper

    names = [f"job/gone{tag}/{i}" for i in range(expired)]
    fill(kind, url, store.tag, names, 1.0, pool, procs)
    time.sleep(1.5)
    app = Celery("bench_scale", broker="memory://")
    app.conf.lease_store_url = url
    saved = list(_sweeper._hooks)
    hooked: list[str] = []
    celery_lease.on_expired("job/")(lambda lease: hooked.append(lease.resource))
    try:
        t0 = time.perf_counter()
        listed = len(list(_sweeper._expired(store, "job/", expired)))  # the read alone
        t1 = time.perf_counter()
        report = celery_lease.run_sweep(app, store=store, limit=expired)
        elapsed = time.perf_counter() - t1
    finally:
        _sweeper._hooks[:] = saved
    return {
        "expired": expired,
        "reclaimed": len(report.reclaimed),
        "hooks_run": len(hooked),
        "seconds": elapsed,
        "listed": listed,
        "list_s": t1 - t0,
    }


def sweeps(
    kind: str, url: str, big: Any, base: Any, size: int, pool: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """``--sweep-repeats`` pairs of sweeps, big and base alternately (each on fresh expired)."""
    pairs = []
    for r in range(args.sweep_repeats):
        order = (big, base) if r % 2 == 0 else (base, big)
        got = {
            s.tag: sweep(kind, url, s, f"{size}r{r}", args.expired, pool, args.fill_processes)
            for s in order
        }
        pairs.append((got[big.tag], got[base.tag]))
    ratios = [b["seconds"] / a["seconds"] for b, a in pairs]
    return {
        "big_s": statistics.median(b["seconds"] for b, _ in pairs),
        "base_s": statistics.median(a["seconds"] for _, a in pairs),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "reclaimed": [(b["reclaimed"], a["reclaimed"]) for b, a in pairs],
        "big_list_s": statistics.median(b["list_s"] for b, _ in pairs),
        "base_list_s": statistics.median(a["list_s"] for _, a in pairs),
        "pairs": pairs,
    }


# -- churn (PostgreSQL) ------------------------------------------------------------------------


def churn_worker(
    url: str, tag: str, index: int, resources: int, seconds: float, cycles_max: int, out: Any
) -> None:
    store = make_store("postgres", url, tag)
    end_at = time.monotonic() + seconds  # from when this process is up
    owner = Owner.new(f"scale-churn-{index}")
    names = [f"churn/{index}/{i}" for i in range(resources)]
    lat: list[float] = []
    done = 0
    try:
        while done < cycles_max:
            t0 = time.perf_counter()
            lease = store.acquire(names[done % resources], owner, 30.0)
            t1 = time.perf_counter()
            store.release(lease)
            lat.append(t1 - t0)
            done += 1
            if len(lat) >= 200:
                out.put((index, time.monotonic(), lat))
                lat = []
                if time.monotonic() >= end_at:
                    break
    finally:
        if lat:
            out.put((index, time.monotonic(), lat))
        out.put((index, None, done))
        store.close()


def table_stats(store: Any) -> dict[str, Any]:
    table = store.leases_table.name
    with store.engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid), pg_indexes_size(c.oid),"
            " s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.autoanalyze_count"
            " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid"
            " WHERE c.oid = %(t)s::regclass",
            {"t": table},
        ).one()
    keys = ("total", "heap", "indexes", "n_live_tup", "n_dead_tup", "autovacuums", "autoanalyzes")
    return dict(zip(keys, (int(v or 0) for v in row), strict=True))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def churn(url: str, store: Any, live: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per = -(-args.churn_cycles // args.processes) if args.churn_cycles else 1 << 62
    workers = [
        ctx.Process(
            target=churn_worker,
            args=(url, store.tag, i, args.churn_resources, args.churn_seconds, per, out),
        )
        for i in range(args.processes)
    ]
    for w in workers:
        w.start()
    t0 = time.monotonic()
    samples = []
    window: list[float] = []
    total = 0
    finished = 0
    next_sample = t0
    first = table_stats(store)
    while finished < len(workers):
        with contextlib.suppress(Exception):
            _index, at, payload = out.get(timeout=1.0)
            if at is None:
                finished += 1
            else:
                window += payload
                total += len(payload)
        if time.monotonic() >= next_sample or finished == len(workers):
            stats = table_stats(store)
            samples.append(
                {
                    "t_s": round(time.monotonic() - t0, 1),
                    "cycles": total,
                    **stats,
                    "total_over_live": stats["total"] / first["total"],
                    "claim_p50_ms": pct(window, 0.50) * 1000,
                    "claim_p99_ms": pct(window, 0.99) * 1000,
                    "window_claims": len(window),
                }
            )
            print(
                f"  churn t={samples[-1]['t_s']:>6}s cycles={total:>9,} "
                f"size={stats['total'] / 2**20:8.1f} MiB ({samples[-1]['total_over_live']:.2f}x) "
                f"dead={stats['n_dead_tup']:>8,} autovac={stats['autovacuums']} "
                f"p99={samples[-1]['claim_p99_ms']:.2f} ms",
                flush=True,
            )
            window = []
            next_sample = time.monotonic() + args.churn_sample
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t0
    with_claims = [s for s in samples if s["window_claims"] >= 100]
    start_p99 = with_claims[0]["claim_p99_ms"] if with_claims else float("nan")
    end_p99 = with_claims[-1]["claim_p99_ms"] if with_claims else float("nan")
    return {
        "live": live,
        "cycles": total,
        "seconds": elapsed,
        "cycles_per_s": total / elapsed,
        "start": first,
        "samples": samples,
        "max_total_over_start": max(s["total_over_live"] for s in samples),
        "p99_start_ms": start_p99,
        "p99_end_ms": end_p99,
        "p99_end_over_start": end_p99 / start_p99,
    }


# -- driver ------------------------------------------------------------------------------------


def run_store(kind: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    sizes = sorted(int(n) for n in args.sizes.split(","))
    phases = {p.strip() for p in args.phases.split(",")}
    ctx = mp.get_context("spawn")
    run = uuid.uuid4().hex[:6]
    big_tag, base_tag = f"{run}b", f"{run}s"
    big, base = make_store(kind, url, big_tag), make_store(kind, url, base_tag)
    big.tag, base.tag = big_tag, base_tag
    owner = Owner.new("scale-holder")
    result: dict[str, Any] = {"store": kind, "sizes": []}
    pool = ctx.Pool(max(args.processes, args.fill_processes))
    try:
        for store in (big, base):  # tables, scripts, the claim statement chosen
            store.release(store.acquire("setup/0", owner, 10.0))
        t0 = time.monotonic()
        fill(kind, url, base_tag, [f"job/live/{i}" for i in range(1000)], LONG_TTL, pool, 2)
        used0 = redis_used(big) if kind == "redis" else 0
        held: list[Any] = []
        have = 0
        print(f"{kind}: baseline store filled with 1,000 in {time.monotonic() - t0:.1f} s")
        for size in sizes:
            row: dict[str, Any] = {"live": size}
            t0 = time.monotonic()
            mine = [f"job/live/{i}" for i in range(have, min(size, args.renew))]
            if mine:  # this process holds the renewal set: the first --renew leases
                calls = capture_claims(kind, big, mine, owner, LONG_TTL)
                replies = send_claims(kind, big, url, calls)
                held += leases_from(kind, big, mine, owner, LONG_TTL, replies)
            rest = [f"job/live/{i}" for i in range(max(have, args.renew), size)]
            got = len(mine) + fill(kind, url, big_tag, rest, LONG_TTL, pool, args.fill_processes)
            have = size
            row["fill_s"] = time.monotonic() - t0
            row["filled"] = got
            print(f"{kind}: N={size:,}: filled {got:,} in {row['fill_s']:.1f} s", flush=True)
            if "memory" in phases:
                row["memory"] = memory(kind, big, size, used0)
                print(f"  memory {json.dumps(row['memory'])}", flush=True)
            if "throughput" in phases:
                row["throughput"] = tp = throughput(kind, url, big_tag, base_tag, pool, args)
                print(
                    f"  throughput {args.processes} procs: big {tp['big_cyc_s']:,.0f} cyc/s, "
                    f"base(1k) {tp['base_cyc_s']:,.0f} cyc/s, ratio {tp['ratio']:.2f} "
                    f"({tp['ratio_range'][0]:.2f}-{tp['ratio_range'][1]:.2f})",
                    flush=True,
                )
            if "sweep" in phases:
                row["sweep"] = sw = sweeps(kind, url, big, base, size, pool, args)
                print(
                    f"  sweep of {args.expired:,} expired: among {size:,} live "
                    f"{sw['big_s'] * 1000:.0f} ms, among 1,000 {sw['base_s'] * 1000:.0f} ms "
                    f"(medians), ratio {sw['ratio']:.2f} "
                    f"({sw['ratio_range'][0]:.2f}-{sw['ratio_range'][1]:.2f}); its listing "
                    f"{sw['big_list_s'] * 1000:.0f} / {sw['base_list_s'] * 1000:.0f} ms",
                    flush=True,
                )
            if "renew" in phases and held:
                row["renew"] = []
                for batch in [int(b) for b in args.renew_batch.split(",")]:
                    rn = renew(kind, big, held, batch)
                    row["renew"].append(rn)
                    print(
                        f"  renew {rn['leases']:,} (batch {rn['batch']:,}, {rn['calls']} calls): "
                        f"wall {rn['wall_s']:.2f} s, client CPU {rn['client_cpu_s']:.2f} s, "
                        f"server CPU {rn['server_cpu_s']:.2f} s, lost {rn['lost']}"
                        + (f", ERROR {rn['error']}" if rn["error"] else ""),
                        flush=True,
                    )
            result["sizes"].append(row)
        if "churn" in phases and kind == "postgres":
            result["churn"] = churn(url, big, sizes[-1], args)
    finally:
        pool.terminate()
        for store in (big, base):
            with contextlib.suppress(Exception):
                drop_store(kind, store)
            store.close()
    return result


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for res in results:
        rows = res["sizes"]
        top = rows[-1] if rows else None
        if top and "throughput" in top:
            ok = top["throughput"]["ratio"] >= 0.9
            lines.append(
                f"{'PASS' if ok else 'FAIL'} {res['store']}: throughput at {top['live']:,} live "
                f"{top['throughput']['ratio']:.2f}x of 1k (target >= 0.9)"
            )
        if top and "sweep" in top:
            ok = top["sweep"]["ratio"] <= 2.0
            lines.append(
                f"{'PASS' if ok else 'FAIL'} {res['store']}: sweep among {top['live']:,} live "
                f"{top['sweep']['ratio']:.2f}x of among 1k (target <= 2)"
            )
        if "churn" in res:
            c = res["churn"]
            ok = c["max_total_over_start"] <= 2.0
            lines.append(
                f"{'PASS' if ok else 'FAIL'} postgres churn: table+index at most "
                f"{c['max_total_over_start']:.2f}x of the live set's (target <= 2)"
            )
            ok = c["p99_end_over_start"] <= 1.5
            lines.append(
                f"{'PASS' if ok else 'FAIL'} postgres churn: p99 claim {c['p99_end_ms']:.2f} ms at "
                f"the end vs {c['p99_start_ms']:.2f} ms at the start, "
                f"{c['p99_end_over_start']:.2f}x (target <= 1.5)"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis,postgres", help="comma list: redis,postgres")
    parser.add_argument("--sizes", default="1000,100000,1000000", help="live leases, comma list")
    parser.add_argument(
        "--phases", default="memory,throughput,sweep,renew", help="also: churn (PostgreSQL)"
    )
    parser.add_argument("--processes", type=int, default=8, help="cycling processes")
    parser.add_argument("--fill-processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run")
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=4, help="big/base pairs per size")
    parser.add_argument("--renew", type=int, default=100_000, help="leases this process holds")
    parser.add_argument(
        "--renew-batch", default="0", help="comma list; 0: one call, as the renewer sends"
    )
    parser.add_argument("--expired", type=int, default=1000, help="expired leases to sweep")
    parser.add_argument("--sweep-repeats", type=int, default=3, help="big/base sweep pairs")
    parser.add_argument("--churn-seconds", type=float, default=540.0)
    parser.add_argument("--churn-cycles", type=int, default=0, help="0: until --churn-seconds")
    parser.add_argument("--churn-resources", type=int, default=1000, help="per process")
    parser.add_argument("--churn-sample", type=float, default=30.0, help="seconds per sample")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    results = []
    try:
        with contextlib.ExitStack() as stack:
            urls = store_urls(stack, stores, args.redis_url, args.postgres_url)
            for kind in stores:
                results.append(run_store(kind, urls[kind], args))
    except KeyboardInterrupt:
        return 130
    print()
    for line in verdicts(results):
        print(line)
    if args.json:
        env = {"python": platform.python_version(), "cpus": os.cpu_count(), "argv": sys.argv}
        Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
