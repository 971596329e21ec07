"""The memory store's upkeep: renewal, reads and listing, eviction, sweeping past retention."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from ..._codec import from_micros
from ..._errors import LeaseLostError
from ..._lease import Lease, LeaseInfo
from ..._names import validate_resource
from ..base import LeasePage, changed_hands, decode_cursor, encode_cursor, monotonic
from .core import MemoryStoreCore

__all__ = ["MemoryUpkeep"]


class MemoryUpkeep(MemoryStoreCore):
    """Renewal, reads, ``list()``, ``force_release`` and ``sweep_expired`` of the memory store."""

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent = monotonic()
        results: list[LeaseLostError | None] = []
        with self._lock:
            now = self._now_us()
            for lease, lease_ttl in zip(leases, ttls, strict=True):
                record = self._live_record(lease, now)
                if isinstance(record, LeaseLostError):
                    results.append(record)
                    continue
                record.expires_us = now + round(lease_ttl * 1e6)
                lease.renewed(sent, from_micros(record.expires_us), lease_ttl)
                results.append(None)
        return results

    def get(self, resource: str) -> LeaseInfo | None:
        resource = validate_resource(resource)
        with self._lock:
            current = self._leases.get(resource)
            return None if current is None else current.info(resource, self._now_us())

    def highest_fence(self, resource: str) -> int | None:
        resource = validate_resource(resource)
        with self._lock:
            return self._fences.get(resource)

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
        with self._lock:
            now = self._now_us()
            ordered = sorted(
                (record.expires_us, resource)
                for resource, record in self._leases.items()
                if resource.startswith(prefix) and (not expired_only or record.expires_us <= now)
            )
            start = 0 if after is None else bisect.bisect_right(ordered, after)
            page = ordered[start : start + limit]
            infos = [self._leases[resource].info(resource, now) for _, resource in page]
        more = start + limit < len(ordered)
        next_cursor = encode_cursor(*page[-1]) if more and page else None
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        resource = validate_resource(resource)
        fence = self._fence_arg(fence)
        with self._lock:
            now = self._now_us()
            if fence is not None:
                shown = self._leases.get(resource)
                if shown is None:
                    return None
                if shown.fence != fence:
                    raise changed_hands(resource, fence, shown.info(resource, now))
            current = self._leases.pop(resource, None)
            if current is not None:
                self._forced[resource] = current.fence
            else:
                self._forced.pop(resource, None)  # the fence moves on: the mark ends
            self._fences[resource] = self._fences.get(resource, 0) + 1
            return None if current is None else current.info(resource, now)

    def sweep_expired(self, *, limit: int = 1000) -> int:
        limit = self._sweep_args(limit)
        removed = 0
        with self._lock:
            now = self._now_us()
            tables = self._tables()
            while removed < limit and self._expiry and self._expiry[0][0] <= now:
                expires, table, key = heapq.heappop(self._expiry)
                records, at = tables[table]
                record = records.get(key)
                if record is not None and record[at] == expires:  # not rewritten since
                    del records[key]
                    removed += 1
            lapsed = [r for r, waits in self._waits.items() if all(w[2] <= now for w in waits)]
            for resource in lapsed[: max(0, limit - removed)]:
                del self._waits[resource]  # every place lapsed: nobody came back
                self._slow.pop(resource, None)
                removed += 1
        return removed
