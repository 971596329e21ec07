"""A copy of an execution that already ran, failed or moved on: end it without running the
body again, and without storing over the state the run left.

One execution has several copies in flight (the hand-off's woken and back-stop copies, an
early copy, a redelivery, a duplicate send); the identity's record in the store and the
task's state in the result backend tell which one runs. Each function here ends the copy
(``Ignore``, or the recorded result) or returns to let it run.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, NoReturn

from celery import states
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore

from . import _clock, _execution
from . import _events as events
from ._codec import decode
from ._errors import IdentityDoneError, LeaseBusyError, LeaseError
from ._lease import Lease, identity_outcome
from ._message import (
    DONE_CHECKS_HEADER,
    LISTED_HEADER,
    WAITS_HEADER,
    copy_kind,
    listed_waits,
    names_task,
    read_header,
)
from ._settings import LeaseSettings
from ._wakes import EARLY_HEADER, LINEAGE_HEADER, WOKEN_HEADER
from .stores.base import MarkOnceStore

log = logging.getLogger(__name__)

#: The share of ``store_down_max_wait`` by which a woken copy reads the result backend early
#: (see ``_sibling_may_have_given_up``): the listing and the give-up are stamped on the wall
#: clocks of the workers involved, so this tolerates clocks apart by up to a quarter of the
#: budget (150 s by default) at the cost of one backend read for places listed longer ago
#: than half of it.
GAVE_UP_CLOCK_SLACK = 0.5
#: The countdowns of those looks: the copy that ran may be between its release and Celery
#: storing its result (a pause there, a slow backend); after the last, the copy ends with the
#: recorded result.
DONE_RECHECKS = (1.0, 2.0, 4.0)
#: How long a copy's give-up mark (see ``give_up_once``) keeps other copies of its task id
#: from giving up: far longer than storing the FAILURE takes; past it a copy gives up again
#: only if none was stored (the marking copy's worker died before).
GIVE_UP_MARK_TTL = 60.0
#: When a copy that found the give-up taken by another copy comes back to read the result.
GIVE_UP_RECHECK = 2.0


def superseded(task: Any, lease: Lease) -> LeaseBusyError:
    """Drop a copy of an attempt its identity has moved past without running the body:
    give the lease back with the identity's record as it was found (so the copy of the
    current attempt still sees it) and end without storing a result (that copy's is).

    Only a copy of this task id is dropped: another task id sharing the identity (an
    identity template, an idempotency key) would never get a result from the newer
    attempt's copy, so while that attempt is still to run it waits as a duplicate of
    running work and ends with the recorded result once it is done: returned is the
    refusal it waits with (see ``_waiting.lease_busy``)."""
    request = task.request
    found = identity_outcome(lease.identity_state or "retry", lease.identity_attempt)
    if lease.identity != request.id and (lease.identity_state or "retry") == "retry":
        _execution.release(task, lease, found, None)
        return LeaseBusyError(
            f"{lease.identity!r} is at attempt {lease.identity_attempt}, run by another "
            f"task id than {request.id}: waiting for its result",
            lease.resource,
            lease.owner.label,
            lease.fence,
            None,
            True,
        )
    log_dropped(
        task,
        lease,
        current_attempt=lease.identity_attempt,
        action="dropped a copy of a superseded attempt",
        why=f"its task retried since: attempt {lease.identity_attempt} runs in a copy of its own",
    )
    _execution.release(task, lease, found, None)
    raise Ignore(
        f"attempt {request.retries or 0} of {lease.identity!r} was superseded by attempt "
        f"{lease.identity_attempt}"
    )


def log_dropped(task: Any, lease: Lease, **fields: Any) -> None:
    """Count and log a copy of this task that ends without running its body (``fields``
    go after the identity and attempt: what it was a copy of, and the action)."""
    events.count("celery_lease_duplicates_total")
    _execution.log_event(
        task,
        "duplicate",
        logging.INFO,
        lease.resource,
        lease.fence,
        lease.owner.label,
        identity=lease.identity,
        attempt=task.request.retries or 0,
        copy=copy_kind(task.request),
        **fields,
    )


def failed_copy(task: Any, lease: Lease) -> NoReturn:
    """Drop a copy of an execution whose body already ran and failed: give the lease back
    with the identity's record as it was found (a new message sharing the identity still
    runs) and end without storing a result (the FAILURE of the run that happened stays)."""
    request = task.request
    log_dropped(
        task,
        lease,
        action="dropped a copy of a failed execution",
        why=f"attempt {request.retries or 0} already ran and failed; its FAILURE stays",
    )
    why = (
        f"attempt {request.retries or 0} of {lease.identity!r} already ran and failed "
        f"(task id {request.id})"
    )
    error = LeaseError(f"{why}; this copy ended without running it")
    # Read and stored under the lease, so the next copy of this execution sees it.
    errbacks = store_failed_copy(task, request, error)
    _execution.release(task, lease, identity_outcome("failed", lease.identity_attempt), None)
    if errbacks:
        try:  # the chord part return, the chain and link_error, as Celery's failure does
            task.backend.mark_as_failure(
                request.id, error, request=request, store_result=False, call_errbacks=True
            )
        except Exception:
            log.exception("task %s[%s]: marking the failure failed", task.name, request.id)
    raise Ignore(why)


def store_failed_copy(task: Any, request: Any, error: LeaseError) -> bool:
    """Store ``error`` as this dropped copy's FAILURE where the failed run's is not in the
    result backend; whether Celery's other failure effects (chord part return, chain,
    errbacks) are still due. The run's FAILURE stays when it is there. It is not when
    Celery stored STARTED over it for this copy (task_track_started: the run's errbacks
    ran, or its worker died before them, which the backend does not tell: stored only),
    or when the worker of the run died after its release and before Celery marked the
    failure (the message came back as a copy): then nothing saw the failure, and it is
    marked as Celery would. The first exception is gone; ``error`` says what happened.
    Nothing is read or stored when the task ignores its result or there is no result
    backend."""
    if request.is_eager or ignores_result(task, request) or not has_backend(task):
        return False
    try:
        stored = task.backend.get_task_meta(request.id, cache=False).get("status")
        if stored in states.READY_STATES:
            return False
        task.backend.store_result(request.id, error, states.FAILURE, request=request)
    except Exception:
        log.exception("task %s[%s]: storing the failure failed", task.name, request.id)
        return False
    return not task.track_started


def drop_if_finished(
    task: Any, request: Any, resource: str, lease: Lease | None = None, done: bool = False
) -> str | None:
    """End this back-stop copy of a waiter (it counts its waits, no wake sent it) when the
    result backend already holds a final state for its task id: another copy of it ran
    (its woken copy) and that state is the task's. Checked before the claim, so
    the identity's record, which another task id sharing the identity may have written
    since, does not decide: the copy ends ``Ignore``d without running the body or storing
    over that state. One backend read per back-stop copy; not on a woken copy (the
    hand-off's path) unless ``lease`` is given: it claimed and found that another copy of
    this execution ran this attempt and ended without an outcome (the lease is given back
    with the record as found when the copy ends), or ``done``: its claim found the identity
    done, or its last allowed wait was refused (this task id's other copy may have run to
    its end, or given up). Not read where ``_task_state`` says. Returns the state read (None:
    not read)."""
    state = task_state(task, request, woken=lease is not None or done)
    if state is not None and state in states.READY_STATES:
        drop_finished(task, request, resource, state, lease)
    return state


def give_up_once(task: Any, store: Any, busy: LeaseBusyError) -> None:
    """Return when this copy, refused at its last allowed wait, is the one copy of its task id
    that gives up (stores FAILURE, runs the errbacks); else send it again to look later.

    Its read found no final state (``drop_if_finished``), but another copy of this task id may
    be between that read and storing its FAILURE: the release's wake and the wake a turn check
    sent once more (both woken copies of one place), or a back-stop copy, refused together.
    Each would give up, and the errbacks ran twice. So the give-up is taken in the lease store
    first, one atomic call per task id (``mark_once``; rare: only a give-up pays it). A copy
    that finds it taken is sent again (nothing stored) in ``GIVE_UP_RECHECK`` seconds as a
    back-stop copy, which reads the task's state before its claim: the FAILURE by then, or,
    if the copy that took it died before storing it, a give-up of its own once the mark has
    expired. A store without ``mark_once`` (a third-party one), or one that fails to answer:
    this copy gives up, as before."""
    request = task.request
    if not isinstance(store, MarkOnceStore) or request.id is None:
        return
    try:
        taken = store.mark_once(f"gave-up:{request.id}", uuid.uuid4().hex, GIVE_UP_MARK_TTL)
    except LeaseError:
        log.debug("task %s[%s]: the give-up mark failed", task.name, request.id, exc_info=True)
        return
    if taken:
        return
    events.count("celery_lease_duplicates_total")
    _execution.log_event(
        task,
        "duplicate",
        logging.INFO,
        busy.resource,
        busy.fence,
        busy.holder_label,
        copy=copy_kind(request),
        action="another copy of this task is giving up",
        why=f"refused at its last allowed wait as another copy was: looking again in "
        f"{GIVE_UP_RECHECK:g}s (it ends unrun on the FAILURE that copy stores)",
    )
    _execution.requeue(
        task, busy, GIVE_UP_RECHECK, {WOKEN_HEADER: None, EARLY_HEADER: None}, store=False
    )


def task_state(task: Any, request: Any, woken: bool = False) -> str | None:
    """This waiter's copy's task state in the result backend; None when not read: not a
    waiter's copy, a woken copy (unless ``woken``), with ``task_track_started`` (Celery
    stored STARTED over it for this copy already), when the task stores no result, with
    no result backend or one a worker cannot read another task's state from (``rpc://``),
    or when the read fails."""
    if (
        request.is_eager
        or request.id is None
        or task.track_started
        or ignores_result(task, request)
        or not backend_readable(task)
        or not int(read_header(request, WAITS_HEADER) or 0)
        or (not woken and read_header(request, WOKEN_HEADER) is not None)
    ):
        return None
    try:
        state = task.backend.get_task_meta(request.id, cache=False).get("status")
    except Exception:  # noqa: BLE001 - the backend failed: decide without it
        return None
    return None if state is None else str(state)


def drop_finished(
    task: Any, request: Any, resource: str, state: str, lease: Lease | None = None
) -> NoReturn:
    """End this copy unrun: its task id already ended ``state`` (another copy ran it).

    With ``lease`` (this copy claimed), the lease is given back with the identity's record
    as found, except after a SUCCESS when the identity is the task id (the default): the
    copy that ran the body to its end stored it, but its release recorded nothing (it was
    paused before it, and another copy had taken the identity over since), so the record is
    completed with the result the backend holds; left as found, it would say ``retry`` for
    good and a later delivery of the task id would run the body again. Another identity (a
    template, an idempotency key) is left as found: the task id's SUCCESS may be another
    identity's run (the task id sent again under a new key) and must not end this one."""
    events.count("celery_lease_duplicates_total")
    _execution.log_event(
        task,
        "duplicate",
        logging.INFO,
        resource,
        None,
        None,
        copy=copy_kind(request),
        state=state,
        action="dropped a copy of a finished task",
        why=f"its task id already ended {state} in the result backend (another copy of it "
        "ran, or gave up): running it again would repeat that or store over it",
    )
    if lease is not None:
        own = state == states.SUCCESS and lease.identity == request.id
        stored = stored_success(task, request) if own else None
        if stored is not None:
            _execution.release(task, lease, "done", stored[0])
        else:  # give it back with the identity's record as found
            found = identity_outcome(lease.identity_state or "retry", lease.identity_attempt)
            _execution.release(task, lease, found, None)
    raise Ignore(f"task {request.id} already ended {state}: a copy of it ends unrun")


def stored_success(task: Any, request: Any) -> tuple[Any] | None:
    """The result of this task id's SUCCESS in the result backend, in a 1-tuple (None: not
    SUCCESS there now, or the read failed)."""
    try:
        meta = task.backend.get_task_meta(request.id, cache=False)
    except Exception:  # (the backend failed: the record stays as found)
        log.debug("task %s[%s]: reading its result failed", task.name, request.id, exc_info=True)
        return None
    return (meta.get("result"),) if meta.get("status") == states.SUCCESS else None


def sibling_may_have_given_up(
    task: Any, request: Any, settings: LeaseSettings, lease: Lease | None = None
) -> bool:
    """A woken copy whose back-stop sibling may have ended FAILURE without claiming: it
    would not wait again when refused (the last allowed wait: it gave up), or its place
    was listed longer ago than ``store_down_max_wait`` (it may have given up on an
    unreachable store). Rare, so only then does a woken copy read the result backend.

    An early copy carries the waits count its waker's claim saw; its place may have been
    re-armed since (its back-stop copy refused while the waker's body ran), so the count
    its claim found in its own place (``lease.own_wake``) counts too. An early copy whose
    claim found no place of its own (it lapsed while the copy waited behind a backlog, or
    the claim was sent again after a lost reply and the first one took it) cannot tell
    its count: it reads the result backend."""
    if read_header(request, WOKEN_HEADER) is None:
        return False
    waits = int(read_header(request, WAITS_HEADER) or 0)
    if lease is not None and lease.own_wake is not None:
        waits = max(waits, listed_waits(lease.own_wake))
    elif own_count_unknown(request, lease):
        return True
    if waits >= settings.busy_max_waits:
        return True
    # Its back-stop copy may have found the store unreachable until store_down_max_wait
    # ran out (that budget starts no sooner than the listing, see _listed_at): only a
    # place listed about that long ago. The two times are read on different workers'
    # wall clocks, so the read starts GAVE_UP_CLOCK_SLACK of the budget early.
    listed = read_header(request, LISTED_HEADER)  # (None in an older version's message)
    try:
        return listed is not None and _clock.wall() - float(listed) >= (
            settings.store_down_max_wait * (1 - GAVE_UP_CLOCK_SLACK)
        )
    except (TypeError, ValueError):
        return False


def duplicate_done(task: Any, done: IdentityDoneError) -> Any:
    request = task.request
    if done.resource is not None:
        # A waiter's copy (woken, or its back-stop) finds the identity done: when this task
        # id's other copy ran it to its end, its success path (the result, link callbacks,
        # a chain's next step) ran too, and this copy ends unrun instead of running it again.
        # Rare (off the hand-off's path), so one backend read here.
        state = task_state(task, request, woken=True)
        if state is not None and state in states.READY_STATES:
            drop_finished(task, request, done.resource, state)
        checks = int(read_header(request, DONE_CHECKS_HEADER) or 0)
        if (
            state is not None
            and checks < len(DONE_RECHECKS)
            and names_task(done.owner_label, request.id)
        ):
            # Not final yet, and this task id's other copy completed the identity: it may
            # be between its release and Celery storing its result (its link callbacks and
            # chain step go first). Look again later, holding no slot; past the last look
            # its worker died in between: end with the result. (Another task id sharing
            # the identity completed it: end with its result now.)
            _execution.requeue(
                task,
                done,
                DONE_RECHECKS[checks],
                {DONE_CHECKS_HEADER: checks + 1, WOKEN_HEADER: None, EARLY_HEADER: None},
                store=False,
            )
    redelivered = bool((request.delivery_info or {}).get("redelivered"))
    events.count("celery_lease_duplicates_total")
    _execution.log_event(
        task,
        "duplicate",
        logging.INFO,
        done.resource,
        done.fence,
        None,
        identity=done.identity,
        redelivered=redelivered,
        copy=copy_kind(request),
        action="returned the recorded result",
    )
    return decode(done.result)


def copy_of_run(lease: Lease, request: Any) -> bool:
    """Whether the run the identity's record names (its attempt) was a run of this
    execution by another of its hand-off copies: see _copy_of_failed."""
    return (request.retries or 0) == lease.identity_attempt and copy_of_failed(lease, request)


def copy_of_failed(lease: Lease, request: Any) -> bool:
    """Whether this message is a copy of the execution whose failure the identity's record
    names (its body ran and raised): the same task id (the owner label the record names ends
    with it, see _owner_label), and an earlier attempt or a copy of the failed one that the
    hand-off made (a woken or back-stop copy: it counts its waits). Another task id sharing
    the identity is a new submission and runs; so do a later attempt (``self.retry()`` sent
    before the failure) and a redelivery of the failed message itself (its worker died before
    Celery stored the failure).

    A hand-off copy carries the fence its waiting execution began at (LINEAGE_HEADER): the
    failed run must be newer (``identity_fence``), else it ran before this message was sent
    (the task id was sent again after its failure) and this one runs. Copies without it (older
    workers') and stores that do not give the fence: the rule above alone."""
    task_id = request.id
    retries = request.retries or 0
    if task_id is None or retries > lease.identity_attempt:
        return False
    if not names_task(lease.identity_owner_label or lease.previous_owner_label, task_id):
        return False
    if retries < lease.identity_attempt:
        return True
    if not int(read_header(request, WAITS_HEADER) or 0):
        return False
    since = read_header(request, LINEAGE_HEADER)
    if since is None or lease.identity_fence is None:
        return True
    try:
        return lease.identity_fence > int(since)
    except (TypeError, ValueError):  # not ours
        return True


def own_count_unknown(request: Any, lease: Lease | None) -> bool:
    """An early copy whose claim on a store that answers with the claimant's own place
    (``own_wake``) found none: it lapsed, or the claim was sent again after a lost reply."""
    return (
        lease is not None
        and read_header(request, EARLY_HEADER) is not None
        and getattr(lease.store, "supports_early_wake", False)
    )


def ignores_result(task: Any, request: Any) -> bool:
    return bool(task.ignore_result or getattr(request, "ignore_result", False))


def has_backend(task: Any) -> bool:
    """Whether the task's app has a result backend (not Celery's DisabledBackend)."""
    return not isinstance(task.backend, DisabledBackend)


def backend_readable(task: Any) -> bool:
    """Whether a worker can read another task's state from the task's result backend: not
    without one, nor from ``rpc://`` (results travel to their caller's reply queue)."""
    return not isinstance(task.backend, (DisabledBackend, RPCBackend))
