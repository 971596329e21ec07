"""One task's lease as Flower should show it: it holds, it waits (where, behind whom), it ended,
or none of these.

Flower merges every event sent under a task id into one state, and the copies of a waiting or
redelivered task (its back-stop copy, a redelivery) share that id: a copy refused while the task
holds its lease sends ``task-lease-busy`` and then ``task-retried``, and Celery's event state
lets either replace STARTED. So the state Flower keeps is the last copy's, not the task's. The
lease store knows who holds the resource (the holder label ends in the holder's task id) and who
waits in its list (by identity, the task id unless the task sets one), and a task's own record
keeps the fence it ran with: those decide here, with Flower's state trusted only for the end of
a task (SUCCESS, FAILURE, REVOKED). Celery's event state would let a later ``task-retried``
replace even those, but no copy sends one after the end: a copy that comes later finds the
identity done and ends as a duplicate, or is dropped as revoked.

Store reads are cached for :data:`CACHE_SECONDS`, each only when the verdict needs it: Flower
calls the hook once per task row, from its event loop, so a table of a hundred tasks on one
resource reads its lease once, its wait list once if a task there may wait, and one identity
record per finished task.
"""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass
from typing import Any

from celery import states

from .. import _clock
from .._errors import LeaseError
from .._lease import LeaseInfo
from .._names import holder_task_id
from ..stores.base import IdentityInfo, Waiter

__all__ = ["CACHE_SECONDS", "Verdict", "clear_cache", "verdict"]

#: Seconds a read of the store is reused.
CACHE_SECONDS = 1.0
#: States after which no copy of the task claims again (see the module docstring): the only ones
#: of Flower's states this module takes as fact.
ENDED = frozenset(states.READY_STATES)
#: Waiters named before the rest are counted.
NAMED_AHEAD = 3
#: What reading Flower's text of the arguments can raise.
_UNREADABLE = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)

_cache: dict[tuple[Any, ...], tuple[float, Any]] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Verdict:
    """What is true of one task's lease: ``text`` for people, and the ``state`` to show instead
    of Flower's when the store proves Flower's wrong (None: Flower's is right)."""

    text: str
    state: str | None = None


def clear_cache() -> None:
    """Forget every cached read (tests; a store that was swapped under a running Flower)."""
    with _lock:
        _cache.clear()


def verdict(task: Any, app: Any) -> Verdict | None:
    """The lease of Flower's copy of ``task``, or None when it is no lease task of ``app`` or
    its resource cannot be worked out from the arguments Flower shows."""
    definition = _definition(task, app)
    if definition is None:
        return None
    try:
        call = _arguments(task)
    except _UNREADABLE:  # (cut short by Flower, or not Python literals)
        return None
    resource = _resource(definition, call)
    if resource is None:
        return None
    try:
        return _decide(task, definition, call, app, resource)
    except LeaseError as exc:
        return Verdict(f"{resource}: lease store unavailable ({exc})")


def _resource(definition: Any, call: tuple[tuple[Any, ...], dict[str, Any]]) -> str | None:
    """The resource the task leases: its template over Flower's text of the arguments."""
    try:
        return str(definition.lease_resource_for(*call))
    except (LeaseError, *_UNREADABLE):
        return None


def _decide(
    task: Any,
    definition: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    app: Any,
    resource: str,
) -> Verdict:
    task_id = str(getattr(task, "uuid", None) or "")
    state = str(getattr(task, "state", None) or states.PENDING)
    info = _lease(app, resource)
    if _holds(info, task_id) and state != states.STARTED:
        # About to contradict Flower (its state, or its end): never on a read up to a cache
        # period old, which may predate the release that the state Flower shows came after.
        info = _lease(app, resource, fresh=True)
    mine = _holds(info, task_id)
    if state in ENDED:
        if info is not None and mine and not info.expired:
            return Verdict(
                f"Flower shows it ended ({state}), yet this task id holds {resource} with fence "
                f"{info.fence}, expires in {info.expires_in:.1f}s: another copy of it runs, or "
                "its release did not reach the store"
            )
        return Verdict(_ended(definition, call, app, resource, state, task_id))
    if info is not None and mine:
        if info.expired:
            return Verdict(
                f"held {resource} with fence {info.fence}: that lease expired "
                f"{-info.expires_in:.1f}s ago and was never released (its worker may have died "
                "or stalled)"
            )
        text = f"holds {resource} with fence {info.fence}, expires in {info.expires_in:.1f}s"
        if state == states.STARTED:
            return Verdict(text)
        # Its body runs (the claim is made right before it): the state Flower kept came from
        # another copy of it, refused because this one holds the lease, or is not caught up.
        return Verdict(
            f"{text} (Flower's last event for this task id said {state}, from another copy of it)",
            states.STARTED,
        )
    queue = _waiters(app, resource)
    identity = _identity_of(definition, call, task_id)
    place = next((w for w in queue if w.identity == identity), None) if identity else None
    if place is not None:
        return Verdict(_waiting(resource, place, queue, info))
    return Verdict(f"not holding {resource}, not in its wait list: {_resource_state(info, queue)}")


def _holds(info: LeaseInfo | None, task_id: str) -> bool:
    return info is not None and bool(task_id) and holder_task_id(info.owner_label) == task_id


def _ended(
    definition: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    app: Any,
    resource: str,
    state: str,
    task_id: str,
) -> str:
    identity = _identity_of(definition, call, task_id)
    record = _identity_record(app, resource, identity) if identity else None
    if record is None:
        return f"ended ({state}); no fence of it is recorded on {resource}"
    if identity == task_id or holder_task_id(record.owner_label) == task_id:
        return f"ended ({state}) with fence {record.fence} on {resource}"
    # An identity of its own (identity= or an idempotency key) that another task ran last.
    return (
        f"ended ({state}); its identity {identity!r} on {resource} was last run by "
        f"{record.owner_label} with fence {record.fence}"
    )


def _waiting(resource: str, place: Waiter, queue: list[Waiter], info: LeaseInfo | None) -> str:
    text = f"waits for {resource} at place {place.position} of {len(queue)}"
    if place.woken:
        text += " (woken: its claim is due)"
    ahead = [w.identity for w in queue if w.position < place.position]
    behind = []
    if len(ahead) == 1:
        behind.append(ahead[0])
    elif ahead:
        named = ", ".join(ahead[:NAMED_AHEAD])
        more = f" and {len(ahead) - NAMED_AHEAD} more" if len(ahead) > NAMED_AHEAD else ""
        behind.append(f"{len(ahead)} waiters ({named}{more})")
    if info is not None:
        behind.append(f"the holder {_holder(info)}")
    if not behind:
        return f"{text}; {resource} is free"
    return f"{text}, behind {' and '.join(behind)}"


def _holder(info: LeaseInfo) -> str:
    if info.expired:
        return (
            f"{info.owner_label} (fence {info.fence}, expired {-info.expires_in:.1f}s ago, "
            "never released)"
        )
    return f"{info.owner_label} (fence {info.fence}, expires in {info.expires_in:.1f}s)"


def _resource_state(info: LeaseInfo | None, queue: list[Waiter]) -> str:
    if info is None:
        text = "free"
    elif info.expired:
        text = f"an expired lease of {info.owner_label} with fence {info.fence} was never released"
    else:
        text = (
            f"held by {info.owner_label} with fence {info.fence}, expires in {info.expires_in:.1f}s"
        )
    return f"{text}; {len(queue)} waiting" if queue else text


def _definition(task: Any, app: Any) -> Any:
    from .._task import LeaseTask

    definition = app.tasks.get(getattr(task, "name", None) or "")
    return definition if isinstance(definition, LeaseTask) else None


def _arguments(task: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args = _literal(getattr(task, "args", None), ())
    kwargs = _literal(getattr(task, "kwargs", None), {})
    return tuple(args), dict(kwargs)


def _literal(text: Any, empty: Any) -> Any:
    if text is None or text == "":
        return empty
    if not isinstance(text, str):
        return text
    return ast.literal_eval(text)


def _identity_of(
    definition: Any, call: tuple[tuple[Any, ...], dict[str, Any]], task_id: str
) -> str | None:
    """The identity the task claims and waits under: its ``identity=`` template over the
    arguments, else its task id. (An ``idempotency_key`` header would win on the worker; Flower
    does not show headers.) None when the task keeps no identity (dedup off)."""
    if not task_id:
        return None
    from celery.app.task import Context

    try:
        identity = definition.lease_identity_for(*call, Context(id=task_id))
    except (LeaseError, *_UNREADABLE):
        return task_id
    return None if identity is None else str(identity)


def _lease(app: Any, resource: str, fresh: bool = False) -> LeaseInfo | None:
    return _cached(  # type: ignore[no-any-return]
        ("lease", id(app), resource), lambda: _store(app).get(resource), fresh
    )


def _waiters(app: Any, resource: str) -> list[Waiter]:
    return _cached(  # type: ignore[no-any-return]
        ("waiters", id(app), resource), lambda: list(_store(app).waiters(resource))
    )


def _identity_record(app: Any, resource: str, identity: str) -> IdentityInfo | None:
    return _cached(  # type: ignore[no-any-return]
        ("identity", id(app), resource, identity),
        lambda: _store(app).identity_get(resource, identity),
    )


def _store(app: Any) -> Any:
    from .._app_stores import get_store

    return get_store(app)


def _cached(key: tuple[Any, ...], read: Any, fresh: bool = False) -> Any:
    now = _clock.monotonic()
    with _lock:
        hit = None if fresh else _cache.get(key)
    if hit is not None and now - hit[0] < CACHE_SECONDS:
        return hit[1]
    value = read()
    with _lock:
        if len(_cache) > 10_000:
            _cache.clear()
        _cache[key] = (now, value)
    return value
