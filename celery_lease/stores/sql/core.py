"""The SQL store's set-up and shared plumbing: engine, tables, statements, wait functions, health.

PostgreSQL (psycopg 3) and SQLite. SQLAlchemy 2 Core defines the tables, creates them
idempotently, quotes the configurable table names and owns the connection pool; the statements
the operations send are built here once per store with the dialect's quoting.

Time is the database's: ``clock_timestamp()`` on PostgreSQL (``now()`` would be the transaction
start), ``julianday('now')`` on SQLite. Times are stored as microseconds since the epoch so both
dialects share one schema. On SQLite every operation runs in a ``BEGIN IMMEDIATE`` transaction
(WAL journal), which takes the write lock up front instead of failing on lock upgrade.

The operations are in the modules :class:`~.store.SQLLeaseStore` is made of.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from ..._errors import LeaseConfigError, LeaseStoreError
from ..._names import mask_url, validate_identifier
from ..base import DEFAULT_MAX_TTL, DEFAULT_RETENTION, BaseLeaseStore
from . import schema
from . import statements as stmts
from .connection import Connections, create_engine, fetch, first_line, sqlstate
from .ledger_statements import LedgerStatements

__all__ = ["SQLStoreCore"]


# The backend's logger name from before the stores became packages, so that logging set up for
# it keeps seeing this store's lines (the force-release warning above all).
log = logging.getLogger("celery_lease.stores.sql")
T = TypeVar("T")

_SQLITE_MIN = (3, 35, 0)  # RETURNING


class SQLStoreCore(BaseLeaseStore):
    """A SQL store's set-up and plumbing (see :class:`~.store.SQLLeaseStore` for the
    arguments)."""

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
            engine = create_engine(url, statement_timeout, engine_options or {})
        self.engine = engine
        self.url = mask_url(engine.url.render_as_string(hide_password=True))
        self.dialect = engine.dialect.name
        #: PostgreSQL: claims name the next waiter and releases run ``meanwhile`` while their
        #: statement is on its way (invariant 15). SQLite's release is not sent anywhere: a
        #: wake sent before it would only find the resource still held.
        self.supports_early_wake = self.dialect == "postgresql"
        if self.dialect not in ("postgresql", "sqlite"):
            raise LeaseConfigError(
                f"SQLLeaseStore supports PostgreSQL and SQLite, not {self.dialect!r} ({self.url})"
            )
        if self.dialect == "postgresql" and engine.dialect.driver != "psycopg":
            raise LeaseConfigError(
                f"SQLLeaseStore needs the psycopg 3 driver (postgresql+psycopg://), got "
                f"{engine.dialect.driver!r} in {self.url}"
            )
        if self.dialect == "sqlite":
            version = engine.dialect.loaded_dbapi.sqlite_version_info
            if version < _SQLITE_MIN:
                raise LeaseConfigError(
                    f"SQLite {version} is too old for SQLLeaseStore: 3.35 or newer is needed "
                    "(for RETURNING); upgrade Python or use PostgreSQL/Redis"
                )
        self._connections = Connections(engine, self.url)
        self.metadata, self.tables = schema.tables(table_prefix)
        self.leases_table, self.meta_table = self.tables["leases"], self.tables["meta"]
        quote = engine.dialect.identifier_preparer.quote
        names = {kind: quote(table.name) for kind, table in self.tables.items()}
        self.sql = stmts.Statements(
            self.dialect, names["leases"], self._paramstyle(), names["gate"], table_prefix, quote
        )
        self.ledger_sql = LedgerStatements(
            self.dialect,
            self.sql.now,
            self._paramstyle(),
            names,
            self.sql.claim_upsert,
            getattr(self.sql, "functions", None),
        )
        self._connections.grant_advice = lambda exc: schema.grant_advice(
            quote, self.tables, engine.url.username, exc
        )
        self._connections.schema_problem = lambda: schema.schema_problem(
            self._connections, self.tables
        )
        # PostgreSQL: whether the wait-list functions are there is found out by create_tables,
        # else before the first claim or release (a store makes no I/O when it is built).
        self._functions_known = self.dialect != "postgresql"
        self._fallback_lock = threading.Lock()
        if create_tables:
            try:
                self.create_tables()
            except BaseException:
                self.close()  # (the engine this store made would keep its pool otherwise)
                raise

    def _paramstyle(self) -> str:
        return "pyformat" if self.dialect == "postgresql" else "named"

    def create_tables(self) -> None:
        """Create the tables and the schema version row if missing; check the version.

        On PostgreSQL also create the wait-list functions of this version when missing and this
        role may (see :mod:`.wait_statements`); without them claims and releases still work,
        each carrying the whole wait-list logic (more server CPU per call).
        """
        schema.create_tables(self._connections, self.metadata, self.tables)
        self._use_functions(create=True)

    def _use_functions(self, *, create: bool) -> None:
        if self.dialect != "postgresql":
            return
        available = schema.wait_functions(
            self._connections,
            self.sql.functions,
            self.leases_table.name,
            create=create,
            table=self._quote(self.leases_table.name),
        )
        self.sql.use_functions(available)
        self.ledger_sql.use_functions(available)
        self._functions_known = True

    def _run_waits(self, what: str, work: Callable[[Any], T]) -> T:
        """Run a claim or release that may call the wait-list functions.

        Functions dropped, or their EXECUTE revoked, after this store chose them fail the one
        statement (autocommit: nothing was written): switch to the one-statement forms, warn
        once, and run the operation again.
        """
        try:
            return self._connections.run(what, work)
        except LeaseStoreError as exc:
            if not self._functions_failed(exc.__cause__):
                raise
        return self._connections.run(what, work)

    def _functions_failed(self, exc: BaseException | None) -> bool:
        if self.dialect != "postgresql" or exc is None:
            return False
        if sqlstate(exc) not in ("42883", "42501"):  # undefined_function, insufficient_privilege
            return False
        orig = getattr(exc, "orig", exc)
        functions = self.sql.functions
        names = [name.strip('"') for name in (functions.settle, functions.hand_off)]
        if not any(name in str(orig) for name in names):
            return False
        with self._fallback_lock:
            if self.sql.acquire_raw is self.sql.fast_raw[0]:
                self.sql.use_functions(False)
                self.ledger_sql.use_functions(False)
                log.warning(
                    "PostgreSQL lease store %s: the wait-list functions %s and %s failed (%s): "
                    "using the one-statement forms from now on (more server CPU per call); as "
                    "the tables' owner run `celery -A proj lease init-schema --url OWNER_URL` "
                    "to create them again",
                    self.url,
                    functions.settle,
                    functions.hand_off,
                    first_line(exc),
                )
        return True

    def grant_statements(self, role: str) -> builtins.list[str]:
        """The ``GRANT`` statements that give ``role`` what the store needs, and no more.

        Run them as the tables' owner after :meth:`create_tables` (``celery -A proj lease
        init-schema --grant ROLE`` does both); the role then needs no right to create anything.
        """
        return schema.grant_statements(self._quote, self.tables, role)

    def _grant(self, kind: str, role: str) -> str:
        return schema.grant_statements(self._quote, self.tables, role, kind)[0]

    def _quote(self, name: str) -> str:
        return str(self.engine.dialect.identifier_preparer.quote(name))

    # -- health and lifetime --------------------------------------------------------------
    def check_health(self) -> builtins.list[str]:
        self._connections.run("health check", lambda c: fetch(c, "SELECT 1", {}))
        # Tables of an earlier version (a store made with create_tables=False, or a role that
        # may not alter them, before their owner upgraded them) fail every claim: say so now.
        problem = schema.schema_problem(self._connections, self.tables)
        if problem is not None:
            raise LeaseConfigError(f"SQL lease store {self.url}: {problem}")
        warnings = []
        if self.dialect == "postgresql":
            self._use_functions(create=False)
            if self.sql.acquire_raw is not self.sql.fast_raw[0]:
                warnings.append(
                    f"PostgreSQL lease store {self.url}: the wait-list functions of this version "
                    "are missing (or not executable by this role): claims and releases work but "
                    "cost the server more; as the tables' owner run `celery -A proj lease "
                    "init-schema --url OWNER_URL` to create them"
                )
        if self.dialect == "sqlite":
            warnings.append(
                f"SQLite lease store {self.url}: exclusion only among processes on this host "
                "sharing the file; use PostgreSQL or Redis across hosts"
            )
        return warnings

    def warm_up(self) -> None:
        self._connections.run("warm-up", lambda cursor: None, self._connections.renewer_free)

    def reset_after_fork(self) -> None:
        self._connections.reset_after_fork()
        self._fallback_lock = threading.Lock()

    def close(self) -> None:
        self._connections.close()
        if self._owns_engine:
            self.engine.dispose()
