"""Unique at publish (``unique=``): a lock on a task's unique key, taken when a copy is
published and given back when its mode says; what a publish does when another copy holds it.

The modes are sidekiq-unique-jobs' words. ``while_executing`` takes no lock here (the run's
lease on ``resource=`` is the only exclusion, as in every mode). The others take one at
publish, in the lease store, on ``unique:<key>`` (the task's name and resource by default):

================================  ===========================================================
``until_executing``               given back when the body starts (after the run's claim)
``until_and_while_executing``     given back when a worker starts the execution, before its
                                  claim (a new copy may be queued while it waits)
``until_executed``                given back when the execution ends (success, failure, a
                                  skip, giving up); kept across ``retry()`` and re-queues
``until_expired``                 never given back: it lives its ttl (a throttle)
================================  ===========================================================

A lock is a lease like any other (a fence, a ttl, ``celery lease ls``, ``release --force``),
owned by the task id: its owner token is derived from the key and the task id, so every copy
and every resend of that task id (``retry()``, a busy re-queue) is its owner without the token
travelling in the message, and a resend is never a conflict. The message carries the lock
(``UNIQUE_HEADER``) so that a worker gives it back without asking the store what it was.
No lock outlives its ttl (``unique_ttl``, plus a countdown's delay): a copy lost with its
worker or purged from its queue frees its key by then; a revoked or expired one when a worker
drops it (``task_revoked``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import signals
from kombu.utils.uuid import uuid

from . import _clock
from ._errors import (
    AlreadyQueuedError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
)
from ._lease import Lease, Owner
from ._message import UNIQUE_HEADER, names_task, read_header
from ._names import (
    MAX_LABEL_LENGTH,
    RESOURCE_PATTERN,
    RESOURCE_RULE,
    holder_task_id,
    key_of,
    label_task_id,
    show_value,
)
from ._pid import getpid
from .stores.base import LOCK_MAX_TTL, LOCK_PREFIX

if TYPE_CHECKING:
    from ._setup import TaskSetup
    from .stores import LeaseStore

__all__ = ["UNIQUE_HEADER", "at_body", "at_start", "finished", "key_for", "publish"]

log = logging.getLogger("celery_lease")

#: A lock's header is resent without asking the store while at least this share of the ttl
#: a resend needs is left (a busy re-queue every few seconds asks about once per half hour).
REFRESH_SHARE = 0.5
#: Whether a worker that drops a revoked or expired copy gives its lock back (the tests'
#: negative control sets False: the key then stays held until its ttl runs out).
RELEASE_ON_REVOKE = True


def key_for(
    task: Any, setup: TaskSetup, args: tuple[Any, ...], kwargs: dict[str, Any], resource: str
) -> str:
    """The lock's resource: ``unique:``, the task's name and the call's ``unique_key`` (by
    default its ``resource``), as the peers key a lock by task name and arguments. Raises
    LeaseConfigError naming the task and the value it produced."""
    template = setup.unique_key
    if template is None:
        part = resource
    elif template.spec is key_of:  # by the arguments as the signature binds them
        part = key_of(*_bound(template, args, kwargs))
    else:
        part = template.render(args, kwargs)
        if not (isinstance(part, str) and RESOURCE_PATTERN.fullmatch(part)):
            raise LeaseConfigError(
                f"task {task.name!r}: unique_key {show_value(template.spec)} gave "
                f"{show_value(part)}, which is not a valid key ({RESOURCE_RULE}); build it with "
                "celery_lease.key_of(...)"
            )
    name = f"{task.name}:{part}"
    key = LOCK_PREFIX + name
    if len(key) <= 200 and RESOURCE_PATTERN.fullmatch(key):
        return key
    return LOCK_PREFIX + _digest(name)  # (long, or a task name with other characters)


def _bound(template: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The call's arguments in the order of the task's parameters, defaults applied: the
    same call made positionally or by keyword gives the same key."""
    try:
        bound = template.signature.bind(*args, **kwargs)
    except TypeError:
        return [*args, *(f"{k}={v!r}" for k, v in sorted(kwargs.items()))]
    bound.apply_defaults()
    return list(bound.arguments.values())


def _digest(text: str) -> str:
    """A valid name for any text: its start as far as it is valid, and a digest of all of it."""
    start = text[:120]
    while start and not RESOURCE_PATTERN.fullmatch(start):
        start = start[:-1]
    return f"{start}.{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def owner_of(key: str, task_id: str, name: str, mode: str, resource: str = "") -> Owner:
    """The owner of ``key``'s lock for ``task_id``: the same for every copy of that task id.
    Its label names the task, the mode and the run's resource (``run=``, when it fits)."""
    token = hashlib.sha256(f"celery_lease unique\0{key}\0{task_id}".encode()).hexdigest()[:32]
    note = f"{name} unique={mode}" if " " not in name else f"unique={mode}"
    label = f"{socket.gethostname()}:{getpid()}:{label_task_id(task_id)} {note}"
    if resource and len(label) + len(resource) + 5 <= MAX_LABEL_LENGTH:
        label += f" run={resource}"
    return Owner(token, label)


def _run_of(label: str | None) -> str | None:
    """The run's resource a lock's label names (None: not written, it did not fit)."""
    if label is None:
        return None
    _, _, run = label.rpartition(" run=")
    return run if run and RESOURCE_PATTERN.fullmatch(run) else None


def _delay(options: dict[str, Any]) -> float:
    """How long a countdown or eta holds the message before a worker may start it."""
    countdown = options.get("countdown")
    if countdown is not None:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            return 0.0  # (Celery refuses it too)
    if isinstance(eta, datetime):
        if eta.tzinfo is None:  # as Celery reads it (enable_utc, the default): UTC
            eta = eta.replace(tzinfo=timezone.utc)
        return max(0.0, eta.timestamp() - _clock.wall())
    return 0.0


# -- publish ----------------------------------------------------------------------------------
def publish(
    task: Any,
    setup: TaskSetup,
    send: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task_id: str | None,
    options: dict[str, Any],
    resource: str,
) -> Any:
    """Publish one copy of ``task`` through ``send`` (Celery's ``apply_async``) with its lock:
    taken first, given back if the publish fails; on a conflict, as ``on_conflict`` says."""
    settings = setup.settings
    mode = settings.unique
    headers = dict(options.get("headers") or {})
    request = task.request
    resend = task_id is not None and task_id == request.id and not request.called_directly
    held = headers.get(UNIQUE_HEADER) or (read_header(request, UNIQUE_HEADER) if resend else None)
    # (a countdown past LOCK_MAX_TTL: the lock lives that long, and no longer)
    needed = min(settings.unique_ttl + _delay(options), LOCK_MAX_TTL)
    if resend or (held is not None and task_id is not None):  # never a conflict
        if held is not None and task_id is not None:  # retry(), a re-queue: the lock goes on
            headers[UNIQUE_HEADER] = _kept(task, setup, held, task_id, needed)
        return send(args, kwargs, task_id, **{**options, "headers": headers})
    task_id = task_id or uuid()
    key = key_for(task, setup, args, kwargs, resource)
    store = setup.current_store()
    owner = owner_of(key, task_id, task.name, mode, resource)
    lock, busy = _take(task, setup, store, key, owner, needed)
    if lock is None:
        assert busy is not None
        other = holder_task_id(busy.holder_label or "")
        return _conflict(task, key, busy, other, settings.on_conflict, mode)
    headers[UNIQUE_HEADER] = [key, lock.fence, mode, round(_clock.wall() + needed, 3), 0]
    try:
        return send(args, kwargs, task_id, **{**options, "headers": headers})
    except BaseException:
        with contextlib.suppress(LeaseError):
            store.release(lock)  # nothing was published: nothing may keep the key
        raise


def _take(
    task: Any,
    setup: TaskSetup,
    store: LeaseStore,
    key: str,
    owner: Owner,
    ttl: float,
) -> tuple[Lease | None, LeaseBusyError | None]:
    """Take the lock (with ``replace``, once more after freeing it); or the refusal."""
    try:
        return store.acquire(key, owner, ttl), None
    except LeaseBusyError as busy:
        other = holder_task_id(busy.holder_label or "")
        if setup.settings.on_conflict != "replace" or not _replace(task, store, busy, other):
            return None, busy
    try:
        return store.acquire(key, owner, ttl), None
    except LeaseBusyError as busy:  # another publish took it first
        return None, busy


def _kept(task: Any, setup: TaskSetup, held: Any, task_id: str, needed: float) -> Any:
    """A resend's lock header: an ``until_executed`` lock is made to last the resend's wait
    (renewed, or taken again when it lapsed) when less than half of that is left."""
    try:
        key, fence, mode, expires, released = held
        if mode != "until_executed" or released:
            return held
        if float(expires) - _clock.wall() >= needed * REFRESH_SHARE:
            return held
        store = setup.current_store()
        lock = _lock(store, key, int(fence), task_id, task.name, mode)
        try:
            store.renew(lock, needed)
        except LeaseLostError:  # lapsed: take it again if nobody else did
            lock = store.acquire(key, lock.owner, needed)
    except LeaseBusyError:
        return held  # another copy holds it now: this one is sent all the same
    except (LeaseError, TypeError, ValueError) as exc:
        log.warning(
            "celery_lease: task %s[%s]: could not extend its unique lock (%s); sent again "
            "without extending it",
            task.name,
            task_id,
            exc,
        )
        return held
    return [key, lock.fence, mode, round(_clock.wall() + needed, 3), 0]


def _lock(store: LeaseStore, key: str, fence: int, task_id: str, name: str, mode: str) -> Lease:
    """The lock a header names, as its owner holds it (for a release or a renewal)."""
    return Lease(
        resource=key,
        owner=owner_of(key, task_id, name, mode),
        fence=fence,
        acquired_at=0,
        expires_at=0,
        ttl=1.0,
        sent_monotonic=_clock.monotonic(),
        store=store,
    )


def _conflict(
    task: Any, key: str, busy: LeaseBusyError, other: str | None, how: str, mode: str
) -> Any:
    """A publish that found the key held by another copy: nothing is published."""
    log.info(
        "celery_lease: task %s: not published, its unique key %r is held by %s (%s)",
        task.name,
        key,
        other or busy.holder_label,
        how,
    )
    if how == "skip":
        return None
    if how == "return_existing" and other is not None:
        return task.AsyncResult(other)
    left = "" if busy.expires_in is None else f", {busy.expires_in:.0f}s left"
    holder = f"task {other}" if other is not None else repr(busy.holder_label)
    raise AlreadyQueuedError(
        f"task {task.name!r} is already queued or running: its unique key {key!r} is held by "
        f"{holder} (unique={mode!r}{left}); nothing was published. on_conflict='return_existing' "
        "returns that task's result, 'skip' returns None, 'replace' revokes a copy not started",
        key,
        other,
    )


def _replace(task: Any, store: LeaseStore, busy: LeaseBusyError, other: str | None) -> bool:
    """on_conflict="replace": revoke the copy that holds the key and free the key, unless
    that copy has started (its run holds its resource, which the lock's label names) or
    cannot be told (not a task's lock, or its label has no room for the resource)."""
    run = _run_of(busy.holder_label)
    if other is None or run is None or busy.resource is None or busy.fence is None:
        return False
    info = store.get(run)
    if info is not None and not info.expired and names_task(info.owner_label, other):
        return False  # started: it runs on, and this publish is refused
    task.app.control.revoke(other)
    try:
        store.force_release(busy.resource, fence=busy.fence)  # only the lock it saw
    except LeaseBusyError:
        return False  # it changed hands meanwhile: a conflict with the new holder
    log.info(
        "celery_lease: task %s: revoked task %s, which held unique key %r, to publish anew",
        task.name,
        other,
        busy.resource,
    )
    return True


# -- the worker's side ------------------------------------------------------------------------
def at_start(task: Any, setup: TaskSetup, request: Any) -> None:
    """A worker starts an execution: ``until_and_while_executing`` gives its lock back."""
    if setup.settings.unique == "until_and_while_executing":
        _give_back(task, setup, request)


def at_body(task: Any, setup: TaskSetup, request: Any) -> None:
    """The body starts (the run's claim succeeded): ``until_executing`` gives its lock back."""
    if setup.settings.unique == "until_executing":
        _give_back(task, setup, request)


def finished(task: Any, request: Any) -> None:
    """The execution ended (success, failure, skip, giving up): ``until_executed`` gives its
    lock back."""
    setup = task._compiled()
    if setup.settings.unique == "until_executed":
        _give_back(task, setup, request)


def _give_back(task: Any, setup: TaskSetup, request: Any) -> None:
    held = read_header(request, UNIQUE_HEADER)
    if not isinstance(held, list) or len(held) != 5 or held[4] or request.id is None:
        return
    key, fence, mode, _, _ = held
    try:
        store = setup.current_store()
        store.release(_lock(store, key, int(fence), request.id, task.name, mode))
    except (LeaseError, TypeError, ValueError) as exc:
        log.warning(
            "celery_lease: task %s[%s]: could not give back its unique lock %r (%s); it frees "
            "itself when its ttl runs out",
            task.name,
            request.id,
            key,
            exc,
        )
        return
    held[4] = 1  # (this execution's later copies carry it: nothing left to give back)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A revoked or expired copy dropped by a worker gives its lock back (any mode but
    ``until_expired``), so its key is free by the time a worker sees it. ``request`` is the
    task's context (Celery sends the worker request's context)."""
    setup_of = getattr(sender, "_compiled", None)
    if not RELEASE_ON_REVOKE or setup_of is None or request is None:
        return
    try:
        held = read_header(request, UNIQUE_HEADER)
        if not isinstance(held, list) or len(held) != 5 or held[4] or held[2] == "until_expired":
            return
        key, fence, mode, _, _ = held
        store = setup_of().current_store()
        store.release(_lock(store, key, int(fence), request.id, sender.name, mode))
    except Exception as exc:  # noqa: BLE001 - a worker's signal handler must not raise
        log.warning(
            "celery_lease: revoked task %s: could not give back its unique lock (%s); it frees "
            "itself when its ttl runs out",
            getattr(request, "id", "?"),
            exc,
        )


signals.task_revoked.connect(_on_revoked, weak=False)
