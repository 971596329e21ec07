"""The SQL store's upkeep: renewal, reads and listing, eviction, sweeping past retention."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from ..._codec import from_micros
from ..._errors import LeaseLostError
from ..._lease import Lease, LeaseInfo
from ..._names import validate_resource
from ..base import (
    LeasePage,
    changed_hands,
    decode_cursor,
    encode_cursor,
    lease_info,
    log_force_release,
    monotonic,
)
from . import ledger
from .connection import fetch, one
from .core import SQLStoreCore, log
from .rows import NO_ROW, why_lost

__all__ = ["SQLUpkeep"]


class SQLUpkeep(SQLStoreCore):
    """Renewal, reads, ``list()``, ``force_release`` and ``sweep_expired`` of the SQL store."""

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        if not leases:
            return []
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent = monotonic()
        rows = self._connections.run(
            "renewal", lambda c: self._renew_rows(c, leases, ttls), self._connections.renewer_free
        )
        results: list[LeaseLostError | None] = []
        for lease, lease_ttl, row in zip(leases, ttls, rows, strict=True):
            new_expires, *state = row
            if new_expires is not None:
                lease.renewed(sent, from_micros(new_expires), lease_ttl)
                results.append(None)
            else:
                results.append(why_lost(lease, *state))
        return results

    def _renew_rows(
        self, cursor: Any, leases: Sequence[Lease], ttls: Sequence[float]
    ) -> list[tuple[Any, ...]]:
        requests = [
            (lease.resource, lease.owner.token, lease.fence, max(1, round(t * 1e6)))
            for lease, t in zip(leases, ttls, strict=True)
        ]
        if self.dialect == "postgresql":
            flat = [v for i, r in enumerate(requests) for v in (i, *r)]
            cursor.execute(self.sql.renew_many(len(requests)), flat)
            by_index = {row[0]: tuple(row[1:]) for row in cursor.fetchall()}
            return [by_index[i] for i in range(len(requests))]
        rows: list[tuple[Any, ...]] = []
        with self._connections.immediate(cursor):
            for resource, token, fence, ttl_us in requests:
                params = {"r": resource, "t": token, "f": fence, "ttl": ttl_us}
                cursor.execute(self.sql.renew_one, params)
                renewed = cursor.fetchone()
                if renewed is not None:
                    rows.append((renewed[0], *NO_ROW))
                    continue
                cursor.execute(self.sql.state, params)
                rows.append((None, *(cursor.fetchone() or NO_ROW)))
        return rows

    def get(self, resource: str) -> LeaseInfo | None:
        validate_resource(resource)
        params = {"r": resource}
        row = self._connections.run(
            f"get of {resource!r}", lambda c: fetch(c, self.sql.get, params)
        )
        return None if row is None else lease_info(resource, *row)

    def highest_fence(self, resource: str) -> int | None:
        validate_resource(resource)
        params = {"r": resource}
        # (a released row keeps its fence: the state statement reads it, held or not)
        row = self._connections.run(
            f"fence read of {resource!r}", lambda c: fetch(c, self.sql.state, params)
        )
        return None if row is None else int(row[2])

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
        query = {
            # substr, not LIKE: LIKE treats _ as a wildcard and ignores case on SQLite.
            "prefix": prefix,
            "plen": len(prefix),
            "after_e": -(2**62) if after is None else after[0],
            "after_r": "" if after is None else after[1],
            "n": limit + 1,
        }
        statement = self.sql.list_expired if expired_only else self.sql.list

        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(statement, query)
            return list(cur.fetchall())

        rows = self._connections.run("list", work)
        infos = [lease_info(*row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = encode_cursor(last[4], last[0])
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        validate_resource(resource)
        fence = self._fence_arg(fence)
        params = {"r": resource, "f": fence}
        shown: builtins.list[LeaseInfo] = []  # (SQLite: the lease that was not evicted)

        def work(cursor: Any) -> tuple[Any, ...] | None:
            if self.dialect == "postgresql":
                cursor.execute(self.sql.force_release, params)
                return one(cursor)
            with self._connections.immediate(cursor):
                cursor.execute(self.sql.get, params)
                row = cursor.fetchone()
                if fence is not None and (row is None or row[1] != fence):
                    if row is not None:
                        shown.append(lease_info(resource, *row))
                    return None
                cursor.execute(self.sql.force_release, params)
                return None if row is None else tuple(row)

        row = self._connections.run(f"force_release of {resource!r}", work)
        if row is not None and row[0] is not None:
            return log_force_release(lease_info(resource, *row), log)
        if fence is None:
            return None
        # Nothing evicted: no lease, or it changed hands (PostgreSQL reads which, after).
        current = shown[0] if shown else None
        if current is None and self.dialect == "postgresql":
            current = self.get(resource)
        if current is not None and current.fence != fence:
            raise changed_hands(resource, fence, current)
        return None

    def sweep_expired(self, *, limit: int = 1000) -> int:
        statements = [*self.ledger_sql.sweep, self.sql.sweep_waits]
        return ledger.sweep(self._connections, statements, self._sweep_args(limit))
