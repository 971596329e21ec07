"""The lease store contract in one place, and BaseLeaseStore: what every store shares.

The contract is split by job, each part importable from here as it always was:
:mod:`.protocol` (the ``LeaseStore`` protocol and the invariants every store keeps, asserted by
``tests/stores`` against each of them), :mod:`.records` (the values the stores hand back) and
:mod:`._checks` (the argument checks made before any I/O). This module keeps the store
defaults a store reads when it is made (``DEFAULT_WAIT_CAP``, ``DEFAULT_HANDOFF_GRACE``,
``SINCE_SKEW``: set them here to change what every store made afterwards starts with) and
:class:`BaseLeaseStore`, the bookkeeping the stores share.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

from .. import _clock
from .._errors import LeaseLostError
from .._lease import Lease
from .._names import validate_ttl
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
from ._checks import (
    IDENTITY_OUTCOMES,
    LOCK_MAX_TTL,
    LOCK_PREFIX,
    MAX_LIST_LIMIT,
    MAX_SWEEP_LIMIT,
    StoreChecks,
    _positive_int,
)
from .protocol import (
    DEFAULT_WAKE_DUE_LIMIT,
    RECENT_EFFECTS,
    FenceGateStore,
    LeaseStore,
    MarkOnceStore,
    ReadableFenceGateStore,
)
from .records import (
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
    log_force_release,
    lost,
    previous_owner,
)

__all__ = [
    "DEFAULT_MAX_TTL",
    "DEFAULT_RETENTION",
    "DEFAULT_WAKE_DUE_LIMIT",
    "IDENTITY_OUTCOMES",
    "LOCK_MAX_TTL",
    "LOCK_PREFIX",
    "MAX_LIST_LIMIT",
    "MAX_SWEEP_LIMIT",
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
    "FenceGateStore",
    "IdentityInfo",
    "IdentityRecords",
    "LeasePage",
    "LeaseStore",
    "MarkOnceStore",
    "ReadableFenceGateStore",
    "Waiter",
    "changed_hands",
    "connection_refused",
    "decode_cursor",
    "encode_cursor",
    "lease_info",
    "log_force_release",
    "lost",
    "previous_owner",
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


#: Default seconds the free resource is held for a woken waiter (then it is held for the
#: waiter behind it; the late one keeps its place).
DEFAULT_HANDOFF_GRACE = 2.0


#: The identity of the records ``mark_once`` writes (the store's identity records of their own,
#: under the mark's key as resource; swept once expired with the others).
MARK_IDENTITY = "celery_lease:mark"


class BaseLeaseStore(StoreChecks):
    """Bookkeeping shared by the stores, and (from :class:`~._checks.StoreChecks`) their
    argument checks (not part of the protocol)."""

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

    @property
    def _retention_us(self) -> int:
        """``retention`` in microseconds, as the stores' records count it."""
        return round(self.retention * 1e6)

    @property
    def _since_skew_us(self) -> int:
        """``since_skew`` in microseconds: a place's ``since`` is at most now plus this."""
        return max(0, round(self.since_skew * 1e6))

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


def monotonic() -> float:
    """The clock whose readings mark when a claim or renewal was sent."""
    return _clock.monotonic()
