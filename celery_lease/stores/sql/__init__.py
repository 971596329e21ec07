"""The SQL lease store: :class:`SQLLeaseStore` (PostgreSQL through psycopg 3, and SQLite)."""

from __future__ import annotations

from .store import SCHEMA_VERSION, TABLE_RIGHTS, SQLLeaseStore

__all__ = ["SCHEMA_VERSION", "TABLE_RIGHTS", "SQLLeaseStore"]
