"""The fenced SQL write: :func:`fenced_update`, re-exported by :mod:`celery_lease.fencing`.

One statement that writes every matched row or none: none if a row carries a newer fence or,
given the SQL lease store (``store=``), the store granted a newer one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _events as events
from ._errors import LeaseConfigError, StaleFenceError
from ._fence_args import fence_of, resource_of
from ._interrupt import shielded
from ._lease import Lease
from ._names import mask_url, show_value
from .stores import LeaseStore

__all__ = ["fenced_update"]


def fenced_update(
    connection: Any,
    target: Any,
    where: Any,
    values: Mapping[str, Any],
    fence: int | Lease,
    *,
    fence_column: str = "fence",
    store: LeaseStore | None = None,
    resource: str | None = None,
) -> int:
    """Update the rows ``where`` matches, all of them or none: none if any carries a newer fence.

    One statement, so it is all-or-nothing on its own, also on an autocommit connection:

    ```sql
    WITH locked AS MATERIALIZED (SELECT fence FROM t WHERE <where> FOR UPDATE)
    UPDATE t SET <values>, fence = :fence
    WHERE <where> AND NOT EXISTS (SELECT 1 FROM locked WHERE locked.fence > :fence)
    ```

    On PostgreSQL the CTE locks every matched row and reads its newest committed fence before
    any row is written, so a newer owner committing while this statement runs makes it write
    nothing (a plain ``UPDATE ... WHERE fence <= :fence`` would re-check only the rows it
    waited for and write the others). SQLite runs one writer at a time; there the check is a
    ``NOT EXISTS`` subquery over the same rows. A NULL fence counts as older than any. Works
    with a Core ``Table`` or an ORM model, on a ``Connection`` or a ``Session``.

    The rows only know the fences that wrote them. Given the SQL lease store (``store=``) whose
    tables are in this connection's database, the same statement also refuses a fence older
    than the newest the store granted for the lease's resource (``AND NOT EXISTS (SELECT 1 FROM
    <leases> WHERE resource = :resource AND fence > :fence)``): from the moment a newer claim
    returned, also while its holder has not written yet, and after a force-release.

    Args:
        connection: a SQLAlchemy ``Connection`` or ``Session``.
        target: a Core ``Table`` or an ORM model with a nullable BIGINT fence column.
        where: the condition of the rows to update.
        values: the new values (SQL expressions allowed).
        fence: the writer's fence, or its :class:`Lease`.
        fence_column: the name of the table's fence column.
        store: the :class:`~celery_lease.stores.SQLLeaseStore` that granted the lease, whose
            tables this connection reaches (same database; checked by dialect and database
            name). A lease store elsewhere (Redis, another database) cannot be read in the same
            statement: admit through ``FenceGate(store=lease_store)`` right before instead.
        resource: the lease's resource, when ``fence`` is a number (a Lease names its own).

    Returns:
        the number of rows updated (>= 1).

    Raises:
        StaleFenceError: a matching row carries a newer fence, or the store granted a newer
            one for the resource; no row was written.
        LookupError: no row matches ``where``.
        LeaseConfigError: the table has no ``fence_column``; ``store`` is no SQL lease store of
            this database, or the resource is unknown or not the lease's.
    """
    import sqlalchemy as sa

    value = fence_of(fence)
    table = target.__table__ if hasattr(target, "__table__") else target
    if fence_column not in table.c:
        raise LeaseConfigError(
            f"fenced_update: table {table.name!r} has no column {fence_column!r}; add a nullable "
            f"BIGINT column {fence_column!r} to it (or name the table's fence column with "
            "fence_column=)"
        )
    column = table.c[fence_column]
    bind = connection.get_bind() if hasattr(connection, "get_bind") else connection
    granted = None  # the store's grant check, when store= is given
    if store is not None:
        named = resource_of("fenced_update", fence, resource)
        leases = _sql_leases(store, bind)
        granted = (
            sa.select(leases.c.fence)
            .where(leases.c.resource == named)
            .where(leases.c.fence > value)
            .correlate(None)
        )
    if bind.dialect.name == "postgresql":
        locked = (
            sa.select(column.label("fence"))
            .where(where)
            .with_for_update()  # every matched row, not only the newer ones: see above
            .cte("celery_lease_fenced")
            .prefix_with("MATERIALIZED")  # evaluated before the update, never folded into it
        )
        newer = sa.exists().where(locked.c.fence > value)
    else:
        # One writer at a time (SQLite): the statement's own snapshot is the newest state. A
        # subquery, not a CTE: Python's sqlite3 reports no rowcount for a WITH statement.
        newer = sa.exists(
            sa.select(sa.literal(1))
            .select_from(table)
            .where(where)
            .where(column > value)
            .correlate(None)  # over all matched rows, not the row being updated
        )
    statement = (
        sa.update(table)
        .where(where)
        .where(~newer)
        .where(sa.or_(column.is_(None), column <= value))  # (each row's own check, kept)
        .values({**values, fence_column: value})
    )
    if granted is not None:
        # Read in the statement's snapshot: every claim committed before it began counts (on
        # PostgreSQL under READ COMMITTED, the default; see docs/fencing.md).
        statement = statement.where(~granted.exists())
    # Shielded: a lease interrupt waits until the driver call returns (a connection cut off
    # mid-command would fail the transaction's rollback and hide the LeaseLostError).
    with shielded():
        result = connection.execute(statement)
        if result.rowcount:
            return int(result.rowcount)
        newest = connection.execute(sa.select(sa.func.max(column)).where(where)).scalar()
        exists = connection.execute(sa.select(sa.func.count()).select_from(table).where(where))
        found = exists.scalar()
        if granted is not None and found:
            newest = max(
                (f for f in (newest, connection.execute(granted).scalar()) if f is not None),
                default=None,
            )
    if not found:
        raise LookupError(f"no row of {table.name} matches the fenced update's condition")
    events.count("celery_lease_stale_fence_rejections_total")
    raise StaleFenceError.rejected(f"{table.name} row", value, newest)


def _sql_leases(store: LeaseStore, bind: Any) -> Any:
    """The leases table of ``store``, a SQL lease store of the database ``bind`` reaches."""
    from .stores.sql import SQLLeaseStore

    if not isinstance(store, SQLLeaseStore):
        raise LeaseConfigError(
            f"fenced_update(store={show_value(store)}): the store's grants are read in the same "
            "SQL statement, so store= takes the SQLLeaseStore whose tables are in this "
            "connection's database; for a lease store elsewhere, admit the fence with "
            "FenceGate(store=lease_store).admit(...) right before the write"
        )
    here, there = bind.engine.url, store.engine.url
    if bind.engine is not store.engine and not _same_database(here, there):
        raise LeaseConfigError(
            f"fenced_update: the lease store {store.url} is not in this connection's "
            f"database ({mask_url(here.render_as_string(hide_password=True))}); pass a "
            "connection to the lease store's database, or admit the fence with "
            "FenceGate(store=lease_store).admit(...) right before the write"
        )
    return store.leases_table


def _same_database(here: Any, there: Any) -> bool:
    """Whether two SQLAlchemy URLs name one database (dialect and database name; SQLite: the
    same file). Hosts are not compared: one server has many names."""
    import os.path

    if here.get_backend_name() != there.get_backend_name():
        return False
    if here.get_backend_name() == "sqlite":
        files = [url.database or "" for url in (here, there)]
        return (
            "" not in files
            and ":memory:" not in files
            and (os.path.realpath(files[0]) == os.path.realpath(files[1]))
        )
    return bool(here.database == there.database)
