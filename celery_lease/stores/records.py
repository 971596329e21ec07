"""What the stores hand back: identity, ledger and wait-list records, due wakes, list pages and
their cursors, and the leases a claim took over, a renewal lost or an eviction missed.

Made the same way by every store (the policy they share); importable from
``celery_lease.stores.base`` too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from .._codec import from_micros
from .._errors import LeaseBusyError, LeaseConfigError, LeaseLostError
from .._lease import Lease, LeaseInfo, split_identity_state
from .._names import show_value, validate_resource

__all__ = [
    "DueWake",
    "EffectRecord",
    "IdentityInfo",
    "IdentityRecords",
    "LeasePage",
    "Waiter",
    "changed_hands",
    "decode_cursor",
    "encode_cursor",
    "lease_info",
    "log_force_release",
    "lost",
    "previous_owner",
]


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
