"""The store protocols and the invariants every store keeps (the whole store contract).

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

The values these methods hand back are in :mod:`.records`; :class:`~.base.BaseLeaseStore`
holds what the stores share. Everything here is importable from ``celery_lease.stores.base``
too.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .._errors import LeaseLostError
from .._lease import Lease, LeaseInfo, Owner
from .records import DueWake, IdentityInfo, IdentityRecords, LeasePage, Waiter

__all__ = [
    "DEFAULT_WAKE_DUE_LIMIT",
    "RECENT_EFFECTS",
    "FenceGateStore",
    "LeaseStore",
    "MarkOnceStore",
    "ReadableFenceGateStore",
]

#: Default number of effects ``identity_records`` returns.
RECENT_EFFECTS = 20
#: Default number of resources one ``wake_due`` call passes the turn on at (per Redis shard;
#: held ones do not count).
DEFAULT_WAKE_DUE_LIMIT = 1000


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
