"""The sweeper: cleanup after leases whose holders are gone, and records past retention.

Expiry is the real recovery path: an expired lease is claimable, and its next owner is told who
held it before. What expiry alone does not do is close what the dead holder left open (a browser
profile, a temp dir) and delete old identity, ledger and checkpoint records. Each sweep run:

1. asks the store to delete identity, ledger and checkpoint records past retention
   (``store.sweep_expired(limit=...)``: bounded, through the stores' expiry indexes);
2. for every resource prefix with an :func:`on_expired` hook, reads the expired leases under it
   (``store.list(expired_only=True)``, the expiry index: O(expired), never the live leases),
   *claims* each (so no task can use the resource while it is cleaned up, and the dead holder's
   fenced writes are refused from then on), runs the hooks, and releases it. A hook that raises
   leaves the sweeper's claim to expire instead: the resource stays flagged (a WARNING log
   line, ``celery_lease_sweeps_total{result="cleanup_failed"}``, the
   :data:`lease_cleanup_failed` signal) and the next run tries again. It is never released as
   if it were clean. An expired lease whose resource has waiting tasks is not claimed past
   them: the free resource is held for the next waiter (the hand-off), so the sweeper wakes that
   waiter if nobody did, and flags the lease (``SweepReport.handed_over``, a WARNING line,
   ``celery_lease_sweeps_total{result="handed_over"}``): the waiter takes it over as
   ``recovered`` and reconciles, the hooks do not run for it. A cleaned-up lease is released
   with the hand-off too: the next waiter is woken at once.

Leases under prefixes without a hook are left alone: their next owner's claim reports the
previous holder (``lease.recovered``), which the sweeper must not erase.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from celery import shared_task
from celery.utils.dispatch import Signal

from . import _clock
from . import _events as events
from ._errors import LeaseBusyError, LeaseConfigError
from ._lease import Lease, LeaseInfo, Owner
from ._names import holder_task_id, show_value, validate_resource
from ._release import release_lease
from ._renewer import get_renewer
from ._settings import LeaseSettings
from ._wakes import send_wake
from .stores.base import MAX_LIST_LIMIT, LeaseStore

__all__ = [
    "ExpiredLease",
    "SweepReport",
    "lease_cleanup_failed",
    "on_expired",
    "run_sweep",
    "sweep",
    "sweep_schedule",
]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
Hook = Callable[["ExpiredLease"], Any]

#: Sent when an ``on_expired`` hook raised; the lease is kept for the next sweep. Receivers get
#: ``sender`` (the hook), ``resource``, ``holder_label``, ``fence`` (the expired holder's) and
#: ``exception``.
lease_cleanup_failed = Signal(name="lease_cleanup_failed")

_hooks: list[tuple[str, Hook]] = []
_CLEANING = " cleaning up after fence "


@dataclass(frozen=True)
class ExpiredLease:
    """What an ``on_expired`` hook is given: the expired lease, and the sweeper's own claim.

    Attributes:
        resource: the resource whose holder is gone.
        holder_label: the expired holder's label (``worker@host:pid:task-id`` for lease tasks).
        fence: the expired holder's fence; its fenced writes are refused from now on.
        expired_at: when its lease expired (store clock).
        lease: the sweeper's lease on the resource while the hook runs; pass ``lease.fence`` to
            fenced cleanup writes.
    """

    resource: str
    holder_label: str
    fence: int
    expired_at: datetime
    lease: Lease

    @property
    def task_id(self) -> str | None:
        """The expired holder's task id, when its label carries one."""
        return holder_task_id(self.holder_label)


@dataclass
class SweepReport:
    """The outcome of one sweep run."""

    #: Identity, ledger and checkpoint records deleted past retention.
    swept: int = 0
    #: Expired leases whose hooks ran and which were released.
    reclaimed: list[str] = field(default_factory=list)
    #: Expired leases whose cleanup failed; kept, flagged, tried again next run.
    cleanup_failed: list[str] = field(default_factory=list)
    #: Expired leases found with a hook (``dry_run``: what a real run would try to reclaim).
    expired: list[str] = field(default_factory=list)
    #: Expired leases whose resource is held for a waiting task: it takes them over (as
    #: recovered) before any cleanup; the hooks did not run for them.
    handed_over: list[str] = field(default_factory=list)
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def on_expired(prefix: str) -> Callable[[F], F]:
    """Register a cleanup hook for expired leases on resources starting with ``prefix``.

    ```python
    import shutil
    from pathlib import Path

    import celery_lease

    PROFILES = Path("/var/lib/agent/profiles")

    @celery_lease.on_expired("browser/")
    def close_profile(expired: celery_lease.ExpiredLease) -> None:
        shutil.rmtree(PROFILES / expired.resource.removeprefix("browser/"), ignore_errors=True)
    ```

    The sweeper calls the hook while it holds the resource's lease, so no task uses the resource
    meanwhile. Hooks must be idempotent (a failed run is repeated) and should finish within the
    lease ttl (the sweeper renews its lease while the hook runs). Several hooks may match one
    resource; they run in registration order. Register hooks in a module the worker (and the
    ``celery lease sweep`` command) imports: the app module or a task module.

    Raises:
        LeaseConfigError: ``prefix`` is not the start of a valid resource name.
    """
    try:
        validate_resource(prefix)
    except LeaseConfigError:
        raise LeaseConfigError(
            f"on_expired prefix {show_value(prefix)} must be the start of a valid resource "
            "name, e.g. 'browser/'"
        ) from None

    def register(hook: F) -> F:
        _hooks.append((prefix, hook))
        return hook

    return register


def _roots() -> list[str]:
    """The registered prefixes that no other registered prefix contains (listed once each)."""
    prefixes = sorted({prefix for prefix, _ in _hooks})
    roots: list[str] = []
    for prefix in prefixes:
        if not roots or not prefix.startswith(roots[-1]):
            roots.append(prefix)
    return roots


def _expired(store: LeaseStore, prefix: str, limit: int) -> Iterator[LeaseInfo]:
    cursor: str | None = None
    while limit > 0:
        page = store.list(
            prefix=prefix, expired_only=True, limit=min(limit, MAX_LIST_LIMIT), cursor=cursor
        )
        yield from page.leases
        limit -= len(page.leases)
        if page.cursor is None:
            return
        cursor = page.cursor


def run_sweep(
    app: Any = None,
    *,
    store: LeaseStore | None = None,
    limit: int = 1000,
    dry_run: bool = False,
) -> SweepReport:
    """Run one sweep (what the ``celery_lease.sweep`` task and ``celery lease sweep`` do).

    Args:
        app: the Celery app whose store to sweep (default: the current app).
        store: sweep this store instead of the app's.
        limit: at most this many records and this many expired leases per run.
        dry_run: only report the expired leases a run would try to reclaim; change nothing.
            It still reads the store, so a store that is down fails it as it fails a run.

    Returns:
        A :class:`SweepReport`.

    Raises:
        LeaseStoreError: the store failed (what was done before stays done).
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise LeaseConfigError(f"sweep limit must be a positive int, got {show_value(limit)}")
    if app is None:
        from celery import current_app

        app = current_app
    settings = LeaseSettings.resolve(app.conf)
    if store is None:
        from ._app_stores import get_store

        store = get_store(app, settings)
    report = SweepReport(dry_run=dry_run)
    roots = _roots()
    if not dry_run:
        report.swept = store.sweep_expired(limit=limit)
        if report.swept:
            events.count("celery_lease_sweeps_total", report.swept, result="swept")
    elif not roots:
        # A dry run skips sweep_expired, and with no hook it lists nothing: it would make no
        # store call at all and report "0 expired" of a store that is down. One bounded read
        # of the expiry index proves the store answers (LeaseStoreError if it does not).
        store.list(expired_only=True, limit=1)
    left = limit
    for root in roots:
        for info in list(_expired(store, root, left)):
            hooks = [hook for prefix, hook in _hooks if info.resource.startswith(prefix)]
            if not hooks:  # under a root, but not under any of its (longer) hook prefixes
                continue
            left -= 1
            report.expired.append(info.resource)
            if not dry_run:
                _reclaim(app, store, settings, info, hooks, report)
        if left <= 0:
            break
    if report.swept or report.reclaimed or report.cleanup_failed:
        log.info(
            "celery_lease sweep of %s: %d records swept, %d leases reclaimed, %d cleanups failed",
            store.url,
            report.swept,
            len(report.reclaimed),
            len(report.cleanup_failed),
        )
    return report


def _sweeper_label(holder_label: str, fence: int) -> str:
    # Names the dead holder, so a retry after a failed cleanup still knows whom it cleans for.
    return (
        f"celery_lease-sweeper@{socket.gethostname()}:{os.getpid()}{_CLEANING}"
        f"{fence} of {holder_label}"
    )


def _original(holder_label: str, fence: int) -> tuple[str, int]:
    """The dead holder behind a sweeper's label (after a failed cleanup), else the same."""
    if _CLEANING not in holder_label:
        return holder_label, fence
    rest = holder_label.split(_CLEANING, 1)[1]
    number, _, label = rest.partition(" of ")
    if not number.isdigit() or not label:  # cut short by the label length limit
        return holder_label, fence
    return label, int(number)


def _reclaim(
    app: Any,
    store: LeaseStore,
    settings: LeaseSettings,
    info: LeaseInfo,
    hooks: list[Hook],
    report: SweepReport,
) -> None:
    holder, fence = _original(info.owner_label, info.fence)
    owner = Owner.new(_sweeper_label(holder, fence))
    try:
        lease = store.acquire(info.resource, owner, min(settings.ttl, store.max_ttl))
    except LeaseBusyError as busy:
        if busy.wake is not None:  # the head waiter nobody woke: its turn, not ours to keep
            send_wake(app, busy.wake, info.resource, "sweep", busy.fence, store=store)
        if busy.holder_label is not None and busy.holder_label.endswith(" (hand-off)"):
            _flag_handed_over(info, busy.holder_label, report)
        return  # (else claimed since it was listed: its new owner deals with it)
    if lease.previous_fence is None:  # released since it was listed: nothing left to clean
        release_lease(lease, app=app)
        return
    if lease.previous_fence != info.fence:  # claimed and expired again since it was listed
        holder, fence = _original(lease.previous_owner_label or "?", lease.previous_fence)
    expired = ExpiredLease(
        resource=info.resource,
        holder_label=holder,  # after a failed cleanup: the dead holder, not the sweeper
        fence=fence,
        expired_at=info.expires_at,
        lease=lease,
    )
    renewer = get_renewer()
    hold = renewer.hold(
        lease,
        interval=settings.effective_renew_interval,
        max_runtime=settings.max_runtime,
        on_lost=lambda _hold, _exc: None,  # seen at release below
    )
    started = _clock.monotonic()
    try:
        for hook in hooks:
            try:
                hook(expired)
            except Exception as exc:  # noqa: BLE001 - a user's hook; flagged, never fatal
                _flag(hook, expired, exc)
                report.cleanup_failed.append(info.resource)
                return  # the claim stays and expires: the next run tries again
    finally:
        renewer.drop(hold)
    if release_lease(lease, app=app):  # (the next waiter is woken at once)
        report.reclaimed.append(info.resource)
        events.count("celery_lease_sweeps_total", result="reclaimed")
        return
    log.warning(
        "celery_lease: cleanup of expired lease %r (holder %r, fence %d) took %.1fs and outlived "
        "the sweeper's lease; another owner may have used the resource meanwhile",
        info.resource,
        expired.holder_label,
        expired.fence,
        _clock.monotonic() - started,
    )
    report.reclaimed.append(info.resource)
    events.count("celery_lease_sweeps_total", result="reclaimed")


def _flag_handed_over(info: LeaseInfo, waiter: str, report: SweepReport) -> None:
    log.warning(
        "celery_lease: expired lease %r (holder %r, fence %d) is held for %s: it takes the "
        "resource over (recovered, and reconciles) before any cleanup; the on_expired hooks did "
        "not run for it",
        info.resource,
        info.owner_label,
        info.fence,
        waiter.removesuffix(" (hand-off)"),
    )
    report.handed_over.append(info.resource)
    events.count("celery_lease_sweeps_total", result="handed_over")


def _flag(hook: Hook, expired: ExpiredLease, exc: Exception) -> None:
    name = getattr(hook, "__qualname__", repr(hook))
    log.warning(
        "celery_lease: cleanup of expired lease %r (holder %r, fence %d) failed in %s: %s: %s; "
        "the lease is kept for the next sweep",
        expired.resource,
        expired.holder_label,
        expired.fence,
        name,
        type(exc).__name__,
        exc,
    )
    events.count("celery_lease_sweeps_total", result="cleanup_failed")
    # (Signal.send logs a receiver's exception itself and goes on with the next receiver.)
    lease_cleanup_failed.send(
        sender=hook,
        resource=expired.resource,
        holder_label=expired.holder_label,
        fence=expired.fence,
        exception=exc,
    )


@shared_task(name="celery_lease.sweep", bind=True)  # type: ignore[untyped-decorator]
def sweep(self: Any, limit: int = 1000, dry_run: bool = False) -> dict[str, Any]:
    """The sweeper as a Celery task (see :func:`run_sweep`); returns the report as a dict."""
    return run_sweep(self.app, limit=limit, dry_run=dry_run).as_dict()


def sweep_schedule(app: Any, every: float = 300.0, *, limit: int = 1000) -> None:
    """Run the sweeper every ``every`` seconds with celery beat: one line in your app module.

    ``celery_lease.sweep_schedule(app, every=300)`` adds a ``celery_lease.sweep`` entry to
    ``app.conf.beat_schedule``; a run not started within ``every`` seconds is dropped (the
    next one does its work), so sweeps never pile up behind a busy queue.
    """
    if isinstance(every, bool) or not isinstance(every, (int, float)) or every <= 0:
        raise LeaseConfigError(f"sweep_schedule every= must be > 0 seconds, got {every!r}")
    schedule = dict(app.conf.beat_schedule or {})
    schedule["celery_lease.sweep"] = {
        "task": "celery_lease.sweep",
        "schedule": float(every),
        "kwargs": {"limit": limit},
        "options": {"expires": float(every)},
    }
    app.conf.beat_schedule = schedule
