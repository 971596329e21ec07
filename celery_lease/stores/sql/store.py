"""The SQL lease store: PostgreSQL (psycopg 3) and SQLite, timed by the database clock.

SQLAlchemy 2 Core defines the tables, creates them idempotently, quotes the configurable table
names and owns the connection pool. The hot path sends hand-written statements (built once per
store with the dialect's quoting) straight through the pooled DBAPI connection: a claim or a
release is one statement in autocommit mode. Going through SQLAlchemy's execution layer with a
transaction per call cost more than half the throughput of raw psycopg in our benchmark.

Time is the database's: ``clock_timestamp()`` on PostgreSQL (``now()`` would be the transaction
start), ``julianday('now')`` on SQLite. Times are stored as microseconds since the epoch so both
dialects share one schema. On SQLite every operation runs in a ``BEGIN IMMEDIATE`` transaction
(WAL journal), which takes the write lock up front instead of failing on lock upgrade.
"""

from __future__ import annotations

import builtins
import logging
import math
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from ..._errors import (
    IdentityDoneError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseLostError,
    LeaseStoreError,
)
from ..._interrupt import shielded
from ..._lease import Lease, LeaseInfo, Owner, from_micros
from ..._ledger import decode
from ..._names import validate_identifier, validate_resource
from .._connections import FreeList
from ..base import (
    DEFAULT_MAX_TTL,
    DEFAULT_RETENTION,
    BaseLeaseStore,
    LeasePage,
    Waiter,
    connection_refused,
    decode_cursor,
    encode_cursor,
    monotonic,
)
from ..urls import check_credentials, mask_url
from . import statements as stmts
from .ledger import SQLLedgerMixin, recovered_from
from .ledger_statements import LedgerStatements

__all__ = ["SCHEMA_VERSION", "SQLLeaseStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_VERSION = 1
_NO_ROW = (None, None, None, None, None, None)  # a missing lease row, shaped like ``state``
_SQLITE_MIN = (3, 35, 0)  # RETURNING


class SQLLeaseStore(SQLLedgerMixin, BaseLeaseStore):
    """Leases in a SQL table (PostgreSQL through psycopg 3, or SQLite).

    Args:
        engine: a SQLAlchemy ``Engine`` to use (not disposed by :meth:`close`); or give ``url``.
        url: ``postgresql+psycopg://user:pw@host:port/db`` or ``sqlite:///path.db`` (or
            ``sqlite://`` for a private in-memory database); the store owns that engine.
        table_prefix: prefix of the table names, default ``celery_lease_``.
        create_tables: create the tables (idempotently) when the store is made.
        max_ttl: the largest ttl accepted.
        statement_timeout: PostgreSQL statement and lock timeout in seconds, so a stuck
            statement cannot pin a row lock; also the client's connect timeout and TCP user
            timeout, with keepalive probes on idle connections, so a dead peer cannot block
            a call until TCP gives up (only for an engine the store creates).
        engine_options: extra keyword arguments for ``sqlalchemy.create_engine``.
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        url: str | None = None,
        table_prefix: str = "celery_lease_",
        create_tables: bool = True,
        max_ttl: float = DEFAULT_MAX_TTL,
        retention: float = DEFAULT_RETENTION,
        statement_timeout: float = 5.0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(max_ttl=max_ttl, retention=retention)
        validate_identifier(table_prefix, "table_prefix")
        if (engine is None) == (url is None):
            raise LeaseConfigError("SQLLeaseStore needs exactly one of engine= or url=")
        self._owns_engine = engine is None
        if engine is None:
            assert url is not None
            engine = _create_engine(url, statement_timeout, engine_options or {})
        self.engine = engine
        self.url = mask_url(engine.url.render_as_string(hide_password=True))
        self.dialect = engine.dialect.name
        if self.dialect not in ("postgresql", "sqlite"):
            raise LeaseConfigError(
                f"SQLLeaseStore supports PostgreSQL and SQLite, not {self.dialect!r} ({self.url})"
            )
        if self.dialect == "postgresql" and engine.dialect.driver != "psycopg":
            raise LeaseConfigError(
                f"SQLLeaseStore needs the psycopg 3 driver (postgresql+psycopg://), got "
                f"{engine.dialect.driver!r} in {self.url}"
            )
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        if self.dialect == "sqlite":
            version = engine.dialect.loaded_dbapi.sqlite_version_info
            if version < _SQLITE_MIN:
                raise LeaseConfigError(
                    f"SQLite {version} is too old for SQLLeaseStore: 3.35 or newer is needed "
                    "(for RETURNING); upgrade Python or use PostgreSQL/Redis"
                )
        # An in-memory SQLite database lives in one connection that all threads share.
        self._serial = threading.Lock() if isinstance(engine.pool, StaticPool) else None
        self._free: FreeList[_Connection] = FreeList(self._connect, _Connection.close)
        # The renewer's calls (renew_many, warm_up) keep their own connections: the one its
        # warm-up opened is still there for the first renewal, whatever the tasks took meanwhile.
        self._renewer_free: FreeList[_Connection] = FreeList(self._connect, _Connection.close)
        self.metadata, self.tables = _tables(table_prefix)
        self.leases_table, self.meta_table = self.tables["leases"], self.tables["meta"]
        quote = engine.dialect.identifier_preparer.quote
        names = {kind: quote(table.name) for kind, table in self.tables.items()}
        self.sql = stmts.Statements(
            self.dialect, names["leases"], self._paramstyle(), names["gate"]
        )
        self.ledger_sql = LedgerStatements(
            self.dialect, self.sql.now, self._paramstyle(), names, self.sql.claim_upsert
        )
        if create_tables:
            try:
                self.create_tables()
            except BaseException:
                self.close()  # (the engine this store made would keep its pool otherwise)
                raise

    def _paramstyle(self) -> str:
        return "pyformat" if self.dialect == "postgresql" else "named"

    # -- schema ----------------------------------------------------------------------------
    def create_tables(self) -> None:
        """Create the tables and the schema version row if missing; check the version."""
        # Many workers may start at once on a new prefix: on PostgreSQL the DDL runs under a
        # transaction-scoped advisory lock; anywhere, a clash is retried with jittered backoff.
        lock_key = zlib.crc32(f"celery_lease schema {self.leases_table.name}".encode())
        deadline = time.monotonic() + 30.0
        delay = 0.05
        while True:
            # A server that cannot be reached fails now, within the connect timeout, saying
            # whether it refused (the task's outage path waits for it); only the DDL is retried.
            with self._translate("table creation"):
                conn = self.engine.connect()
            try:
                with conn, conn.begin():
                    if self.dialect == "postgresql":
                        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key})
                    self.metadata.create_all(conn, checkfirst=True)
                break
            except SQLAlchemyError as exc:  # another process created them at the same time
                if time.monotonic() > deadline:
                    raise LeaseStoreError(
                        f"could not create the lease tables in {self.url}: {exc}"
                    ) from exc
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
        meta = self.meta_table
        with self._translate("schema check"), self.engine.begin() as conn:
            found = conn.execute(
                sa.select(meta.c.value).where(meta.c.key == "schema_version")
            ).scalar()
            if found is None:
                insert = pg_insert if self.dialect == "postgresql" else sqlite_insert
                conn.execute(
                    insert(meta)
                    .values(key="schema_version", value=str(SCHEMA_VERSION))
                    .on_conflict_do_nothing()
                )
                found = str(SCHEMA_VERSION)
        if int(found) > SCHEMA_VERSION:
            raise LeaseConfigError(
                f"the lease tables in {self.url} have schema version {found}, newer than this "
                f"celery_lease ({SCHEMA_VERSION}); upgrade celery_lease"
            )

    # -- plumbing --------------------------------------------------------------------------
    @contextmanager
    def _translate(self, what: str, first_attempt: bool = True) -> Iterator[None]:
        try:
            yield
        except (SQLAlchemyError, self._dbapi_error) as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            # A refusal on a retry follows a dropped connection that may have run the statement.
            if first_attempt and connection_refused(exc):
                raise LeaseStoreError(
                    f"SQL lease store {self.url} refused the connection during {what} "
                    f"({type(exc).__name__}: {first_line}): nothing was sent; the server is "
                    "down or not listening at that address",
                    True,
                ) from exc
            raise LeaseStoreError(
                f"SQL lease store {self.url} failed during {what}: {type(exc).__name__}: "
                f"{first_line}; the outcome is unknown"
            ) from exc

    def _run(
        self, what: str, work: Callable[[Any], T], free: FreeList[_Connection] | None = None
    ) -> T:
        """Run ``work(cursor)`` on a connection of the store: the one place driver errors are
        caught.

        The connection comes from a free list (the store's, or the renewer's ``free``) and goes
        back when the work ends (taking one from the SQLAlchemy pool per call cost more than
        the statement itself; keeping one per thread left one per task behind under gevent).
        A connection interrupted mid-call is closed, never reused. A broken connection (the
        server restarted) is dropped with the idle ones and the whole pool, and the work is
        tried once more on a fresh connection; every operation is safe to repeat (a claim
        repeated with the same owner token returns the same lease).
        """
        if free is None:
            free = self._free
        for attempt in (1, 2):
            with shielded(), self._translate(what, attempt == 1):
                if self._serial is not None:
                    self._serial.acquire()
                try:
                    held = free.get()
                    try:
                        result = work(held.cursor)
                    except BaseException as exc:
                        if not isinstance(exc, self._dbapi_error):
                            # Interrupted mid-call (a signal, a soft time limit): the
                            # connection may be mid-command, so it never serves again.
                            held.invalidate(exc)
                            free.discard(held)
                            raise
                        disconnected = self.engine.dialect.is_disconnect(
                            exc,  # type: ignore[arg-type]  # the dialect's DBAPI Error
                            held.conn.dbapi_connection,
                            None,
                        )
                        if self.dialect == "sqlite":
                            _rollback_quietly(held.conn)
                        if not disconnected:
                            free.put(held)  # the statement failed; the connection is fine
                            raise
                        held.invalidate(exc)
                        free.discard(held)
                        free.clear()
                        self.engine.dispose()
                        if attempt == 1:
                            continue
                        raise
                    free.put(held)
                    return result
                finally:
                    if self._serial is not None:
                        self._serial.release()
        raise AssertionError("unreachable")  # pragma: no cover

    def _connect(self) -> _Connection:
        return _Connection(
            self.engine.raw_connection(),
            # Closed for real when it is discarded or the store closes: put back into the pool,
            # it could land in one that a reconnect disposed meanwhile, and leak. (Not the one
            # shared connection of an in-memory SQLite database.)
            detach=not isinstance(self.engine.pool, StaticPool),
        )

    @contextmanager
    def _immediate(self, cursor: Any) -> Iterator[None]:
        """A SQLite write transaction that takes the write lock up front (no-op on PG)."""
        if self.dialect != "sqlite":
            yield
            return
        cursor.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            _rollback_quietly(cursor.connection)
            raise
        cursor.execute("COMMIT")

    # -- operations ------------------------------------------------------------------------
    def acquire(
        self,
        resource: str,
        owner: Owner,
        ttl: float,
        *,
        identity: str | None = None,
        wait: str | None = None,
        wait_ttl: float = 120.0,
    ) -> Lease:
        ttl = self._claim_args(resource, owner, ttl)
        identity = self._identity_args(identity)
        # No wait list in SQL yet: a refused claim is not queued (position None), so the task
        # waits with the back-off as before.
        self._wait_args(identity, wait, wait_ttl)
        ttl_us = max(1, round(ttl * 1e6))
        params = {"r": resource, "t": owner.token, "l": owner.label, "ttl": ttl_us}
        if identity is not None:
            params["i"] = identity
        claim = self._claim if identity is None else self._claim_identity
        for _ in range(3):
            sent = monotonic()
            row = self._run(f"acquire of {resource!r}", lambda c: claim(c, params))
            if row is None:  # a racing first claim is not visible to our snapshot yet: ask again
                continue
            (claimed, marked, fence, acquired, expires, prev_label, prev_fence, h_token, h_label,
             h_fence, h_acquired, h_expires, i_state, i_fence, i_label, i_result, ckpt,
             now, h_prev_label, h_prev_fence) = row  # fmt: skip
            if identity is not None and not claimed and i_state == "done":
                raise IdentityDoneError.completed(resource, identity, i_fence, i_result)
            if claimed and not marked:
                # The identity was completed by a run that committed after our snapshot: give
                # the lease back and report the duplicate.
                assert identity is not None
                return self._completed_meanwhile(resource, owner, identity, fence, acquired, ttl)
            if not claimed:
                if h_token is None or h_expires <= now:
                    # Our snapshot shows the lease free (released or expired), but a claim
                    # racing ours committed first: held by an owner we cannot see yet.
                    continue
                if h_token != owner.token:
                    raise LeaseBusyError.held(
                        resource,
                        h_label,
                        int(h_fence),
                        (h_expires - now) / 1e6,
                        # the holder runs this very identity: a duplicate of running work
                        duplicate=i_state == "running" and i_fence == h_fence,
                    )
                # The same claim retried after a lost reply: the same lease, and what the first
                # attempt recovered (the lease row's prev_*, the identity row's hidden facts).
                fence, acquired, expires = h_fence, h_acquired, h_expires
                prev_label, prev_fence = h_prev_label, h_prev_fence
                ours = i_state == "running" and i_fence == h_fence
                i_state, i_fence, i_label = recovered_from(i_result if ours else None)
            if prev_fence is None and i_state is not None and i_fence != fence:
                prev_label, prev_fence = i_label, i_fence  # an earlier attempt never finished
            else:
                i_state = i_state if i_fence != fence else None
            return Lease(
                resource=resource,
                owner=owner,
                fence=int(fence),
                acquired_at=from_micros(acquired),
                expires_at=from_micros(expires),
                ttl=ttl,
                sent_monotonic=sent,
                store=self,
                previous_owner_label=prev_label if prev_fence is not None else None,
                previous_fence=int(prev_fence) if prev_fence is not None else None,
                identity=identity,
                identity_state=i_state,
                checkpoints=decode(ckpt) if ckpt and prev_fence is not None else None,
            )
        raise LeaseBusyError.held(resource, None, None, None)

    def _completed_meanwhile(
        self, resource: str, owner: Owner, identity: str, fence: int, acquired: int, ttl: float
    ) -> Lease:
        lease = Lease(
            resource=resource,
            owner=owner,
            fence=int(fence),
            acquired_at=from_micros(acquired),
            expires_at=from_micros(acquired),
            ttl=ttl,
            sent_monotonic=monotonic(),
            store=self,
        )
        self.release(lease)
        info = self.identity_get(resource, identity)
        raise IdentityDoneError.completed(
            resource,
            identity,
            None if info is None else info.fence,
            None if info is None else info.result,
        )

    def _claim(self, cursor: Any, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """The claim without identity, answered in the shape of a ClaimRow."""
        if self.dialect == "postgresql":
            cursor.execute(self.sql.acquire, params)
            row = _one(cursor)
        else:
            with self._immediate(cursor):
                cursor.execute(self.sql.acquire, params)
                row = cursor.fetchone()
                if row is not None:
                    fence, acquired, expires, prev_label, prev_fence = row
                    row = (1, fence, acquired, expires, prev_label, prev_fence, None, acquired,
                           None, None)  # fmt: skip
                else:
                    cursor.execute(self.sql.holder, params)
                    row = _one(cursor)
        if row is None:
            return None
        ok, fence, acquired, expires, label, prev_fence, token, now, h_prev_label, h_prev_fence = (
            row
        )
        nothing = (None, None, None, None, None)
        if ok:
            return (1, 1, fence, acquired, expires, label, prev_fence, *nothing[:5], *nothing[:4],
                    None, now, None, None)  # fmt: skip
        return (0, 0, *nothing, token, label, fence, acquired, expires, *nothing[:4], None, now,
                h_prev_label, h_prev_fence)  # fmt: skip

    def renew_many(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        if not leases:
            return []
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent = monotonic()
        rows = self._run("renewal", lambda c: self._renew_rows(c, leases, ttls), self._renewer_free)
        results: list[LeaseLostError | None] = []
        for lease, lease_ttl, row in zip(leases, ttls, rows, strict=True):
            new_expires, *state = row
            if new_expires is not None:
                lease.renewed(sent, from_micros(new_expires), lease_ttl)
                results.append(None)
            else:
                results.append(self._why_lost(lease, *state))
        return results

    def _renew_rows(
        self, cursor: Any, leases: Sequence[Lease], ttls: Sequence[float]
    ) -> list[tuple[Any, ...]]:
        requests = [
            (lease.resource, lease.owner.token, lease.fence, max(1, round(t * 1e6)))
            for lease, t in zip(leases, ttls, strict=True)
        ]
        if self.dialect == "postgresql":
            flat = [v for i, r in enumerate(requests) for v in (i, *r)]
            cursor.execute(self.sql.renew_many(len(requests)), flat)
            by_index = {row[0]: tuple(row[1:]) for row in cursor.fetchall()}
            return [by_index[i] for i in range(len(requests))]
        rows: list[tuple[Any, ...]] = []
        with self._immediate(cursor):
            for resource, token, fence, ttl_us in requests:
                params = {"r": resource, "t": token, "f": fence, "ttl": ttl_us}
                cursor.execute(self.sql.renew_one, params)
                renewed = cursor.fetchone()
                if renewed is not None:
                    rows.append((renewed[0], *_NO_ROW))
                    continue
                cursor.execute(self.sql.state, params)
                rows.append((None, *(cursor.fetchone() or _NO_ROW)))
        return rows

    def _why_lost(
        self,
        lease: Lease,
        token: Any,
        label: Any,
        fence: Any,
        expires: Any,
        now: Any,
        forced: Any = None,
    ) -> LeaseLostError:
        """The loss, from the lease row's state (``forced``: its prev_fence, see ``state``)."""
        if token is None:
            if forced is not None and forced == lease.fence:
                return self._lost(lease, "force_released", None, None)
            return self._lost(lease, "released", None, None)
        if token != lease.owner.token or fence != lease.fence:
            return self._lost(lease, "taken_over", label, fence)
        return self._lost(lease, "expired", None, None)

    def verify(self, lease: Lease) -> None:
        self._renew_ttl(lease, None)
        params = {"r": lease.resource}
        row = self._run(
            f"verify of {lease.resource!r}",
            lambda c: _fetch(c, self.sql.state, params),
        )
        token, label, fence, expires, now, forced = row or _NO_ROW
        if token == lease.owner.token and fence == lease.fence and expires > now:
            return
        raise self._why_lost(lease, token, label, fence, expires, now, forced)

    def release(
        self, lease: Lease, *, outcome: str | None = None, result: str | None = None
    ) -> bool:
        self._renew_ttl(lease, None)
        self._outcome_args(lease, outcome)
        params = {"r": lease.resource, "t": lease.owner.token, "f": lease.fence}

        def work(cursor: Any) -> int:
            if outcome is not None:
                return self._release_outcome(
                    cursor,
                    {
                        **params,
                        "i": lease.identity,
                        "o": outcome,
                        "res": result if outcome == "done" else None,
                    },
                )
            cursor.execute(self.sql.release, params)
            return int(cursor.rowcount)

        return self._run(f"release of {lease.resource!r}", work) == 1

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        """No wait list in SQL stores yet: always empty."""
        validate_resource(resource)
        return []

    def get(self, resource: str) -> LeaseInfo | None:
        validate_resource(resource)
        params = {"r": resource}
        row = self._run(f"get of {resource!r}", lambda c: _fetch(c, self.sql.get, params))
        return None if row is None else _info(resource, *row)

    def list(
        self,
        *,
        prefix: str = "",
        expired_only: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> LeasePage:
        limit = self._list_args(prefix, limit)
        after = decode_cursor(cursor)
        query = {
            # substr, not LIKE: LIKE treats _ as a wildcard and ignores case on SQLite.
            "prefix": prefix,
            "plen": len(prefix),
            "after_e": -(2**62) if after is None else after[0],
            "after_r": "" if after is None else after[1],
            "expired": 1 if expired_only else 0,
            "n": limit + 1,
        }

        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(self.sql.list, query)
            return list(cur.fetchall())

        rows = self._run("list", work)
        infos = [_info(*row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = encode_cursor(last[4], last[0])
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str) -> LeaseInfo | None:
        validate_resource(resource)
        params = {"r": resource}

        def work(cursor: Any) -> tuple[Any, ...] | None:
            if self.dialect == "postgresql":
                cursor.execute(self.sql.force_release, params)
                return _one(cursor)
            with self._immediate(cursor):
                cursor.execute(self.sql.get, params)
                row = cursor.fetchone()
                cursor.execute(self.sql.force_release, params)
                return None if row is None else tuple(row)

        row = self._run(f"force_release of {resource!r}", work)
        if row is None or row[0] is None:
            return None
        info = _info(resource, *row)
        log.warning(
            "force-released lease on %r held by %r with fence %d",
            resource,
            info.owner_label,
            info.fence,
        )
        return info

    # -- fence gate support (used by celery_lease.FenceGate) --------------------------------------
    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted; one statement."""
        params = {"k": validate_resource(key), "f": int(fence)}

        def work(cursor: Any) -> tuple[Any, ...] | None:
            if self.dialect == "postgresql":
                return _fetch(cursor, self.sql.gate_admit, params)
            with self._immediate(cursor):
                row = _fetch(cursor, self.sql.gate_admit, params)
                if row is not None:
                    return (1, row[0])
                highest = _fetch(cursor, self.sql.gate_read, params)
                return None if highest is None else (0, highest[0])

        for _ in range(3):
            row = self._run(f"fence gate admit of {key!r}", work)
            # None, or a refusal citing a fence our snapshot saw as lower than ours: a racing
            # admit committed a higher fence after our snapshot; ask again to report it.
            if row is not None and (row[0] or int(row[1]) > int(fence)):
                return bool(row[0]), int(row[1])
        raise LeaseStoreError(f"fence gate admit of {key!r} kept racing a concurrent insert")

    def gate_highest(self, key: str) -> int | None:
        params = {"k": validate_resource(key)}
        row = self._run(
            f"fence gate read of {key!r}", lambda c: _fetch(c, self.sql.gate_read, params)
        )
        return None if row is None else int(row[0])

    def check_health(self) -> builtins.list[str]:
        self._run("health check", lambda c: _fetch(c, "SELECT 1", {}))
        warnings = []
        if self.dialect == "sqlite":
            warnings.append(
                f"SQLite lease store {self.url}: exclusion only among processes on this host "
                "sharing the file; use PostgreSQL or Redis across hosts"
            )
        return warnings

    def warm_up(self) -> None:
        self._run("warm-up", lambda cursor: None, self._renewer_free)

    def reset_after_fork(self) -> None:
        """Forget connections inherited from the parent (SQLAlchemy's fork recipe); the free
        lists forget theirs by themselves."""
        if self._serial is None:
            self.engine.dispose(close=False)

    def close(self) -> None:
        self._free.close()
        self._renewer_free.close()
        if self._owns_engine:
            self.engine.dispose()


class _Connection:
    """A connection checked out of the engine's pool, with its cursor; closed when dropped."""

    __slots__ = ("conn", "cursor", "detach", "pid")

    def __init__(self, conn: Any, *, detach: bool = True) -> None:
        self.conn = conn
        self.cursor = conn.cursor()
        self.pid = os.getpid()
        self.detach = detach

    def invalidate(self, exc: BaseException) -> None:
        """Mark the connection unusable (its pool record will not reuse it)."""
        if self.pid == os.getpid():
            self.conn.invalidate(exc)

    def close(self, _getpid: Callable[[], int] = os.getpid) -> None:
        # (_getpid is bound early: at interpreter exit module globals may already be gone)
        if self.pid != _getpid():
            return  # a parent's connection: never touch it from a forked child
        self.pid = -1
        try:
            self.cursor.close()
            if self.detach:
                self.conn.detach()  # so that close() closes the DBAPI connection itself
            self.conn.close()
        except Exception:  # closing a broken connection may fail; it is gone anyway
            log.debug("closing a lease store connection failed", exc_info=True)

    def __del__(self) -> None:  # lost without being closed (e.g. an interrupt at the wrong time)
        try:  # (not contextlib.suppress: it may already be gone at interpreter exit)
            self.close()
        except Exception:  # noqa: BLE001 - nothing sensible to do at interpreter exit
            return


def _create_engine(url: str, statement_timeout: float, options: dict[str, Any]) -> Engine:
    check_credentials(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise LeaseConfigError(
            f"malformed SQL lease store URL {mask_url(url)!r}; expected "
            "postgresql+psycopg://user:password@host:port/dbname or sqlite:///path/to/file.db"
        ) from None
    kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool
        else:
            kwargs["max_overflow"] = -1  # the store's free lists bound them (see _run)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30.0}
    elif parsed.get_backend_name() == "postgresql":
        ms = int(statement_timeout * 1000)
        seconds = max(1, math.ceil(statement_timeout))
        kwargs["connect_args"] = {
            "options": f"-c statement_timeout={ms} -c lock_timeout={ms} "
            f"-c idle_in_transaction_session_timeout={ms * 2}",
            # The server enforces the timeouts above only while it runs and can reach us. A
            # connection to a host that died or a network that drops packets would otherwise
            # block its thread until TCP gives up (about 15 minutes): bound the connect, the
            # wait for unacknowledged data, and probe idle connections.
            "connect_timeout": max(2, seconds),  # (libpq reads 1 as 2)
            "tcp_user_timeout": ms,
            "keepalives": 1,
            "keepalives_idle": seconds,
            "keepalives_interval": max(1, seconds // 3),
            "keepalives_count": 3,
        }
        # Autocommit connections: nothing to roll back when a connection goes back to the pool.
        kwargs["pool_reset_on_return"] = None
        kwargs["max_overflow"] = -1  # the store's free lists bound them (see _run)
    kwargs.update(options)
    try:
        engine = sa.create_engine(parsed, **kwargs)
    except ImportError as exc:
        if parsed.get_backend_name() == "postgresql":  # the driver is an optional extra
            raise LeaseConfigError(
                f"SQLLeaseStore needs the psycopg package for PostgreSQL ({mask_url(url)}): "
                f"pip install 'celery-lease[postgres]' ({exc})"
            ) from None
        raise LeaseConfigError(f"cannot use SQL lease store URL {mask_url(url)!r}: {exc}") from None
    except ArgumentError as exc:
        raise LeaseConfigError(f"cannot use SQL lease store URL {mask_url(url)!r}: {exc}") from None

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        if engine.dialect.name == "sqlite":
            dbapi_connection.isolation_level = None  # we issue BEGIN IMMEDIATE ourselves
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()
        else:
            dbapi_connection.autocommit = True

    return engine


def _tables(prefix: str) -> tuple[sa.MetaData, dict[str, sa.Table]]:
    metadata = sa.MetaData()
    # "C" collation on PostgreSQL: byte order, the same order list() cursors assume.
    name = sa.String(200).with_variant(sa.String(200, collation="C"), "postgresql")
    tables = {
        "leases": sa.Table(
            f"{prefix}leases",
            metadata,
            sa.Column("resource", name, primary_key=True),
            sa.Column("owner_token", sa.String(64), nullable=True),
            sa.Column("owner_label", sa.String(200), nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.Column("acquired_us", sa.BigInteger, nullable=False),
            sa.Column("expires_us", sa.BigInteger, nullable=True),
            sa.Column("prev_label", sa.String(200), nullable=True),
            sa.Column("prev_fence", sa.BigInteger, nullable=True),
            sa.Index(f"{prefix}leases_expiry", "expires_us", "resource"),
            # Room on each page for in-place (HOT) updates of the frequently rewritten rows.
            postgresql_with={"fillfactor": 70},
        ),
        "meta": sa.Table(
            f"{prefix}meta",
            metadata,
            sa.Column("key", sa.String(64), primary_key=True),
            sa.Column("value", sa.String(200), nullable=False),
        ),
        "gate": sa.Table(
            f"{prefix}fence_gate",
            metadata,
            sa.Column("key", sa.String(200), primary_key=True),
            sa.Column("fence", sa.BigInteger, nullable=False),
        ),
        "ids": sa.Table(
            f"{prefix}identities",
            metadata,
            sa.Column("resource", name, primary_key=True),
            sa.Column("identity", sa.String(200), primary_key=True),
            sa.Column("state", sa.String(16), nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.Column("owner_token", sa.String(64), nullable=False),
            sa.Column("owner_label", sa.String(200), nullable=False),
            sa.Column("result", sa.Text, nullable=True),
            sa.Column("expires_us", sa.BigInteger, nullable=False),
            sa.Index(f"{prefix}identities_expiry", "expires_us"),
        ),
        "ledger": sa.Table(
            f"{prefix}ledger",
            metadata,
            sa.Column("resource", name, primary_key=True),
            sa.Column("identity", sa.String(200), primary_key=True),
            sa.Column("key", sa.String(200), primary_key=True),
            sa.Column("state", sa.String(16), nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.Column("owner_token", sa.String(64), nullable=False),
            sa.Column("receipt", sa.Text, nullable=True),
            sa.Column("expires_us", sa.BigInteger, nullable=False),
            sa.Index(f"{prefix}ledger_expiry", "expires_us"),
        ),
        "ckpt": sa.Table(
            f"{prefix}checkpoints",
            metadata,
            sa.Column("resource", name, primary_key=True),
            sa.Column("identity", sa.String(200), primary_key=True),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.Column("data", sa.Text, nullable=False),
            sa.Column("expires_us", sa.BigInteger, nullable=False),
            sa.Index(f"{prefix}checkpoints_expiry", "expires_us"),
        ),
    }
    return metadata, tables


def _one(cursor: Any) -> tuple[Any, ...] | None:
    row = cursor.fetchone()
    return None if row is None else tuple(row)


def _fetch(cursor: Any, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    cursor.execute(sql, params)
    return _one(cursor)


def _info(
    resource: str, label: str, fence: int, acquired: int, expires: int, now: int
) -> LeaseInfo:
    return LeaseInfo(
        resource=resource,
        owner_label=label,
        fence=int(fence),
        acquired_at=from_micros(acquired),
        expires_at=from_micros(expires),
        expires_in=(expires - now) / 1e6,
    )


def _rollback_quietly(conn: Any) -> None:
    try:
        conn.rollback()
    except Exception:  # the connection is being discarded anyway
        log.debug("rollback after a failed SQLite statement failed", exc_info=True)
