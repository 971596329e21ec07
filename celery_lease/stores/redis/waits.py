"""The Redis store's wait lists: reading one, the wakes ``wake_due`` passes on (invariant 16)."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from ..._codec import from_micros
from ..._names import validate_resource
from ..base import DEFAULT_WAKE_DUE_LIMIT, DueWake, Waiter
from .core import RedisStoreCore, _text

__all__ = ["RedisWaits"]


class RedisWaits(RedisStoreCore):
    """Wait list reads and ``wake_due`` of the Redis store."""

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        validate_resource(resource)
        with self._run("wait list read of %r", resource):
            now, *raw = self._waiters(
                keys=self._keys(self.shard_of(resource), "waits"), args=[resource]
            )
        out: builtins.list[Waiter] = []
        for line in _text(raw[0]).split("\n") if raw and raw[0] else ():
            # (and " <attempt>" after a retry: see scripts.py)
            identity, since, expires, woken = line.split(" ")[:4]
            if int(expires) <= now:
                continue
            out.append(
                Waiter(
                    len(out) + 1,
                    identity,
                    from_micros(int(since)),
                    from_micros(int(expires)),
                    int(woken) > now,
                )
            )
        return out

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        names, limit = self._wake_due_args(resources, limit)
        grace = max(1, round(self.handoff_grace * 1e6))
        kinds = ("leases", "waits", "wpay", "waits_exp")
        calls: builtins.list[tuple[builtins.list[str], builtins.list[Any]]] = []
        if names is None:
            # Every shard in one call; on a cluster one per shard (a slot each).
            groups = [range(self.shards)] if not self.cluster else [[s] for s in range(self.shards)]
            for shards in groups:
                keys: builtins.list[str] = []
                for shard in shards:
                    keys += self._keys(shard, *kinds)
                calls.append((keys, [grace, limit]))
        else:
            by_shard: dict[int, builtins.list[str]] = {}
            for resource in names:
                by_shard.setdefault(self.shard_of(resource), []).append(resource)
            for shard, members in by_shard.items():
                calls.append((self._keys(shard, *kinds), [grace, limit, *members]))
        out: builtins.list[DueWake] = []
        for keys, args in calls:
            with self._run("wake_due"):
                reply = self._wake_due(keys=keys, args=args)
            for i in range(0, len(reply), 3):
                out.append(DueWake(_text(reply[i]), _text(reply[i + 1]), bool(int(reply[i + 2]))))
        return out
