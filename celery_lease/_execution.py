"""What every part of a lease task does to the execution it runs: say what happened (its log
lines and Celery events), send it again (a re-queue that leaves ``retries`` alone), and give its
lease back, waking the next waiter.

The rooms above it decide *when*: ``_attempt`` (one attempt), ``_waiting`` (a refused claim),
``_copies`` (a copy of work that already ran) and ``_outcomes`` (a lost lease, a store down).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Retry

from . import _clock, metrics
from . import _events as events
from . import _failpoints as failpoints
from ._codec import encode
from ._errors import BUSY_ADVICE, LeaseBusyError, LeaseConfigError, LeaseError, LeaseStoreError
from ._eventlog import lease_log
from ._eventlog import log as event_log
from ._lease import Lease
from ._message import WAITS_HEADER, carry
from ._wake_queues import ROUTE_HEADER
from ._wake_queues import to_wake_queue as _to_wake_queue
from ._wakes import send_wake
from .stores._bounds import POLL

if TYPE_CHECKING:
    from .stores import LeaseStore

log = logging.getLogger(__name__)

#: An early wake only follows a body shorter than this (seconds): the claim's guess at the
#: next waiter grows stale as the body runs (a back-stop copy re-arms it with a new message),
#: and past a few seconds the round trip it saves is noise.
EARLY_WAKE_MAX_HELD = 5.0
_NO_EXTRA: dict[str, Any] = {}
#: Pauses before a release the store cancelled for contention (a lock or statement timeout, a
#: deadlock: rolled back, so safe to send again) is sent again, one per try (seconds).
RELEASE_RETRY_PAUSES = (0.05, 0.2, 0.5)
#: No try is sent again once this long (seconds) has passed since the first was sent: each try
#: may wait the whole store call timeout (5/12 of the ttl; 25 s at the default ttl, where a
#: lock waited on that long is not contention a second try gets past).
RELEASE_RETRY_BUDGET = 2.0
#: The series every release counts (looked up once, not per task).
_RELEASED = events.Recorder(
    metrics.Series("c", "celery_lease_releases_total"),
    metrics.Series("h", "celery_lease_hold_seconds"),
)


# -- saying what happened ----------------------------------------------------------------------


def log_event(
    task: Any,
    event: str,
    level: int,
    resource: str | None,
    fence: int | None,
    holder: str | None,
    **fields: Any,
) -> None:
    """One structured line for a lease event of this execution (see _eventlog)."""
    if not event_log.isEnabledFor(level):  # claimed/released are DEBUG: the hot path
        return
    lease_log(
        event,
        level,
        resource=resource,
        fence=fence,
        holder=holder,
        task_id=task.request.id,
        task=task.name,
        **{k: v for k, v in fields.items() if v is not None},
    )


def lease_event(
    task: Any,
    type_: str,
    task_id: str | None = None,
    hostname: str | None = None,
    **fields_: Any,
) -> None:
    """A Celery event about this execution's lease (``lease_send_events``)."""
    if not task.lease_settings.send_events:
        return
    request = task.request
    events.send_event(
        task.app, hostname or request.hostname, task_id or request.id, type_, **fields_
    )


# -- sending it again --------------------------------------------------------------------------


def requeue(
    task: Any,
    exc: LeaseError,
    delay: float,
    updates: dict[str, Any],
    store: bool = True,
    wake_queue: str | None = None,
) -> NoReturn:
    """Send this execution again after ``delay`` without touching ``request.retries``.

    ``updates`` sets our budget headers on the new message (None drops one). Ends with
    ``Retry`` (Celery stores RETRY), or with ``Ignore`` (nothing stored) when not ``store``.
    With ``wake_queue``, the copy is sent through that wake queue (on its own route as a wake
    is, see _to_wake_queue), not behind its task queue's backlog.
    """
    request = task.request
    headers = carry(request, dict(request.headers or {}))  # (when it was published; its lock)
    headers.pop(ROUTE_HEADER, None)  # (it goes on the route the copy was sent on)
    for header, value in updates.items():
        if value is None:
            headers.pop(header, None)
        else:
            headers[header] = value
    signature = task.signature_from_request(
        request, countdown=delay, retries=request.retries or 0, headers=headers
    )
    if wake_queue is not None:
        _to_wake_queue(signature.options, signature.options.setdefault("headers", {}), wake_queue)
    signature.apply_async()
    if not store:
        raise Ignore(f"{exc}: sent again in {delay:.2f}s") from exc
    raise Retry(retry_message(exc, delay), exc=exc, when=delay, sig=signature)


def retry_message(exc: LeaseError, delay: float) -> str:
    """What Celery's retry line says for an execution sent again (``Task proj.x[id] retry:
    <this>``): one short sentence. Celery's own, ``Retry in 15.0s: <the error's repr>``, ran to
    300 characters and named the back-stop's delay, while a listed waiter is woken by the
    release, often within milliseconds. The holder's label is left to the ``busy`` event line
    and the RETRY state (the whole error goes to the result backend, as before)."""
    if not isinstance(exc, LeaseBusyError):
        return f"{exc}: sent again in {delay:.2f}s"
    if exc.duplicate:
        return (
            f"busy: a copy of this execution holds {exc.resource} (fence {exc.fence}): "
            f"looking again in {delay:.2f}s"
        )
    held = f"busy: {exc.resource} is held (fence {exc.fence})"
    if exc.position and exc.polling:
        # Why its place polls (no identity, its message too big, no room), as _lease_busy put
        # it after the advice.
        _, _, note = str(exc).partition(BUSY_ADVICE)
        return (
            f"{held}: polling at place {exc.position} of its wait list, back in {delay:.1f}s"
            f"{' ' + note.strip() if note.strip() else ''}"
        )
    if exc.position:
        return (
            f"{held}: waiting at place {exc.position} of its wait list, woken when it is "
            f"released (back-stop copy in {delay:.1f}s)"
        )
    # Why it is not in the wait list (full, or its message too big), as _lease_busy appended
    # it after the advice: the busy event line saying so is logged once per 10 s only.
    _, _, note = str(exc).partition(BUSY_ADVICE)
    return f"{held}: trying again in {delay:.2f}s{' ' + note.strip() if note.strip() else ''}"


# -- giving the lease back ---------------------------------------------------------------------


def release(
    task: Any,
    lease: Lease,
    outcome: str,
    result: Any,
    held_since: float | None = None,
    early: bool = False,
) -> None:
    """Give the lease back (recording the identity's outcome) and wake the next waiter;
    with ``held_since`` (monotonic), also record how long the lease was held.

    With ``early`` (a body that ran and ended, not lost), the waiter the claim said a
    release would wake (``lease.next_wake``, stores that tell) is woken once the release is
    sent, while its reply is awaited, instead of after it: the release's round trip then
    overlaps the wake's trip through the broker. The release's answer decides: when it
    hands the resource to that same message nothing more is sent; otherwise its own wake
    is sent as usual, and the early copy is one more copy of a listed waiter (identity
    dedup runs the body once). A copy that comes before the release landed (the store
    read the two out of order) is refused and sent again shortly (``EARLY_HEADER``); if
    the release never lands, the lease runs out and the waiter's copies claim it as after
    any crash."""
    assert lease.store is not None
    failpoints.hit("inside_release")
    sent: list[str] = []
    upcoming, lease.next_wake = lease.next_wake, None
    meanwhile = (
        _wake_meanwhile(task, lease, upcoming, sent)
        if early
        and upcoming is not None
        and upcoming != POLL  # (a polling waiter comes back by itself)
        and held_since is not None
        and lease.lost is None
        and _clock.monotonic() - held_since < EARLY_WAKE_MAX_HELD
        and lease.remaining() > 0
        else _NO_EXTRA
    )
    recorded = (
        _recorded(task, lease, result) if outcome == "done" and lease.identity is not None else None
    )
    released = False
    try:
        released = _send_release(lease, outcome, recorded, meanwhile)
        if released and event_log.isEnabledFor(logging.DEBUG):  # (not the call, when off)
            log_event(
                task,
                "released",
                logging.DEBUG,
                lease.resource,
                lease.fence,
                lease.owner.label,
                outcome=outcome,
            )
    except LeaseError as exc:
        log.warning("could not release %r (it expires by itself within its ttl): %s", lease, exc)
        return
    finally:
        if held_since is not None:
            held = _clock.monotonic() - held_since
            if released:
                _RELEASED.record(held)
            else:
                events.observe_hold(held)
    if lease.handoff is not None:
        payload, lease.handoff = lease.handoff, None
        if sent and (payload == sent[0] or rearmed_wake(sent[0], payload)):
            return  # that waiter's wake went out with the release
        failpoints.hit("before_wake")
        wake(task, payload, lease.resource, "release", lease.fence, store=lease.store)
        failpoints.hit("after_wake")


def _send_release(
    lease: Lease, outcome: str, recorded: str | None, meanwhile: dict[str, Any]
) -> bool:
    """The store's release of ``lease``, sent again after a short pause (up to
    ``RELEASE_RETRY_PAUSES``, while ``RELEASE_RETRY_BUDGET`` has not passed since the first
    try) when the store cancelled it for contention and rolled it back
    (``LeaseStoreError.transient``): given up at once, a finished body's ``done`` would never
    be recorded, and a later delivery of the task would run as a takeover."""
    assert lease.store is not None
    started = _clock.monotonic()
    for pause in (*RELEASE_RETRY_PAUSES, None):
        try:
            return lease.store.release(
                lease,
                outcome=outcome if lease.identity is not None else None,
                result=recorded,
                **meanwhile,
            )
        except LeaseStoreError as exc:
            if (
                pause is None
                or not getattr(exc, "transient", False)  # (a third party's may lack it)
                or _clock.monotonic() - started + pause >= RELEASE_RETRY_BUDGET
            ):
                raise
            log.info("release of %r sent again in %gs: %s", lease, pause, exc)
            meanwhile = _NO_EXTRA  # (an early wake went out with the first try)
            time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


def _wake_meanwhile(task: Any, lease: Lease, upcoming: str, sent: list[str]) -> dict[str, Any]:
    """The release's option that wakes ``upcoming`` (the next waiter the claim named) while
    the release's reply is on its way; ``sent`` gets it once sent."""

    def wake_early() -> None:  # (the store runs it once its release is sent)
        if wake(
            task, upcoming, lease.resource, "release", lease.fence, early=True, store=lease.store
        ):
            sent.append(upcoming)
        failpoints.hit("after_early_wake")

    return {"meanwhile": wake_early}


def _recorded(task: Any, lease: Lease, result: Any) -> str | None:
    """A finished body's result as the identity's record keeps it for duplicates (None: a
    result that cannot be encoded, said in a warning)."""
    try:
        return "null" if result is None else encode(result)
    except LeaseConfigError as exc:
        log.warning(
            "task %s: result not recorded for duplicates of identity %r: %s",
            task.name,
            lease.identity,
            exc,
        )
        return None


def rearmed_wake(early: str, payload: str) -> bool:
    """Whether the release handed the resource to the very execution whose early copy is
    out (``early``), its place re-armed since the claim named it: its back-stop copy was
    refused while this body ran, so ``payload`` counts more waits and is otherwise the
    same message (task id, attempt, arguments, route). The early copy is then its woken
    copy; a second one would only run as a duplicate (and, with no result backend to tell
    it so, end with the recorded result: link callbacks twice). The early copy's claim
    reads the place's newer count (``Lease.own_wake``), so at the last allowed wait it too
    reads the result backend before it runs (see _sibling_may_have_given_up). Rare (a place
    re-armed during a short body), so the two messages are parsed only then."""
    try:
        a, b = json.loads(early), json.loads(payload)
        waits_a = int(a["options"]["headers"].pop(WAITS_HEADER))
        waits_b = int(b["options"]["headers"].pop(WAITS_HEADER))
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    return a == b and waits_b > waits_a


def wake(
    task: Any,
    payload: str,
    resource: str,
    by: str,
    fence: int | None = None,
    early: bool = False,
    store: LeaseStore | None = None,
) -> bool:
    """Send a woken waiter's message now (see ``_wakes.send_wake``); with ``store``, the
    turn is checked once its grace is over. Returns whether it was sent."""
    return send_wake(
        task.app,
        payload,
        resource,
        by,
        fence,
        early=early,
        wake_queues=task._compiled().wake_queues,
        store=store,
    )
