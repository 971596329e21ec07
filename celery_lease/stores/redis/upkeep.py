"""The Redis store's upkeep: renewal, reads and listing, eviction, sweeping past retention."""

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
    log_force_release,
    monotonic,
)
from .connection import Connections
from .core import RedisStoreCore, _text, log

__all__ = ["RedisUpkeep"]


class RedisUpkeep(RedisStoreCore):
    """Renewal, reads, ``list()``, ``force_release`` and ``sweep_expired`` of the Redis store."""

    def _renew_call(
        self,
        leases: Sequence[Lease],
        ttls: Sequence[float],
        what: str,
        via: Connections | None = None,
    ) -> tuple[float, list[Any]]:
        """One call for all leases; on a cluster, one call per shard (a slot each).

        Returns the monotonic time the (first) call was sent and one reply item per lease.
        """
        groups: dict[int, list[int]] = {}
        for i, lease in enumerate(leases):
            shard = self.shard_of(lease.resource) if self.cluster else 0
            groups.setdefault(shard, []).append(i)
        items: list[Any] = [None] * len(leases)
        sent = monotonic()  # the earliest send time: the self-fence deadline stays conservative
        for indexes in groups.values():
            keys: list[str] = []
            args: list[Any] = []
            for i in indexes:
                lease, ttl = leases[i], ttls[i]
                keys += self._keys(self.shard_of(lease.resource), "leases", "expiry", "fences")
                args += [lease.resource, lease.owner.token, str(lease.fence), round(ttl * 1e6)]
            with self._run(what):
                reply = self._renew(keys=keys, args=args, via=via)
            for i, item in zip(indexes, reply[1:], strict=True):
                items[i] = item
        return sent, items

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        if not leases:
            return []
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent, items = self._renew_call(
            leases, [max(t, 1e-6) for t in ttls], "renewal", self._renewer_connections
        )
        results: list[LeaseLostError | None] = []
        for lease, lease_ttl, item in zip(leases, ttls, items, strict=True):
            if item[0] == 1:
                lease.renewed(sent, from_micros(item[1]), lease_ttl)
                results.append(None)
            else:
                results.append(self._lost_from(lease, item))
        return results

    def get(self, resource: str) -> LeaseInfo | None:
        validate_resource(resource)
        with self._run("get of %r", resource):
            reply = self._get(keys=self._keys(self.shard_of(resource), "leases"), args=[resource])
        now, record = reply[0], reply[1] if len(reply) > 1 else None
        return None if record is None else self._info(resource, record, now)

    def highest_fence(self, resource: str) -> int | None:
        fences = self._fences_key(resource)
        with self._run("fence read of %r", resource):
            found = self.client.hget(fences, resource)
        return None if found is None else int(found)

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
        args = [
            "1" if expired_only else "0",
            "" if after is None else str(after[0]),
            "" if after is None else after[1],
            prefix,
            limit,
        ]
        # One call over every shard; on a cluster one per shard (a slot each), merged below.
        calls = [range(self.shards)] if not self.cluster else [[s] for s in range(self.shards)]
        now = 0
        more = False
        found: list[tuple[int, str, Any]] = []  # (expires_us, resource, record)
        for shards in calls:
            keys: list[str] = []
            for shard in shards:
                keys += self._keys(shard, "leases", "expiry")
            with self._run("list"):
                reply = self._list(keys=keys, args=args)
            now = max(now, int(reply[0]))
            more = more or bool(int(reply[1]))
            for i in range(2, len(reply), 2):
                if reply[i + 1]:  # an index entry whose record is gone (a racing release)
                    found.append((self._parse(reply[i + 1])[3], _text(reply[i]), reply[i + 1]))
        if len(calls) > 1:  # merge the shards' pages in (expiry, resource) order
            found.sort(key=lambda entry: (entry[0], entry[1]))
            more = more or len(found) > limit
            found = found[:limit]
        infos = [self._info(resource, record, now) for _, resource, record in found]
        next_cursor = None
        if more and found:
            next_cursor = encode_cursor(found[-1][0], found[-1][1])
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        validate_resource(resource)
        fence = self._fence_arg(fence)
        keys = self._keys(self.shard_of(resource), "leases", "expiry", "fences")
        with self._run("force_release of %r", resource):
            reply = self._force_release(keys=keys, args=[resource, "" if fence is None else fence])
        now, record = reply[0], reply[1] if len(reply) > 1 else None
        if len(reply) > 3 and reply[3]:  # the fence named is not the lease's: it changed hands
            assert fence is not None
            raise changed_hands(resource, fence, self._info(resource, reply[3], now))
        if not record:
            return None
        return log_force_release(self._info(resource, record, now), log)

    def sweep_expired(self, *, limit: int = 1000) -> int:
        limit = self._sweep_args(limit)
        start, self._sweep_start = self._sweep_start, (self._sweep_start + 1) % self.shards
        order = [(start + i) % self.shards for i in range(self.shards)]
        # One call over every shard; on a cluster one per shard (a slot each) until the limit.
        calls = [order] if not self.cluster else [[s] for s in order]
        removed = 0
        for shards in calls:
            keys: builtins.list[str] = []
            for shard in shards:
                keys += self._keys(
                    shard, "ids", "ids_exp", "ckpt", "ledger", "ledger_exp", "waits", "wpay",
                    "waits_exp",
                )  # fmt: skip
            with self._run("sweep"):
                removed += int(self._sweep(keys=keys, args=[limit - removed]))
            if removed >= limit:
                break
        return removed
