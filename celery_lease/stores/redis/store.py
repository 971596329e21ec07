"""The Redis lease store: claims and releases (the per-task path), one Lua script each.

:class:`RedisLeaseStore` is made of one class per job: :mod:`.core` (set-up, keys, health),
:mod:`.upkeep` (renewal, reads, listing, eviction, sweeping), :mod:`.ledger` (identity records,
effects, checkpoints), :mod:`.gates` (fence gates and once-marks), :mod:`.waits` (wait lists and
the wakes ``wake_due`` passes on). Claims and releases stay here, on the class itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._codec import decode
from ..._errors import IdentityDoneError, LeaseBusyError
from ..._lease import Lease, Owner
from ..base import monotonic, previous_owner
from . import scripts as lua
from .core import _text
from .gates import RedisGates
from .ledger import RedisLedger
from .upkeep import RedisUpkeep
from .waits import RedisWaits

__all__ = ["RedisLeaseStore"]


def _acquire_order(fixed: tuple[Any, ...], own: tuple[Any, ...]) -> list[Any]:
    """ACQUIRE's seventeen arguments in its own order, from HEADED_CLAIM's ``fixed`` and
    ``own`` (for a stand-in a test swapped in for the claim's script)."""
    ttl, retention, cap, grace, cap_bytes, early, own_wake, skew = fixed
    resource, token, label, identity, payload, wait_ttl, attempt, name, since = own
    return [
        resource, token, label, ttl, identity, retention, payload, wait_ttl, cap, grace,
        cap_bytes, attempt, early, own_wake, name, since, skew,
    ]  # fmt: skip


class RedisLeaseStore(RedisWaits, RedisLedger, RedisGates, RedisUpkeep):
    """Leases in Redis: a standalone server, or a Redis Cluster with ``cluster=True``.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` to use (not closed by
            :meth:`close`); or give ``url``.
        url: ``redis://``, ``rediss://`` or ``unix://`` URL; the store creates and owns a client.
        cluster: with ``url``, connect to a Redis Cluster (any node's address; the client
            discovers the rest). Every script touches the keys of one shard, which share a hash
            tag and so a slot; batched renewals and ``list()`` make one call per shard.
        key_prefix: prefix of every key, default ``celery_lease:``; the store adds a hash tag.
        shards: how many hash-tagged key groups resources spread over (Cluster slots); each
            ``list()`` touches all of them.
        max_ttl: the largest ttl accepted.
        socket_timeout: seconds a command may take before it fails as LeaseStoreError
            (only for a client the store creates).
        require_noeviction: make :meth:`check_health` refuse (raise) instead of warn when the
            server may evict keys (``maxmemory-policy`` other than ``noeviction``).
        require_persistence: likewise when the server persists nothing (no AOF, no RDB).
        password: with ``url``, the password to authenticate with when the URL carries none
            (a URL's own password wins). Keeps it out of ``lease_store_url``, which Celery's
            ``inspect conf`` and Flower show unmasked; ``lease_store_options={"password": ...}``
            is masked there.
    """

    supports_early_wake = True

    # -- claims and releases --------------------------------------------------------------
    def acquire(
        self,
        resource: str,
        owner: Owner,
        ttl: float,
        *,
        identity: str | None = None,
        wait: str | None = None,
        wait_ttl: float = 120.0,
        attempt: int | None = None,
        waiter: str | None = None,
        since: int | None = None,
        early_wake: bool = False,
        own_wake: bool = False,
    ) -> Lease:
        ttl, identity, name, payload, attempt = self._claim_checks(
            resource, owner, ttl, identity, waiter, since, wait, wait_ttl, attempt
        )
        shard = self.shard_of(resource)
        keys = self._acquire_keys[shard]
        grace = max(1, round(self.handoff_grace * 1e6))
        ttl_us, early = max(1, round(ttl * 1e6)), "1" if early_wake else ""
        sent = monotonic()
        if (
            identity is None
            and name is None
            and not payload
            and attempt is None
            and since is None
            and not own_wake
        ):
            # The claim most tasks send (see lua.SHORT_CLAIM): three arguments of its own.
            base, short = self._short_claim
            if base is not self._acquire:  # (a test swapped the claim's script)
                short = self._remade("_short_claim", lua.SHORT_CLAIM, self._acquire)
            own: tuple[str | int, ...] = (resource, owner.token, owner.label)
            with self._run("acquire of %r", resource):
                if short is not None:
                    reply = short(keys=keys, args=own, fixed=(ttl_us, grace, early))
                else:
                    fixed = (ttl_us, 0, 0, grace, 0, early, "", 0)
                    reply = self._acquire(
                        keys=keys, args=_acquire_order(fixed, (*own, "", "", 0, "", "", ""))
                    )
        else:
            base, headed = self._headed_claim
            if base is not self._acquire:
                headed = self._remade("_headed_claim", lua.HEADED_CLAIM, self._acquire)
            fixed = (
                ttl_us,
                self._retention_us,
                self.wait_cap,
                grace,
                self.wait_bytes_cap,
                early,
                "1" if own_wake else "",
                self._since_skew_us,
            )
            own = (
                resource,
                owner.token,
                owner.label,
                identity or "",
                payload,
                max(1, round(wait_ttl * 1e6)),
                "" if attempt is None else attempt,
                name if name is not None and name != identity else "",
                "" if since is None else since,
            )
            with self._run("acquire of %r", resource):
                if headed is not None:
                    reply = headed(keys=keys, args=own, fixed=fixed)
                else:
                    reply = self._acquire(keys=keys, args=_acquire_order(fixed, own))
        if reply[0] == 2:
            assert identity is not None
            result = _text(reply[2]) if reply[2] else None
            label = _text(reply[3]) if len(reply) > 3 and reply[3] else None
            raise IdentityDoneError.completed(resource, identity, int(reply[1]), result, label)
        if reply[0] == 0:
            _, label, fence, expires, now, epoch, *more = reply
            more += [0, 0, None, 0][len(more) :]
            self._note_epoch(shard, epoch)
            raise LeaseBusyError.held(
                resource,
                _text(label),
                int(fence),
                (expires - now) / 1e6,
                duplicate=bool(more[0]),
                position=int(more[1]) or None,
                wake=None if more[2] is None else _text(more[2]),
                polling=bool(more[3]),
            )
        (
            _,
            fence,
            acquired,
            expires,
            epoch,
            prev_label,
            prev_fence,
            i_state,
            i_fence,
            i_label,
            ckpt,
            next_wake,
            own,
        ) = [*reply, None, None, None, None, None, None, None, None][:13]
        self._note_epoch(shard, epoch)
        prev_label, prev_fence = previous_owner(prev_label, prev_fence, i_label, i_fence)
        checkpoints = None
        if ckpt is not None:
            checkpoints = decode(_text(ckpt).split("\n", 1)[1])
        lease = Lease(
            resource=resource,
            owner=owner,
            fence=int(fence),
            acquired_at=int(acquired),  # (datetimes when first read)
            expires_at=int(expires),
            ttl=ttl,
            sent_monotonic=sent,
            store=self,
            previous_owner_label=None if prev_label is None else _text(prev_label),
            previous_fence=None if prev_fence is None else int(prev_fence),
            identity=identity,
            identity_state=None if i_state is None else _text(i_state),
            checkpoints=checkpoints,
            identity_owner_label=None if i_state is None or i_label is None else _text(i_label),
            identity_fence=None if i_state is None or not i_fence else int(i_fence),
        )
        if next_wake is not None:
            lease.next_wake = _text(next_wake)
        if own is not None:
            lease.own_wake = _text(own)
        return lease

    def verify(self, lease: Lease) -> None:
        self._renew_ttl(lease, None)
        _, items = self._renew_call([lease], [0.0], f"verify of {lease.resource!r}")
        if items[0][0] != 1:
            raise self._lost_from(lease, items[0])

    def release(
        self,
        lease: Lease,
        *,
        outcome: str | None = None,
        result: str | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> bool:
        """See :meth:`LeaseStore.release`; ``meanwhile`` (called once, also when the call
        fails) runs while the release's reply is awaited: the command is on its way first
        (except when the server's script cache is cold, after a restart: the NOSCRIPT answer
        is read after ``meanwhile`` ran, and the release is sent again once loaded)."""
        self._release_checks(lease, outcome)
        shard = self.shard_of(lease.resource)
        grace = max(1, round(self.handoff_grace * 1e6))
        # (each script with its fixed arguments first: see lua.HEADED_RELEASE, unless a test
        # swapped it for a stand-in, which is sent its arguments in its own order)
        if outcome is None:
            keys = self._release_keys[shard]
            base, headed = self._headed_release
            if base is not self._release:
                headed = self._remade("_headed_release", lua.HEADED_RELEASE, self._release)
            fixed: tuple[str | int, ...] = (grace,)
            own: tuple[str | int, ...] = (lease.resource, lease.owner.token, lease.fence)
            script = self._release
        else:
            keys = self._outcome_keys[shard]
            base, headed = self._headed_release_outcome
            if base is not self._release_outcome:
                headed = self._remade(
                    "_headed_release_outcome", lua.HEADED_RELEASE_OUTCOME, self._release_outcome
                )
            fixed = (self._retention_us, grace)
            own = (
                lease.resource,
                lease.owner.token,
                lease.fence,
                lease.identity or "",
                outcome,
                result or "",
            )
            script = self._release_outcome
        with self._run("release of %r", lease.resource):
            if headed is not None:
                done = headed(keys=keys, args=own, meanwhile=meanwhile, fixed=fixed)
            else:
                done = script(keys=keys, args=[*own, *fixed], meanwhile=meanwhile)
        if isinstance(done, list):  # handed over to the head waiter
            lease.handoff = None if done[1] is None else _text(done[1])
            return True
        lease.handoff = None
        return bool(done)
