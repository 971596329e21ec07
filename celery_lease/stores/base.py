"""The lease store contract.

A store is dumb and atomic: each operation below is one atomic step in the store (one Lua script,
one SQL statement or one immediate transaction), costs one round trip, and reads time from the
store's own clock. Policy (retries, backoff, renewal cadence) lives above the stores.

Invariants every store keeps, asserted by ``tests/stores`` against each of them:

1. At most one live lease per resource at any instant of the store clock.
2. Every fence is strictly greater than every fence issued for that resource before; release,
   expiry, force-release and store restarts never reset the sequence.
3. Only the owner token *and* fence of the live lease can renew or verify it; only that pair can
   release it. Anything else changes nothing in the store.
4. An expired lease is claimable; the claim reports the expired owner's label and fence. The
   same claim sent again (same owner token) gets the same lease back only while that lease is
   live; once it ran out, it is a new claim like any other (13 applies to it).
5. Driver errors surface as ``LeaseStoreError`` (outcome unknown), never as driver exceptions.

Exactly-once support (optional ``identity=`` on acquire; ledger and checkpoints):

6. An identity recorded done is never claimed again: ``acquire`` raises ``IdentityDoneError``
   with the recorded result, in the same round trip as the claim. A claim that finds the
   resource held by a live lease running the *same* identity raises ``LeaseBusyError`` with
   ``duplicate=True`` (a copy of running work); any other holder gives ``duplicate=False``.
7. A claim marks its identity running with its fence; ``release(outcome=...)`` records the
   outcome only if the identity still carries that fence (a newer owner's record is kept).
8. A ledger key takes effect at most once per identity: ``effect_begin`` records an intent only
   for the live owner and never over a done record; ``effect_done`` completes only the intent
   recorded with the same fence.
9. Checkpoints are written only by the live owner, and never over a newer fence's.
10. Identity, ledger and checkpoint records expire ``retention`` seconds after their last write.
11. ``sweep_expired`` deletes identity, ledger and checkpoint records past their retention, at
    most ``limit`` per call, found through an expiry index (cost proportional to what it
    removes, not to what is kept). Lease records, which carry the fence, are never swept.

Hand-off (optional ``wait=`` on acquire; needs ``identity=``):

12. A claim refused because other work holds the resource joins the resource's FIFO wait list
    in the same round trip (at most ``wait_cap`` waiters, whose wake payloads add up to at most
    ``wait_bytes_cap`` bytes (UTF-8); an identity already waiting keeps its place, and a refused
    claim re-arms it: it no longer counts as woken, see 14; its new payload replaces the old one
    while the list's payloads stay within ``wait_bytes_cap``, or, when it is at most
    ``REARM_GROWTH`` bytes bigger, within ``wait_bytes_cap`` plus ``REARM_GROWTH`` per listed
    waiter; else the old one is kept).
    A claim past those bounds gets a polling place (below), or past the polling bound too is
    refused unlisted (position None). A waiter's place lapses
    ``wait_ttl`` seconds after its last refused claim. A claim naming its ``attempt`` (the
    task's retries) lists that attempt; a later refused claim naming an older attempt of the
    same identity (a copy sent before the retry) leaves the place as it is (not re-armed, its
    payload kept), and 13 does not count it as that waiter: it is held behind it and, when it
    claims, leaves the place listed. A place or claim without an attempt matches any attempt.
    A place is named by the claim's ``identity``, or by its ``waiter=`` name when it has none
    (no identity record is written then). A **polling place** has the wake payload ``POLL``:
    nobody sends its task a message, its own back-off copy comes back to claim, and when its
    turn comes the free resource is held for it ``POLL_HOLD`` graces (it polls once a grace).
    A claim asking to wait with a message the list has no room for (``wait_cap`` places with
    messages, or ``wait_bytes_cap`` bytes) gets a polling place instead, while the list holds
    fewer than ``POLL_PLACES * wait_cap`` places in all; ``LeaseBusyError.polling`` says so. A
    polling place re-armed with a message that fits the bytes bound takes it. A new place joins
    behind every place whose ``since`` is not later than its own: the claim's ``since=`` (when
    its message was published, ``order="publish"``, by the publisher's clock; one more than
    ``since_skew`` seconds ahead of the store's clock counts as that far ahead, ``SINCE_SKEW``),
    else now. ``since`` only orders the list: a place's lapse, wake and hold run on the store's
    clock whatever it says.
13. While the resource has no live lease it is held for the waiter woken less than
    ``handoff_grace`` seconds ago (one wake in flight, 14), else for its first waiter never
    woken (or re-armed, 12): the first that did not miss its grace. Only that waiter, or a
    waiter listed before it, can claim it; every other claim is refused and queued behind. A
    waiter woken longer ago that has not claimed (its message waits behind a backlog, or its
    worker is paused) missed its grace: it keeps its place and may claim whenever it comes (it
    arrived earlier), but nothing is held for it; the hold moves on to the waiters behind it.
    After a wake missed its grace, nothing is held for any waiter (woken or not) for
    ``10 * handoff_grace`` seconds, so a backlog that keeps missing its wakes cannot keep the
    resource idle. That window ends with the list: once no place is listed (every waiter
    claimed or lapsed), a list made afresh holds for its waiters again, whatever wakes the
    old one missed. A waiter leaves the list when it claims.
14. ``release`` wakes in its own round trip: the first waiter never woken (the head, in the
    common case) is marked woken and its wake payload comes back in ``lease.handoff`` for the
    releaser to send, unless a wake was sent less than ``handoff_grace`` ago (one wake in flight
    at a time). A waiter is woken once per refused claim: one whose woken copy came back
    refused (too late, or beaten to the resource) is re-armed by that claim (12) and woken
    again by a later release, so no release wakes nobody while a re-armed waiter is listed.
    A claim refused by a head nobody woke gets the head's payload in ``LeaseBusyError.wake``
    (the releaser died before waking it).
15. Optional (stores with ``supports_early_wake``): ``acquire(..., early_wake=True)`` also
    returns, with the lease, the wake payload a release would send if it ran then (``14``:
    the first waiter never woken, none while a wake is in flight) in ``Lease.next_wake``, in
    the same round trip. It changes nothing in the store. On such a store a claim without
    ``wait`` by a listed identity leaves its place as it is when refused (not re-armed, 12),
    and ``acquire(..., own_wake=True)`` returns in ``Lease.own_wake`` the wake payload the
    claimant's own place held when the claim took it off the list (None: no place, also for
    the same claim sent again after a lost reply: the first run took the place).
16. ``wake_due`` passes the turn on when nobody else will (the releaser died before sending its
    wake, the woken copy was dropped unclaimed: revoked, expired, rejected, undecodable; the
    holder died and its lease ran out). For each resource with a wait list (those named, else
    any, at most ``limit``) that has no live lease and no wake in flight (14), in one atomic
    step per resource: every waiter whose wake missed its grace and was not sent again since is
    sent again once (its message may never have left; it keeps its place, 13, and is not
    marked woken again), and the first waiter never woken (or re-armed) is woken as a release
    wakes it. The payloads come back, oldest place first, for the caller to send. A waiter
    woken or re-armed afterwards may be sent again after its next missed grace. Without names,
    the resources are taken by when their lists lapse, and only those with a live place and no
    live lease count against ``limit`` (a wake in flight counts: its list is read to know);
    Redis counts per shard and reads past at most ``WAKE_DUE_SKIP`` held ones per shard.
"""

from __future__ import annotations

import builtins
import errno
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, Protocol, runtime_checkable

from .. import _clock
from .._codec import from_micros
from .._errors import LeaseBusyError, LeaseConfigError, LeaseLostError
from .._lease import Lease, LeaseInfo, Owner, identity_outcome, split_identity_state
from .._names import IDENTITY_RULE, MAX_FENCE, show_value, validate_resource, validate_ttl
from .._names import RESOURCE_PATTERN as _RESOURCE_RE
from .._settings import DEFAULT_RETENTION, WAIT_BYTES_CAP
from ._bounds import (
    POLL,
    POLL_HOLD,
    POLL_PLACES,
    REARM_GROWTH,
    RENEW_BATCH,
    SINCE_SKEW,
    WAKE_DUE_SKIP,
)

__all__ = [
    "DEFAULT_MAX_TTL",
    "DEFAULT_RETENTION",
    "DEFAULT_WAKE_DUE_LIMIT",
    "LOCK_MAX_TTL",
    "LOCK_PREFIX",
    "POLL",
    "POLL_HOLD",
    "POLL_PLACES",
    "REARM_GROWTH",
    "RECENT_EFFECTS",
    "SINCE_SKEW",
    "WAKE_DUE_SKIP",
    "BaseLeaseStore",
    "DueWake",
    "EffectRecord",
    "IdentityInfo",
    "IdentityRecords",
    "LeasePage",
    "LeaseStore",
    "Waiter",
    "changed_hands",
    "connection_refused",
    "decode_cursor",
    "encode_cursor",
]


def connection_refused(exc: BaseException) -> bool:
    """Whether a driver error is a refused connection (ECONNREFUSED), however it is wrapped.

    redis-py chains the ``ConnectionRefusedError``; libpq (psycopg) puts the system's message
    in its own text.
    """
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError) or (
            isinstance(seen, OSError) and seen.errno == errno.ECONNREFUSED
        ):
            return True
        if "connection refused" in str(seen).lower():
            return True
        # Follow the chain as a traceback shows it: an explicit cause, else an unsuppressed
        # context.
        if seen.__cause__ is not None:
            seen = seen.__cause__
        else:
            seen = None if seen.__suppress_context__ else seen.__context__
    return False


#: Upper bound on a single claim's or renewal's ttl unless a store is given another ``max_ttl``.
#: Long tasks keep short leases alive by renewing; a huge ttl only makes crash recovery slow.
DEFAULT_MAX_TTL = 600.0
#: Resources under this prefix are publish locks (``unique=``): a lock's ttl is how long a
#: queued copy keeps its key (an hour by default), bounded by ``LOCK_MAX_TTL`` instead.
LOCK_PREFIX = "unique:"
LOCK_MAX_TTL = 30 * 86400.0
MAX_LIST_LIMIT = 10_000
MAX_SWEEP_LIMIT = 100_000


IDENTITY_OUTCOMES = ("done", "failed", "retry")
#: The longest a waiter's place may be kept (``acquire``'s ``wait_ttl``), seconds.
_MAX_WAIT_TTL = 365 * 86400.0
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class IdentityInfo:
    """What a store records for one task identity (see ``identity_get``)."""

    resource: str
    identity: str
    state: str
    fence: int
    owner_label: str
    result: str | None
    expires_at: datetime
    #: The attempt (``request.retries``) the record names as current (0: none recorded).
    attempt: int = 0

    def __post_init__(self) -> None:
        state, attempt = split_identity_state(self.state)
        if attempt:
            object.__setattr__(self, "state", state)
            object.__setattr__(self, "attempt", attempt)


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """One ledger entry of a task identity (see ``identity_records``)."""

    key: str
    state: str  # "intent" (begun, not known done) or "done"
    fence: int  # of the owner that last wrote it
    receipt: str | None  # JSON text, once done
    expires_at: datetime  # retention runs from its last write: the latest is the most recent


@dataclass(frozen=True, slots=True)
class IdentityRecords:
    """A task identity's checkpoints and effects on a resource (see ``identity_records``)."""

    checkpoints: str | None  # JSON text of all steps, as the last checkpoint() stored it
    checkpoint_fence: int | None
    effects: list[EffectRecord]  # most recently written first


#: Default number of effects ``identity_records`` returns.
RECENT_EFFECTS = 20


@dataclass(frozen=True, slots=True)
class Waiter:
    """One task waiting for a resource (see ``waiters``)."""

    position: int  # 1 = the next to run
    identity: str
    #: its first refused claim, store clock; or when its message was published
    #: (order="publish"), which may lie up to SINCE_SKEW ahead of the store clock
    since: datetime
    expires_at: datetime  # when its place lapses unless it claims again
    woken: bool  # woken less than the grace ago, not claimed yet (see 13 for whom it holds)


#: Default cap on a resource's wait list; a refused claim beyond it waits with the back-off,
#: which for a burst much larger than the cap left most tasks polling (200 tasks of 0.05 s:
#: 28 s at 32 against 16 s at 256, 11 s for a dedicated queue). Each refused claim and release
#: on a resource with waiters reads and rewrites its whole list (Redis: about 0.3 ms at 32
#: waiters, 1-4 ms at 256 on a loaded 2-core box; SQL: the JSON column, payloads included):
#: the cost grows with the list's length, see docs/performance.md.
DEFAULT_WAIT_CAP = 256
#: Default bound on the bytes (UTF-8) of the wake payloads a resource's wait list holds: a claim
#: whose payload would take the list past it is refused unlisted, as past ``wait_cap``. The SQL
#: stores keep the list, payloads included, in one column of the lease row that each refused
#: claim and release reads and rewrites: its cost follows the list's bytes (PostgreSQL: 256
#: waiters of 20 kB, 5 MB, took 120-230 ms per operation; 128 KiB about 5 ms), so this bounds
#: it. 128 KiB lists 256 wake messages of 512 bytes (a task with three small arguments sends
#: about 360: task name, arguments, ids, queue, headers).
DEFAULT_WAIT_BYTES_CAP = WAIT_BYTES_CAP


def rearm_fits(old: int, new: int, after: int, count: int, bytes_cap: int) -> bool:
    """Whether a re-armed waiter's new payload (``new`` bytes, replacing ``old``) is kept, the
    list's payloads then adding up to ``after`` bytes over ``count`` listed waiters."""
    if new - old <= REARM_GROWTH:
        bytes_cap += REARM_GROWTH * count
    return new <= old or after <= bytes_cap


#: Default number of resources one ``wake_due`` call passes the turn on at (per Redis shard;
#: held ones do not count).
DEFAULT_WAKE_DUE_LIMIT = 1000

#: Default seconds the free resource is held for a woken waiter (then it is held for the
#: waiter behind it; the late one keeps its place).
DEFAULT_HANDOFF_GRACE = 2.0


class DueWake(NamedTuple):
    """A wake ``wake_due`` hands back to send (invariant 16)."""

    resource: str
    payload: str
    #: True for a missed wake sent once more (the waiter's place is unchanged), False for a
    #: waiter woken now (the free resource is held for it for the grace).
    again: bool


class LeasePage(NamedTuple):
    """One page of ``list()``: the leases and the cursor for the next page (None at the end)."""

    leases: list[LeaseInfo]
    cursor: str | None


#: The identity of the records ``mark_once`` writes (the store's identity records of their own,
#: under the mark's key as resource; swept once expired with the others).
MARK_IDENTITY = "celery_lease:mark"


@runtime_checkable
class LeaseStore(Protocol):
    """Where leases and fences live. See the module docstring for the invariants."""

    #: The store's URL with any password masked; safe to log.
    url: str
    #: The largest ttl accepted by ``acquire`` and ``renew`` (on a publish lock, a resource
    #: under ``LOCK_PREFIX``: ``LOCK_MAX_TTL`` when that is longer).
    max_ttl: float

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
        """Claim ``resource`` for ``owner`` for ``ttl`` seconds of store time, atomically.

        With ``wait`` (a wake payload: the message to send again, or ``POLL``; needs
        ``identity`` or ``waiter``), a claim refused for other work joins the resource's FIFO
        wait list, keeping its place for ``wait_ttl`` seconds (invariants 12-14);
        ``LeaseBusyError.position`` tells where and ``.polling`` whether nobody will send its
        message; ``attempt`` (the task's retries) keeps a copy of an older attempt from taking
        over a newer attempt's place (12); ``waiter`` names the place of a claim without an
        identity; ``since`` (microseconds since the epoch) places it by when it was published
        rather than by when it arrived. A payload with a NUL character or a lone surrogate
        raises ``LeaseConfigError`` on every store.

        Succeeds when the resource has no lease, a released one or an expired one. The returned
        fence is greater than any fence issued for this resource before. When the claim takes
        over an expired lease that was never released, ``previous_owner_label`` and
        ``previous_fence`` name that owner.

        With ``identity``, the same round trip checks and records the task identity: a done
        identity is not claimed (``IdentityDoneError``); otherwise it is marked running with the
        new fence, and an identity found begun and not done sets ``identity_state``, the
        ``previous_*`` fields (unless the lease itself was taken over) and ``checkpoints``.

        Raises:
            LeaseBusyError: another owner's lease is live; names holder, fence and expiry, and
                sets ``duplicate`` when that holder runs this same identity.
            IdentityDoneError: the identity already completed; carries its result and the
                label of the owner that completed it (``owner_label``).
            LeaseConfigError: bad resource name or ttl.
            LeaseStoreError: the store failed; the claim may or may not have happened.
        """
        ...

    def renew(self, lease: Lease, ttl: float | None = None) -> Lease:
        """Reset the lease's expiry to store-now + ``ttl`` (default: its current ttl).

        Only the owner token and fence of the live lease can renew; an expired lease cannot be
        renewed even if nobody took it over (its owner has already self-fenced). On success the
        given lease is updated in place and returned.

        Raises:
            LeaseLostError: the lease expired, was released or taken over; nothing changed.
            LeaseStoreError: the store failed; the lease state is unknown.
        """
        ...

    def renew_many(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        """Renew every lease, as ``renew`` would one by one, in one round trip per
        ``RENEW_BATCH`` (1,000) leases: one for the common few, batches one after another for
        more (so that no statement or script grows with the number of leases).

        Returns a list aligned with ``leases``: None where the lease was renewed (and updated in
        place), the LeaseLostError where it was not.

        Raises:
            LeaseStoreError: the store failed; the state of every lease not yet reported is
                unknown (the leases of batches answered before it are renewed, and updated in
                place, or not; those of the batches after it were not sent).
        """
        ...

    def release(
        self, lease: Lease, *, outcome: str | None = None, result: str | None = None
    ) -> bool:
        """Release the lease if this owner token and fence still hold it.

        Returns True when it was released, False when it was not ours any more (expired and
        taken over, force-released, already released): then nothing changes, so a release
        retried after a takeover never frees the new owner's lease. The fence sequence is kept.

        ``outcome`` (``done``, ``failed``, ``retry``) records the identity's outcome in the same
        round trip, with ``result`` (JSON text) for done, if the identity still carries this
        lease's fence.
        """
        ...

    def effect_begin(self, lease: Lease, key: str) -> tuple[str, int | None, str | None]:
        """Record the intent of ledger effect ``key`` of the lease's identity, if not done.

        Proves the lease is live and ours in the same round trip. Returns ``("new", None,
        None)``, ``("intent", earlier_fence, None)`` when an earlier owner recorded an intent
        and never completed it (the intent is now this owner's), or ``("done", fence,
        receipt)``.

        Raises:
            LeaseLostError: the lease is not live and ours; nothing changed.
        """
        ...

    def effect_done(self, lease: Lease, key: str, receipt: str) -> bool:
        """Record effect ``key`` done with ``receipt`` (JSON text) if its intent is this fence's.

        Does not require a live lease (the effect did happen). Returns False when a newer owner
        took the intent over meanwhile (its record is kept).
        """
        ...

    def checkpoint(self, lease: Lease, data: str) -> None:
        """Store ``data`` (JSON text of all steps) as the identity's checkpoints; fenced.

        Raises:
            LeaseLostError: the lease is not live and ours; nothing changed.
        """
        ...

    def identity_get(self, resource: str, identity: str) -> IdentityInfo | None:
        """Read the record of a task identity on a resource, or None."""
        ...

    def identity_records(
        self, resource: str, identity: str, *, limit: int = RECENT_EFFECTS
    ) -> IdentityRecords:
        """Read an identity's checkpoints and its ``limit`` most recently written effects
        (records past retention are left out). For operators (``celery lease show``): on Redis
        it reads through the shard's ledger hash."""
        ...

    def verify(self, lease: Lease) -> None:
        """Prove the owner token and fence hold a live lease right now (store clock).

        Raises:
            LeaseLostError: they do not; nothing changed.
            LeaseStoreError: the store failed; the lease state is unknown.
        """
        ...

    def get(self, resource: str) -> LeaseInfo | None:
        """Read the resource's lease (live, or expired and never released), or None."""
        ...

    def highest_fence(self, resource: str) -> int | None:
        """The newest fence granted for ``resource`` (a force-release's bump included), held
        or not: release and expiry keep it, as the next claim's fence is greater. None when
        the resource was never claimed here (or its record is gone: a Redis shard that lost
        its data)."""
        ...

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        """The resource's wait list, head first (places that lapsed are left out)."""
        ...

    def list(
        self,
        *,
        prefix: str = "",
        expired_only: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> LeasePage:
        """List leases (live, or expired and never released) by expiry, oldest first.

        ``expired_only`` returns only leases whose expiry passed on the store clock, found
        through an expiry index (cost proportional to the result, never a keyspace scan).
        Pass the returned cursor back to read the next page.
        """
        ...

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        """Administrator's eviction: drop the resource's lease whoever holds it.

        Bumps the fence, so that a ``FenceGate`` on this store (and a fenced helper given it)
        refuses every write of the evicted holder at once, and any other fenced side effect
        once the next holder's fence reached it.
        Returns what was evicted, or None when there was no lease. Wakes nobody: the caller
        passes the turn on (``wake_due``), as ``celery_lease.force_release`` does.

        With ``fence``, only the lease with that fence is evicted (the one an operator was
        shown): when the resource has no lease, nothing changes and None comes back; when its
        lease has another fence (it changed hands), nothing changes either.

        Raises:
            LeaseBusyError: ``fence`` was given and the lease has another fence; it names the
                holder and fence the resource has now.
        """
        ...

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        """Pass the turn on where nobody else will (invariant 16); the wakes to send.

        ``resources``: only these (a release's follow-up, an eviction); None: every resource
        with a wait list, up to ``limit`` of them that have a live place and no live lease, by
        when their lists lapse (a worker's periodic pass; the cost follows the resources with
        waiters, found through the wait lists' index, never the leases; Redis: ``limit`` per
        shard, reading past at most ``WAKE_DUE_SKIP`` held resources per shard).

        Raises:
            LeaseConfigError: a bad resource name or limit.
            LeaseStoreError: the store failed; a wake may have been marked and not returned
                (the next pass sends it again once its grace is over).
        """
        ...

    def sweep_expired(self, *, limit: int = 1000) -> int:
        """Delete identity, ledger and checkpoint records whose retention has passed.

        At most ``limit`` records per call, oldest first, found through the records' expiry
        indexes: the cost follows what is removed, never what is kept. Lease records and the
        fence sequence are never swept. Call it again while it returns ``limit`` (a sweeper task
        or a cron job can); records past retention are already invisible to every other
        operation, so sweeping late only costs space.

        Returns:
            How many records were removed (on Redis an identity and its checkpoints count as
            one record).

        Raises:
            LeaseConfigError: ``limit`` is not an integer 1..100000.
            LeaseStoreError: the store failed; some records may have been removed.
        """
        ...

    def check_health(self) -> builtins.list[str]:
        """Check the store's configuration; return warnings (empty when all is well).

        Raises:
            LeaseStoreError: the store is unreachable, or refuses to run by its settings.
            LeaseConfigError: what the store runs on is not what this version needs (SQL:
                tables missing, or made by an earlier version without its columns); the
                message names what is missing and the fix.
        """
        ...

    def reset_after_fork(self) -> None:
        """Drop connections inherited from a parent process (called in each forked child)."""
        ...

    def warm_up(self) -> None:
        """Open the renewer's connection now, ahead of its first renewal.

        The renewer calls it on one of its lanes while a process's first claim on this store
        is in flight, so the first renewal does not pay for a connection handshake on a slow
        network. A store with nothing to open does nothing (:class:`BaseLeaseStore`'s default);
        an error here is only logged (the first renewal retries and reports it).
        """
        ...

    def close(self) -> None:
        """Close what the store created (never a client or engine passed in by the user)."""
        ...


@runtime_checkable
class FenceGateStore(Protocol):
    """A store that can keep a :class:`~celery_lease.FenceGate`: the highest fence admitted per key.

    This is all ``FenceGate`` needs to admit, and all it checks when it is made (a store that
    is not one is refused then): ``url`` and ``gate_admit``. ``FenceGate.highest`` also needs
    :class:`ReadableFenceGateStore`; ``close`` is never called on a store passed in (only on
    one the gate built from a URL). Every store shipped here is both (Redis: one script on the
    gates hash of the key's shard; SQL: one statement on the ``fence_gate`` table and the
    leases table; memory).

    A store that is also a lease store knows every fence it granted: for a key that is one of
    its resources, its gate refuses the fences older than the newest granted as well (below).
    A gate store of its own (another service's database) knows only what it admitted.
    """

    #: The store's URL with any password masked; safe to log.
    url: str

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Atomically admit ``fence`` for ``key`` if it is >= every fence admitted before.

        In a store that is also a lease store, the fence must also be >= the newest fence the
        store granted for ``key`` as a resource (claims, and force-releases, which bump it),
        checked in the same atomic step as the admit: from the moment a newer claim returned,
        every older fence is refused, whether or not its holder has written yet. A key that
        names no resource of the store is checked against admitted fences only.

        Returns:
            ``(True, fence)`` when admitted (recorded as the highest), else ``(False, highest)``
            with the higher fence admitted or granted before; nothing changes then.

        Raises:
            LeaseConfigError: ``key`` is not a valid name.
            LeaseStoreError: the store failed; treat the write as not admitted.
        """
        ...


@runtime_checkable
class ReadableFenceGateStore(FenceGateStore, Protocol):
    """A fence-gate store that can also say the highest fence it admitted for a key."""

    def gate_highest(self, key: str) -> int | None:
        """The highest fence admitted for ``key`` so far, or None (granted fences not counted:
        a lease store's :meth:`~LeaseStore.get` shows the holder's)."""
        ...


@runtime_checkable
class MarkOnceStore(Protocol):
    """A store that can hand one caller a short-lived mark per key (every store shipped here).

    A task id's give-up ("gave up after N busy waits") is taken with it, so that two copies of
    one task refused at their last wait together do not both store FAILURE and run the
    errbacks (see ``_copies.give_up_once``); a store that is not one: each copy gives up.
    """

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Atomically record ``key`` for ``ttl`` seconds unless a live record of another
        ``token`` has it.

        Returns:
            True when the caller (``token``) holds the mark now, also when it held it already
            (a call repeated after a lost reply); False while another token's record lives.

        Raises:
            LeaseConfigError: ``key`` is not a valid name.
            LeaseStoreError: the store failed; whether the mark was taken is unknown.
        """
        ...


def lease_info(
    resource: str, owner_label: str, fence: int, acquired_us: int, expires_us: int, now_us: int
) -> LeaseInfo:
    """A lease record (times in microseconds of the store clock) as a :class:`LeaseInfo`."""
    return LeaseInfo(
        resource=resource,
        owner_label=owner_label,
        fence=int(fence),
        acquired_at=from_micros(acquired_us),
        expires_at=from_micros(expires_us),
        expires_in=(expires_us - now_us) / 1e6,
    )


def previous_owner(
    label: str | None, fence: int | None, identity_label: str | None, identity_fence: int | None
) -> tuple[str | None, int | None]:
    """Whom a claim took over from: the lease record's previous holder; failing that, the owner
    the identity record names (an earlier attempt of this identity that never finished)."""
    if fence is None and identity_fence is not None:
        return identity_label, identity_fence
    return label, fence


def log_force_release(info: LeaseInfo, log: logging.Logger) -> LeaseInfo:
    """The one log line of an administrator's force-release, on the backend's own ``log``
    (``celery_lease.stores.redis`` / ``.sql``, where it always was; the memory store, made for
    tests, logs nothing)."""
    log.warning(
        "force-released lease on %r held by %r with fence %d",
        info.resource,
        info.owner_label,
        info.fence,
    )
    return info


def changed_hands(resource: str, fence: int, info: LeaseInfo) -> LeaseBusyError:
    """The refusal of ``force_release(resource, fence=fence)``: the lease has another fence
    now (``info``), which was not the one to evict."""
    state = "expired, not released" if info.expired else f"expires in {info.expires_in:.1f}s"
    return LeaseBusyError(
        f"resource {resource!r} changed hands: it is held by {info.owner_label!r} with fence "
        f"{info.fence} ({state}), not fence {fence} that was to be evicted; nothing was "
        "evicted (look again, e.g. celery lease show)",
        resource,
        info.owner_label,
        info.fence,
        info.expires_in,
    )


def lost(
    lease: Lease, reason: str, label: str | None, fence: int | None, expired: bool = False
) -> LeaseLostError:
    """Mark ``lease`` lost for ``reason`` (the holder's label and fence, if taken over;
    ``expired``: that holder's lease has run out since)."""
    return lease.mark_lost(
        LeaseLostError.lost(lease.resource, lease.fence, reason, label, fence, expired)
    )


def _positive_int(value: object, name: str) -> int:
    """``value`` when it is an int >= 1 (not a bool: the stores send it as it is, and the Redis
    store keeps it packed with its script's keys, where ``True == 1`` would reuse a head)."""
    if type(value) is not int or value < 1:
        raise LeaseConfigError(f"{name} must be an int >= 1, got {show_value(value)}")
    return value


class BaseLeaseStore:
    """Argument checks and bookkeeping shared by the stores (not part of the protocol)."""

    url: str
    max_ttl: float

    def __init__(
        self, *, max_ttl: float = DEFAULT_MAX_TTL, retention: float = DEFAULT_RETENTION
    ) -> None:
        self.max_ttl = validate_ttl(max_ttl, 365 * 86400.0, name="max_ttl")
        #: Seconds identity, ledger and checkpoint records are kept after their last write.
        self.retention = validate_ttl(retention, 3650 * 86400.0, name="retention")
        self.wait_cap = DEFAULT_WAIT_CAP
        self.wait_bytes_cap = DEFAULT_WAIT_BYTES_CAP
        #: Seconds the free resource is held for a woken head waiter (see invariant 13).
        self.handoff_grace = DEFAULT_HANDOFF_GRACE
        #: Seconds a claim's ``since=`` may lie ahead of the store's clock and still place it as
        #: it is (a publisher's clock a little fast); a later one counts as this far ahead.
        self.since_skew = SINCE_SKEW

    @property
    def wait_cap(self) -> int:
        """Most waiters a resource's wait list holds (an int >= 1)."""
        return self._wait_cap

    @wait_cap.setter
    def wait_cap(self, value: int) -> None:
        self._wait_cap = _positive_int(value, "wait_cap")

    @property
    def wait_bytes_cap(self) -> int:
        """Most bytes (UTF-8) of wake payloads a resource's wait list holds (an int >= 1)."""
        return self._wait_bytes_cap

    @wait_bytes_cap.setter
    def wait_bytes_cap(self, value: int) -> None:
        self._wait_bytes_cap = _positive_int(value, "wait_bytes_cap")

    #: Whether ``acquire(..., early_wake=True)`` sets ``Lease.next_wake`` (invariant 15).
    supports_early_wake = False

    # The checks run before any I/O so bad input never reaches a store.
    def _claim_checks(
        self,
        resource: str,
        owner: Owner,
        ttl: float,
        identity: str | None,
        waiter: str | None,
        since: int | None,
        wait: str | None,
        wait_ttl: float,
        attempt: int | None,
    ) -> tuple[float, str | None, str | None, str, int | None]:
        """Every check of a claim's arguments, in the order ``acquire`` makes them
        (``_claim_args``, ``_identity_args``, ``_waiter_args``, ``_wait_args``,
        ``_attempt_args``): returns ``(ttl, identity, place name, wait payload, attempt)``.

        The arguments a lease task sends (plain types, valid names, no waiter name or
        ``since``) pass in one expression here, the same rules as those checks apply (a
        claim's eleven Python calls of them cost it about 10k instructions); anything else goes
        through each check, which also says what is wrong.
        """
        if (
            type(resource) is str
            and _RESOURCE_RE.fullmatch(resource) is not None
            and type(owner) is Owner
            and (type(ttl) is float or type(ttl) is int)
            and 0 < ttl <= self.max_ttl
            and ttl < _INF
            and (
                identity is None
                or (type(identity) is str and _RESOURCE_RE.fullmatch(identity) is not None)
            )
            and waiter is None
            and since is None
            and (
                wait is None
                or (
                    identity is not None
                    and type(wait) is str
                    and wait != ""
                    and "\x00" not in wait
                    and wait.isascii()
                    and type(wait_ttl) is float
                    and 0.0 < wait_ttl <= _MAX_WAIT_TTL
                )
            )
            and (attempt is None or (type(attempt) is int and attempt >= 0))
        ):
            return float(ttl), identity, identity, "" if wait is None else wait, attempt
        ttl = self._claim_args(resource, owner, ttl)
        identity = self._identity_args(identity)
        name = self._waiter_args(identity, waiter, since)  # (its place's name)
        payload = self._wait_args(name, wait, wait_ttl)
        return ttl, identity, name, payload, self._attempt_args(attempt)

    def _release_checks(self, lease: Lease, outcome: str | None) -> None:
        """``_renew_ttl(lease, None)`` then ``_outcome_args(lease, outcome)``: a release's
        checks, the common case (a Lease of a claim, an outcome of attempt 0) in one
        expression, anything else through each check."""
        if type(lease) is Lease:
            ttl = lease.ttl
            if (
                type(ttl) is float
                and 0.0 < ttl <= self.max_ttl
                and ttl < _INF
                and type(lease.resource) is str
                and (
                    outcome is None
                    or (
                        type(outcome) is str
                        and outcome in IDENTITY_OUTCOMES
                        and lease.identity is not None
                    )
                )
            ):
                return
        self._renew_ttl(lease, None)
        self._outcome_args(lease, outcome)

    def _claim_args(self, resource: str, owner: Owner, ttl: float) -> float:
        validate_resource(resource)
        if not isinstance(owner, Owner):
            raise LeaseConfigError(
                f"owner must be an Owner (use Owner.new(label)), got {show_value(owner)}"
            )
        return validate_ttl(ttl, self._ttl_bound(resource))

    def _renew_ttl(self, lease: Lease, ttl: float | None) -> float:
        if not isinstance(lease, Lease):
            raise LeaseConfigError(f"expected a Lease from acquire(), got {show_value(lease)}")
        return validate_ttl(lease.ttl if ttl is None else ttl, self._ttl_bound(lease.resource))

    def _ttl_bound(self, resource: str) -> float:
        """The longest ttl of a claim on ``resource``: ``max_ttl``, or for a publish lock
        (under ``LOCK_PREFIX``) ``LOCK_MAX_TTL``, whichever is longer."""
        if resource.startswith(LOCK_PREFIX):
            return max(self.max_ttl, LOCK_MAX_TTL)
        return self.max_ttl

    @property
    def _retention_us(self) -> int:
        """``retention`` in microseconds, as the stores' records count it."""
        return round(self.retention * 1e6)

    @property
    def _since_skew_us(self) -> int:
        """``since_skew`` in microseconds: a place's ``since`` is at most now plus this."""
        return max(0, round(self.since_skew * 1e6))

    @staticmethod
    def _identity_args(identity: str | None) -> str | None:
        if identity is None:
            return None
        try:
            return validate_resource(identity)
        except LeaseConfigError:
            raise LeaseConfigError(
                f"invalid task identity {show_value(identity)}: it follows the resource-name "
                f"rule ({IDENTITY_RULE})"
            ) from None

    @staticmethod
    def _waiter_args(identity: str | None, waiter: str | None, since: int | None) -> str | None:
        """The name of the claim's place (its identity, else ``waiter``), ``since`` checked."""
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
            raise LeaseConfigError(
                f"since must be microseconds since the epoch (an int), got {show_value(since)}"
            )
        if waiter is None:
            return identity
        try:
            validate_resource(waiter)
        except LeaseConfigError:
            raise LeaseConfigError(
                f"invalid waiter name {show_value(waiter)}: it follows the resource-name "
                f"rule ({IDENTITY_RULE})"
            ) from None
        return identity if identity is not None else waiter

    @staticmethod
    def _wait_args(identity: str | None, wait: str | None, wait_ttl: float) -> str:
        """``identity``: the place's name (the claim's identity or waiter name)."""
        if wait is None:
            return ""
        if identity is None:
            raise LeaseConfigError(
                "acquire(wait=...) needs identity= or waiter= (the name of the waiter's place)"
            )
        if not isinstance(wait, str) or not wait:
            raise LeaseConfigError(f"wait must be a non-empty string, got {show_value(wait)}")
        # Every store refuses the same payloads: PostgreSQL's JSON cannot hold U+0000, and
        # no store can encode a lone surrogate (the UTF-8 the stores count and keep).
        if "\x00" in wait:
            raise LeaseConfigError(
                f"wait payload has a NUL character (U+0000) at position {wait.index(chr(0))}, "
                "which not every store can keep; escape it (a task's wake message is JSON, "
                "which writes it as \\u0000)"
            )
        if not wait.isascii():
            try:
                wait.encode()
            except UnicodeEncodeError as exc:
                raise LeaseConfigError(
                    f"wait payload has a lone surrogate ({wait[exc.start]!a}) at position "
                    f"{exc.start}, which UTF-8 cannot encode (the stores keep payloads as "
                    "UTF-8); pass valid Unicode text"
                ) from None
        validate_ttl(wait_ttl, _MAX_WAIT_TTL, name="wait_ttl")
        return wait

    @staticmethod
    def _attempt_args(attempt: int | None) -> int | None:
        if attempt is None:
            return None
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise LeaseConfigError(
                f"attempt must be a non-negative int or None, got {show_value(attempt)}"
            )
        return attempt

    @staticmethod
    def _outcome_args(lease: Lease, outcome: str | None) -> None:
        if outcome is None:
            return
        name, attempt = split_identity_state(outcome)
        # (with the attempt of a retried task: "retry:2", see split_identity_state)
        if name not in IDENTITY_OUTCOMES or outcome != identity_outcome(name, attempt):
            raise LeaseConfigError(
                f"release outcome {show_value(outcome)} must be one of {IDENTITY_OUTCOMES}"
            )
        if lease.identity is None:
            raise LeaseConfigError("release(outcome=...) needs a lease claimed with identity=")

    @staticmethod
    def _ledger_args(lease: Lease, key: str) -> tuple[str, str]:
        if lease.identity is None:
            raise LeaseConfigError("the ledger needs a lease claimed with identity=")
        return lease.identity, validate_resource(key)

    @staticmethod
    def _records_args(resource: str, identity: str, limit: int) -> tuple[str, str, int]:
        validate_resource(resource)
        ident = BaseLeaseStore._identity_args(identity) or ""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise LeaseConfigError(f"limit must be an integer 1..1000, got {show_value(limit)}")
        return resource, ident, limit

    @staticmethod
    def _list_args(prefix: str, limit: int) -> int:
        if not isinstance(prefix, str) or (prefix and not _prefix_ok(prefix)):
            raise LeaseConfigError(
                f"list prefix {show_value(prefix)} must be empty or the start of a valid "
                "resource name"
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LIST_LIMIT:
            raise LeaseConfigError(f"list limit must be 1..{MAX_LIST_LIMIT}, got {limit!r}")
        return limit

    @staticmethod
    def _wake_due_args(
        resources: Sequence[str] | None, limit: int
    ) -> tuple[builtins.list[str] | None, int]:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LIST_LIMIT:
            raise LeaseConfigError(f"wake_due limit must be 1..{MAX_LIST_LIMIT}, got {limit!r}")
        if resources is None:
            return None, limit
        if isinstance(resources, str):
            raise LeaseConfigError(
                f"wake_due resources= takes a list of names, got the string {show_value(resources)}"
            )
        return [validate_resource(r) for r in dict.fromkeys(resources)], limit

    @staticmethod
    def _fence_arg(fence: int | None) -> int | None:
        if fence is None:
            return None
        if isinstance(fence, bool) or not isinstance(fence, int) or not 0 <= fence <= MAX_FENCE:
            raise LeaseConfigError(
                f"fence must be an int from 0 to {MAX_FENCE} (the fence shown for the lease), "
                f"got {show_value(fence)}"
            )
        return fence

    @staticmethod
    def _sweep_args(limit: int) -> int:
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 0 < limit <= MAX_SWEEP_LIMIT
        ):
            raise LeaseConfigError(f"sweep limit must be 1..{MAX_SWEEP_LIMIT}, got {limit!r}")
        return limit

    _lost = staticmethod(lost)

    def renew(self, lease: Lease, ttl: float | None = None) -> Lease:
        result = self.renew_many([lease], ttl)[0]
        if result is not None:
            raise result
        return lease

    def reset_after_fork(self) -> None:
        """Most drivers notice a fork themselves; stores that do not override this."""

    def warm_up(self) -> None:
        """Nothing to open ahead of the first renewal (see :meth:`LeaseStore.warm_up`)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    def __enter__(self) -> BaseLeaseStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def renew_many(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        """See :meth:`LeaseStore.renew_many`: ``_renew_batch`` per ``RENEW_BATCH`` leases."""
        if len(leases) <= RENEW_BATCH:
            return self._renew_batch(leases, ttl)
        for lease in leases:  # every argument checked before any batch is sent
            self._renew_ttl(lease, ttl)
        results: list[LeaseLostError | None] = []
        for start in range(0, len(leases), RENEW_BATCH):
            results += self._renew_batch(leases[start : start + RENEW_BATCH], ttl)
        return results

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None
    ) -> list[LeaseLostError | None]:  # pragma: no cover - overridden
        """Renew at most ``RENEW_BATCH`` leases in one round trip."""
        raise NotImplementedError


def encode_cursor(expires_us: int, resource: str) -> str:
    """Make the opaque ``list()`` cursor that resumes after (expiry, resource)."""
    return f"{int(expires_us)}|{resource}"


def decode_cursor(cursor: str | None) -> tuple[int, str] | None:
    """Parse a cursor made by :func:`encode_cursor`; None means start at the beginning."""
    if cursor is None:
        return None
    try:
        micros, resource = cursor.split("|", 1)
        return int(micros), validate_resource(resource)
    except (AttributeError, ValueError, LeaseConfigError):
        raise LeaseConfigError(
            f"list cursor {show_value(cursor)} is not one returned by list(); pass None to "
            "start from the beginning"
        ) from None


def _prefix_ok(prefix: str) -> bool:
    try:
        validate_resource(prefix)
    except LeaseConfigError:
        return False
    return True


def monotonic() -> float:
    """The clock whose readings mark when a claim or renewal was sent."""
    return _clock.monotonic()
