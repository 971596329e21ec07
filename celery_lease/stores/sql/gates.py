"""The SQL store's fence gates (used by ``celery_lease.FenceGate``) and once-marks."""

from __future__ import annotations

from typing import Any

from ..._errors import LeaseStoreError
from ..._names import validate_fence, validate_resource
from ..base import MARK_IDENTITY
from .connection import fetch
from .core import SQLStoreCore

__all__ = ["SQLGates"]


class SQLGates(SQLStoreCore):
    """Fence gates and ``mark_once`` of the SQL store."""

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted and >= the fence this
        store granted ``key`` as a resource (its lease row's); one statement."""
        params = {"k": validate_resource(key), "f": validate_fence(fence)}

        def work(cursor: Any) -> tuple[Any, ...] | None:
            if self.dialect == "postgresql":
                return fetch(cursor, self.sql.gate_admit, params)
            with self._connections.immediate(cursor):  # (one writer: nothing runs in between)
                row = fetch(cursor, self.sql.gate_admit, params)
                if row is not None:
                    return (1, row[0])
                highest = fetch(cursor, self.sql.gate_refused, params)
                return None if highest is None or highest[0] is None else (0, highest[0])

        for _ in range(3):
            row = self._connections.run(f"fence gate admit of {key!r}", work)
            # None, or a refusal citing no fence or one our snapshot saw as lower than ours: a
            # racing admit committed a higher fence after our snapshot; ask again to report it.
            if row is not None and (row[0] or (row[1] is not None and int(row[1]) > int(fence))):
                return bool(row[0]), int(row[1])
        raise LeaseStoreError(f"fence gate admit of {key!r} kept racing a concurrent insert")

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Record ``key`` for ``ttl`` seconds unless a live record of another ``token`` has it:
        whether this caller holds it now (so a call repeated after a lost reply still finds
        its own). One statement, on a row of the identities table (swept once expired)."""
        params = {
            "r": validate_resource(key),
            "i": MARK_IDENTITY,
            "t": token,
            "ttl": max(1, round(ttl * 1e6)),
        }

        def work(cursor: Any) -> bool:
            with self._connections.immediate(cursor):
                return fetch(cursor, self.ledger_sql.mark_once, params) is not None

        return self._connections.run(f"mark of {key!r}", work)

    def gate_highest(self, key: str) -> int | None:
        params = {"k": validate_resource(key)}
        row = self._connections.run(
            f"fence gate read of {key!r}", lambda c: fetch(c, self.sql.gate_read, params)
        )
        return None if row is None else int(row[0])
