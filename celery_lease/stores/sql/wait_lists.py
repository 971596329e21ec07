"""The SQL store's wait-list reads and the wakes ``wake_due`` passes on (invariant 16)."""

from __future__ import annotations

import builtins
import json
from collections.abc import Sequence
from typing import Any

from ..._codec import from_micros
from ..._names import validate_resource
from ..base import DEFAULT_WAKE_DUE_LIMIT, DueWake, Waiter
from . import waits
from .connection import fetch
from .core import SQLStoreCore

__all__ = ["SQLWaitLists"]


class SQLWaitLists(SQLStoreCore):
    """Wait list reads and ``wake_due`` of the SQL store (the rules are in :mod:`.waits`)."""

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        validate_resource(resource)
        params = {"r": resource}
        row = self._connections.run(
            f"wait list read of {resource!r}", lambda c: fetch(c, self.sql.waiters, params)
        )
        if row is None:
            return []
        raw, now = row
        return [
            Waiter(place, w[0], from_micros(w[1]), from_micros(w[2]), int(w[3]) > now)
            for place, w in enumerate(waits.Waits.read(raw, 0, now, 0).places, 1)
        ]

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        names, limit = self._wake_due_args(resources, limit)
        if names is None:
            query = {"n": limit}

            def candidates(cursor: Any) -> builtins.list[str]:
                cursor.execute(self.sql.due_candidates, query)
                return [row[0] for row in cursor.fetchall()]

            names = self._connections.run("wake_due scan", candidates)
        out: builtins.list[DueWake] = []
        for resource in names:
            out += self._wake_due_one(resource)
        return out

    def _wake_due_one(self, resource: str) -> builtins.list[DueWake]:
        """wake_due of one resource: decided in Python on its row (see waits.due), written
        back in the same BEGIN IMMEDIATE (SQLite) or only if the row is as it was read
        (PostgreSQL: a claim, release or another pass since then writes nothing here, and
        the next pass looks again)."""
        grace = max(1, round(self.handoff_grace * 1e6))
        params = {"r": resource}

        def work(cursor: Any) -> builtins.list[tuple[str, bool]]:
            with self._connections.immediate(cursor):
                cursor.execute(self.sql.due_read, params)
                row = cursor.fetchone()
                if row is None:
                    return []
                raw, slow, token, expires, fence, now = row
                if token is not None and expires > now:
                    return []  # held: its holder's release wakes the next waiter
                # (as read: waits.due changes the places it is given)
                old = raw if isinstance(raw, str) else json.dumps(raw)
                listed, sent = waits.due(raw, slow, now, grace)
                if not sent:
                    return []
                columns = waits.stored(listed)
                if self.dialect != "postgresql":
                    cursor.execute(self.sql.waits_write, {"r": resource, **columns})
                    return sent
                cursor.execute(
                    self.sql.due_write,
                    {
                        "r": resource,
                        "f": fence,
                        "old": old,
                        "oslow": slow,
                        **columns,
                    },
                )
                return sent if cursor.rowcount == 1 else []

        sent = self._connections.run(f"wake_due of {resource!r}", work)
        return [DueWake(resource, payload, again) for payload, again in sent]
