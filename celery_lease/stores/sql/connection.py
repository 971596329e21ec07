"""The SQL store's connection layer: connections, the engine, and driver errors.

Everything that touches the DBAPI lives here: the engine a URL names (timeouts, keepalives,
SQLite pragmas), the free lists of checked-out connections (one for the tasks, one for the
renewer), and :meth:`Connections.run`, the one place where a driver exception becomes a
:class:`LeaseStoreError`. The store and the ledger functions hand it ``work(cursor)`` callables.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from ..._clock import monotonic
from ..._errors import LeaseConfigError, LeaseError, LeaseStoreError
from ..._interrupt import gevent_patched, shielded
from ..._names import check_credentials, mask_url
from ..._pid import getpid
from .._connections import FreeList
from ..base import connection_refused

__all__ = [
    "Connection",
    "Connections",
    "create_engine",
    "fetch",
    "first_line",
    "one",
    "permission_denied",
    "rollback_quietly",
    "undefined_object",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a SQLite call waits for a locked database before it fails, in seconds.
SQLITE_BUSY_TIMEOUT = 30.0

#: Under gevent a SQLite connection waits for a locked database by sleeping through the hub,
#: not in C (see :meth:`Connections._attempt`); False is the tests' negative control.
COOPERATIVE_BUSY_WAIT = True

#: How long one round of SQLite's busy wait in C lasts for a store call, in seconds; the store
#: starts another round at once, until SQLITE_BUSY_TIMEOUT. SQLite's busy handler sleeps longer
#: the longer a call has waited (1, 2, 5 ... up to 100 ms between tries), so under a burst a call
#: that had waited for a while slept 100 ms at a time while newer ones took the write lock in
#: between: a renewal waited 2 s behind six threads of refused claims, a release 4 s in a burst
#: of 200 tasks. In rounds of 3 ms it tries after 0, 1 and 3 ms, again and again: never more
#: than 2 ms apart. None: one round of SQLITE_BUSY_TIMEOUT (the tests' negative control).
SQLITE_BUSY_ROUND: float | None = 0.003


def set_sqlite_busy_wait(cursor: Any, rounds: bool = False) -> bool:
    """Set a SQLite connection's busy wait in C: SQLITE_BUSY_TIMEOUT, or none under gevent
    (then Connections._attempt and create_tables wait through the hub), or with ``rounds``
    (a store call's connection) one round of SQLITE_BUSY_ROUND (Connections._attempt starts
    the next). Whether Connections._attempt is to wait on when the database is locked."""
    green = COOPERATIVE_BUSY_WAIT and gevent_patched()
    wait = SQLITE_BUSY_TIMEOUT
    if green:
        wait = 0.0
    elif rounds and SQLITE_BUSY_ROUND is not None:
        wait = SQLITE_BUSY_ROUND
    cursor.execute(f"PRAGMA busy_timeout={round(wait * 1000)}")
    return wait < SQLITE_BUSY_TIMEOUT


def database_busy(exc: BaseException) -> bool:
    """Whether a SQLite error is SQLITE_BUSY: another connection has the write lock (what
    SQLite's busy handler waits for; not SQLITE_LOCKED, a shared cache's table lock)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return int(code) & 0xFF == 5
    return "database is locked" in str(exc)


def database_locked(exc: BaseException) -> bool:
    """Whether a SQLite error says the database (or a table) is locked by another connection."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (and their extended codes)
    return "locked" in str(exc)


class Connections:
    """The connections of one SQL store, and the translation of its driver errors.

    Args:
        engine: the store's engine (its pool hands out the DBAPI connections).
        url: the store's URL, password masked, for error messages.
    """

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.dialect = engine.dialect.name
        self.dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        # An in-memory SQLite database lives in one connection that all threads share.
        self.serial = threading.Lock() if isinstance(engine.pool, StaticPool) else None
        self.free: FreeList[Connection] = FreeList(self._connect, Connection.close)
        # The renewer's calls (renew_many, warm_up) keep their own connections: the one its
        # warm-up opened is still there for the first renewal, whatever the tasks took meanwhile.
        self.renewer_free: FreeList[Connection] = FreeList(self._connect, Connection.close)
        #: What to tell a role refused for a missing right (the store sets it: the GRANT).
        self.grant_advice: Callable[[BaseException], str] = lambda exc: (
            "the GRANT statements of `celery lease init-schema --grant ROLE`"
        )
        #: What is missing from the schema and how to add it, or None (the store sets it):
        #: asked when a statement names a table or column the database does not have.
        self.schema_problem: Callable[[], str | None] = lambda: None

    @contextmanager
    def translate(self, what: str, first_attempt: bool = True) -> Iterator[None]:
        try:
            yield
        except (SQLAlchemyError, self.dbapi_error) as exc:
            raise self.translated(exc, what, first_attempt) from exc

    def translated(self, exc: BaseException, what: str, first_attempt: bool = True) -> LeaseError:
        """The LeaseStoreError (or LeaseConfigError) that the driver error ``exc`` becomes
        (call it while handling ``exc``)."""
        if permission_denied(exc):  # nothing ran: a right is missing, say which GRANT
            return LeaseStoreError(
                f"SQL lease store {self.url} was refused during {what}: "
                f"{first_line(exc)}; the role {self.engine.url.username or '?'!r} lacks a "
                f"right the store needs: as the tables' owner run {self.grant_advice(exc)} "
                "(nothing was changed)"
            )
        if undefined_object(exc):  # tables of an earlier version, or none at all
            problem = self._schema_problem()
            if problem is not None:
                return LeaseConfigError(
                    f"SQL lease store {self.url} failed during {what}: {problem}"
                )
        first = str(exc).splitlines()[0] if str(exc) else ""
        # A refusal on a retry follows a dropped connection that may have run the statement.
        if first_attempt and connection_refused(exc):
            return LeaseStoreError(
                f"SQL lease store {self.url} refused the connection during {what} "
                f"({type(exc).__name__}: {first}): nothing was sent; the server is "
                "down or not listening at that address",
                True,
            )
        if sqlstate(exc) in CANCELLED_FOR_CONTENTION:  # (autocommit: rolled back)
            return LeaseStoreError(
                f"SQL lease store {self.url} cancelled a statement of {what} "
                f"({type(exc).__name__}: {first}): it was rolled back; the server is busy or "
                "the row is contended",
                transient=True,
            )
        return LeaseStoreError(
            f"SQL lease store {self.url} failed during {what}: {type(exc).__name__}: "
            f"{first}; the outcome is unknown"
        )

    def _schema_problem(self) -> str | None:
        try:
            return self.schema_problem()
        except LeaseStoreError:  # the catalog could not be read: report the first error
            return None

    def run(
        self, what: str, work: Callable[[Any], T], free: FreeList[Connection] | None = None
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
            free = self.free
        if getattr(self.translate, "__func__", None) is not _TRANSLATE:
            # translate is wrapped or overridden (tracing every store error): go through it.
            for attempt in (1, 2):
                with shielded(), self.translate(what, attempt == 1):
                    result = self._attempt(work, free, attempt)
                if result is not _RETRY:
                    return result
            raise AssertionError("unreachable")  # pragma: no cover
        for attempt in (1, 2):
            # What ``with shielded(), self.translate(what, attempt == 1):`` does, as plain
            # calls: a with statement calls a Python __enter__/__exit__ through a fresh
            # interpreter frame from C, which cost a claim and a release more than this.
            shield = shielded()
            shield.__enter__()
            try:
                result = self._attempt(work, free, attempt)
            except (SQLAlchemyError, self.dbapi_error) as exc:
                raise self.translated(exc, what, attempt == 1) from exc
            finally:
                shield.__exit__()
            if result is not _RETRY:
                return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _attempt(self, work: Callable[[Any], T], free: FreeList[Connection], attempt: int) -> T:
        """One attempt of :meth:`run` (shielded, its driver errors translated by the caller):
        ``work``'s result, or ``_RETRY`` when the connection broke on the first attempt.

        A SQLite connection waits in C for a locked database only for one short round
        (SQLITE_BUSY_ROUND), or not at all under gevent: then the work is asked again here,
        until SQLITE_BUSY_TIMEOUT, at once after a round (SQLite's own wait would sleep ever
        longer between tries, and a call that had waited long lost the lock to newer ones), or
        under gevent after a sleep that lets the hub run the other greenlets. In C the whole
        process slept, the greenlet holding the lock with it if it had switched away inside its
        transaction, so the lock stayed held until the call failed at the deadline.
        """
        if self.serial is not None:
            self.serial.acquire()
        try:
            deadline, pause = 0.0, 0.001
            while True:
                held = free.get()
                try:
                    result = work(held.cursor)
                except BaseException as exc:
                    if not isinstance(exc, self.dbapi_error):
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
                        try:
                            rollback_quietly(held.conn)
                        except BaseException:  # interrupted (a soft time limit): not reused
                            held.invalidate(exc)
                            free.discard(held)
                            raise
                    if not disconnected:
                        free.put(held)  # the statement failed; the connection is fine
                        # (rounds for SQLITE_BUSY; a shared cache's SQLITE_LOCKED, which
                        # SQLite never waits for, only through the hub: no round would pause)
                        if held.rounds and (
                            database_busy(exc) if not held.green else database_locked(exc)
                        ):
                            # (rolled back: nothing was written, the work may run again)
                            now = monotonic()
                            if not deadline:
                                deadline = now + SQLITE_BUSY_TIMEOUT
                            if now < deadline:
                                if held.green:
                                    time.sleep(min(pause, deadline - now))  # a hub switch
                                    pause = min(pause * 2, 0.02)
                                continue
                        raise
                    held.invalidate(exc)
                    free.discard(held)
                    free.clear()
                    self.engine.dispose()
                    if attempt == 1:
                        return _RETRY  # type: ignore[return-value]
                    raise
                free.put(held)
                return result
        finally:
            if self.serial is not None:
                self.serial.release()

    def _connect(self) -> Connection:
        conn = self.engine.raw_connection()
        green = rounds = False
        if self.dialect == "sqlite":  # (again: a pooled connection may predate the patching)
            cursor = conn.cursor()
            rounds = set_sqlite_busy_wait(cursor, rounds=True)
            green = rounds and COOPERATIVE_BUSY_WAIT and gevent_patched()
            cursor.close()
        return Connection(
            conn,
            green=green,
            rounds=rounds,
            # Closed for real when it is discarded or the store closes: put back into the pool,
            # it could land in one that a reconnect disposed meanwhile, and leak. (Not the one
            # shared connection of an in-memory SQLite database.)
            detach=not isinstance(self.engine.pool, StaticPool),
            postgresql=self.dialect == "postgresql",
        )

    @contextmanager
    def immediate(self, cursor: Any) -> Iterator[None]:
        """A SQLite write transaction that takes the write lock up front (no-op on PG)."""
        if self.dialect != "sqlite":
            yield
            return
        cursor.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            rollback_quietly(cursor.connection)
            raise
        cursor.execute("COMMIT")

    def reset_after_fork(self) -> None:
        """Forget connections inherited from the parent (SQLAlchemy's fork recipe); the free
        lists forget theirs by themselves."""
        if self.serial is None:
            self.engine.dispose(close=False)

    def close(self) -> None:
        """Close the idle connections of both free lists (the engine is the store's to dispose)."""
        self.free.close()
        self.renewer_free.close()


_TRANSLATE = Connections.translate
#: What Connections._attempt returns when the work is to be tried again on a fresh connection.
_RETRY = object()


class Connection:
    """A connection checked out of the engine's pool, with its cursor; closed when dropped."""

    __slots__ = ("conn", "cursor", "detach", "green", "pid", "rounds")

    def __init__(
        self,
        conn: Any,
        *,
        detach: bool = True,
        postgresql: bool = False,
        green: bool = False,
        rounds: bool = False,
    ) -> None:
        self.conn = conn
        #: SQLite under gevent: no busy wait in C, Connections waits through the hub.
        self.green = green
        #: SQLite: the busy wait in C is short (or none), Connections starts the next round.
        self.rounds = rounds
        # PostgreSQL (psycopg 3.2+): a cursor that keeps the raw cursor its long statements
        # use (see wait_statements.fetch), made once per connection instead of once a call.
        cursor = raw_keeping_cursor(conn.dbapi_connection) if postgresql else None
        self.cursor: Any = conn.cursor() if cursor is None else cursor
        self.pid = getpid()
        self.detach = detach

    def invalidate(self, exc: BaseException) -> None:
        """Mark the connection unusable (its pool record will not reuse it)."""
        if self.pid == getpid():
            self.conn.invalidate(exc)

    def close(self, _getpid: Callable[[], int] = os.getpid) -> None:
        # (_getpid is bound early: at interpreter exit module globals may already be gone)
        if self.pid != _getpid():
            return  # a parent's connection: never touch it from a forked child
        self.pid = -1
        try:
            raw = getattr(self.cursor, "raw", None)
            if raw is not None:
                raw.close()
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


def create_engine(url: str, statement_timeout: float, options: dict[str, Any]) -> Engine:
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
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT}
    elif parsed.get_backend_name() == "postgresql":
        ms = int(statement_timeout * 1000)
        seconds = max(1, math.ceil(statement_timeout))
        kwargs["connect_args"] = {
            # (jit off: the store's statements are short, and compiling one whose estimate
            # passes jit_above_cost took 0.5 s, a thousand times its run)
            "options": f"-c statement_timeout={ms} -c lock_timeout={ms} "
            f"-c idle_in_transaction_session_timeout={ms * 2} -c jit=off",
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
            set_sqlite_busy_wait(cursor)
            cursor.close()
        else:
            dbapi_connection.autocommit = True

    return engine


#: SQLSTATEs of a statement PostgreSQL cancelled for contention: lock_not_available (lock
#: timeout), query_canceled (statement timeout), deadlock_detected, serialization_failure. The
#: store's statements run in autocommit: a cancelled one was rolled back (a release, one
#: statement, did not happen at all).
CANCELLED_FOR_CONTENTION = frozenset({"55P03", "57014", "40P01", "40001"})


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error, wrapped by SQLAlchemy or not (None from SQLite)."""
    return getattr(getattr(exc, "orig", exc), "sqlstate", None)


def permission_denied(exc: BaseException) -> bool:
    """PostgreSQL refused a statement for a missing right (SQLSTATE 42501)."""
    return sqlstate(exc) == "42501"


def undefined_object(exc: BaseException) -> bool:
    """A statement named a table or column the database does not have (PostgreSQL SQLSTATE
    42P01 or 42703; SQLite says "no such table" or "no such column")."""
    orig = getattr(exc, "orig", exc)
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate is not None:
        return sqlstate in ("42P01", "42703")
    return str(orig).startswith(("no such table", "no such column"))


def first_line(exc: BaseException) -> str:
    """The first line of a driver error's own message."""
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0] if text else type(exc).__name__


def one(cursor: Any) -> tuple[Any, ...] | None:
    row = cursor.fetchone()
    return None if row is None else tuple(row)


def fetch(cursor: Any, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    cursor.execute(sql, params)
    return one(cursor)


def rollback_quietly(conn: Any) -> None:
    """Roll back after a failed SQLite statement; a driver error doing so is only logged. Any
    other exception (a soft time limit's, raised by its signal handler) goes on."""
    try:
        conn.rollback()
    except (sqlite3.Error, SQLAlchemyError):
        log.debug("rollback after a failed SQLite statement failed", exc_info=True)


_raw_keeping: Any = None  # the class, made at the first PostgreSQL connection (False: none)


def raw_keeping_cursor(dbapi_connection: Any) -> Any:
    """A psycopg cursor with a ``raw`` slot for the ``RawCursor`` of the same connection
    (made at its first use, then reused), or None without psycopg 3.2's ``RawCursor`` or when
    the connection has the user's ``cursor_factory`` (e.g. ClientCursor behind PgBouncer):
    their cursor class is kept, and the long statements get a new raw cursor per call."""
    global _raw_keeping  # noqa: PLW0603 - one class per process
    if _raw_keeping is None:
        import psycopg

        if getattr(psycopg, "RawCursor", None) is None:  # pragma: no cover - psycopg 3.1
            _raw_keeping = False
        else:

            class RawKeepingCursor(psycopg.Cursor):
                """A plain cursor, and the raw cursor of its connection once asked for."""

                __slots__ = ("raw",)

            _raw_keeping = RawKeepingCursor
    if _raw_keeping is False:
        return None
    if getattr(dbapi_connection, "cursor_factory", None) is not _raw_keeping.__base__:
        return None  # the user's cursor_factory (psycopg's own default is psycopg.Cursor)
    cursor = _raw_keeping(dbapi_connection)
    cursor.raw = None
    return cursor
