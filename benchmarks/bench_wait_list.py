"""What a refused claim and a release cost on a resource whose wait list is full.

For each store (Redis, PostgreSQL, SQLite), each wake payload size and each list length, this
fills one resource's wait list (a holder, then refused claims that join it, each with a random
payload of that many bytes) until it is as long as asked or the store lists no more (its
``wait_cap`` or ``wait_bytes_cap``), then times, per cycle: a refused claim that finds the list
full (a newcomer), a refused claim of a listed waiter (re-armed), the holder's release (it wakes
the head) and the woken head's claim (it leaves the list); a newcomer then joins to keep the
list full. ``--unbounded`` lifts ``wait_bytes_cap`` so the list holds every payload whatever
its size: the cost before the bound.

It is a measurement, not a test: it prints milliseconds (median and p90 over the cycles) and
exits 0 (130 when interrupted). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

from celery_lease import LeaseBusyError, Owner  # noqa: E402
from celery_lease.stores import store_from_url  # noqa: E402

STORES = ("redis", "postgres", "sqlite")
TTL = 600.0
WAIT_TTL = 3600.0
PREFIX = "celery_lease_bench_wl"
OPERATIONS = ("full", "rearm", "release", "woken")


def payload(who: str, size: int) -> str:
    """``size`` bytes (at least the name): the waiter's name, then random URL-safe text (it
    does not compress, like most task arguments)."""
    text = f"{who}:{secrets.token_urlsafe(size)}"
    return text[: max(size, len(who) + 1)]


def claim(store: Any, resource: str, who: str, size: int | None) -> Any:
    wait = None if size is None else payload(who, size)
    return store.acquire(resource, Owner.new(who), TTL, identity=who, wait=wait, wait_ttl=WAIT_TTL)


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    try:
        result = action()
    except LeaseBusyError as busy:
        result = busy
    return time.perf_counter() - started, result


def fill(store: Any, resource: str, size: int, length: int) -> tuple[Any, int]:
    """Hold ``resource`` and list up to ``length`` waiters with ``size``-byte payloads (until
    the store refuses one unlisted): the holder's lease and how many were listed."""
    lease = claim(store, resource, "holder", None)
    listed = 0
    for k in range(length):
        _, busy = timed(lambda k=k: claim(store, resource, f"w{k}", size))
        if not getattr(busy, "position", None):
            break
        listed += 1
    return lease, listed


def run_one(store: Any, size: int, length: int, cycles: int) -> dict[str, Any]:
    """Fill one resource's list and time ``cycles`` cycles on it."""
    resource = f"wl-{uuid.uuid4().hex[:10]}"
    lease, listed = fill(store, resource, size, length)
    times: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    joined = listed
    for n in range(cycles):
        seconds, _ = timed(lambda n=n: claim(store, resource, f"new{n}", size))
        times["full"].append(seconds)
        if listed:
            seconds, _ = timed(lambda j=joined: claim(store, resource, f"w{j - 1}", size))
            times["rearm"].append(seconds)
        seconds, _ = timed(lambda held=lease: store.release(held))
        times["release"].append(seconds)
        head = lease.handoff.split(":", 1)[0] if lease.handoff else "holder"
        seconds, lease = timed(lambda head=head: claim(store, resource, head, size))
        times["woken"].append(seconds)
        if isinstance(lease, LeaseBusyError):  # (not expected: the head is held for)
            lease = claim(store, resource, "holder", None)
        if listed:
            timed(lambda j=joined: claim(store, resource, f"w{j}", size))  # refill
            joined += 1
    waiters = store.waiters(resource)
    store.release(lease)
    return {
        "payload": size,
        "asked": length,
        "listed": listed,
        "list_kib": round(len(waiters) * size / 1024, 1),
        **{
            op: {
                "median_ms": round(statistics.median(xs) * 1e3, 3),
                "p90_ms": round(sorted(xs)[int(0.9 * (len(xs) - 1))] * 1e3, 3),
            }
            for op, xs in times.items()
            if xs
        },
    }


def contend(
    make: Callable[[], Any], store: Any, size: int, length: int, threads: int, seconds: float
) -> dict[str, Any]:
    """Fill one resource's list, then ``threads`` threads (a store each) send refused claims
    at it for ``seconds`` (newcomers and listed waiters in turn) while the holder renews its
    lease every 0.1 s, as its renewer would: the renewal waits for the row behind them."""
    resource = f"wl-{uuid.uuid4().hex[:10]}"
    lease, listed = fill(store, resource, size, length)
    stop = time.monotonic() + seconds
    claims: list[float] = []
    errors: list[str] = []

    def worker(n: int) -> None:
        mine = make()
        try:
            k = 0
            while time.monotonic() < stop:
                who = f"w{(n * 7 + k) % listed}" if k % 2 and listed else f"t{n}-{k}"
                try:
                    seconds_, _ = timed(lambda who=who: claim(mine, resource, who, size))
                    claims.append(seconds_)
                except Exception as exc:  # (a statement timeout is a result here)
                    errors.append(type(exc).__name__)
                k += 1
        finally:
            mine.close()

    pool = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(threads)]
    for thread in pool:
        thread.start()
    renewals: list[float] = []
    while time.monotonic() < stop:
        try:
            seconds_, _ = timed(lambda: store.renew(lease, TTL))
            renewals.append(seconds_)
        except Exception as exc:  # (as above)
            errors.append(f"renewal {type(exc).__name__}")
        time.sleep(0.1)
    for thread in pool:
        thread.join()
    with contextlib.suppress(Exception):
        store.release(lease)

    def q(xs: list[float], p: float) -> float | None:
        return round(sorted(xs)[int(p * (len(xs) - 1))] * 1e3, 1) if xs else None

    return {
        "payload": size,
        "asked": length,
        "listed": listed,
        "threads": threads,
        "claims": len(claims),
        "claim_p50_ms": q(claims, 0.5),
        "claim_p99_ms": q(claims, 0.99),
        "renewals": len(renewals),
        "renewal_p50_ms": q(renewals, 0.5),
        "renewal_max_ms": round(max(renewals) * 1e3, 1) if renewals else None,
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
    }


@contextlib.contextmanager
def store_of(kind: str, args: argparse.Namespace, tmp: str) -> Iterator[tuple[Any, str]]:
    tag = uuid.uuid4().hex[:8]
    store = make_store(kind, args, tmp, tag)
    try:
        yield store, tag
    finally:
        cleanup(kind, store, tag)
        store.close()


def make_store(kind: str, args: argparse.Namespace, tmp: str, tag: str) -> Any:
    """A store of ``kind`` on this run's keys, tables or file (``tag`` names them)."""
    if kind == "redis":
        store = store_from_url(args.redis_url, key_prefix=f"{PREFIX}_{tag}:")
    elif kind == "postgres":
        store = store_from_url(args.postgres_url, table_prefix=f"{PREFIX}_{tag}_")
    else:
        store = store_from_url(f"sqlite:///{tmp}/leases-{tag}.db")
    if args.unbounded:
        store.wait_bytes_cap = 1 << 40
    return store


def cleanup(kind: str, store: Any, tag: str) -> None:
    """Delete what this run made on a server it may not own (by its prefix)."""
    with contextlib.suppress(Exception):
        if kind == "redis":
            client = store.client
            batch = list(client.scan_iter(match=f"{PREFIX}_{tag}:*", count=1000))
            for i in range(0, len(batch), 500):
                client.delete(*batch[i : i + 500])
        elif kind == "postgres":
            import sqlalchemy as sa

            with store.engine.begin() as conn:
                names = conn.execute(
                    sa.text("SELECT tablename FROM pg_tables WHERE tablename LIKE :p"),
                    {"p": f"{PREFIX}_{tag}_%"},
                ).scalars()
                for name in list(names):
                    conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))


@contextlib.contextmanager
def servers(args: argparse.Namespace, env: dict[str, Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if "redis" in args.stores and not args.redis_url:
            from tests.tooling.servers import RedisServer

            redis_server = RedisServer(appendonly=True, appendfsync="everysec")
            stack.callback(redis_server.close)
            redis_server.start()
            args.redis_url = redis_server.url
            env["redis_started_by_benchmark"] = True
        if "postgres" in args.stores and not args.postgres_url:
            from tests.tooling.servers import PostgresServer

            pg_server = PostgresServer()
            stack.callback(pg_server.close)
            pg_server.start()
            args.postgres_url = pg_server.url
            env["postgres_started_by_benchmark"] = True
        yield


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(STORES), help="comma list of stores")
    parser.add_argument("--payloads", default="200,2000,20000", help="payload bytes, comma list")
    parser.add_argument("--lengths", default="16,256", help="wait list lengths, comma list")
    parser.add_argument("--cycles", type=int, default=10, help="timed cycles per setting")
    parser.add_argument(
        "--contend",
        type=int,
        metavar="THREADS",
        help="instead: THREADS threads send refused claims at the full list while the holder "
        "renews every 0.1 s (claim and renewal latency, errors such as statement timeouts)",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="with --contend: how long")
    parser.add_argument(
        "--unbounded",
        action="store_true",
        help="lift wait_bytes_cap (every payload is listed): the cost without the bound",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args(argv)
    args.stores = [s for s in args.stores.split(",") if s]
    unknown = set(args.stores) - set(STORES)
    if unknown:
        parser.error(f"unknown store {sorted(unknown)[0]!r}; stores: {', '.join(STORES)}")
    args.payloads = [int(x) for x in args.payloads.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "unbounded": args.unbounded,
    }
    rows: list[dict[str, Any]] = []
    print(
        f"wait list cost, ms (median / p90 of {args.cycles}), "
        f"{'wait_bytes_cap lifted' if args.unbounded else 'default bounds'}"
    )
    print(
        f"{'store':9} {'payload':>7} {'asked':>5} {'listed':>6} {'list':>9} | "
        + " ".join(f"{op:>13}" for op in OPERATIONS)
    )
    try:
        with servers(args, env), tempfile.TemporaryDirectory(prefix="bench-wl-") as tmp:
            for kind in args.stores:
                for length in args.lengths:
                    for size in args.payloads:
                        with store_of(kind, args, tmp) as (store, tag):
                            store.wait_cap = max(store.wait_cap, length)
                            if args.contend:
                                row = {
                                    "store": kind,
                                    **contend(
                                        lambda kind=kind, tag=tag: make_store(kind, args, tmp, tag),
                                        store,
                                        size,
                                        length,
                                        args.contend,
                                        args.seconds,
                                    ),
                                }
                            else:
                                row = {
                                    "store": kind,
                                    **run_one(store, size, length, args.cycles),
                                }
                        rows.append(row)
                        if args.contend:
                            print(
                                f"{kind:9} {size:7} {length:5} {row['listed']:6} | "
                                f"{args.contend} threads: {row['claims']} refused claims, "
                                f"p50 {row['claim_p50_ms']} ms, p99 {row['claim_p99_ms']} ms; "
                                f"renewals p50 {row['renewal_p50_ms']} ms, "
                                f"max {row['renewal_max_ms']} ms; errors {row['errors']} "
                                f"{' '.join(row['error_kinds'])}",
                                flush=True,
                            )
                            continue
                        cells = " ".join(
                            f"{row[op]['median_ms']:6.2f}/{row[op]['p90_ms']:6.2f}"
                            if op in row
                            else f"{'-':>13}"
                            for op in OPERATIONS
                        )
                        print(
                            f"{kind:9} {size:7} {length:5} {row['listed']:6} "
                            f"{row['list_kib']:7.1f}kB | {cells}",
                            flush=True,
                        )
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    env["load_average_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
