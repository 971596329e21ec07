"""Lease stores: one atomic contract over Redis, PostgreSQL, SQLite and memory.

The Redis and SQL stores import their drivers lazily, so ``celery_lease.stores`` works with only
the drivers you installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    DEFAULT_MAX_TTL,
    BaseLeaseStore,
    FenceGateStore,
    LeasePage,
    LeaseStore,
    MarkOnceStore,
    ReadableFenceGateStore,
)
from .memory import MemoryLeaseStore
from .urls import mask_url, store_from_url

if TYPE_CHECKING:
    from .redis import RedisLeaseStore
    from .sql import SQLLeaseStore

__all__ = [
    "DEFAULT_MAX_TTL",
    "BaseLeaseStore",
    "FenceGateStore",
    "LeasePage",
    "LeaseStore",
    "MarkOnceStore",
    "MemoryLeaseStore",
    "ReadableFenceGateStore",
    "RedisLeaseStore",
    "SQLLeaseStore",
    "mask_url",
    "store_from_url",
]


def __getattr__(name: str) -> Any:
    if name == "RedisLeaseStore":
        from .redis import RedisLeaseStore

        return RedisLeaseStore
    if name == "SQLLeaseStore":
        from .sql import SQLLeaseStore

        return SQLLeaseStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
