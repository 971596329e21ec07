"""Releasing and evicting from outside a task, with the hand-off a lease task's release does.

A store's ``release()`` and ``force_release()`` only change the store: the next waiter's message
is not sent (that is a Celery message, and a store knows no app). A lease task sends it when its
release hands the resource over; code that is not a lease task (a script, a cron job, a
management command, the CLI, a test) uses these two, which send it through the app, so a waiter
runs in milliseconds rather than from its back-stop copy a ttl later.
"""

from __future__ import annotations

from typing import Any

from ._app_stores import get_store
from ._errors import LeaseConfigError
from ._lease import Lease, LeaseInfo
from ._wakes import pass_turn, send_wake
from .stores.base import LeaseStore

__all__ = ["force_release", "release_lease"]


def _app_or_current(app: Any) -> Any:
    if app is not None:
        return app
    from celery import current_app

    return current_app._get_current_object()


def release_lease(lease: Lease, *, app: Any = None) -> bool:
    """Release ``lease`` and hand its resource to the next waiting task, as a lease task does.

    For a lease claimed outside a task (``store.acquire(...)`` in a script, a cron job, a
    test): ``lease.store.release(lease)`` frees the resource but wakes nobody, and the task
    waiting for it runs only from its back-stop copy, a ttl later. This sends the waiter's
    message through ``app`` (default: the current app) and checks, once the hand-off's grace
    is over, that the waiter claimed (else the next one is woken). A process that exits
    before then runs that check first, at interpreter exit: it waits up to about the grace.

    Returns:
        True when released; False when the lease was not this owner's any more (expired and
        taken over, evicted, released already): then nothing changed and nobody was woken.

    Raises:
        LeaseStoreError: the store failed; the lease expires by itself within its ttl.
    """
    store = lease.store
    if store is None:
        raise LeaseConfigError(
            f"{lease!r} has no store: pass a lease returned by a store's acquire()"
        )
    released = store.release(lease)
    payload, lease.handoff = lease.handoff, None
    if payload is not None:
        send_wake(
            _app_or_current(app), payload, lease.resource, "release", lease.fence, store=store
        )
    return released


def force_release(
    resource: str,
    *,
    app: Any = None,
    fence: int | None = None,
    store: LeaseStore | None = None,
) -> LeaseInfo | None:
    """Evict ``resource``'s holder and hand the resource to the next waiting task.

    What ``celery -A proj lease release --force`` does: the store's ``force_release`` (the
    fence moves on, so the evicted holder's fenced writes are refused once the resource is
    claimed again; the evicted task finds its lease lost and runs again from the start), then
    the next waiter is woken, as a release wakes it, and its turn checked as
    :func:`release_lease` checks it (at interpreter exit at the latest).

    Args:
        resource: the resource to evict.
        app: the app whose store and broker to use (default: the current app).
        fence: evict only the lease with this fence (the one you were shown): when the resource
            changed hands since, nothing is evicted and ``LeaseBusyError`` names its holder now.
        store: evict in this store instead of the app's.

    Returns:
        What was evicted, or None when the resource had no lease.

    Raises:
        LeaseBusyError: ``fence`` was given and the lease has another fence.
        LeaseStoreError: the store failed.
    """
    app = _app_or_current(app)
    if store is None:
        store = get_store(app)
    evicted = store.force_release(resource, fence=fence)
    pass_turn(app, store, [resource], by="evict")
    return evicted
