"""An in-process lease store for users' unit tests: its claims and releases.

Thread-safe and with an injectable clock, so tests can move time without sleeping. It keeps the
same contract as the Redis and SQL stores (the contract suite runs against it too) but shares
nothing between processes: never use it for real exclusion.

:class:`MemoryLeaseStore` is made of one class per job: :mod:`.core` (its tables, clock and
lock, the retention index), :mod:`.waits` (wait lists), :mod:`.ledger` (identity records,
effects, checkpoints), :mod:`.upkeep` (renewal, reads, listing, eviction, sweeping),
:mod:`.gates` (fence gates and once-marks). Claims and releases stay here, on the class itself.
"""

from __future__ import annotations

from ..._codec import decode, from_micros
from ..._errors import IdentityDoneError, LeaseBusyError, LeaseLostError
from ..._lease import Lease, Owner
from ..base import monotonic, previous_owner
from .core import _IDS, _Record
from .gates import MemoryGates
from .ledger import MemoryLedger
from .upkeep import MemoryUpkeep
from .waits import MemoryWaits, _held, _older, _wake

__all__ = ["MemoryLeaseStore"]


class MemoryLeaseStore(MemoryWaits, MemoryLedger, MemoryGates, MemoryUpkeep):
    """Leases in a dict, guarded by a lock, timed by ``clock`` (epoch seconds).

    Args:
        clock: returns the store's "now" in seconds since the epoch; defaults to
            ``time.time``. Tests pass a controllable clock to expire leases without sleeping.
        max_ttl: the largest ttl accepted.
    """

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
    ) -> Lease:
        ttl, identity, name, payload, attempt = self._claim_checks(
            resource, owner, ttl, identity, waiter, since, wait, wait_ttl, attempt
        )
        sent = monotonic()
        with self._lock:
            now = self._now_us()
            ident = self._alive(self._ids, (resource, identity or ""), now, 4)
            if identity is not None and ident is not None and ident[0] == "done":
                raise IdentityDoneError.completed(resource, identity, ident[1], ident[3], ident[2])
            current = self._leases.get(resource)
            waits = self._wait_list(resource, now)
            if current is not None and current.expires_us > now:
                if current.token != owner.token:
                    duplicate = (
                        ident is not None and ident[0] == "running" and ident[1] == current.fence
                    )
                    position = (
                        0
                        if duplicate
                        else self._join(resource, name, payload, wait_ttl, now, attempt, since)
                    )
                    raise LeaseBusyError.held(
                        resource,
                        current.label,
                        current.fence,
                        (current.expires_us - now) / 1e6,
                        duplicate=duplicate,
                        position=position,
                        polling=self._polling(resource, position),
                    )
                # The same claim retried: the same lease and what the first attempt recovered.
                record = current
                before, fence, state, label, ident_fence = record.recovery or (None,) * 5
                previous: tuple[str | None, int | None] | None = (
                    None if fence is None else (before, fence)
                )
                checkpoints = None
                if identity is not None and state is not None:
                    ckpt = self._alive(self._ckpts, (resource, identity), now, -1)
                    checkpoints = decode(ckpt[1]) if ckpt else None
            else:
                held = (
                    None if self._slow.get(resource, 0) > now else _held(waits, name, now, attempt)
                )
                if held is not None:
                    # held for a waiter ahead of this claim (never woken, or woken within its
                    # grace): wait behind it
                    position = self._join(resource, name, payload, wait_ttl, now, attempt, since)
                    wake = None
                    if held[3] == 0:  # nobody woke it (the releaser died?): wake it now
                        _wake(held, now, round(self.handoff_grace * 1e6))
                        wake = held[4]
                    raise LeaseBusyError.held(
                        resource,
                        f"the waiting task {held[0]} (hand-off)",
                        self._fences.get(resource, 0),
                        (held[3] - now) / 1e6,
                        position=position,
                        wake=wake,
                        polling=self._polling(resource, position),
                    )
                # The waiter held for claims, or a waiter ahead of it that missed its grace
                # (an earlier arrival); or a wake missed its grace lately (woken copies wait
                # behind a backlog, or their workers are paused) and nothing is held: this
                # claim takes the resource rather than leaving it idle. A waiter that claims
                # leaves the list (a copy of an older attempt leaves the newer one's place).
                for place, entry in enumerate(waits):
                    if entry[0] == name and not _older(entry, attempt):
                        del waits[place]
                        if not waits:
                            del self._waits[resource]
                            self._slow.pop(resource, None)
                        break
                fence = self._fences.get(resource, 0) + 1
                self._fences[resource] = fence
                self._forced.pop(resource, None)
                record = _Record(owner.token, owner.label, fence, now, now + round(ttl * 1e6))
                self._leases[resource] = record
                previous = None if current is None else (current.label, current.fence)
                checkpoints = None
                state = label = ident_fence = None
                if identity is not None and ident is not None:
                    before_label, before_fence = previous or (None, None)
                    previous = previous_owner(before_label, before_fence, ident[2], ident[1])
                    state, label, ident_fence = ident[0], ident[2], ident[1]
                    ckpt = self._alive(self._ckpts, (resource, identity), now, -1)
                    checkpoints = decode(ckpt[1]) if ckpt else None
                if previous is not None or state is not None:
                    record.recovery = (*(previous or (None, None)), state, label, ident_fence)
            if identity is not None:
                self._ids[(resource, identity)] = [
                    "running",
                    record.fence,
                    owner.label,
                    None,
                    now + self._retention_us,
                    owner.token,
                ]
                self._index(now + self._retention_us, _IDS, (resource, identity))
        return Lease(
            resource=resource,
            owner=owner,
            fence=record.fence,
            acquired_at=from_micros(record.acquired_us),
            expires_at=from_micros(record.expires_us),
            ttl=ttl,
            sent_monotonic=sent,
            store=self,
            previous_owner_label=None if previous is None else previous[0],
            previous_fence=None if previous is None else previous[1],
            identity=identity,
            identity_state=state,
            checkpoints=checkpoints,
            identity_owner_label=label if state is not None else None,
            identity_fence=ident_fence if state is not None else None,
        )

    def verify(self, lease: Lease) -> None:
        self._renew_ttl(lease, None)
        with self._lock:
            record = self._live_record(lease, self._now_us())
        if isinstance(record, LeaseLostError):
            raise record

    def release(
        self, lease: Lease, *, outcome: str | None = None, result: str | None = None
    ) -> bool:
        self._release_checks(lease, outcome)
        with self._lock:
            if outcome is not None:
                assert lease.identity is not None
                ident = self._ids.get((lease.resource, lease.identity))
                ours = ident is not None and (ident[1], ident[5]) == (
                    lease.fence,
                    lease.owner.token,
                )
                if ident is not None and ours and ident[0] != "done":
                    ident[0] = outcome
                    ident[3] = result if outcome == "done" else None
                    ident[4] = self._now_us() + self._retention_us
                    self._index(ident[4], _IDS, (lease.resource, lease.identity))
            current = self._leases.get(lease.resource)
            lease.handoff = None
            if current is None or (current.token, current.fence) != (
                lease.owner.token,
                lease.fence,
            ):
                return False
            del self._leases[lease.resource]
            now = self._now_us()
            # Wake the first waiter never woken (a head woken before that missed its grace
            # keeps its place, nothing is held for it), unless a wake was sent less than the
            # grace ago (a backlog?): one wake in flight at a time.
            waits = self._wait_list(lease.resource, now)
            if not any(w[3] > now for w in waits):
                woke = next((w for w in waits if w[3] == 0), None)
                if woke is not None:
                    _wake(woke, now, round(self.handoff_grace * 1e6))
                    lease.handoff = woke[4]
            return True
