"""The Redis store's fence gates (used by ``celery_lease.FenceGate``) and once-marks."""

from __future__ import annotations

import builtins
from typing import Any

from ..._names import validate_fence, validate_resource
from ..base import MARK_IDENTITY
from .core import RedisStoreCore

__all__ = ["RedisGates"]


class RedisGates(RedisStoreCore):
    """Fence gates and ``mark_once`` of the Redis store."""

    def _gate_key(self, key: str) -> str:
        """The key's gate string of the earlier layout (read only: see scripts.py)."""
        return f"{self.key_prefix}gate:{key}"

    def _gate_keys(self, key: str) -> builtins.list[str]:
        """The gate script's KEYS for a validated ``key``: the gates and fences hashes of its
        shard (the resource of the same name's), and on a single server its earlier string."""
        keys = self._keys(self.shard_of(key), "gates", "fences")
        if not self.cluster:  # (on a cluster the string is in another slot: read apart)
            keys.append(self._gate_key(key))
        return keys

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted and >= the newest fence
        granted for ``key`` as a resource; one round trip (on a cluster two, the first time a
        key is admitted: the earlier layout's string is read from its own slot)."""
        key = validate_resource(key)
        fence = validate_fence(fence)  # (Lua compares doubles: exact up to 2**53 only)
        keys = self._gate_keys(key)
        args: list[Any] = [key, fence, ""]
        with self._run("fence gate admit of %r", key):
            reply = self._gate_admit(keys=keys, args=args)
            if int(reply[0]) == 2:
                earlier = self.client.get(self._gate_key(key))
                args[2] = "-" if earlier is None else int(earlier)
                reply = self._gate_admit(keys=keys, args=args)
        return bool(int(reply[0])), int(reply[1])

    def gate_highest(self, key: str) -> int | None:
        """The highest fence admitted for ``key`` (in either layout), or None."""
        key = validate_resource(key)
        gates = self._keys(self.shard_of(key), "gates")[0]
        with self._run("fence gate read of %r", key):
            found = [self.client.hget(gates, key), self.client.get(self._gate_key(key))]
        return max((int(value) for value in found if value is not None), default=None)

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Record ``key`` for ``ttl`` seconds unless a live record of another ``token`` has it:
        whether this caller holds it now (so a call repeated after a lost reply still finds
        its own). One round trip, on an entry of the identities hash of the key's shard
        (swept once expired)."""
        key = validate_resource(key)
        keys = self._keys(self.shard_of(key), "ids", "ids_exp")
        args = [f"{key}|{MARK_IDENTITY}", token, max(1, round(ttl * 1e6))]
        with self._run("mark of %r", key):
            return bool(int(self._mark_once(keys=keys, args=args)))
