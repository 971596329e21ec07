"""The SQL store's schema: its tables, and creating them (idempotently, by many workers at once).

Times are stored as microseconds since the epoch, so PostgreSQL and SQLite share one schema.
"""

from __future__ import annotations

import random
import time
import zlib

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError

from ..._errors import LeaseConfigError, LeaseStoreError
from .connection import Connections

__all__ = ["SCHEMA_VERSION", "create_tables", "tables"]

SCHEMA_VERSION = 1


def create_tables(
    connections: Connections, metadata: sa.MetaData, tables: dict[str, sa.Table]
) -> None:
    """Create the tables and the schema version row if missing; check the version."""
    # Many workers may start at once on a new prefix: on PostgreSQL the DDL runs under a
    # transaction-scoped advisory lock; anywhere, a clash is retried with jittered backoff.
    lock_key = zlib.crc32(f"celery_lease schema {tables['leases'].name}".encode())
    deadline = time.monotonic() + 30.0
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
            break
        except SQLAlchemyError as exc:  # another process created them at the same time
            if time.monotonic() > deadline:
                raise LeaseStoreError(
                    f"could not create the lease tables in {connections.url}: {exc}"
                ) from exc
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)
    meta = tables["meta"]
    with connections.translate("schema check"), connections.engine.begin() as conn:
        found = conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        if found is None:
            insert = pg_insert if connections.dialect == "postgresql" else sqlite_insert
            conn.execute(
                insert(meta)
                .values(key="schema_version", value=str(SCHEMA_VERSION))
                .on_conflict_do_nothing()
            )
            found = str(SCHEMA_VERSION)
    if int(found) > SCHEMA_VERSION:
        raise LeaseConfigError(
            f"the lease tables in {connections.url} have schema version {found}, newer than this "
            f"celery_lease ({SCHEMA_VERSION}); upgrade celery_lease"
        )


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
