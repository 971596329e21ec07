"""The Redis lease store: :class:`RedisLeaseStore` (one Lua script per operation)."""

from __future__ import annotations

from .store import RedisLeaseStore

__all__ = ["RedisLeaseStore"]
