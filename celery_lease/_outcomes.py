"""An attempt that cannot go on: the store is down at the claim, the lease was lost (taken
over, renewal failed past the self-fence deadline, the runtime cap, a side effect that saw a
newer fence), or a gate refused the new fence. Each is sent again on a budget of its own
(``lease_store_down_max_wait``, ``lease_lost_max_retries``), then fails saying which.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NoReturn

from celery import states

from . import _clock, _copies, _execution
from . import _events as events
from . import _outage as outage
from ._errors import (
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
    LeaseStoreError,
    StaleFenceError,
)
from ._eventlog import lease_log
from ._gates import Refusal
from ._interrupt import Interrupter
from ._lease import Lease
from ._message import LOST_HEADER, STORE_DOWN_HEADER, STORE_WAITS_HEADER, WAITS_HEADER, read_header
from ._names import mask_url
from ._renewer import Hold
from ._wakes import EARLY_HEADER, WOKEN_HEADER

if TYPE_CHECKING:
    from ._setup import TaskSetup

log = logging.getLogger(__name__)

#: Lost-lease reasons that mean the lease ran out while the body was still running.
EXPIRY_REASONS = frozenset({"expired", "self_fenced", "renew_failed", "max_runtime"})


def store_down(
    task: Any,
    setup: TaskSetup,
    exc: LeaseStoreError,
    resource: str,
    listed: bool = False,
    gate: str | None = None,
) -> NoReturn:
    """The store failed at claim time: wait for it, on a budget of its own.

    Each attempt is sent again with the busy backoff until ``store_down_max_wait`` seconds
    have passed since this execution's first failed claim (a message header), then the task
    fails with a LeaseStoreError saying so. The outage is reported once per interval per
    process (``_outage``), not once per attempt.

    A copy of a waiter (it counts busy waits) may have a sibling copy that ran the task
    or gave up already: it reads the task's state in the result backend first and ends
    unrun on a final one (the backend is often up when the store is not), and is sent
    again without storing RETRY over another copy's state, as a back-stop copy (which
    reads that state before its claim), not as a woken one. So is a message whose claim
    was sent with a place to wake and got no answer (``listed``): it may have listed that
    place, and a copy of it may be woken and run while this one waits; it is sent again
    counting one wait, as the copy of a waiter it may be.

    With ``gate`` (its label) it is a fence gate of ``gates=`` that failed after the claim
    (given back by then): the outage is reported, and the give-up worded, for that gate.
    """
    request = task.request
    if request.is_eager or request.called_directly:
        raise exc
    busy_waits = int(read_header(request, WAITS_HEADER) or 0)
    copy_of_waiter = bool(busy_waits or listed) and not task.track_started
    if copy_of_waiter:
        state = _copies.task_state(task, request, woken=True)
        if state is not None and state in states.READY_STATES:
            _copies.drop_finished(task, request, resource, state)
    settings = setup.settings
    made = setup.store
    store = made.url if made is not None else mask_url(settings.store_url)
    budget = settings.store_down_max_wait
    if gate is None:
        outage.claim_failed(store, exc, budget)
    else:
        outage.claim_failed(gate, exc, budget, what="fence gate")
    now = _clock.wall()
    try:
        since = float(read_header(request, STORE_DOWN_HEADER) or now)
    except (TypeError, ValueError):  # not ours: start counting now
        since = now
    waited = max(0.0, now - since)
    if waited >= budget:
        raise LeaseStoreError(
            f"gave up claiming the lease after waiting {waited:.1f}s for "
            f"{'the lease store' if gate is None else f'its fence gate {gate}'}, "
            f"which {'refuses connections' if exc.refused else 'keeps failing'} "
            f"(lease_store_down_max_wait={budget:g}s; raise it to wait longer): {exc}",
            exc.refused,
        ) from exc
    waits = int(read_header(request, STORE_WAITS_HEADER) or 0)
    delay = min(setup.busy_delay(waits), since + budget - now)
    log.debug(
        "task %s[%s] could not claim its lease, retrying in %.2fs: %s",
        task.name,
        request.id,
        delay,
        exc,
    )
    updates: dict[str, Any] = {STORE_WAITS_HEADER: waits + 1, STORE_DOWN_HEADER: since}
    if copy_of_waiter:
        updates[WOKEN_HEADER] = updates[EARLY_HEADER] = None
        if not busy_waits:
            updates[WAITS_HEADER] = 1
        _execution.requeue(task, exc, delay, updates, store=False)
    _execution.requeue(task, exc, delay, updates)


def lease_lost(task: Any, setup: TaskSetup, lost: LeaseLostError, lease: Lease) -> NoReturn:
    """The lease is lost (``lost`` says why): run this execution again later, on its own
    budget (``lease_lost_max_retries``); eager and direct calls raise at once."""
    request = task.request
    reason = lost.reason or "unknown"
    events.count("celery_lease_leases_lost_total", reason=reason)
    if reason in EXPIRY_REASONS:
        events.count("celery_lease_expired_while_running_total")
    eager = bool(request.is_eager or request.called_directly)
    retries = int(read_header(request, LOST_HEADER) or 0)
    gave_up = not eager and retries >= setup.settings.lost_max_retries
    if not lease.extra.pop("lost_logged", False):  # said once, when it happened
        _execution.log_event(
            task,
            "lost",
            logging.WARNING,
            lease.resource,
            lease.fence,
            lost.holder_label,
            reason=reason,
            action="raise" if eager else ("fail" if gave_up else "rerun"),
        )
    if eager:
        raise lost
    if gave_up:
        raise LeaseLostError(
            f"{lost} (gave up after {retries} re-runs; raise lease_lost_max_retries)",
            *lost.args[1:],
        )
    _execution.requeue(task, lost, setup.settings.lost_retry_delay, {LOST_HEADER: retries + 1})


def lease_lost_in_flight(
    task: Any,
    interrupter: Interrupter,
    task_id: str | None,
    hostname: str | None,
    hold: Hold,
    error: LeaseLostError,
) -> None:
    """Renewer callback: the lease is gone while the body runs. Stop the body."""
    lease = hold.lease
    lease.extra["lost_logged"] = True
    lease_log(
        "lost",
        logging.WARNING,
        resource=lease.resource,
        fence=lease.fence,
        holder=error.holder_label,
        task_id=task_id,
        task=task.name,
        reason=error.reason,
        action="interrupt the body",
    )
    interrupter.interrupt()
    _execution.lease_event(
        task,
        "task-lease-lost",
        task_id=task_id,
        hostname=hostname,
        resource=lease.resource,
        fence=lease.fence,
        reason=error.reason,
        holder=error.holder_label,
    )


def stale_fence(task: Any, setup: TaskSetup, lease: Lease, refused: StaleFenceError) -> NoReturn:
    """A side effect refused this lease's fence (``refused``): a newer owner exists, so the
    lease is lost. Said with the newer fence and its holder where known."""
    newer_fence, holder = newer_holder(lease, refused)
    lost = lease.lost or lease.mark_lost(
        LeaseLostError.lost(
            lease.resource,
            lease.fence,
            "stale_fence",
            holder,
            newer_fence if holder is not None else None,
        )
    )
    _execution.log_event(
        task,
        "stale_fence",
        logging.WARNING,
        lease.resource,
        lease.fence,
        lease.owner.label,
        key=refused.key,
        rejected_fence=refused.fence if refused.fence != lease.fence else None,
        newer_fence=newer_fence,
        newer_holder=holder,
    )
    lease_lost(task, setup, lost, lease)


def gate_refused(task: Any, setup: TaskSetup, refusal: Refusal, lease: Lease) -> NoReturn:
    """A gate of ``gates=`` refused the new fence (the lease is given back by now): a stale
    fence there ends the attempt as a lost lease, a gate that failed as a store outage."""
    error = refusal.error
    if isinstance(error, StaleFenceError) and _gate_outlived_store(error, lease):
        raise LeaseConfigError(
            f"task {task.name!r}: fence gate {refusal.gate} already admitted fence "
            f"{error.highest} for key {refusal.key!r}, higher than any fence the lease "
            f"store {_store_url(lease)} ever granted for {lease.resource!r} (its newest: "
            f"{lease.fence}): the gate outlived its lease store (the store was reset or "
            "replaced, e.g. moved from Redis to SQL, or a test's in-memory store), so no "
            "claim would ever pass it. Reset the gate's record of that key (its row or "
            "key), or give the gate the lease store's fences (FenceGate(store=lease_store) "
            "or the store's URL and prefix); the task does not run again by itself"
        )
    if isinstance(error, StaleFenceError):
        newer = "a newer fence" if error.highest is None else f"fence {error.highest}"
        lost = lease.mark_lost(
            LeaseLostError(
                f"lease on {lease.resource!r} with fence {lease.fence} is stale at its claim: "
                f"fence gate {refusal.gate} already admitted {newer} for key "
                f"{refusal.key!r}; the task runs again later",
                lease.resource,
                lease.fence,
                None,
                "stale_fence",
            )
        )
        lease_lost(task, setup, lost, lease)
    if isinstance(error, LeaseStoreError):
        store_down(task, setup, error, lease.resource, gate=refusal.gate)
    raise error


def _gate_outlived_store(refused: StaleFenceError, lease: Lease) -> bool:
    """Whether a gate's refusal at claim names a fence above every fence the lease store ever
    granted for the resource (read after the lease was given back: a newer claim since then
    raises the store's fence too, and then this is an ordinary stale claim)."""
    if refused.highest is None or refused.highest <= lease.fence or lease.store is None:
        return False
    try:
        granted = lease.store.highest_fence(lease.resource)
    except LeaseError:  # unknown: treat it as the ordinary stale claim it most likely is
        return False
    return granted is not None and refused.highest > granted


def _store_url(lease: Lease) -> str:
    return str(getattr(lease.store, "url", "?"))


def newer_holder(lease: Lease, refused: StaleFenceError) -> tuple[int | None, str | None]:
    """The newer fence behind a side effect's refusal, and its holder when read from the store.

    A ``FenceGate`` names the fence it accepted (so does a gateway's 409 whose body says
    ``{"highest": N}``); a 409 may name none, and then the store tells who holds the resource
    now, or, when nobody does (the newer owner released already), the newest fence it granted
    (a read or two, on this rare path; nothing when it fails or granted no newer fence)."""
    if refused.highest is not None:
        return refused.highest, None
    store = lease.store
    if store is None:
        return None, None
    try:
        info = store.get(lease.resource)
        if info is not None and info.fence > lease.fence:
            # (an expired lease's owner holds nothing: name its fence, not it)
            return info.fence, None if info.expired else info.owner_label
        highest = store.highest_fence(lease.resource)
    except LeaseError:
        return None, None
    return (highest, None) if highest is not None and highest > lease.fence else (None, None)
