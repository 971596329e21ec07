"""The SQL store's schema: its tables, and creating them (idempotently, by many workers at once).

Times are stored as microseconds since the epoch, so PostgreSQL and SQLite share one schema.
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError

from ... import _clock
from ..._errors import LeaseConfigError, LeaseStoreError
from ..._names import show_value
from .connection import (
    Connections,
    database_locked,
    first_line,
    permission_denied,
    sqlstate,
)

__all__ = [
    "SCHEMA_VERSION",
    "TABLE_RIGHTS",
    "WAITS_COMPRESSION",
    "create_tables",
    "grant_statements",
    "missing",
    "schema_problem",
    "tables",
    "wait_functions",
]

SCHEMA_VERSION = 1
#: The rights the store's role needs on each of its tables (by kind), and nothing more: lease
#: and gate rows are never deleted (a lease row keeps its resource's fence), the schema version
#: row is written by whoever creates the tables; records past retention are deleted by the sweep.
TABLE_RIGHTS: dict[str, tuple[str, ...]] = {
    "leases": ("SELECT", "INSERT", "UPDATE"),
    "meta": ("SELECT",),
    "gate": ("SELECT", "INSERT", "UPDATE"),
    "ids": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "ledger": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "ckpt": ("SELECT", "INSERT", "UPDATE", "DELETE"),
}
_ROLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_DENIED_TABLE = re.compile(r'permission denied for (?:table|relation) "?([A-Za-z0-9_]+)')


def grant_statements(
    quote: Callable[[str], str], tables: dict[str, sa.Table], role: str, kind: str | None = None
) -> list[str]:
    """The GRANTs that give ``role`` what the store needs on ``tables`` (or one ``kind``)."""
    if not isinstance(role, str) or not _ROLE_RE.fullmatch(role):
        raise LeaseConfigError(
            f"role={show_value(role)} is not allowed: use 1..63 characters of A-Z a-z 0-9 _ "
            "starting with a letter or underscore"
        )
    return [
        f"GRANT {', '.join(TABLE_RIGHTS[k])} ON {quote(table.name)} TO {quote(role)}"
        for k, table in tables.items()
        if kind is None or k == kind
    ]


def grant_advice(
    quote: Callable[[str], str], tables: dict[str, sa.Table], role: str | None, exc: BaseException
) -> str:
    """The GRANT that fixes a refusal: for the table the error names, else for all of them."""
    if role is None or not _ROLE_RE.fullmatch(role):
        return "the GRANT statements of `celery lease init-schema --grant ROLE`"
    match = _DENIED_TABLE.search(str(exc))
    kinds = {table.name: kind for kind, table in tables.items()}
    kind = kinds.get(match[1]) if match else None
    return "; ".join(grant_statements(quote, tables, role, kind))


def create_tables(
    connections: Connections, metadata: sa.MetaData, tables: dict[str, sa.Table]
) -> None:
    """Create the tables and the schema version row if missing; check the version."""
    # Many workers may start at once on a new prefix: on PostgreSQL the DDL runs under a
    # transaction-scoped advisory lock; anywhere, a clash is retried with jittered backoff.
    lock_key = zlib.crc32(f"celery_lease schema {tables['leases'].name}".encode())
    deadline = _clock.monotonic() + 30.0
    delay = 0.05
    while True:
        # A server that cannot be reached fails now, within the connect timeout, saying
        # whether it refused (the task's outage path waits for it); only the DDL is retried.
        with connections.translate("table creation"):
            conn = connections.engine.connect()
        try:
            with conn, conn.begin():
                if connections.dialect == "postgresql":
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key})
                metadata.create_all(conn, checkfirst=True)
                _add_wait_columns(conn, tables["leases"])
            break
        except SQLAlchemyError as exc:  # another process created them at the same time
            if permission_denied(exc):  # ... or this role may not: retrying cannot help
                role = connections.engine.url.username or "?"
                # Tables an earlier version made, short of what this one adds: say so, not
                # "may not create the lease tables" (they are there; only the owner may alter).
                with connections.translate("schema check"), connections.engine.connect() as c:
                    absent, columns = missing(c, tables)
                if columns and not absent:
                    upgrade = _lacks_columns(connections, tables, columns, first_line(exc))
                    raise LeaseConfigError(
                        f"SQL lease store {connections.url}: {upgrade}"
                    ) from None
                raise LeaseConfigError(
                    f"the role {role!r} of {connections.url} may not create the lease tables "
                    f"({first_line(exc)}): create them beforehand as their owner with "
                    f"`celery -A proj lease init-schema --url OWNER_URL --grant {role}` (or "
                    "SQLLeaseStore(url=OWNER_URL).create_tables() and grant_statements(role)); "
                    "the store's own role then needs no right to create anything"
                ) from None
            if _clock.monotonic() > deadline:
                raise LeaseStoreError(
                    f"could not create the lease tables in {connections.url}: {exc}"
                ) from exc
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)
    meta = tables["meta"]
    while True:
        try:
            with connections.translate("schema check"), connections.engine.begin() as conn:
                found = conn.execute(
                    sa.select(meta.c.value).where(meta.c.key == "schema_version")
                ).scalar()
                if found is None:
                    insert = pg_insert if connections.dialect == "postgresql" else sqlite_insert
                    conn.execute(
                        insert(meta)
                        .values(key="schema_version", value=str(SCHEMA_VERSION))
                        .on_conflict_do_nothing()
                    )
                    found = str(SCHEMA_VERSION)
            break
        except LeaseStoreError as exc:
            # (SQLite under gevent has no busy wait in C, see Connections._attempt: a locked
            # database is asked again after a sleep that lets the other greenlets run)
            cause = getattr(exc.__cause__, "orig", exc.__cause__)
            locked = (
                connections.dialect == "sqlite" and cause is not None and database_locked(cause)
            )
            if not locked or _clock.monotonic() > deadline:
                raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)
    if int(found) > SCHEMA_VERSION:
        raise LeaseConfigError(
            f"the lease tables in {connections.url} have schema version {found}, newer than this "
            f"celery_lease ({SCHEMA_VERSION}); upgrade celery_lease"
        )


def missing(conn: sa.Connection, tables: dict[str, sa.Table]) -> tuple[list[str], list[str]]:
    """What this version needs and the database lacks: the names of the store's tables that
    are not there, and of the lease table's columns that are not (none when it is missing)."""
    inspector = sa.inspect(conn)
    absent = [table.name for table in tables.values() if not inspector.has_table(table.name)]
    leases = tables["leases"]
    if leases.name in absent:
        return absent, []
    have = {column["name"] for column in inspector.get_columns(leases.name)}
    return absent, [column.name for column in leases.columns if column.name not in have]


def schema_problem(connections: Connections, tables: dict[str, sa.Table]) -> str | None:
    """Why the store cannot run on the tables it finds, and the fix; None when nothing it
    needs is missing.

    Raises:
        LeaseStoreError: the catalog could not be read (the database is unreachable).
    """
    with connections.translate("schema check"), connections.engine.connect() as conn:
        absent, columns = missing(conn, tables)
    if absent:
        return (
            f"the lease tables {', '.join(absent)} do not exist: {_fix(connections)} to create them"
        )
    if columns:
        return _lacks_columns(connections, tables, columns)
    return None


def _fix(connections: Connections, grant: bool = True) -> str:
    """How to create or upgrade the tables: as their owner on PostgreSQL."""
    if connections.dialect != "postgresql":
        return (
            "run `celery -A proj lease init-schema` (or SQLLeaseStore(url=...).create_tables(), "
            "or make the store with create_tables=True)"
        )
    role = connections.engine.url.username
    to = f" --grant {role}" if grant and role else ""
    return (
        f"as the tables' owner run `celery -A proj lease init-schema --url OWNER_URL{to}` "
        "(or SQLLeaseStore(url=OWNER_URL).create_tables())"
    )


def _lacks_columns(
    connections: Connections,
    tables: dict[str, sa.Table],
    columns: list[str],
    refused: str | None = None,
) -> str:
    """The lease table lacks ``columns``; ``refused``: the driver's refusal when this role
    tried to add them."""
    role = connections.engine.url.username
    what = "the hand-off wait list" if set(columns) <= WAIT_COLUMNS else "added since"
    why = f"; the role {role or '?'!r} may not add them ({refused})" if refused else ""
    rights = " (the store's role needs no new right)" if connections.dialect == "postgresql" else ""
    return (
        f"the lease table {tables['leases'].name} was made by an earlier celery_lease and lacks "
        f"the column{'s' if len(columns) > 1 else ''} {', '.join(columns)} ({what}){why}: "
        f"{_fix(connections, grant=False)} to add them, which keeps every lease and fence{rights}"
    )


WAIT_COLUMNS = frozenset({"waits", "wait_slow_us", "waits_expire_us"})


def wait_functions(
    connections: Connections, functions: Any, leases: str, *, create: bool, table: str
) -> bool:
    """Whether this role can call the wait-list functions of this version (PostgreSQL), making
    them first when missing and ``create`` (as :func:`create_tables`, under the advisory lock).

    A role that may not create them (the least-privilege role: it needs no right for this)
    gets ``False``, and the store claims with the whole logic in each statement instead,
    until the tables' owner creates them (``init-schema``, or a store made by the owner).
    Only functions the lease table's owner owns, in the table's schema, are used: their
    names are predictable, and one made by another role (who may create in a schema on the
    search path) would otherwise run with the rights of whoever claims.
    """
    # each function: whether it exists, and whether this role may (and should) execute it
    check = sa.text(
        "SELECT p.oid IS NOT NULL, coalesce(has_function_privilege(p.oid, 'EXECUTE') "
        "AND p.proowner = c.relowner AND p.pronamespace = c.relnamespace, false) "
        "FROM unnest(CAST(:f AS text[])) WITH ORDINALITY AS s(f, n) "
        "LEFT JOIN pg_catalog.pg_proc AS p ON p.oid = pg_catalog.to_regprocedure(s.f) "
        "LEFT JOIN pg_catalog.pg_class AS c ON c.oid = pg_catalog.to_regclass(:t) ORDER BY n"
    )
    signatures = {"f": list(functions.signatures), "t": table}
    lock_key = {"k": zlib.crc32(f"celery_lease schema {leases}".encode())}
    for attempt in (1, 2, 3):
        with connections.translate("wait-list function check"):
            try:
                with connections.engine.connect() as conn:
                    found = conn.execute(check, signatures).all()
                    if all(usable for _, usable in found) or not create:
                        return all(usable for _, usable in found)
                    # The connection is in autocommit mode, where a transaction-level lock
                    # ends with its own statement: this one is held until unlocked below.
                    conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), lock_key)
                    try:
                        found = conn.execute(check, signatures).all()  # (another made them?)
                        # another version's SQL has other names: only the missing ones are made
                        for ddl, (exists, _) in zip(functions.ddl, found, strict=True):
                            if not exists:
                                conn.exec_driver_sql(ddl)
                        found = conn.execute(check, signatures).all()
                    finally:
                        _unlock(conn, lock_key)
            except SQLAlchemyError as exc:
                if attempt < 3 and _made_by_another(exc):
                    continue  # the next check sees the other store's functions
                if not permission_denied(exc):
                    raise
                return False
        break
    return all(usable for _, usable in found)


def _unlock(conn: Any, key: dict[str, int]) -> None:
    """Let go of the session advisory lock; a connection that cannot is thrown away (its
    session, and with it the lock, ends) rather than returned to the pool holding it."""
    try:
        conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), key)
    except SQLAlchemyError:
        conn.invalidate()


def _made_by_another(exc: BaseException) -> bool:
    """CREATE FUNCTION lost a race to another store making the same function (PostgreSQL):
    the other committed between this store's check and its create (kept as a back-stop; the
    session lock above orders stores that hold it)."""
    return sqlstate(exc) in ("42723", "23505")  # duplicate_function, unique_violation


def wait_columns() -> list[sa.Column[Any]]:
    """The lease row's wait list (see :mod:`.waits`): added to a table made before it existed."""
    return [
        # [[identity, since_us, expires_us, woken_until_us, payload], ...], oldest first
        sa.Column("waits", sa.Text().with_variant(JSONB(), "postgresql"), nullable=True),
        # until when nothing is held for a woken head (a wake missed its grace lately)
        sa.Column("wait_slow_us", sa.BigInteger, nullable=True),
        # when the list's last place lapses: the sweep finds lapsed lists through its index
        sa.Column("waits_expire_us", sa.BigInteger, nullable=True),
    ]


#: How PostgreSQL compresses a long wait list (the ``waits`` column, PostgreSQL 14+ on a server
#: built with lz4, as the common packages are): each refused claim and each release rewrites the
#: whole list, and with the default pglz compression that took about half of their server time
#: once the list passed a few kB (``benchmarks/bench_wait_list.py``, 190 waiters of 400 bytes:
#: 5.3 ms a claim with pglz, 2.7 ms with lz4; 32 waiters: 1.7 and 0.9 ms). Set right after
#: the lease table is created, before any store uses it; a table made earlier is never altered
#: by a store (the ALTER takes an ACCESS EXCLUSIVE lock, which waits behind every open reader of
#: the table while every claim and renewal waits behind it): its owner can run it
#: (docs/stores.md). A server that cannot (before 14, or without lz4) keeps its default.
WAITS_COMPRESSION = "lz4"


def _compress_waits_ddl() -> sa.DDL:
    """The step after CREATE TABLE that sets the list's compression, or leaves the server's
    default where the server refuses the method."""
    return sa.DDL(  # type: ignore[no-untyped-call]  # (DDL.__init__ is unannotated)
        "DO $$ BEGIN EXECUTE 'ALTER TABLE %(fullname)s ALTER COLUMN waits SET COMPRESSION "
        f"{WAITS_COMPRESSION}'; EXCEPTION WHEN feature_not_supported OR syntax_error OR "
        "invalid_parameter_value THEN NULL; END $$"
    )


def wait_index(prefix: str) -> sa.Index:
    """The index of lists to sweep (only rows that have one: most never do)."""
    where = sa.text("waits_expire_us IS NOT NULL")
    return sa.Index(
        f"{prefix}leases_waits", "waits_expire_us", postgresql_where=where, sqlite_where=where
    )


def _add_wait_columns(conn: sa.Connection, leases: sa.Table) -> None:
    """Give a lease table made by an earlier version the wait-list columns and index (what
    is there already is left alone; nothing is done when all is there)."""
    inspector = sa.inspect(conn)
    have = {column["name"] for column in inspector.get_columns(leases.name)}
    quote = conn.dialect.identifier_preparer.quote
    for column in wait_columns():
        if column.name not in have:
            kind = column.type.compile(dialect=conn.dialect)
            conn.execute(
                sa.text(f"ALTER TABLE {quote(leases.name)} ADD COLUMN {quote(column.name)} {kind}")
            )
    index = next(i for i in leases.indexes if i.name and i.name.endswith("leases_waits"))
    if index.name not in {i["name"] for i in inspector.get_indexes(leases.name)}:
        index.create(conn)


def tables(prefix: str) -> tuple[sa.MetaData, dict[str, sa.Table]]:
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
            *wait_columns(),
            sa.Index(f"{prefix}leases_expiry", "expires_us", "resource"),
            wait_index(prefix),
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
    # Room on each page for in-place (HOT) updates of the frequently rewritten lease rows. Set
    # by a DDL step right after CREATE TABLE (same transaction): the ``postgresql_with`` table
    # option does the same in one statement but exists only from SQLAlchemy 2.1, and 2.0 (our
    # minimum, the last for Python 3.10) rejects it on every dialect.
    fillfactor = sa.DDL("ALTER TABLE %(fullname)s SET (fillfactor = 70)")  # type: ignore[no-untyped-call]  # (DDL.__init__ is unannotated)
    sa.event.listen(tables["leases"], "after_create", fillfactor.execute_if(dialect="postgresql"))
    compress = _compress_waits_ddl()
    sa.event.listen(tables["leases"], "after_create", compress.execute_if(dialect="postgresql"))
    return metadata, tables
