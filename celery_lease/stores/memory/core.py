"""The memory store's state and shared helpers: tables, clock and lock, the retention index.

What its operations share: the tables under one lock, the injectable clock, the retention
index, and telling a live lease from a lost one.

The store (:class:`~.store.MemoryLeaseStore`) is made of one class per job on top of this one.
"""

from __future__ import annotations

import builtins
import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ... import _clock
from ..._errors import LeaseLostError
from ..._lease import Lease, LeaseInfo
from ..base import DEFAULT_MAX_TTL, DEFAULT_RETENTION, BaseLeaseStore, lease_info

__all__ = ["MemoryStoreCore"]

_IDS, _LEDGER, _CKPTS = 0, 1, 2  # the retained tables, as numbered in the retention index


@dataclass(slots=True)
class _Record:
    token: str
    label: str
    fence: int
    acquired_us: int
    expires_us: int
    #: What the claim recovered (previous label, previous fence, identity state), kept so that
    #: the same claim retried returns it again.
    #: (previous label, previous fence, identity state, identity label, identity fence)
    recovery: tuple[str | None, int | None, str | None, str | None, int | None] | None = None

    def info(self, resource: str, now_us: int) -> LeaseInfo:
        return lease_info(
            resource, self.label, self.fence, self.acquired_us, self.expires_us, now_us
        )


class MemoryStoreCore(BaseLeaseStore):
    """A memory store's state and shared helpers (see :class:`~.store.MemoryLeaseStore` for
    the arguments)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        max_ttl: float = DEFAULT_MAX_TTL,
        retention: float = DEFAULT_RETENTION,
    ) -> None:
        super().__init__(max_ttl=max_ttl, retention=retention)
        self.url = "memory://"
        self._clock = clock or _clock.wall
        self._lock = threading.Lock()
        self._leases: dict[str, _Record] = {}
        self._fences: dict[str, int] = {}
        self._gates: dict[str, int] = {}
        # key -> (token, expires_us) of mark_once
        self._marks: dict[str, tuple[str, int]] = {}
        # resource -> fence of the lease force-released there, until the fence moves on
        self._forced: dict[str, int] = {}
        # (resource, identity) -> [state, fence, label, result, expires_us, token]
        self._ids: dict[tuple[str, str], list[Any]] = {}
        # (resource, identity, key) -> [state, fence, receipt, expires_us, token]
        self._ledger: dict[tuple[str, str, str], list[Any]] = {}
        # (resource, identity) -> [fence, data, expires_us]
        self._ckpts: dict[tuple[str, str], list[Any]] = {}
        # The retention index: (expires_us, table, key) for every write of those records; an
        # entry whose record was rewritten later (or removed) is skipped when it comes up.
        self._expiry: list[tuple[int, int, Any]] = []
        # resource -> FIFO wait list of [identity, since_us, expires_us, woken_until_us,
        # payload, attempt or None, whether its missed wake was sent again (wake_due)]
        self._waits: dict[str, list[list[Any]]] = {}
        # resource -> until when nothing is held for a woken head (a wake missed its grace)
        self._slow: dict[str, int] = {}

    def _now_us(self) -> int:
        return int(self._clock() * 1_000_000)

    def _index(self, expires_us: int, table: int, key: Any) -> None:
        """Note a record's new expiry in the retention index (under the lock)."""
        heapq.heappush(self._expiry, (expires_us, table, key))
        live = len(self._ids) + len(self._ledger) + len(self._ckpts)
        if len(self._expiry) > 4 * live + 1024:  # mostly superseded entries: rebuild
            tables = self._tables()
            self._expiry = [
                (record[at], t, k)
                for t, (records, at) in enumerate(tables)
                for k, record in records.items()
            ]
            heapq.heapify(self._expiry)

    def _tables(self) -> tuple[tuple[dict[Any, list[Any]], int], ...]:
        """The retained tables and where each keeps its expiry, in _IDS/_LEDGER/_CKPTS order."""
        return ((self._ids, 4), (self._ledger, 3), (self._ckpts, 2))

    @staticmethod
    def _alive(table: dict[Any, list[Any]], key: Any, now: int, at: int) -> list[Any] | None:
        record = table.get(key)
        if record is not None and record[at] <= now:
            del table[key]
            return None
        return record

    def _live_record(self, lease: Lease, now: int) -> _Record | LeaseLostError:
        current = self._leases.get(lease.resource)
        if current is None:
            forced = self._forced.get(lease.resource) == lease.fence
            return self._lost(lease, "force_released" if forced else "released", None, None)
        if current.token != lease.owner.token or current.fence != lease.fence:
            expired = current.expires_us <= now
            return self._lost(lease, "taken_over", current.label, current.fence, expired)
        if current.expires_us <= now:
            return self._lost(lease, "expired", None, None)
        return current

    def _live(self, resource: str, now: int) -> bool:
        """Whether ``resource`` has a live lease."""
        current = self._leases.get(resource)
        return current is not None and current.expires_us > now

    def check_health(self) -> builtins.list[str]:
        return ["MemoryLeaseStore shares nothing between processes: use it only in tests"]

    def close(self) -> None:
        """Nothing to close."""
