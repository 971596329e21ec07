"""Acquire+release throughput of the lease stores next to the raw floor of their own drivers.

For Redis, PostgreSQL and SQLite this runs the store (``RedisLeaseStore`` or ``SQLLeaseStore``)
and a *floor*: the same number of round trips doing the least a lease could do, written directly
against the driver the store uses (redis-py ``SET NX PX`` + ``DEL``; a one-row ``UPDATE ...
RETURNING`` through psycopg or sqlite3). Both run from 1 process and from N processes (each on
its own resources, so nothing contends but the machine), interleaved store/floor/floor/store so
that drift on a small machine does not bias their ratio. It also counts on the server how many
round trips one acquire and one release cost.

It is a measurement, not a test: it prints PASS/FAIL per target and always exits 0 (130 when
interrupted). See ``benchmarks/README.md`` for how to run it and how to read the table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

STORES = ("redis", "postgres", "sqlite")
TTL = 60.0
RESOURCES_PER_WORKER = 8
WARM_CYCLES = 20  # per counting run: connect, load scripts, let psycopg prepare its statements
COUNT_OPS = {"redis": 1000, "postgres": 200, "sqlite": 200}
RATIO_TARGET = 0.8
ROUND_TRIP_TOLERANCE = 0.01
KEY_PREFIX = "celery_lease_bench:"
FLOOR_KEY_PREFIX = "celery_lease_bench_floor:"
TABLE_PREFIX = "celery_lease_bench_"
FLOOR_TABLE = "celery_lease_bench_floor"
PG_DATABASE = "celery_lease_bench"
# The server commands that run a script: each is one request from the client.
SCRIPT_COMMANDS = (
    "eval",
    "evalsha",
    "eval_ro",
    "evalsha_ro",
    "fcall",
    "fcall_ro",
    "script|load",
    "script|exists",
)

# The floors: the clock expressions are the store's, so the database does comparable work.
PG_NOW = "(extract(epoch from clock_timestamp()) * 1000000)::bigint"
SQLITE_NOW = "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"
FLOOR_COLUMNS = """
    resource varchar(200) {collate} PRIMARY KEY,
    owner_token varchar(64),
    owner_label varchar(200) NOT NULL,
    fence bigint NOT NULL,
    acquired_us bigint NOT NULL,
    expires_us bigint,
    prev_label varchar(200),
    prev_fence bigint"""
FLOOR_ACQUIRE = {
    "postgres": f"""
        UPDATE {FLOOR_TABLE} SET owner_token = %(t)s, owner_label = %(l)s, fence = fence + 1,
            acquired_us = n.us, expires_us = n.us + %(ttl)s
        FROM (SELECT {PG_NOW} AS us) AS n
        WHERE resource = %(r)s
        RETURNING fence, acquired_us, expires_us""",
    "sqlite": f"""
        UPDATE {FLOOR_TABLE} SET owner_token = :t, owner_label = :l, fence = fence + 1,
            acquired_us = n.us, expires_us = n.us + :ttl
        FROM (SELECT {SQLITE_NOW} AS us) AS n
        WHERE resource = :r
        RETURNING fence, acquired_us, expires_us""",
}
FLOOR_RELEASE = {
    "postgres": f"""
        UPDATE {FLOOR_TABLE} SET owner_token = NULL, expires_us = NULL
        WHERE resource = %(r)s AND owner_token = %(t)s""",
    "sqlite": f"""
        UPDATE {FLOOR_TABLE} SET owner_token = NULL, expires_us = NULL
        WHERE resource = :r AND owner_token = :t""",
}


class BenchInterrupted(KeyboardInterrupt):
    """SIGTERM, treated like Ctrl-C so that the servers and workers are still stopped."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise BenchInterrupted


# -- the two sides: store and floor, built inside whichever process uses them -----------------
@dataclass
class Ops:
    """One side of a comparison: ``acquire(i)`` claims name ``i``, ``release`` gives it back."""

    acquire: Callable[[int], Any]
    release: Callable[[Any], None]
    close: Callable[[], None]
    raw: Any = None  # the store, client or connection, for the round-trip counters


def _redis_client(url: str) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # Exactly the options RedisLeaseStore gives the client it creates from a URL.
    return redis.Redis.from_url(
        url, socket_timeout=5.0, socket_connect_timeout=5.0, retry=Retry(NoBackoff(), 1)
    )


def _pg_conninfo(url: str, app: str | None = None, *, store_options: bool = False) -> str:
    from psycopg.conninfo import make_conninfo
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    params: dict[str, Any] = {
        "host": parsed.host,
        "port": parsed.port,
        "user": parsed.username,
        "password": parsed.password,
        "dbname": parsed.database,
        **parsed.query,
    }
    if store_options:  # the connection options SQLLeaseStore sets (statement_timeout=5.0)
        params["options"] = (
            "-c statement_timeout=5000 -c lock_timeout=5000 "
            "-c idle_in_transaction_session_timeout=10000"
        )
        params["connect_timeout"] = 5
    if app:
        params["application_name"] = app
    return make_conninfo(**{k: v for k, v in params.items() if v is not None})


def _with_app(url: str, app: str | None) -> str:
    if not app:
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).update_query_dict({"application_name": app}).render_as_string(False)


def build_ops(kind: str, side: str, cfg: dict[str, Any], names: list[str], app: str = "") -> Ops:
    """Build the store or the floor for ``kind`` over the resource ``names``."""
    from celery_lease import Owner

    owner = Owner.new(f"bench:{os.getpid()}")
    if side == "store":
        if kind == "redis":
            from celery_lease.stores.redis import RedisLeaseStore

            store: Any = RedisLeaseStore(url=cfg["url"], key_prefix=KEY_PREFIX)
        else:
            from celery_lease.stores.sql import SQLLeaseStore

            store = SQLLeaseStore(
                url=_with_app(cfg["url"], app), table_prefix=TABLE_PREFIX, create_tables=False
            )
        acquire, release = store.acquire, store.release

        def store_acquire(i: int) -> Any:
            return acquire(names[i], owner, TTL)

        def store_release(lease: Any) -> None:
            if not release(lease):
                raise RuntimeError(f"store release of {lease.resource} found it not ours")

        return Ops(store_acquire, store_release, store.close, store)
    if kind == "redis":
        return _redis_floor(cfg, names, owner)
    if kind == "postgres":
        return _pg_floor(cfg, names, owner, app)
    return _sqlite_floor(cfg, names, owner)


def _redis_floor(cfg: dict[str, Any], names: list[str], owner: Any) -> Ops:
    client = _redis_client(cfg["url"])
    keys = [FLOOR_KEY_PREFIX + name for name in names]
    token, px = owner.token, int(TTL * 1000)
    set_, delete = client.set, client.delete

    def acquire(i: int) -> str:
        key = keys[i]
        if not set_(key, token, nx=True, px=px):
            raise RuntimeError(f"floor SET NX found {key} taken")
        return key

    def release(key: str) -> None:
        if delete(key) != 1:
            raise RuntimeError(f"floor DEL found no {key}")

    return Ops(acquire, release, client.close, client)


def _pg_floor(cfg: dict[str, Any], names: list[str], owner: Any, app: str) -> Ops:
    import psycopg

    conn = psycopg.connect(
        _pg_conninfo(cfg["url"], app or None, store_options=True), autocommit=True
    )
    cursor = conn.cursor()
    # One statement, so one transaction whatever the number of names.
    cursor.execute(
        f"INSERT INTO {FLOOR_TABLE} (resource, owner_label, fence, acquired_us) "
        "SELECT unnest(%s::varchar[]), '', 0, 0 ON CONFLICT DO NOTHING",
        (names,),
    )
    token, label, ttl_us = owner.token, owner.label, round(TTL * 1e6)
    execute, sql_acquire, sql_release = (
        cursor.execute,
        FLOOR_ACQUIRE["postgres"],
        FLOOR_RELEASE["postgres"],
    )

    def acquire(i: int) -> str:
        execute(sql_acquire, {"r": names[i], "t": token, "l": label, "ttl": ttl_us})
        if cursor.fetchone() is None:
            raise RuntimeError(f"floor UPDATE found no row {names[i]}")
        return names[i]

    def release(name: str) -> None:
        execute(sql_release, {"r": name, "t": token})
        if cursor.rowcount != 1:
            raise RuntimeError(f"floor release found {name} not ours")

    return Ops(acquire, release, conn.close, conn)


def sqlite_connect(path: str) -> Any:
    """A sqlite3 connection set up the way SQLLeaseStore sets up its own."""
    import sqlite3

    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=30000"):
        conn.execute(f"PRAGMA {pragma}")
    return conn


def _sqlite_floor(cfg: dict[str, Any], names: list[str], owner: Any) -> Ops:
    conn = sqlite_connect(cfg["floor_path"])
    cursor = conn.cursor()
    cursor.execute("BEGIN IMMEDIATE")
    cursor.executemany(
        f"INSERT OR IGNORE INTO {FLOOR_TABLE} (resource, owner_label, fence, acquired_us) "
        "VALUES (?, '', 0, 0)",
        [(name,) for name in names],
    )
    cursor.execute("COMMIT")
    token, label, ttl_us = owner.token, owner.label, round(TTL * 1e6)
    execute, sql_acquire, sql_release = (
        cursor.execute,
        FLOOR_ACQUIRE["sqlite"],
        FLOOR_RELEASE["sqlite"],
    )

    def acquire(i: int) -> str:
        # As the store claims: one statement in a BEGIN IMMEDIATE transaction.
        execute("BEGIN IMMEDIATE")
        execute(sql_acquire, {"r": names[i], "t": token, "l": label, "ttl": ttl_us})
        row = cursor.fetchone()
        execute("COMMIT")
        if row is None:
            raise RuntimeError(f"floor UPDATE found no row {names[i]}")
        return names[i]

    def release(name: str) -> None:
        # As the store releases: one autocommit UPDATE (SQLLeaseStore.release takes no
        # BEGIN IMMEDIATE; a lone UPDATE takes the write lock when it starts).
        execute(sql_release, {"r": name, "t": token})
        if cursor.rowcount != 1:
            raise RuntimeError(f"floor release found {name} not ours")

    return Ops(acquire, release, conn.close, conn)


def resource_names(run_id: str, group: str, count: int) -> list[str]:
    return [f"b{run_id}/{group}/r{i}" for i in range(count)]


# -- worker processes ------------------------------------------------------------------------
def timed_loop(
    ops: Ops, count: int, start: float, warm_end: float, end: float
) -> tuple[int, float]:
    """Warm up until ``warm_end``, then count acquire+release cycles until ``end``.

    Times are ``time.monotonic()``, one clock for every process on the machine.
    """
    mono, acquire, release = time.monotonic, ops.acquire, ops.release
    delay = start - mono()
    if delay > 0:
        time.sleep(delay)
    i = 0
    while mono() < warm_end:
        release(acquire(i % count))
        i += 1
    done = 0
    t0 = now = mono()
    while now < end:
        release(acquire(i % count))
        i += 1
        done += 1
        now = mono()
    return done, now - t0


def worker_main(kind: str, cfg: dict[str, Any], index: int, pipe: Any) -> None:
    """One benchmark process: builds its own store and floor, then runs what it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    sides: dict[str, Ops] = {}
    try:
        names = resource_names(cfg["run_id"], f"w{index}", RESOURCES_PER_WORKER)
        for side in ("store", "floor"):
            sides[side] = build_ops(kind, side, cfg, names)
        pipe.send(("ready", os.getpid()))
        while True:
            try:
                message = pipe.recv()
            except EOFError:
                return
            if message[0] == "stop":
                return
            _, side, start, warm_end, end = message
            try:
                pipe.send(("done", timed_loop(sides[side], len(names), start, warm_end, end)))
            except Exception:
                pipe.send(("error", traceback.format_exc()))
    except Exception:
        with contextlib.suppress(Exception):
            pipe.send(("error", traceback.format_exc()))
    finally:
        for ops in sides.values():
            with contextlib.suppress(Exception):
                ops.close()


class WorkerPool:
    """``count`` spawned worker processes for one store, kept for all its runs."""

    def __init__(self, kind: str, cfg: dict[str, Any], count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        try:
            for index in range(count):
                parent, child = context.Pipe()
                proc = context.Process(
                    target=worker_main,
                    args=(kind, cfg, index, child),
                    name=f"bench-{kind}-{index}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.pipes.append(parent)
                self.procs.append(proc)
            failed = [reply for reply in self._replies(120.0) if reply[0] != "ready"]
        except BaseException:
            self.close()
            raise
        if failed:
            self.close()
            raise RuntimeError(f"a {kind} worker failed to start:\n{failed[0][1]}")

    def _replies(self, timeout: float) -> list[tuple[str, Any]]:
        replies = []
        deadline = time.monotonic() + timeout
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            while not pipe.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"worker {proc.name} exited with {proc.exitcode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {proc.name} did not answer in {timeout:.0f}s")
            replies.append(pipe.recv())
        return replies

    def run(self, side: str, warmup: float, seconds: float) -> float:
        """Run ``side`` in every worker at once; return the total cycles per second."""
        start = time.monotonic() + 0.05 + 0.01 * len(self.pipes)
        for pipe in self.pipes:
            pipe.send(("run", side, start, start + warmup, start + warmup + seconds))
        total = 0.0
        for reply in self._replies(warmup + seconds + 60.0):
            if reply[0] != "done":
                raise RuntimeError(f"a worker failed during the {side} run:\n{reply[1]}")
            done, elapsed = reply[1]
            if done:  # a worker blocked for the whole window (SQLite lock) adds nothing
                total += done / elapsed
        return total

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(Exception):
                pipe.send(("stop",))
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()  # our own child, by its Process handle
                proc.join(5.0)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.procs = [], []


# -- round trips per operation, measured on the server ---------------------------------------
def count_redis(cfg: dict[str, Any], side: str) -> dict[str, Any]:
    """Requests read by the server (``total_reads_processed``) per acquire and per release.

    One request read = one round trip (no pipelining here). Also reports the top-level script
    calls and every command the server ran (commands inside a script count there too).
    """
    import redis

    k = COUNT_OPS["redis"]
    admin = redis.Redis.from_url(cfg["url"])
    names = resource_names(cfg["run_id"], f"count-{side}", k)
    ops = build_ops("redis", side, cfg, names)

    def snap() -> collections.Counter[str]:
        info = admin.info("stats", "commandstats")
        return collections.Counter(
            reads=info["total_reads_processed"],
            commands=info["total_commands_processed"],
            scripts=sum(info.get(f"cmdstat_{c}", {}).get("calls", 0) for c in SCRIPT_COMMANDS),
        )

    try:
        for i in range(k):  # warm: connect, load the scripts (NOSCRIPT + SCRIPT LOAD once)
            ops.release(ops.acquire(i))
        s0 = snap()
        s1 = snap()
        own = s1 - s0  # what one snapshot itself costs (the INFO request)
        held = [ops.acquire(i) for i in range(k)]
        s2 = snap()
        for lease in held:
            ops.release(lease)
        s3 = snap()
    finally:
        ops.close()
        admin.close()

    def per_op(a: collections.Counter[str], b: collections.Counter[str], key: str) -> float:
        return (b[key] - a[key] - own[key]) / k

    return {
        "method": "redis INFO stats total_reads_processed delta (1 request = 1 round trip)",
        "ops": k,
        "acquire": per_op(s1, s2, "reads"),
        "release": per_op(s2, s3, "reads"),
        "script_calls": {
            "acquire": per_op(s1, s2, "scripts"),
            "release": per_op(s2, s3, "scripts"),
        },
        "server_commands": {
            "acquire": per_op(s1, s2, "commands"),
            "release": per_op(s2, s3, "commands"),
        },
    }


class PgObserver:
    """Reads ``pg_stat_database.xact_commit`` from inside one open transaction.

    Its own reads therefore never commit, so they add nothing to the counter they read.
    """

    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(_pg_conninfo(url, "celery_lease_bench_observer"))
        self.cursor = self.conn.cursor()

    def _scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        self.cursor.execute("SELECT pg_stat_clear_snapshot()")
        self.cursor.execute(sql, params)
        row = self.cursor.fetchone()
        return None if row is None else row[0]

    def settled_commits(self, app: str) -> int:
        """The commit count once every backend named ``app`` exited (flushing its stats)."""
        deadline = time.monotonic() + 30.0
        while self._scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL backends of {app} did not exit")
            time.sleep(0.02)
        sql = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        value = self._scalar(sql)
        while True:  # a backend flushes its counters on exit; make sure they have landed
            time.sleep(0.15)
            again = self._scalar(sql)
            if again == value or time.monotonic() > deadline:
                return int(again)
            value = again

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.rollback()
        self.conn.close()


def count_postgres(cfg: dict[str, Any], side: str) -> dict[str, Any]:
    """Transactions committed per acquire and per release (autocommit: 1 statement = 1).

    Three runs on fresh connections (so each backend's counters are flushed when it exits):
    setup+warm-up only, then also K acquires, then also K acquires and K releases. The
    differences are the acquires and the releases; connection setup cancels out.
    """
    k = COUNT_OPS["postgres"]
    app = f"celery_lease_bench_count_{side}"
    observer = PgObserver(cfg["url"])

    def run(tag: str, acquires: int, releases: int) -> int:
        names = resource_names(cfg["run_id"], f"count-{side}-{tag}", k + WARM_CYCLES)
        before = observer.settled_commits(app)
        ops = build_ops("postgres", side, cfg, names, app=app)
        try:
            for i in range(k, k + WARM_CYCLES):
                ops.release(ops.acquire(i))
            held = [ops.acquire(i) for i in range(acquires)]
            for lease in held[:releases]:
                ops.release(lease)
        finally:
            ops.close()
        return observer.settled_commits(app) - before

    try:
        base = run("base", 0, 0)
        acquired = run("acquire", k, 0)
        released = run("release", k, k)
    finally:
        observer.close()
    return {
        "method": "pg_stat_database.xact_commit delta (autocommit: 1 statement = 1 round trip)",
        "ops": k,
        "acquire": (acquired - base) / k,
        "release": (released - acquired) / k,
        "connection_setup_and_warmup_commits": base,
    }


def count_sqlite(cfg: dict[str, Any], side: str) -> dict[str, Any]:
    """Statements executed per acquire and per release (in-process calls, not network)."""
    from sqlalchemy import event

    k = COUNT_OPS["sqlite"]
    names = resource_names(cfg["run_id"], f"count-{side}", k)
    ops = build_ops("sqlite", side, cfg, names)
    seen: list[str] = []
    if side == "store":
        engine = ops.raw.engine
        engine.dispose()  # every connection from now on is made, and traced, below

        @event.listens_for(engine, "connect")
        def _trace(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.set_trace_callback(seen.append)

    else:
        ops.raw.set_trace_callback(seen.append)
    try:
        for i in range(k):
            ops.release(ops.acquire(i))
        n0 = len(seen)
        held = [ops.acquire(i) for i in range(k)]
        n1 = len(seen)
        for lease in held:
            ops.release(lease)
        n2 = len(seen)
    finally:
        ops.close()

    def kinds(statements: list[str]) -> dict[str, float]:
        first = collections.Counter(" ".join(s.split()[:2]).upper() for s in statements)
        return {name: n / k for name, n in sorted(first.items())}

    return {
        "method": "sqlite3 set_trace_callback on the connections (in-process statements)",
        "ops": k,
        "acquire": (n1 - n0) / k,
        "release": (n2 - n1) / k,
        "statements": {"acquire": kinds(seen[n0:n1]), "release": kinds(seen[n1:n2])},
    }


COUNTERS = {"redis": count_redis, "postgres": count_postgres, "sqlite": count_sqlite}


# -- servers and schema --------------------------------------------------------------------------
def prepare_redis(
    args: argparse.Namespace, stack: contextlib.ExitStack, env: dict[str, Any]
) -> str:
    url = args.redis_url
    if not url:
        from tests.tooling.servers import RedisServer

        server = RedisServer(appendonly=True, appendfsync="everysec")
        stack.callback(server.close)
        server.start()
        url = server.url
        env["redis_started_by_benchmark"] = True
    else:
        stack.callback(cleanup_redis, url)
    client = _redis_client(url)
    try:
        info = client.info("server")
        env["redis_server"] = info.get("redis_version")
        with contextlib.suppress(Exception):
            env["redis_config"] = {
                k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                for name in ("appendonly", "appendfsync", "maxmemory-policy", "save")
                for k, v in client.config_get(name).items()
            }
    finally:
        client.close()
    return url


def cleanup_redis(url: str) -> None:
    """On a server we did not start, delete the keys this benchmark made (by our prefixes)."""
    client = _redis_client(url)
    try:
        for pattern in (KEY_PREFIX + "*", FLOOR_KEY_PREFIX + "*"):
            batch = list(client.scan_iter(match=pattern, count=1000))
            for i in range(0, len(batch), 500):
                client.delete(*batch[i : i + 500])
    finally:
        client.close()


def prepare_postgres(
    args: argparse.Namespace, stack: contextlib.ExitStack, env: dict[str, Any]
) -> str:
    import psycopg

    url = args.postgres_url
    if not url:
        from tests.tooling.servers import PostgresServer

        server = PostgresServer()
        stack.callback(server.close)
        server.start()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {PG_DATABASE}")
        url = server.url.rsplit("/", 1)[0] + f"/{PG_DATABASE}"
        env["postgres_started_by_benchmark"] = True
    else:
        stack.callback(cleanup_postgres, url)
    from celery_lease.stores.sql import SQLLeaseStore

    SQLLeaseStore(url=url, table_prefix=TABLE_PREFIX).close()  # creates the lease tables
    with psycopg.connect(_pg_conninfo(url), autocommit=True) as conn:
        for statement in floor_schema('COLLATE "C"'):
            conn.execute(statement)
        env["postgres_server"] = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        env["postgres_config"] = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("fsync", "synchronous_commit", "wal_sync_method", "shared_buffers")
        }
    return url


def floor_schema(collate: str) -> list[str]:
    """The floor table, shaped like the lease table (same columns, same expiry index)."""
    return [
        f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} ({FLOOR_COLUMNS.format(collate=collate)})",
        f"CREATE INDEX IF NOT EXISTS {FLOOR_TABLE}_expiry ON {FLOOR_TABLE} (expires_us, resource)",
    ]


def cleanup_postgres(url: str) -> None:
    """On a server we did not start, drop the tables this benchmark made (by our prefix)."""
    import psycopg

    from celery_lease.stores.sql import SQLLeaseStore

    store = SQLLeaseStore(url=url, table_prefix=TABLE_PREFIX, create_tables=False)
    try:
        store.metadata.drop_all(store.engine)  # whatever tables the store has under our prefix
    finally:
        store.close()
    with psycopg.connect(_pg_conninfo(url), autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {FLOOR_TABLE}")


def prepare_sqlite(stack: contextlib.ExitStack, env: dict[str, Any]) -> tuple[str, str]:
    import sqlite3

    directory = tempfile.mkdtemp(prefix="celery-lease-bench-sqlite-")
    stack.callback(shutil.rmtree, directory, True)
    store_path = os.path.join(directory, "leases.db")
    floor_path = os.path.join(directory, "floor.db")
    from celery_lease.stores.sql import SQLLeaseStore

    SQLLeaseStore(url=f"sqlite:///{store_path}", table_prefix=TABLE_PREFIX).close()
    conn = sqlite_connect(floor_path)
    try:
        for statement in floor_schema(""):
            conn.execute(statement)
    finally:
        conn.close()
    env["sqlite"] = sqlite3.sqlite_version
    env["sqlite_directory_filesystem"] = _filesystem_of(directory)
    return store_path, floor_path


def _filesystem_of(path: str) -> str:
    best = ("", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best[0]):
                best = (parts[1], parts[2])
    return best[1]


# -- results ------------------------------------------------------------------------------------
@dataclass
class Result:
    store: str
    processes: int
    store_runs: list[float] = field(default_factory=list)
    floor_runs: list[float] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    machine_busy: list[float] = field(default_factory=list)
    steal: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [s / f for s, f in zip(self.store_runs, self.floor_runs, strict=False) if f]

    def summary(self) -> dict[str, Any]:
        ratios = self.ratios
        return {
            "store": self.store,
            "processes": self.processes,
            "store_cycles_per_s": statistics.median(self.store_runs) if self.store_runs else None,
            "floor_cycles_per_s": statistics.median(self.floor_runs) if self.floor_runs else None,
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "store_runs": self.store_runs,
            "floor_runs": self.floor_runs,
            "ratio_runs": ratios,
            "run_order": self.order,
            "machine_busy_per_run": self.machine_busy,
            "cpu_steal_per_run": self.steal,
        }


def cpu_times() -> list[int]:
    """The machine-wide CPU counters of /proc/stat (empty where there is none)."""
    try:
        with open("/proc/stat") as stat:
            return [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def cpu_busy(before: list[int], after: list[int]) -> tuple[float, float]:
    """Fractions of all CPUs busy, and stolen by the hypervisor, between two readings."""
    if len(before) < 8 or len(after) < 8:
        return float("nan"), float("nan")
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    idle = delta[3] + delta[4]  # idle + iowait
    return 1 - idle / total, delta[7] / total


def measure(
    kind: str, cfg: dict[str, Any], procs: int, args: argparse.Namespace, result: Result
) -> None:
    pool = WorkerPool(kind, cfg, procs)
    try:
        for rep in range(args.repeats):
            # store, floor | floor, store | ...: a linear drift hits both sides alike
            for side in ("store", "floor") if rep % 2 == 0 else ("floor", "store"):
                before = cpu_times()
                rate = pool.run(side, args.warmup, args.seconds)
                busy, steal = cpu_busy(before, cpu_times())
                (result.store_runs if side == "store" else result.floor_runs).append(rate)
                result.order.append(side)
                result.machine_busy.append(busy)
                result.steal.append(steal)
                print(
                    f"    {kind:8} {procs} proc  rep {rep + 1}  {side:5}  {rate:10,.0f} cycles/s"
                    f"  (machine {busy:4.0%} busy, {steal:3.0%} steal)"
                )
    finally:
        pool.close()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def evaluate_targets(
    summaries: list[dict[str, Any]], round_trips: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    targets = []
    for row in summaries:
        if row["store"] in ("redis", "postgres"):
            value = row["ratio"]
            targets.append(
                {
                    "target": f"{row['store']} store >= {RATIO_TARGET} of floor, "
                    f"{row['processes']} process{'es' if row['processes'] > 1 else ''}",
                    "value": value,
                    "pass": value is not None and value >= RATIO_TARGET,
                }
            )
    for kind in ("redis", "postgres"):
        if kind not in round_trips:
            continue  # not measured in this run (--stores)
        counted = round_trips.get(kind, {}).get("store")
        for op in ("acquire", "release"):
            value = None if counted is None or "error" in counted else counted[op]
            targets.append(
                {
                    "target": f"{kind} store: exactly 1 round trip per {op}",
                    "value": value,
                    "pass": value is not None and abs(value - 1.0) <= ROUND_TRIP_TOLERANCE,
                }
            )
    return targets


def print_table(summaries: list[dict[str, Any]], round_trips: dict[str, dict[str, Any]]) -> None:
    header = (
        f"{'store':9} {'procs':>5} {'store cyc/s':>12} {'floor cyc/s':>12} {'ratio':>6} "
        f"{'(min-max)':>11}  {'store rt acq/rel':>16}  {'floor rt acq/rel':>16}"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in summaries:
        kind = row["store"]
        rts = []
        for side in ("store", "floor"):
            counted = round_trips.get(kind, {}).get(side) or {}
            if "acquire" in counted:
                rts.append(f"{counted['acquire']:.3f}/{counted['release']:.3f}")
            else:
                rts.append("-")
        spread = (
            f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}" if row["ratio"] is not None else "-"
        )
        print(
            f"{kind:9} {row['processes']:>5} {_fmt(row['store_cycles_per_s'], ',.0f'):>12} "
            f"{_fmt(row['floor_cycles_per_s'], ',.0f'):>12} {_fmt(row['ratio'], '.2f'):>6} "
            f"{spread:>11}  {rts[0]:>16}  {rts[1]:>16}"
        )
    print(
        "cycles/s: median over repeats of the total over all processes (1 cycle = acquire + "
        "release);\nratio: median of per-repeat store/floor pairs; rt: round trips per operation "
        "counted on the server\n(redis: requests read, postgres: committed transactions, sqlite: "
        "statements executed in-process)."
    )
    sqlite_store = round_trips.get("sqlite", {}).get("store") or {}
    if "statements" in sqlite_store:
        print(f"sqlite store statements per op: {sqlite_store['statements']}")
    redis_store = round_trips.get("redis", {}).get("store") or {}
    if "script_calls" in redis_store:
        print(
            f"redis store per op: script calls {redis_store['script_calls']}, server commands "
            f"incl. inside scripts {redis_store['server_commands']}"
        )


def environment() -> dict[str, Any]:
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "redis_py": version("redis"),
        "hiredis": version("hiredis"),
        "psycopg": version("psycopg"),
        "psycopg_binary": version("psycopg-binary"),
        "sqlalchemy": version("sqlalchemy"),
        "celery_lease": version("celery-lease"),
        "celery_lease_path": str(
            Path(importlib.import_module("celery_lease").__file__ or "").parent
        ),
        "loadavg_start": os.getloadavg(),
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        # The code measured: the working tree may differ from the commit.
        def git(*cmd: str) -> str:
            done = subprocess.run(
                ["git", "-C", str(ROOT), *cmd],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            )
            return done.stdout.rstrip("\n")

        env["git_commit"] = git("rev-parse", "HEAD")
        env["git_changed_package_files"] = git("status", "--porcelain", "celery_lease").splitlines()
    with contextlib.suppress(ImportError):
        import psycopg

        env["libpq"] = psycopg.pq.version()
        env["psycopg_impl"] = psycopg.pq.__impl__
    with contextlib.suppress(ImportError):
        from redis.utils import HIREDIS_AVAILABLE

        env["redis_py_hiredis_parser"] = HIREDIS_AVAILABLE
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Acquire+release cycles/s of the lease stores against their raw driver floor."
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per run")
    parser.add_argument("--warmup", type=float, default=0.25, help="warm-up seconds per run")
    parser.add_argument("--repeats", type=int, default=6, help="store+floor pairs per setting")
    parser.add_argument(
        "--stores", default=",".join(STORES), help="comma list of " + ",".join(STORES)
    )
    parser.add_argument("--processes", default="1,8", help="comma list of process counts")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument(
        "--postgres-url", help="use this postgresql+psycopg:// database instead of starting one"
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    args = parser.parse_args(argv)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = set(args.stores) - set(STORES)
    if unknown:
        parser.error(f"unknown store(s) {', '.join(sorted(unknown))}; choose from {STORES}")
    try:
        args.processes = [int(p) for p in args.processes.split(",") if p.strip()]
    except ValueError:
        parser.error("--processes takes integers, e.g. 1,8")
    if not args.processes or min(args.processes) < 1:
        parser.error("--processes takes positive integers")
    if args.seconds <= 0 or args.warmup < 0 or args.repeats < 1:
        parser.error("--seconds must be > 0, --warmup >= 0, --repeats >= 1")
    return args


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    env = environment()
    run_id = uuid.uuid4().hex[:8]
    results: list[Result] = []
    round_trips: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    interrupted = False
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        try:
            for kind in args.stores:
                print(f"== {kind}")
                try:
                    if kind == "redis":
                        cfg = {"url": prepare_redis(args, stack, env)}
                    elif kind == "postgres":
                        cfg = {"url": prepare_postgres(args, stack, env)}
                    else:
                        store_path, floor_path = prepare_sqlite(stack, env)
                        cfg = {"url": f"sqlite:///{store_path}", "floor_path": floor_path}
                    cfg["run_id"] = run_id
                    round_trips[kind] = {}
                    for side in ("store", "floor"):
                        round_trips[kind][side] = COUNTERS[kind](cfg, side)
                        counted = round_trips[kind][side]
                        print(
                            f"    {kind:8} {side:5} round trips per acquire "
                            f"{counted['acquire']:.3f}, per release {counted['release']:.3f}"
                        )
                    for procs in args.processes:
                        result = Result(kind, procs)
                        results.append(result)
                        measure(kind, cfg, procs, args, result)
                except Exception as exc:
                    if isinstance(exc, BenchInterrupted):
                        raise
                    errors[kind] = traceback.format_exc()
                    print(f"!! {kind} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping workers and servers", file=sys.stderr)
    summaries = [r.summary() for r in results]
    targets = evaluate_targets(summaries, round_trips)
    env["loadavg_end"] = os.getloadavg()
    print_table(summaries, round_trips)
    print("\ntargets (a measurement: the exit status is 0 either way)")
    for target in targets:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        print(f"  {'PASS' if target['pass'] else 'FAIL'}  {target['target']}: {value}")
    for kind, error in errors.items():
        print(f"\n{kind} did not run:\n{error}", file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"\nwall time {elapsed:.0f}s")
    if args.json:
        report = {
            "environment": env,
            "settings": {
                "seconds": args.seconds,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "processes": args.processes,
                "stores": args.stores,
                "ttl": TTL,
                "resources_per_worker": RESOURCES_PER_WORKER,
                "count_ops": COUNT_OPS,
                "ratio_target": RATIO_TARGET,
                "redis_url_given": bool(args.redis_url),
                "postgres_url_given": bool(args.postgres_url),
            },
            "results": summaries,
            "round_trips": round_trips,
            "targets": targets,
            "errors": errors,
            "interrupted": interrupted,
            "wall_seconds": elapsed,
        }
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
