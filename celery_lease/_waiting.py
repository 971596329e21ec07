"""A refused claim: the resource is busy. Wait for it (in the resource's wait list, woken by
the release; in a polling place; or with the back-off), skip it or fail, as ``on_busy`` says.

A listed waiter's refused claim left the message a release sends again (its wake payload, see
``_message.wake_payload``) in the wait list; this copy is re-queued as its *back-stop*, sent
no sooner than the lease ttl, which runs only if nobody wakes it. A waiter whose message is
not kept (no identity, too big, no room) *polls* in its place. An *early* copy (sent as a
release went out) that found the release not landed yet is sent again shortly. The rules,
drawn as a state machine: docs/handoff.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore

from . import _copies, _execution, _unique
from . import _events as events
from . import _failpoints as failpoints
from ._errors import BUSY_ADVICE, LeaseBusyError
from ._message import (
    POLLS_HEADER,
    STORE_DOWN_HEADER,
    STORE_WAITS_HEADER,
    UNIQUE_HEADER,
    WAITS_HEADER,
    count,
    names_task,
    read_header,
    request_get,
)
from ._wake_queues import wake_queue_for
from ._wakes import EARLY_HEADER, EARLY_RETRY_DELAYS, LINEAGE_HEADER, WOKEN_HEADER

if TYPE_CHECKING:
    from ._setup import TaskSetup

log = logging.getLogger(__name__)

# An early copy (EARLY_HEADER) claims without re-arming its place, so the release that sent it
# still wakes it (the releaser sent that wake already).
#: Such a copy that came through a wake queue is sent again through it too, on the waiter's
#: route (the tests' negative control sets False): on its task queue it waited behind the
#: burst's first attempts, 0.5-0.8 s where 20 ms was meant.
EARLY_RETRY_VIA_WAKE_QUEUE = True
#: A polling waiter's copies go through its task queue's wake queue, as wakes do (the tests'
#: negative control sets False): through the task queue they waited behind its backlog and
#: missed the turn held for them, and listed later arrivals, woken through the wake queue,
#: overtook them.
POLL_VIA_WAKE_QUEUE = True


class Refused:
    """What the claim knew of its own refusal, besides the store's answer: ``wait_cap``, the
    store's wait list bounds when the claim asked to join the list (None when it did not);
    ``too_large``, the size of a wake message too big to ask (0: none), or too big for the
    store's whole wait list budget (``budget``, its wait_bytes_cap) when that is given;
    ``poll``, how often a copy in a polling place comes back (the store's grace)."""

    __slots__ = ("budget", "poll", "too_large", "wait_cap")

    def __init__(
        self,
        wait_cap: str | None = None,
        too_large: int = 0,
        budget: int | None = None,
        poll: float = 2.0,
    ) -> None:
        self.wait_cap = wait_cap
        self.too_large = too_large
        self.budget = budget
        self.poll = poll


_PLAIN = Refused()


def lease_busy(
    task: Any, setup: TaskSetup, busy: LeaseBusyError, refused: Refused = _PLAIN
) -> NoReturn:
    """A refused claim: wait (re-queue), fail or skip."""
    events.count("celery_lease_claim_conflicts_total")
    request = task.request
    settings = setup.settings
    if request.is_eager or request.called_directly:
        if settings.on_busy == "skip" and not busy.duplicate:
            raise skipped(busy) from None
        raise busy
    # A copy of work running now (same identity under a live lease: a redelivery, a
    # duplicate send) is re-armed whatever on_busy says, also past busy_max_waits: acking
    # it would leave no copy if the running one dies, and failing it would store FAILURE
    # under the running task's id. on_busy is for *other* work contending for the resource.
    duplicate = busy.duplicate
    if settings.on_busy != "retry" and not duplicate:
        skip(task, busy, settings.on_busy)
    if busy.wake is not None:  # the resource is free for a head waiter nobody woke
        payload, busy.wake = busy.wake, None
        _execution.wake(
            task, payload, busy.resource or "?", "claim", busy.fence, store=setup.current_store()
        )
    waits = int(read_header(request, WAITS_HEADER) or 0)
    early = read_header(request, EARLY_HEADER)
    left = min(count(early), len(EARLY_RETRY_DELAYS))
    if left and not duplicate:
        _early_again(task, busy, left, waits)
    if waits >= settings.busy_max_waits and not duplicate and early is None:
        # A late copy of a waiter that gave up already (its other copy was refused at its
        # last allowed wait first): the task's FAILURE is stored and its errbacks ran.
        # (An early copy refused past its short retries is not given up: the release
        # that woke it may not have landed yet, and it sends no second wake for it. It
        # waits on with the back-off, as a woken copy without the early header.)
        read = _copies.drop_if_finished(task, request, busy.resource or "?", done=True)
        failpoints.hit("before_give_up")
        if read is not None:  # (a copy sent again must be able to read what this one stores)
            _copies.give_up_once(task, setup.current_store(), busy)
        raise LeaseBusyError(
            f"{busy} (gave up after {waits} busy waits; raise lease_busy_max_waits to wait longer)",
            *busy.args[1:],
        )
    if busy.position and busy.polling and not duplicate:
        _poll(task, setup, busy, refused, waits)
    _wait(task, setup, busy, refused, waits)


def _early_again(task: Any, busy: LeaseBusyError, left: int, waits: int) -> NoReturn:
    """An early copy, woken with a release (see _execution.release) that had not landed when
    it claimed: its claim left the place as it was, for that release to wake. Soon again."""
    delay = EARLY_RETRY_DELAYS[len(EARLY_RETRY_DELAYS) - left]
    _execution.log_event(
        task,
        "busy",
        logging.INFO,
        busy.resource,
        busy.fence,
        busy.holder_label,
        action="early wake: sent again",
        wait=f"{delay:.2f}s",
    )
    _execution.requeue(
        task,
        busy,
        delay,
        # (0 after the last: still an early copy, see the give-up in lease_busy)
        {EARLY_HEADER: left - 1},
        store=task.track_started or not waits,
        wake_queue=_came_from(task.request) if EARLY_RETRY_VIA_WAKE_QUEUE else None,
    )


def _poll(
    task: Any, setup: TaskSetup, busy: LeaseBusyError, refused: Refused, waits: int
) -> NoReturn:
    """Its place polls (invariant 12): nobody sends its message, so this copy comes back
    once a grace, to be there when its turn comes (the free resource is then held for it two
    graces). Polls are no busy waits: its place keeps its turn."""
    request = task.request
    polls = count(read_header(request, POLLS_HEADER))
    events.observe("celery_lease_wait_list_length", float(busy.position or 0))
    delay = min(setup.busy_delay(0), refused.poll)
    full = too_big = None
    if refused.too_large:
        events.count("celery_lease_wait_payload_too_large_total")
        too_big, over = _too_large(setup, refused)
        why = f"its wake message is {refused.too_large} bytes, over {over}"
    elif not setup.dedup:
        why = "it has no identity to tell its copies apart (identity=False)"
    else:
        events.count("celery_lease_wait_list_full_total")
        full = refused.wait_cap or "at its cap"
        why = f"its wait list had no room for its message ({full})"
    _execution.log_event(
        task,
        "busy",
        logging.INFO,
        busy.resource,
        busy.fence,
        busy.holder_label,
        action="poll",
        wait=f"{delay:.2f}s",
        position=busy.position,
        wait_list_full=full,
        wait_payload_too_large=too_big,
    )
    if not polls:  # (said once, with the state RETRY; later polls store nothing)
        busy = LeaseBusyError(
            f"{busy} ({why}: it polls in its place, coming back every {delay:.1f}s)",
            *busy.args[1:],
        )
        _execution.lease_event(task, "task-lease-busy", action="poll", wait=delay, **fields(busy))
    events.count("celery_lease_busy_waits_total")
    updates: dict[str, Any] = {
        POLLS_HEADER: polls + 1,
        STORE_WAITS_HEADER: None,
        STORE_DOWN_HEADER: None,
        WOKEN_HEADER: None,
        EARLY_HEADER: None,
    }
    wake_queue = None
    if POLL_VIA_WAKE_QUEUE:
        wake_queue = _came_from(request)
        if wake_queue is None and setup.wake_queues:
            wake_queue = wake_queue_for(task.app, request.delivery_info)
    _execution.requeue(
        task,
        busy,
        delay,
        updates,
        store=not polls and not waits and not task.track_started,
        wake_queue=wake_queue,
    )


def _wait(
    task: Any, setup: TaskSetup, busy: LeaseBusyError, refused: Refused, waits: int
) -> NoReturn:
    """Wait: listed (the release wakes it; this copy is the back-stop), or with the back-off
    (not listed: it did not ask, or the list had no room for it)."""
    request = task.request
    duplicate = busy.duplicate
    full = too_big = None
    if busy.position:  # queued: the release wakes it; this copy is the back-stop
        events.observe("celery_lease_wait_list_length", float(busy.position))
        delay = setup.backstop_delay(waits)
    else:
        delay = setup.busy_delay(waits)
        if refused.wait_cap is not None and not duplicate:
            # It asked to wait in the list and was not listed: the list is at its cap
            # (of waiters or of payload bytes). Say so (else it reads like a claim that
            # never asked to wait).
            full = refused.wait_cap or "at its cap"
            events.count("celery_lease_wait_list_full_total")
            busy = LeaseBusyError(
                f"{busy} (its wait list is full ({full}): waiting with the back-off, "
                "not in the list)",
                *busy.args[1:],
            )
        elif refused.too_large and not duplicate:
            # It would have waited in the list but its wake message is over the bound:
            # say so, as for a full list (else it reads like a claim that never asked).
            events.count("celery_lease_wait_payload_too_large_total")
            too_big, over = _too_large(setup, refused)
            busy = LeaseBusyError(
                f"{busy} (its wake message is {refused.too_large} bytes, over {over}: waiting "
                "with the back-off, not in the wait list)",
                *busy.args[1:],
            )
    events.count("celery_lease_busy_waits_total")
    _execution.log_event(
        task,
        "busy",
        logging.INFO,
        busy.resource,
        busy.fence,
        busy.holder_label,
        action="wait",
        wait=f"{delay:.2f}s",
        waits=waits + 1,
        duplicate=duplicate or None,
        position=busy.position,
        wait_list_full=full,
        wait_payload_too_large=too_big,
    )
    _execution.lease_event(task, "task-lease-busy", action="wait", wait=delay, **fields(busy))
    # The store answered: a later outage starts its own budget.
    updates = {
        WAITS_HEADER: waits + 1,
        STORE_WAITS_HEADER: None,
        STORE_DOWN_HEADER: None,
        WOKEN_HEADER: None,
        EARLY_HEADER: None,
    }
    if busy.fence is not None and read_header(request, LINEAGE_HEADER) is None:
        # This waiting execution's start. Refused by a run of this very identity (a
        # redelivery or duplicate of running work): that run counts as after the start,
        # so if it fails this message's copies end unrun.
        updates[LINEAGE_HEADER] = busy.fence - 1 if duplicate else busy.fence
    # A copy of a waiting execution refused again: its first refusal stored RETRY, or another
    # copy of it has ended since and its final state must stay (backends keep only SUCCESS
    # from being stored over).
    _execution.requeue(task, busy, delay, updates, store=not waits or task.track_started)


def _came_from(request: Any) -> str | None:
    """The wake queue this copy was delivered from (None: its task queue)."""
    via = getattr(request, "lease_wake_queue", None)
    return via if isinstance(via, str) else None


def _too_large(setup: TaskSetup, refused: Refused) -> tuple[str, str]:
    """How a wake message over its bound is shown: its size against the bound, and the bound
    it is over (``lease_handoff_max_payload``, or the store's whole wait list budget)."""
    bound = setup.settings.handoff_max_payload
    if refused.budget is None:
        return f"{refused.too_large} > {bound} bytes", f"lease_handoff_max_payload={bound}"
    return (
        f"{refused.too_large} > {refused.budget} bytes (wait_bytes_cap)",
        f"the store's whole wait list budget (wait_bytes_cap {refused.budget} bytes; "
        f"lease_handoff_max_payload={bound})",
    )


def skip(task: Any, busy: LeaseBusyError, how: str = "skip") -> NoReturn:
    """on_busy="skip" or "fail": end FAILURE with a LeaseBusyError that says why, without
    running; "skip"'s says it was skipped, "fail"'s is the refusal itself.

    An expected outcome, so it is told as one: one WARNING line, no traceback. ``Ignore``
    alone stores no state, so a caller's ``result.get()`` waited forever: the reason
    (resource, holder) is stored through the result backend first, with the chord and
    errbacks handled as for any failure; ``Ignore`` then keeps Celery from storing over it
    or logging a task failure with a traceback. The execution ended: a lock its publish took
    (``unique="until_executed"``) is given back.
    """
    request = task.request
    error = skipped(busy) if how == "skip" else busy
    _execution.log_event(
        task,
        "skipped" if how == "skip" else "failed",
        logging.WARNING,
        busy.resource,
        busy.fence,
        busy.holder_label,
        why=f"on_busy={how!r}",
    )
    _execution.lease_event(task, "task-lease-busy", action=how, **fields(busy))
    if not (task.ignore_result or getattr(request, "ignore_result", False)):
        try:
            task.backend.mark_as_failure(request.id, error, request=request)
        except Exception:
            log.exception("task %s[%s]: storing the %s failed", task.name, request.id, how)
    unique = request_get(request, UNIQUE_HEADER) is not None
    if unique and not names_task(busy.holder_label, request.id):
        # (a copy of this same task id holds the resource: it runs on and keeps the lock)
        _unique.finished(task, request)
    raise Ignore(str(error))


def skipped(busy: LeaseBusyError) -> LeaseBusyError:
    """The error of a task skipped by ``on_busy="skip"``: why, without "retry later"."""
    reason = str(busy).removesuffix(BUSY_ADVICE)
    return LeaseBusyError(f"skipped (on_busy='skip'): {reason}", *busy.args[1:])


def fields(busy: LeaseBusyError) -> dict[str, Any]:
    """A refusal's fields, as its Celery event carries them."""
    return {
        "resource": busy.resource,
        "holder": busy.holder_label,
        "fence": busy.fence,
        "expires_in": busy.expires_in,
    }
