"""What the SQL store's statements answer, and what those rows mean.

Shared by the store and the ledger functions: a lease row read back as a :class:`LeaseInfo`, the
reason a lease was lost from its row's state, and the recovery facts a claim keeps in its
identity row so that the same claim retried reports them again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..._errors import LeaseLostError
from ..._lease import Lease
from ..base import lost

__all__ = ["NO_ROW", "ClaimRow", "identity_fields", "recovered_from", "recovery_facts", "why_lost"]

#: A missing lease row, shaped like the ``state`` statement's answer
#: (owner_token, owner_label, fence, expires_us, now_us, prev_fence).
NO_ROW = (None, None, None, None, None, None)


class ClaimRow(NamedTuple):
    """What a claim answers, with or without identity (the PostgreSQL claim statements select
    these columns in this order; the SQLite path and the plain claim build one by name).

    Times are microseconds of the database clock.
    """

    #: 1 when this claim took the lease, else 0.
    claimed: int
    #: 1 when it also marked its identity running (0 with claimed: completed meanwhile).
    marked: int
    #: The new lease: fence, acquired, expires, and the owner it took over from.
    fence: Any = None
    acquired: Any = None
    expires: Any = None
    prev_label: Any = None
    prev_fence: Any = None
    #: When not claimed: the lease row as it stands (its holder may be this very owner, whose
    #: earlier attempt's reply was lost).
    holder_token: Any = None
    holder_label: Any = None
    holder_fence: Any = None
    holder_acquired: Any = None
    holder_expires: Any = None
    #: The identity record found (state, fence, owner label, result or recovery facts).
    ident_state: Any = None
    ident_fence: Any = None
    ident_label: Any = None
    ident_result: Any = None
    #: The identity's checkpoints (JSON text), when the claim recovers them.
    checkpoints: Any = None
    #: The database clock at the claim.
    now: Any = None
    #: When not claimed: the lease row's own previous owner (what its first attempt recovered).
    holder_prev_label: Any = None
    holder_prev_fence: Any = None
    #: When not claimed: the claim's place in the wait list (0: not queued), the payload of a
    #: head waiter it woke, and the head waiter (with until when the resource is held for it)
    #: when refused for a hand-off (see .waits).
    position: Any = 0
    wake: Any = None
    hold: Any = None
    hold_until: Any = None
    #: When claimed (PostgreSQL, when asked): the payload a release would wake now, and the
    #: payload of the claimant's own place as the claim took it off the list (invariant 15).
    next_wake: Any = None
    own_wake: Any = None
    #: When refused and listed: whether its place is a polling one (invariant 12).
    polling: Any = False


def identity_fields(ident: tuple[Any, ...]) -> dict[str, Any]:
    """An identity row (state, fence, owner_label, result) as ClaimRow fields."""
    state, fence, label, result = ident
    return {
        "ident_state": state,
        "ident_fence": fence,
        "ident_label": label,
        "ident_result": result,
    }


def why_lost(
    lease: Lease,
    token: Any,
    label: Any,
    fence: Any,
    expires: Any,
    now: Any,
    forced: Any = None,
) -> LeaseLostError:
    """The loss, from the lease row's state (``forced``: its prev_fence, see ``state``)."""
    if token is None:
        if forced is not None and forced == lease.fence:
            return lost(lease, "force_released", None, None)
        return lost(lease, "released", None, None)
    if token != lease.owner.token or fence != lease.fence:
        return lost(lease, "taken_over", label, fence, expires <= now)
    return lost(lease, "expired", None, None)


def recovery_facts(ident: tuple[Any, ...]) -> str | None:
    """What a claim recovers from the identity row it found (state, fence, owner_label, ...),
    kept in its running row's result so that the same claim retried can report it again."""
    state, fence, label = ident[:3]
    return None if state is None else f"{state}\n{fence}\n{label}"


def recovered_from(facts: str | None) -> tuple[str | None, int | None, str | None]:
    """(state, fence, label) of the earlier attempt, from :func:`recovery_facts`."""
    if not facts:
        return None, None, None
    state, fence, label = facts.split("\n", 2)
    return state, int(fence), label
