"""An in-process lease store for users' unit tests.

Thread-safe and with an injectable clock, so tests can move time without sleeping. It keeps the
same contract as the Redis and SQL stores (the contract suite runs against it too) but shares
nothing between processes: never use it for real exclusion.
"""

from __future__ import annotations

import bisect
import builtins
import heapq
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _clock
from .._codec import decode, from_micros
from .._errors import IdentityDoneError, LeaseBusyError, LeaseLostError
from .._lease import Lease, LeaseInfo, Owner
from .._names import validate_fence, validate_resource
from .base import (
    DEFAULT_MAX_TTL,
    DEFAULT_RETENTION,
    DEFAULT_WAKE_DUE_LIMIT,
    POLL,
    POLL_HOLD,
    POLL_PLACES,
    RECENT_EFFECTS,
    BaseLeaseStore,
    DueWake,
    EffectRecord,
    IdentityInfo,
    IdentityRecords,
    LeasePage,
    Waiter,
    changed_hands,
    decode_cursor,
    encode_cursor,
    lease_info,
    monotonic,
    previous_owner,
    rearm_fits,
)

__all__ = ["MemoryLeaseStore"]

_IDS, _LEDGER, _CKPTS = 0, 1, 2  # the retained tables, as numbered in the retention index


@dataclass(slots=True)
class _Record:
    token: str
    label: str
    fence: int
    acquired_us: int
    expires_us: int
    #: What the claim recovered (previous label, previous fence, identity state), kept so that
    #: the same claim retried returns it again.
    #: (previous label, previous fence, identity state, identity label, identity fence)
    recovery: tuple[str | None, int | None, str | None, str | None, int | None] | None = None

    def info(self, resource: str, now_us: int) -> LeaseInfo:
        return lease_info(
            resource, self.label, self.fence, self.acquired_us, self.expires_us, now_us
        )


def _wake(waiter: list[Any], now: int, grace: int) -> None:
    """Mark ``waiter`` woken for ``grace`` us from ``now`` (a polling one: POLL_HOLD graces; its
    place is kept as long); the free resource is held for it until then (against the claims
    listed behind it). Once that passes unclaimed the waiter keeps its place and is not woken
    again until a refused claim of its own re-arms it (``_join``)."""
    until = now + grace * (POLL_HOLD if waiter[4] == POLL else 1)
    waiter[3] = until
    waiter[2] = max(waiter[2], until)
    waiter[6] = False


def _older(waiter: list[Any], attempt: int | None) -> bool:
    """Whether a claim of ``attempt`` is a copy of an older attempt than the one ``waiter``
    was listed by (its identity retried since): it neither re-arms, replaces the wake of,
    nor claims as that waiter. A place or a claim that names no attempt (a worker of an
    earlier version) is never older."""
    return attempt is not None and waiter[5] is not None and attempt < waiter[5]


def _held(
    waits: list[list[Any]], identity: str | None, now: int, attempt: int | None = None
) -> list[Any] | None:
    """The waiter the free resource is held for against a claim by ``identity``: the one
    whose wake is in flight (woken less than the grace ago: one wake at a time, even with a
    re-armed waiter ahead of it), else the first never woken (or re-armed), unless
    ``identity`` is that waiter or listed before it (None then, or when nobody waits); a copy
    of an older attempt than the one listed is not that waiter."""
    held = next((w for w in waits if w[3] > now), None)
    if held is None:
        held = next((w for w in waits if w[3] == 0), None)
    for waiter in waits:
        if waiter[0] == identity and not _older(waiter, attempt):
            return None
        if waiter is held:
            return held
    return None


class MemoryLeaseStore(BaseLeaseStore):
    """Leases in a dict, guarded by a lock, timed by ``clock`` (epoch seconds).

    Args:
        clock: returns the store's "now" in seconds since the epoch; defaults to
            ``time.time``. Tests pass a controllable clock to expire leases without sleeping.
        max_ttl: the largest ttl accepted.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        max_ttl: float = DEFAULT_MAX_TTL,
        retention: float = DEFAULT_RETENTION,
    ) -> None:
        super().__init__(max_ttl=max_ttl, retention=retention)
        self.url = "memory://"
        self._clock = clock or _clock.wall
        self._lock = threading.Lock()
        self._leases: dict[str, _Record] = {}
        self._fences: dict[str, int] = {}
        self._gates: dict[str, int] = {}
        # key -> (token, expires_us) of mark_once
        self._marks: dict[str, tuple[str, int]] = {}
        # resource -> fence of the lease force-released there, until the fence moves on
        self._forced: dict[str, int] = {}
        # (resource, identity) -> [state, fence, label, result, expires_us, token]
        self._ids: dict[tuple[str, str], list[Any]] = {}
        # (resource, identity, key) -> [state, fence, receipt, expires_us, token]
        self._ledger: dict[tuple[str, str, str], list[Any]] = {}
        # (resource, identity) -> [fence, data, expires_us]
        self._ckpts: dict[tuple[str, str], list[Any]] = {}
        # The retention index: (expires_us, table, key) for every write of those records; an
        # entry whose record was rewritten later (or removed) is skipped when it comes up.
        self._expiry: list[tuple[int, int, Any]] = []
        # resource -> FIFO wait list of [identity, since_us, expires_us, woken_until_us,
        # payload, attempt or None, whether its missed wake was sent again (wake_due)]
        self._waits: dict[str, list[list[Any]]] = {}
        # resource -> until when nothing is held for a woken head (a wake missed its grace)
        self._slow: dict[str, int] = {}

    def _now_us(self) -> int:
        return int(self._clock() * 1_000_000)

    def _wait_list(self, resource: str, now: int) -> builtins.list[builtins.list[Any]]:
        listed = self._waits.get(resource, ())
        # A woken waiter that did not claim within its grace (its message waits behind a
        # backlog, or its worker is paused): nothing is held for woken heads for 10 graces.
        missed = max((w[3] for w in listed if 0 < w[3] <= now), default=0)
        if missed:
            hold = 10 * round(self.handoff_grace * 1e6)
            self._slow[resource] = max(self._slow.get(resource, 0), missed + hold)
        waits = [w for w in listed if w[2] > now]
        if waits:
            self._waits[resource] = waits
        else:  # (the window after a missed wake ends with the list: invariant 13)
            self._waits.pop(resource, None)
            self._slow.pop(resource, None)
        return waits

    def _join(
        self,
        resource: str,
        identity: str | None,
        payload: str,
        wait_ttl: float,
        now: int,
        attempt: int | None,
        since: int | None = None,
    ) -> int:
        """The claimant's place in the list (0: not listed), joining or re-arming it;
        ``identity``: the place's name."""
        if not payload or identity is None:
            return 0
        waits = self._waits.setdefault(resource, [])
        until = now + round(wait_ttl * 1e6)
        for place, waiter in enumerate(waits, 1):
            if waiter[0] == identity:
                if _older(waiter, attempt):
                    # a copy of an attempt its identity moved past (a back-stop copy sent
                    # before a retry): the newer attempt keeps its wake and its state
                    return place
                # Refused again (a woken copy too late or beaten to it, or a back-stop copy):
                # it keeps its place and is re-armed, so the next release wakes it again. Its
                # new payload replaces the old one within the bytes bound (rearm_fits; else the
                # old, valid one is kept).
                waiter[2] = max(waiter[2], until)
                waiter[3] = 0
                waiter[6] = False
                old, new = _bytes(waiter[4]), _bytes(payload)
                after = _payload_bytes(waits) - old + new
                if rearm_fits(old, new, after, len(waits), self.wait_bytes_cap):
                    waiter[4] = payload
                    waiter[5] = attempt
                return place
        if payload != POLL and (
            sum(w[4] != POLL for w in waits) >= self.wait_cap
            or _payload_bytes(waits) + len(payload.encode()) > self.wait_bytes_cap
        ):
            payload = POLL  # no room for its message: a polling place
        if len(waits) >= POLL_PLACES * self.wait_cap:
            return 0
        # behind every place not listed later than it (its publish time, at most since_skew
        # ahead of now: a publisher's clock a little fast keeps its order; else now)
        at = min(now + self._since_skew_us, since) if since is not None else now
        place = len(waits)
        while place and waits[place - 1][1] > at:
            place -= 1
        waits.insert(place, [identity, at, until, 0, payload, attempt, False])
        return place + 1

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

    def _polling(self, resource: str, position: int) -> bool:
        """Whether the place at ``position`` (1-based; 0: none) is a polling one."""
        waits = self._waits.get(resource, ())
        return 0 < position <= len(waits) and waits[position - 1][4] == POLL

    def _index(self, expires_us: int, table: int, key: Any) -> None:
        """Note a record's new expiry in the retention index (under the lock)."""
        heapq.heappush(self._expiry, (expires_us, table, key))
        live = len(self._ids) + len(self._ledger) + len(self._ckpts)
        if len(self._expiry) > 4 * live + 1024:  # mostly superseded entries: rebuild
            tables = self._tables()
            self._expiry = [
                (record[at], t, k)
                for t, (records, at) in enumerate(tables)
                for k, record in records.items()
            ]
            heapq.heapify(self._expiry)

    def _tables(self) -> tuple[tuple[dict[Any, list[Any]], int], ...]:
        """The retained tables and where each keeps its expiry, in _IDS/_LEDGER/_CKPTS order."""
        return ((self._ids, 4), (self._ledger, 3), (self._ckpts, 2))

    def sweep_expired(self, *, limit: int = 1000) -> int:
        limit = self._sweep_args(limit)
        removed = 0
        with self._lock:
            now = self._now_us()
            tables = self._tables()
            while removed < limit and self._expiry and self._expiry[0][0] <= now:
                expires, table, key = heapq.heappop(self._expiry)
                records, at = tables[table]
                record = records.get(key)
                if record is not None and record[at] == expires:  # not rewritten since
                    del records[key]
                    removed += 1
            lapsed = [r for r, waits in self._waits.items() if all(w[2] <= now for w in waits)]
            for resource in lapsed[: max(0, limit - removed)]:
                del self._waits[resource]  # every place lapsed: nobody came back
                self._slow.pop(resource, None)
                removed += 1
        return removed

    @staticmethod
    def _alive(table: dict[Any, list[Any]], key: Any, now: int, at: int) -> list[Any] | None:
        record = table.get(key)
        if record is not None and record[at] <= now:
            del table[key]
            return None
        return record

    def _live_record(self, lease: Lease, now: int) -> _Record | LeaseLostError:
        current = self._leases.get(lease.resource)
        if current is None:
            forced = self._forced.get(lease.resource) == lease.fence
            return self._lost(lease, "force_released" if forced else "released", None, None)
        if current.token != lease.owner.token or current.fence != lease.fence:
            expired = current.expires_us <= now
            return self._lost(lease, "taken_over", current.label, current.fence, expired)
        if current.expires_us <= now:
            return self._lost(lease, "expired", None, None)
        return current

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent = monotonic()
        results: list[LeaseLostError | None] = []
        with self._lock:
            now = self._now_us()
            for lease, lease_ttl in zip(leases, ttls, strict=True):
                record = self._live_record(lease, now)
                if isinstance(record, LeaseLostError):
                    results.append(record)
                    continue
                record.expires_us = now + round(lease_ttl * 1e6)
                lease.renewed(sent, from_micros(record.expires_us), lease_ttl)
                results.append(None)
        return results

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

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        names, limit = self._wake_due_args(resources, limit)
        out: builtins.list[DueWake] = []
        with self._lock:
            now = self._now_us()
            if names is None:
                # By when the last place lapses, as the other stores' indexes order them; only a
                # list with a live place on a resource with no live lease counts against the
                # limit (a held one's release wakes its next waiter).
                lapses = ((max((w[2] for w in ws), default=0), r) for r, ws in self._waits.items())
                names = [
                    r
                    for _, r in sorted(
                        (lapse, r) for lapse, r in lapses if lapse > now and not self._live(r, now)
                    )[:limit]
                ]
            for resource in names:
                if self._live(resource, now):
                    continue  # held: its holder's release wakes the next waiter
                waits = self._wait_list(resource, now)
                if any(w[3] > now for w in waits):
                    continue  # a wake in flight: its grace decides
                for waiter in waits:
                    if waiter[3] != 0 and not waiter[6]:  # missed its grace: once more
                        waiter[6] = True
                        out.append(DueWake(resource, waiter[4], True))
                woke = next((w for w in waits if w[3] == 0), None)
                if woke is not None:
                    _wake(woke, now, round(self.handoff_grace * 1e6))
                    out.append(DueWake(resource, woke[4], False))
        return out

    def _live(self, resource: str, now: int) -> bool:
        """Whether ``resource`` has a live lease."""
        current = self._leases.get(resource)
        return current is not None and current.expires_us > now

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        resource = validate_resource(resource)
        with self._lock:
            now = self._now_us()
            return [
                Waiter(place, w[0], from_micros(w[1]), from_micros(w[2]), w[3] > now)
                for place, w in enumerate(self._wait_list(resource, now), 1)
            ]

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

    def get(self, resource: str) -> LeaseInfo | None:
        resource = validate_resource(resource)
        with self._lock:
            current = self._leases.get(resource)
            return None if current is None else current.info(resource, self._now_us())

    def highest_fence(self, resource: str) -> int | None:
        resource = validate_resource(resource)
        with self._lock:
            return self._fences.get(resource)

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
        with self._lock:
            now = self._now_us()
            ordered = sorted(
                (record.expires_us, resource)
                for resource, record in self._leases.items()
                if resource.startswith(prefix) and (not expired_only or record.expires_us <= now)
            )
            start = 0 if after is None else bisect.bisect_right(ordered, after)
            page = ordered[start : start + limit]
            infos = [self._leases[resource].info(resource, now) for _, resource in page]
        more = start + limit < len(ordered)
        next_cursor = encode_cursor(*page[-1]) if more and page else None
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        resource = validate_resource(resource)
        fence = self._fence_arg(fence)
        with self._lock:
            now = self._now_us()
            if fence is not None:
                shown = self._leases.get(resource)
                if shown is None:
                    return None
                if shown.fence != fence:
                    raise changed_hands(resource, fence, shown.info(resource, now))
            current = self._leases.pop(resource, None)
            if current is not None:
                self._forced[resource] = current.fence
            else:
                self._forced.pop(resource, None)  # the fence moves on: the mark ends
            self._fences[resource] = self._fences.get(resource, 0) + 1
            return None if current is None else current.info(resource, now)

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted and >= the newest fence
        granted for ``key`` as a resource (FenceGate support)."""
        validate_resource(key)
        fence = validate_fence(fence)
        with self._lock:
            # Under the lock that claims and force-releases take: a grant is either before
            # this decision (and counts) or after it.
            admitted, granted = self._gates.get(key), self._fences.get(key)
            highest = max((f for f in (admitted, granted) if f is not None), default=None)
            if highest is not None and highest > fence:
                self._gate_decided(key, fence, False, highest)
                return False, highest
            self._gates[key] = int(fence)
            self._gate_decided(key, fence, True, int(fence))
            return True, int(fence)

    def _gate_decided(self, key: str, fence: int, admitted: bool, highest: int) -> None:
        """Called under the store lock with each gate decision, in the order they were made."""

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Record ``key`` for ``ttl`` seconds unless a live record of another ``token`` has it:
        whether this caller holds it now."""
        validate_resource(key)
        with self._lock:
            now = self._now_us()
            for name in [k for k, (_, until) in self._marks.items() if until <= now]:
                del self._marks[name]
            held = self._marks.get(key)
            if held is None:
                self._marks[key] = (token, now + max(1, round(ttl * 1e6)))
                return True
            return held[0] == token

    def gate_highest(self, key: str) -> int | None:
        with self._lock:
            return self._gates.get(validate_resource(key))

    def check_health(self) -> builtins.list[str]:
        return ["MemoryLeaseStore shares nothing between processes: use it only in tests"]

    def close(self) -> None:
        """Nothing to close."""


def _bytes(payload: str) -> int:
    """A wake payload's bytes (UTF-8) as the bound counts them: none for a polling place."""
    return 0 if payload == POLL else len(payload.encode())


def _payload_bytes(waits: builtins.list[builtins.list[Any]]) -> int:
    """The bytes (UTF-8) of the wake payloads in a wait list (bounded by wait_bytes_cap)."""
    return sum(_bytes(w[4]) for w in waits)
