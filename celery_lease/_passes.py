"""Where a worker passes the turn on, and what a process does on its way out.

Which process of a worker passes over the wait lists (see ``_wakes``): a worker without pool
processes, on the waker's thread; a prefork worker with an event loop, in its main process, on
that loop; one without, in its first pool process. A prefork worker that passes on its loop
takes the turn checks its pool processes have pending when they exit (``_ParentTurns``).

Importing this module installs three process-wide hooks: a ``worker_process_init`` receiver
that starts the passes in the first prefork pool process of a worker without an event loop,
and a ``worker_process_shutdown`` receiver and an ``atexit`` handler that release the leases
still held and run (or hand over) the turn checks still pending.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import weakref
from typing import Any

from celery import signals

from . import metrics
from ._app_stores import _stores, lease_stores
from ._errors import LeaseError
from ._renewer import get_renewer
from ._settings import LeaseSettings
from ._wakes import TurnCheck, drain_turns, get_waker

__all__ = [
    "HAND_OVER_TURNS",
    "PARENT_CALL_TIMEOUT",
    "PASS_IN_PARENT",
    "is_prefork",
    "pass_on_loop",
    "release_all_held",
    "start_passes",
]

# (the logger these lines had before they left _app.py: logging settings that name it still apply)
log = logging.getLogger("celery_lease._app")


def release_all_held() -> int:
    """Release every lease this process still holds (shutdown path). Returns how many."""
    renewer = get_renewer()
    held = renewer.held()
    renewer.shutdown()
    released = 0
    for lease in held:
        if lease.store is None:
            continue
        try:
            released += bool(lease.store.release(lease))
        except LeaseError as exc:
            log.warning("could not release %r at shutdown: %s", lease, exc)
    if held:
        log.info("celery_lease released %d of %d held leases at shutdown", released, len(held))
    return released


def _on_process_shutdown(**_: Any) -> None:
    release_all_held()
    # A pool process recycled right after its release: its turn check is handed to the main
    # process (its pool slot is not held for it), or else runs before it exits.
    turns = _parent_turns if HAND_OVER_TURNS else None
    drain_turns(hand_over=None if turns is None else turns.hand_over)
    metrics.mark_process_dead()


def _at_exit() -> None:
    release_all_held()
    if _parent_turns is not None:  # (a prefork worker's main process whose loop has stopped)
        _parent_turns.take_leftovers()
    drain_turns()  # (the CLI, a script's release_lease or force_release: about a grace)


def _pass_over_waits(app: Any, call_timeout: float | None = None) -> None:
    """Pass the turn on over ``app``'s wait lists every renew interval in this process (see
    ``_wakes``): a wake whose sender died, or the waiters of a holder that died, go out within
    about the hand-off grace plus that interval. ``call_timeout``: through stores of their own
    whose calls wait at most that long (an event loop waits for them)."""
    settings = LeaseSettings.resolve(app.conf)
    get_waker().pass_every(
        app,
        settings.effective_renew_interval,
        lambda: lease_stores(app, call_timeout=call_timeout),
    )


#: Whether a prefork worker with an event loop (a Redis or AMQP broker) passes over the wait
#: lists in its main process, on that loop (the tests' negative control sets False: in its
#: first pool process, as a worker without an event loop does).
PASS_IN_PARENT = True
#: The longest one store call of a prefork worker's main process may wait for an answer: its
#: event loop (fetching, dispatching and acking every task) waits meanwhile. A pass makes one
#: call per store, and stops at an error until its next interval.
PARENT_CALL_TIMEOUT = 1.0

#: Apps whose prefork pool processes pass over the wait lists (see start_passes).
_pass_in_children: weakref.WeakSet[Any] = weakref.WeakSet()


class _ParentTurns:
    """How the pool processes of a prefork worker that passes on its event loop hand their
    pending turn checks to its main process when they exit, instead of waiting for them: a
    process recycled by ``--max-tasks-per-child`` right after its release would hold its pool
    slot for about a grace, and with one slot the woken waiter could not run meanwhile.

    A pipe made by the main process before it forks the pool. A pool process writes one line
    per check, ``[resource, due]`` in JSON (each written whole: under PIPE_BUF bytes); the main
    process reads them on its event loop and checks that resource at its due time in each
    store it passes over (the same wait lists as the pool process's store: only checks on a
    store the app's settings name are handed over).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.pid = os.getpid()
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)  # (a main process that stalls: keep them here)
        self._partial = b""

    def register_with(self, hub: Any) -> None:
        hub.add_reader(self.read_fd, self._read)  # (again after a reconnection: no harm)

    def hand_over(self, checks: list[TurnCheck]) -> list[TurnCheck]:
        """In a pool process: write the checks the main process can run; the others come
        back (and those a full or closed pipe did not take)."""
        if os.getpid() == self.pid:
            return checks
        named = {id(store) for store in _stores.get(self.app, {}).values()}
        kept: list[TurnCheck] = []
        for check in checks:
            line = json.dumps([check.resource, check.due]).encode() + b"\n"
            if check.app is not self.app or id(check.store) not in named:
                kept.append(check)
                continue
            try:
                if len(line) > select.PIPE_BUF or os.write(self.write_fd, line) != len(line):
                    kept.append(check)
            except OSError:
                kept.append(check)
        return kept

    def take_leftovers(self) -> None:
        """In the main process at its exit: take the checks its pool processes handed over
        after its event loop stopped (a warm shutdown: they exit as the pool is closed), for
        ``drain_turns`` to run."""
        if os.getpid() == self.pid:
            while self._read():
                pass

    def _read(self) -> bool:
        """Take the checks written so far (on the event loop); whether anything was read.
        Never raises: an error here would stop the worker's event loop."""
        try:
            data = os.read(self.read_fd, 65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            log.exception("celery_lease: reading the turn checks of the pool processes failed")
            return False
        try:
            self._schedule(data)
        except Exception:
            log.exception("celery_lease: the turn checks handed over by a pool process failed")
        return bool(data)

    def _schedule(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        checks = []
        for line in lines:
            try:
                resource, due = json.loads(line)
                checks.append((str(resource), float(due)))
            except (ValueError, TypeError):
                log.warning("celery_lease: a pool process handed over an unreadable turn check")
        if not checks:
            return
        waker = get_waker()
        for store in lease_stores(self.app, call_timeout=PARENT_CALL_TIMEOUT):
            for resource, due in checks:
                waker.check_at(self.app, store, resource, due)


#: This worker's, when its pool processes hand their turn checks to its main process.
_parent_turns: _ParentTurns | None = None
#: Whether they do (the tests' negative control sets False: each waits for its own).
HAND_OVER_TURNS = True


def start_passes(worker: Any) -> bool:
    """Pass over the wait lists once per worker: in this process, on the waker's thread,
    unless the pool forks. A prefork worker passes in its main process, on its event loop
    (started by pass_on_loop), whichever pool processes come and go; never on a thread
    there (the loop forks the pool processes: a thread of ours could be forked in the middle
    of a store call). Without an event loop, its first pool process passes.

    Returns:
        Whether the passes wait for the worker's event loop (``pass_on_loop``).
    """
    global _parent_turns  # noqa: PLW0603 - one worker per process; its pool inherits it
    app = worker.app
    on_loop = False
    if not is_prefork(worker):
        _pass_over_waits(app)
    elif PASS_IN_PARENT and getattr(worker, "use_eventloop", False):
        on_loop = True
        if _parent_turns is None or _parent_turns.app is not app:
            _parent_turns = _ParentTurns(app)
    else:
        _pass_in_children.add(app)
    return on_loop


def pass_on_loop(app: Any, hub: Any) -> None:
    """The worker's event loop starts (again, after a broker reconnection): a prefork
    worker's main process passes over the wait lists on it, through stores whose calls
    wait at most PARENT_CALL_TIMEOUT (the loop waits for them)."""
    get_waker().run_on(hub)
    _pass_over_waits(app, call_timeout=PARENT_CALL_TIMEOUT)
    if _parent_turns is not None:
        _parent_turns.register_with(hub)


def is_prefork(worker: Any) -> bool:
    """Whether the worker runs its tasks in prefork pool processes."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    pool = getattr(worker, "pool_cls", None)
    return isinstance(pool, type) and issubclass(pool, PreforkPool)


def _on_process_init(**_: Any) -> None:
    # Without an event loop in the main process (a broker transport without one, or
    # PASS_IN_PARENT off): one pool process passes (the first; a replacement takes its index):
    # every process would multiply the passes, and each holds a store connection of its own
    # while it passes. (Shrunk away by --autoscale, or recycled by --max-tasks-per-child
    # faster than one interval, it passes no more: see start_passes.)
    from billiard.process import current_process

    if getattr(current_process(), "index", 0) not in (0, None):
        return
    for app in list(_pass_in_children):
        _pass_over_waits(app)


# Import-time side effect (1 of 3): the first pool process of a prefork worker without an event
# loop passes over the wait lists of the apps its worker started (connected here, in the
# parent, before it forks).
signals.worker_process_init.connect(_on_process_init, weak=False)


# Import-time side effects (2 and 3 of 3): a pool process that exits, and an interpreter that
# exits, release the leases still held, so the next owner need not wait for the ttl, and run
# the turn checks still pending (bounded by about a grace), so a wake it sent is passed on if
# its waiter never claims. Both are process-wide and idempotent (nothing held, nothing pending:
# nothing done), so they are connected once, when the first lease task module imports this one.
signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
atexit.register(_at_exit)
