"""What the SQL store's statements answer, and what those rows mean.

Shared by the store and the ledger functions: a lease row read back as a :class:`LeaseInfo`, the
reason a lease was lost from its row's state, and the recovery facts a claim keeps in its
identity row so that the same claim retried reports them again.
"""

from __future__ import annotations

from typing import Any

from ..._errors import LeaseLostError
from ..._lease import Lease
from ..base import lease_info, lost

__all__ = ["NO_ROW", "ClaimRow", "lease_info", "recovered_from", "recovery_facts", "why_lost"]

#: A missing lease row, shaped like the ``state`` statement's answer
#: (owner_token, owner_label, fence, expires_us, now_us, prev_fence).
NO_ROW = (None, None, None, None, None, None)

#: Normalised answer of a claim (with or without identity):
#: (claimed, marked, fence, acquired, expires, prev_label, prev_fence,
#:  holder_token, holder_label, holder_fence, holder_acquired, holder_expires,
#:  ident_state, ident_fence, ident_label, ident_result, checkpoints, now,
#:  holder_prev_label, holder_prev_fence)
ClaimRow = tuple[Any, ...]


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
        return lost(lease, "taken_over", label, fence)
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
