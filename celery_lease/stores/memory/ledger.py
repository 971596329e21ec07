"""The memory store's identity records, ledger effects and checkpoints (invariants 6-10)."""

from __future__ import annotations

from ..._codec import from_micros
from ..._errors import LeaseLostError
from ..._lease import Lease
from ..._names import validate_resource
from ..base import RECENT_EFFECTS, EffectRecord, IdentityInfo, IdentityRecords
from .core import _CKPTS, _LEDGER, MemoryStoreCore

__all__ = ["MemoryLedger"]


class MemoryLedger(MemoryStoreCore):
    """Identity records, ledger effects and checkpoints of the memory store."""

    def effect_begin(self, lease: Lease, key: str) -> tuple[str, int | None, str | None]:
        identity, key = self._ledger_args(lease, key)
        with self._lock:
            now = self._now_us()
            live = self._live_record(lease, now)
            if isinstance(live, LeaseLostError):
                raise live
            entry = self._alive(self._ledger, (lease.resource, identity, key), now, 3)
            if entry is not None and entry[0] == "done":
                return "done", entry[1], entry[2]
            self._ledger[(lease.resource, identity, key)] = [
                "intent",
                lease.fence,
                None,
                now + self._retention_us,
                lease.owner.token,
            ]
            self._index(now + self._retention_us, _LEDGER, (lease.resource, identity, key))
            if entry is not None and entry[1] != lease.fence:
                return "intent", entry[1], None
            return "new", None, None

    def effect_done(self, lease: Lease, key: str, receipt: str) -> bool:
        identity, key = self._ledger_args(lease, key)
        with self._lock:
            entry = self._ledger.get((lease.resource, identity, key))
            if entry is None or entry[0] != "intent":
                return False
            if (entry[1], entry[4]) != (lease.fence, lease.owner.token):
                return False
            entry[:4] = ["done", lease.fence, receipt, self._now_us() + self._retention_us]
            self._index(entry[3], _LEDGER, (lease.resource, identity, key))
            return True

    def checkpoint(self, lease: Lease, data: str) -> None:
        identity, _ = self._ledger_args(lease, "checkpoint")
        with self._lock:
            now = self._now_us()
            live = self._live_record(lease, now)
            if isinstance(live, LeaseLostError):
                raise live
            current = self._ckpts.get((lease.resource, identity))
            if current is not None and current[0] > lease.fence:
                raise self._lost(lease, "taken_over", None, current[0])
            self._ckpts[(lease.resource, identity)] = [lease.fence, data, now + self._retention_us]
            self._index(now + self._retention_us, _CKPTS, (lease.resource, identity))

    def identity_get(self, resource: str, identity: str) -> IdentityInfo | None:
        validate_resource(resource)
        identity = self._identity_args(identity) or ""
        with self._lock:
            record = self._alive(self._ids, (resource, identity), self._now_us(), 4)
            if record is None:
                return None
            state, fence, label, result, expires, _token = record
        return IdentityInfo(resource, identity, state, fence, label, result, from_micros(expires))

    def identity_records(
        self, resource: str, identity: str, *, limit: int = RECENT_EFFECTS
    ) -> IdentityRecords:
        resource, identity, limit = self._records_args(resource, identity, limit)
        with self._lock:
            now = self._now_us()
            ckpt = self._alive(self._ckpts, (resource, identity), now, -1)
            effects = [
                EffectRecord(key[2], entry[0], entry[1], entry[2], from_micros(entry[3]))
                for key, entry in self._ledger.items()
                if key[:2] == (resource, identity) and entry[3] > now
            ]
        effects.sort(key=lambda e: (e.expires_at, e.key), reverse=True)
        return IdentityRecords(
            None if ckpt is None else ckpt[1], None if ckpt is None else ckpt[0], effects[:limit]
        )
