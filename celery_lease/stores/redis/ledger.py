"""The Redis store's identity records, ledger effects and checkpoints (invariants 6-10)."""

from __future__ import annotations

from ..._codec import from_micros
from ..._lease import Lease
from ..._names import validate_resource
from ..base import RECENT_EFFECTS, EffectRecord, IdentityInfo, IdentityRecords
from .core import RedisStoreCore, _text

__all__ = ["RedisLedger"]


class RedisLedger(RedisStoreCore):
    """Identity records, ledger effects and checkpoints of the Redis store."""

    def effect_begin(self, lease: Lease, key: str) -> tuple[str, int | None, str | None]:
        identity, key = self._ledger_args(lease, key)
        keys = self._keys(self.shard_of(lease.resource), "leases", "ledger", "ledger_exp", "fences")
        args: list[str | int] = [
            lease.resource,
            lease.owner.token,
            lease.fence,
            identity,
            key,
            self._retention_us,
        ]
        with self._run("effect %r of %r", (key, lease.resource)):
            reply = self._effect_begin(keys=keys, args=args)
        if reply[0] == 0:
            raise self._lost_from(lease, reply)
        state = _text(reply[1])
        if state == "done":
            return "done", int(reply[2]), _text(reply[3]) if len(reply) > 3 else None
        if state == "intent":
            return "intent", int(reply[2]), None
        return "new", None, None

    def effect_done(self, lease: Lease, key: str, receipt: str) -> bool:
        identity, key = self._ledger_args(lease, key)
        keys = self._keys(self.shard_of(lease.resource), "ledger", "ledger_exp")
        member = f"{lease.resource}|{identity}|{key}"
        with self._run("effect %r done of %r", (key, lease.resource)):
            done = self._effect_done(
                keys=keys,
                args=[member, lease.fence, receipt, self._retention_us, lease.owner.token],
            )
        return bool(done)

    def checkpoint(self, lease: Lease, data: str) -> None:
        identity, _ = self._ledger_args(lease, "checkpoint")
        keys = self._keys(self.shard_of(lease.resource), "leases", "ckpt", "fences")
        args: list[str | int] = [lease.resource, lease.owner.token, lease.fence, identity, data]
        with self._run("checkpoint of %r", lease.resource):
            reply = self._checkpoint(keys=keys, args=args)
        if reply[0] == 0:
            raise self._lost_from(lease, reply)

    def identity_get(self, resource: str, identity: str) -> IdentityInfo | None:
        validate_resource(resource)
        identity = self._identity_args(identity) or ""
        keys = self._keys(self.shard_of(resource), "ids", "ids_exp")
        with self._run("identity read of %r", resource):
            reply = self._identity_get(keys=keys, args=[f"{resource}|{identity}"])
        if not reply:
            return None
        record, expires = reply
        state, fence, _token, label, result = _text(record).split("\n", 4)
        return IdentityInfo(
            resource,
            identity,
            state,
            int(fence),
            label,
            result or None,
            from_micros(int(float(expires))),
        )

    def identity_records(
        self, resource: str, identity: str, *, limit: int = RECENT_EFFECTS
    ) -> IdentityRecords:
        resource, identity, limit = self._records_args(resource, identity, limit)
        shard = self.shard_of(resource)
        ids_exp, ckpt_key, ledger, ledger_exp = self._keys(
            shard, "ids_exp", "ckpt", "ledger", "ledger_exp"
        )
        member = f"{resource}|{identity}"
        # Names follow the resource rule (no * ? [ ] or backslash), so the pattern matches
        # only this identity's entries; the fields are compared exactly below all the same.
        pattern = f"{member}|*"
        with self._run("identity records read of %r", resource):
            seconds, micros = self.client.time()
            now = int(seconds) * 1_000_000 + int(micros)
            ckpt_exp = self.client.zscore(ids_exp, member)
            ckpt = self.client.hget(ckpt_key, member) if (ckpt_exp or 0) > now else None
            entries = {
                _text(field)[len(member) + 1 :]: _text(value)
                for field, value in self.client.hscan_iter(ledger, match=pattern, count=1000)
                if _text(field).startswith(pattern[:-1])
            }
            pipe = self.client.pipeline(transaction=False)
            for key in entries:
                pipe.zscore(ledger_exp, f"{member}|{key}")
            expiries = pipe.execute() if entries else []
        effects = []
        for (key, value), expires in zip(entries.items(), expiries, strict=True):
            if expires is None or expires <= now:
                continue
            state, fence, _token, receipt = value.split("\n", 3)
            effects.append(
                EffectRecord(key, state, int(fence), receipt or None, from_micros(int(expires)))
            )
        effects.sort(key=lambda e: (e.expires_at, e.key), reverse=True)
        if ckpt is None:
            return IdentityRecords(None, None, effects[:limit])
        fence, data = _text(ckpt).split("\n", 1)
        return IdentityRecords(data, int(fence), effects[:limit])
