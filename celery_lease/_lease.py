"""The lease value and handle: who owns a resource, with which fence, until when.

A :class:`Lease` is what a store's ``acquire`` returns and what a task sees through
``current_lease()``. Its fence is the number side effects compare; its ``check()`` is local and
cheap (the owner's own monotonic self-fence deadline), its ``guard()`` costs one store round trip
and proves the lease is still live right before an irreversible effect.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from . import _clock
from ._codec import from_micros
from ._errors import LeaseConfigError, LeaseLostError
from ._interrupt import raise_if_interrupted
from ._names import clean_label, show_value

# The owner stops acting once ttl * (1 - DEFAULT_MARGIN_FRACTION) has passed since the last
# successful claim or renewal was sent, unless a margin is set explicitly.
from ._settings import DEFAULT_MARGIN_FRACTION

if TYPE_CHECKING:
    from ._ledger import Effect
    from .stores.base import LeaseStore

__all__ = [
    "CURRENT_LEASE",
    "DEFAULT_MARGIN_FRACTION",
    "Lease",
    "LeaseInfo",
    "Owner",
    "from_micros",
]

_HEX = frozenset("0123456789abcdef")


def split_identity_state(state: str | None) -> tuple[str | None, int]:
    """An identity record's state and the attempt it names (``"retry:2"`` -> ``("retry", 2)``).

    A task records its outcome with the attempt (``request.retries``) from which copies are
    current: ``"retry:N"`` after a user retry of attempt N-1. A copy of an earlier attempt (a
    back-stop re-queued before the retry) is superseded and must not run the body. Attempt 0
    is not written, so the common states stay ``done``, ``running``, ``retry``, ``failed``.
    """
    if state is None or ":" not in state:
        return state, 0
    name, _, attempt = state.partition(":")
    try:
        return name, max(int(attempt), 0)
    except ValueError:
        return state, 0


def identity_outcome(outcome: str, attempt: int) -> str:
    """The outcome a release records for copies of ``attempt`` on (see split_identity_state)."""
    attempt = min(attempt, 99_999_999)  # (the SQL state column holds 16 characters)
    return f"{outcome}:{attempt}" if attempt > 0 and outcome != "done" else outcome


@dataclass(frozen=True, slots=True)
class Owner:
    """Who claims a lease: a secret random token plus a human label.

    The token (128 random bits, hex) decides ownership; the label (host, pid, task id) is for
    people and is what messages, logs and events show. The token never appears in full there.
    """

    token: str
    label: str

    def __post_init__(self) -> None:
        if not (32 <= len(self.token) <= 64 and set(self.token) <= _HEX):
            raise LeaseConfigError(
                f"owner token {show_value(self.token[:8] + '...')} is not 32..64 lowercase hex "
                "characters; use Owner.new() to make one"
            )
        object.__setattr__(self, "label", clean_label(self.label))

    @classmethod
    def new(cls, label: str | None = None) -> Owner:
        """Make an owner with a new random 128-bit token; the label defaults to ``host:pid``.

        The token goes through the same check as one you pass to ``Owner(token, label)``.
        :meth:`fresh` makes the same kind of owner for a label you already have, skipping that
        check (the task's claim path uses it, once per claim).
        """
        if label is None:
            label = f"{socket.gethostname()}:{os.getpid()}"
        return cls(secrets.token_hex(16), label)

    @classmethod
    def fresh(cls, label: str) -> Owner:
        """Make an owner with a new random token for ``label`` (required), without validating.

        The same owner as ``Owner.new(label)``, made without ``__post_init__``'s token check:
        the token is made right here, so the check could only pass. For hot paths that make an
        owner per claim; use :meth:`new` when you want the default ``host:pid`` label.
        """
        owner = object.__new__(cls)
        # (os.urandom is what secrets.token_hex reads too, without two calls around it)
        object.__setattr__(owner, "token", os.urandom(16).hex())
        object.__setattr__(owner, "label", clean_label(label))
        return owner

    @property
    def short(self) -> str:
        """The first 6 token characters: enough to tell owners apart in a debug log."""
        return self.token[:6]

    def __repr__(self) -> str:
        return f"Owner(label={self.label!r}, token={self.short}...)"


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """What a store knows about a resource's lease, as read by ``get`` and ``list``.

    Times come from the store clock. ``expires_in`` is negative for an expired lease that was
    never released. The owner token is not part of it.
    """

    resource: str
    owner_label: str
    fence: int
    acquired_at: datetime
    expires_at: datetime
    expires_in: float

    @property
    def expired(self) -> bool:
        return self.expires_in <= 0


class Lease:
    """A claimed lease and the owner's handle on it.

    Attributes:
        resource: the leased resource name.
        owner: the :class:`Owner` that holds it (``owner_label`` is its printable label).
        fence: the fencing token, strictly greater than any fence issued for this resource
            before; pass it to every fenced side effect.
        acquired_at: when the claim happened, store clock, aware UTC.
        expires_at: when the lease expires unless renewed, store clock, aware UTC; updated on
            every successful renewal.
        ttl: the time to live of the last claim or renewal, seconds.
        margin: seconds before ``ttl`` runs out at which the owner stops acting on its own
            (self-fence); defaults to a quarter of the current ``ttl``.
        previous_owner_label, previous_fence: set when this claim took over an expired lease
            that its owner never released.

    A store may pass ``acquired_at`` and ``expires_at`` as store-clock microseconds since the
    epoch (an ``int``): they become datetimes when first read (most leased tasks never read
    them, and making two datetimes cost a claim about 2 % of its client CPU).
    """

    def __init__(
        self,
        *,
        resource: str,
        owner: Owner,
        fence: int,
        acquired_at: datetime | int,
        expires_at: datetime | int,
        ttl: float,
        sent_monotonic: float,
        store: LeaseStore | None = None,
        previous_owner_label: str | None = None,
        previous_fence: int | None = None,
        margin: float | None = None,
        identity: str | None = None,
        identity_state: str | None = None,
        checkpoints: dict[str, Any] | None = None,
        identity_owner_label: str | None = None,
        identity_fence: int | None = None,
    ) -> None:
        self.resource = resource
        self.owner = owner
        self.fence = fence
        self._acquired_at = acquired_at
        self._expires_at = expires_at
        self.ttl = ttl
        self._margin = margin
        self.previous_owner_label = previous_owner_label
        self.previous_fence = previous_fence
        self.store = store
        #: The task identity this lease runs (dedup and ledger key), or None.
        self.identity = identity
        #: The identity's state found by the claim: None (first run), "running" (an owner
        #: vanished), "retry" or "failed" (an earlier attempt ended without completing).
        #: ``identity_attempt``: the attempt (``request.retries``) that record names as current:
        #: a copy of an earlier attempt is superseded (0: none recorded).
        self.identity_state, self.identity_attempt = split_identity_state(identity_state)
        #: The label of the owner the identity's record names (the last attempt's: its task id
        #: tells a copy of a failed execution from another message sharing the identity), when
        #: the claim found a record (None also when the store does not say).
        self.identity_owner_label = identity_owner_label
        #: The fence of the claim that record names (None with ``identity_owner_label``): a
        #: run newer than a waiting execution's start is a run of one of its copies.
        self.identity_fence = identity_fence
        #: Progress recorded by earlier owners of this identity (step -> data), oldest first.
        self.checkpoints: dict[str, Any] = dict(checkpoints or {})
        # Monotonic time at which the last successful claim/renewal was *sent*: the lease was
        # certainly live from then on for ttl seconds of store time, so we may act until
        # sent + ttl - margin on our own clock whatever the reply latency was.
        self._sent_monotonic = sent_monotonic
        self._lost: LeaseLostError | None = None
        self._lock = threading.Lock()
        #: Free-form per-lease state for the layers above the store (task, identity, ...).
        self.extra: dict[str, Any] = {}
        #: The task's ``reconcile_effect(key, lease)``, set by the task that claimed the lease:
        #: the ledger asks it about an effect an earlier owner began but never recorded done.
        self.reconcile_effect: Callable[[str, Lease], Any] | None = None
        #: Set by ``release``: the wake payload of the waiter the resource was handed over to
        #: (the releaser sends it), or None when nobody was waiting.
        self.handoff: str | None = None
        #: Set by a claim that asked for it (``early_wake=True``, stores that can): the wake
        #: payload of the waiter a release would wake as the claim left the list (its first
        #: waiter never woken), so the releaser can send it before releasing; None when nobody
        #: waited then. A guess: the release's own answer (``handoff``) decides.
        self.next_wake: str | None = None
        #: Set by a claim that asked for it (``own_wake=True``, stores that can): the wake
        #: payload the claimant's own place in the wait list held when the claim took it off,
        #: or None when it had no place. A copy woken early carries the waits count its
        #: waker's claim saw; this one counts every re-arm since.
        self.own_wake: str | None = None

    # -- times (store clock) ------------------------------------------------------------------
    # (The first read converts under the lock: a renewal recorded by the renewer thread
    # meanwhile must not be overwritten with the older expiry.)
    def _time(self, name: str) -> datetime:
        value = getattr(self, name)
        if isinstance(value, datetime):
            return value
        with self._lock:
            value = getattr(self, name)
            if not isinstance(value, datetime):
                value = from_micros(value)
                setattr(self, name, value)
            return value

    @property
    def acquired_at(self) -> datetime:
        return self._time("_acquired_at")

    @acquired_at.setter
    def acquired_at(self, value: datetime | int) -> None:
        with self._lock:
            self._acquired_at = value

    @property
    def expires_at(self) -> datetime:
        return self._time("_expires_at")

    @expires_at.setter
    def expires_at(self, value: datetime | int) -> None:
        with self._lock:
            self._expires_at = value

    # -- identity ---------------------------------------------------------------------------
    @property
    def owner_label(self) -> str:
        return self.owner.label

    @property
    def recovered(self) -> bool:
        """True when an earlier owner may have acted and did not finish: the claim took over an
        expired lease that was never released, or found this identity begun and not done.
        ``previous_owner_label`` and ``previous_fence`` name that owner."""
        return self.previous_fence is not None

    # -- exactly-once helpers (need an identity) ----------------------------------------------
    def effect(self, key: str) -> Effect:
        """A ledgered side effect: runs at most once per identity and key, across owners.

        ``receipt = lease.effect("charge:inv-42")(charge)`` (or use it as a decorator, or as a
        context manager checking ``effect.done``). See :class:`celery_lease.Effect`.

        Args:
            key: the effect's key, unique per identity; it follows the resource-name rule.

        Raises:
            LeaseConfigError: ``key`` is not a valid effect key, or the lease has no identity.
        """
        from ._ledger import Effect

        return Effect(self, key)

    def checkpoint(self, step: str, data: Any = None) -> None:
        """Record progress for this identity; a later owner reads it in ``checkpoints``.

        ``lease.checkpoint("page", {"page": 3})``: the step's name first, its data second.

        Args:
            step: the step's name (the key in ``checkpoints``); it follows the resource-name
                rule.
            data: what the step recorded; JSON-serialisable.

        Raises:
            LeaseConfigError: ``step`` is not a valid step name, or the lease has no identity.
            LeaseLostError: this owner no longer holds the lease (the write is fenced).
        """
        from ._ledger import write_checkpoint

        write_checkpoint(self, step, data)

    # -- self-fencing -----------------------------------------------------------------------
    @property
    def margin(self) -> float:
        """Seconds before ``ttl`` runs out at which the owner stops acting (self-fence)."""
        return self.ttl * DEFAULT_MARGIN_FRACTION if self._margin is None else self._margin

    @margin.setter
    def margin(self, value: float | None) -> None:
        self._margin = value

    @property
    def sent_monotonic(self) -> float:
        """Monotonic time at which the last successful claim or renewal was sent."""
        return self._sent_monotonic

    @property
    def deadline(self) -> float:
        """Monotonic time after which this owner must stop acting unless it renewed."""
        return self._sent_monotonic + self.ttl - self.margin

    def remaining(self) -> float:
        """Seconds left before the self-fence deadline (negative once it has passed)."""
        return self.deadline - _clock.monotonic()

    @property
    def lost(self) -> LeaseLostError | None:
        """The error recorded when the lease was found lost, else None."""
        return self._lost

    def mark_lost(self, error: LeaseLostError) -> LeaseLostError:
        """Record that the lease is lost; the first recorded cause wins. Returns it."""
        with self._lock:
            if self._lost is None:
                self._lost = error
            return self._lost

    def check(self) -> None:
        """Raise LeaseLostError if the lease is known lost or the self-fence deadline passed.

        Local and cheap: no store round trip. Call it often in long loops. In a task body
        that was already interrupted and went on (it swallowed the :class:`LeaseInterrupt`),
        it raises that interrupt again instead.
        """
        if self._lost is not None:
            raise_if_interrupted()  # a body that swallowed the interrupt gets it again
            raise self._lost
        if _clock.monotonic() >= self.deadline:
            raise_if_interrupted()
            raise self.mark_lost(LeaseLostError.lost(self.resource, self.fence, "self_fenced"))

    def guard(self) -> None:
        """Prove with one store round trip that this owner and fence still hold a live lease.

        Call it right before an irreversible effect. A side effect that checks the fence itself
        (a FenceGate, a fenced write) is still required for safety: a pause right after
        ``guard()`` returns can outlast the lease.

        Raises:
            LeaseLostError: the lease is lost (and is marked so).
            LeaseStoreError: the store could not answer; the lease state is unknown.
        """
        self.check()
        if self.store is None:
            raise LeaseConfigError("this lease has no store attached, so guard() cannot run")
        try:
            self.store.verify(self)
        except LeaseLostError as exc:
            raise self.mark_lost(exc) from None

    def renewed(self, sent_monotonic: float, expires_at: datetime | int, ttl: float) -> None:
        """Record a successful renewal (called by stores; ``expires_at`` may be store-clock
        microseconds)."""
        with self._lock:
            self._sent_monotonic = max(self._sent_monotonic, sent_monotonic)
            self._expires_at = expires_at
            self.ttl = ttl

    def __repr__(self) -> str:
        state = "lost" if self._lost is not None else "held"
        return (
            f"<Lease {self.resource!r} fence={self.fence} owner={self.owner.label!r} "
            f"expires_at={self.expires_at.isoformat()} {state}>"
        )


#: The lease of the lease task execution running in this context, None outside one. Set by
#: LeaseTask around the body; read by ``current_lease()`` and by the fencing helpers, which sit
#: below the task layer (so it lives here, not in _task).
CURRENT_LEASE: ContextVar[Lease | None] = ContextVar("celery_lease_current", default=None)
