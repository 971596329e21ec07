"""Sending wakes, and passing the turn on where a woken waiter never claims.

A wake is a waiting task's message sent again: its turn has come (invariants 12-16 of
``stores/protocol.py``). Everything that wakes a waiter sends it through :func:`send_wake`: the
releasing task, a refused claim that found the head never woken, the sweeper, the CLI and
``celery_lease.release_lease`` / ``force_release``. Two more things make sure the turn goes on
when the woken copy never claims (revoked, expired, dropped before its claim, stuck in a
dead worker) or the wake never left (its sender died after the release):

* after each wake this process sends, a **turn check** once the wake's grace is over (a
  polling place's turn: once its hold of ``POLL_HOLD`` graces is over): the store's
  ``wake_due`` on that resource wakes the next waiter and sends the missed one's wake once
  more (the grace, not a ttl later);
* every worker makes a **pass** over its stores' wait lists every renew interval
  (``wake_due`` on every list): wakes whose sender died, and waiters of a holder that died, go
  out within about the grace plus one interval.

A process that exits with turn checks pending runs them first (:func:`drain_turns`: a prefork
pool process on ``worker_process_shutdown``, the CLI, a script at interpreter exit), each once
its waiter claimed or its grace is over, and never waits much past the latest one (a store
that does not answer cannot hold the exit): a pool process recycled right after its release,
or ``celery lease release --force``, no longer takes the turn check with it.

One thread per process (:class:`Waker`) keeps both; a forked child makes its own. A prefork
worker with an event loop (a Redis or AMQP broker) passes in its main process, on that loop
(:meth:`Waker.run_on`, the consumer's hub timer), never on a thread there (the loop forks the
pool processes: a thread of ours could be forked in the middle of a store call); its pool
processes hand the turn checks they have pending when they exit to it (``_passes``). So neither
depends on one pool process staying alive (``--max-tasks-per-child``, ``--autoscale``). A
prefork worker without an event loop passes in its first pool process.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _clock
from . import _events as events
from ._errors import LeaseError
from ._pid import getpid
from ._wake_queues import (
    ROUTE_HEADER,
    WAKE_QUEUE_SUFFIX,
    task_wake_queues,
    to_wake_queue,
    wake_queue,
    wake_queues_on,
)
from .stores._bounds import POLL, POLL_HOLD

if TYPE_CHECKING:
    from .stores.base import LeaseStore

__all__ = [
    "EARLY_HEADER",
    "EARLY_RETRY_DELAYS",
    "LINEAGE_HEADER",
    "ROUTE_HEADER",
    "WAKE_QUEUE_SUFFIX",
    "WOKEN_HEADER",
    "TurnCheck",
    "Waker",
    "drain_turns",
    "get_waker",
    "pass_turn",
    "send_wake",
    "to_wake_queue",
    "wake_queue",
    "wake_queues_on",
]

log = logging.getLogger(__name__)

#: The fence of the holder that refused a message's first claim (or of the waker, on the woken
#: copy of that claim's listing): every copy of that waiting execution (its lineage) carries
#: it, so a failed run of this task id newer than it is a sibling copy's run, and an older one
#: ran before this message was sent (a task id re-sent after its failure runs).
LINEAGE_HEADER = "celery_lease_since_fence"
#: When (wall clock) a waiter's message was sent by a wake: the hand-off latency's start.
WOKEN_HEADER = "celery_lease_woken_at"
#: In a wake sent with the release that hands the resource over (an early wake, see
#: ``LeaseTask._release``): how many more times this copy, refused because that release has not
#: landed yet, is sent again after a short delay (``EARLY_RETRY_DELAYS``).
EARLY_HEADER = "celery_lease_early"
EARLY_RETRY_DELAYS = (0.02, 0.1, 0.5)

#: Whether this process passes the turn on at all: turn checks after its wakes and passes over
#: the wait lists (the tests' negative control sets False: dropped wakes then wait for their
#: back-stop copies).
PASS_THE_TURN = True
#: How long after a wake's grace ends its turn check runs: the woken copy's claim, sent just
#: before the grace ended, has landed by then.
TURN_SLACK = 0.05
#: The passes over the wait lists are spread by +- this share of their interval.
PASS_JITTER = 0.2
#: The longest a pass on an event loop waits before it is tried again after store errors (it
#: backs off from one renew interval, doubling: each failure held the loop for its timeout).
RETRY_CAP = 30.0
#: How many graces after a polling place's turn came its turn check runs: when its hold ends
#: (POLL_HOLD graces: it polls once a grace), not while it is still in flight (the tests'
#: negative control sets 1).
POLL_TURN_GRACES = POLL_HOLD
#: The most resources one turn check names in its ``wake_due`` (the checks due together on one
#: store go in one call).
TURN_BATCH = 100
#: Whether a process that exits runs its pending turn checks first (:func:`drain_turns`; the
#: tests' negative control sets False).
EXIT_TURNS = True
#: How much longer than its latest pending turn check is due an exiting process waits for its
#: turn checks: a store call and the wakes it hands back. Then it exits all the same.
EXIT_SLACK = 1.0
#: How often an exiting process looks whether the waiters it woke have claimed (then it need
#: not wait for their grace to end).
EXIT_POLL = 0.05
#: How long an exiting process's turn checks may take before ``on_wait`` is told it waits.
WAIT_NOTICE = 0.3


def send_wake(
    app: Any,
    payload: str,
    resource: str,
    by: str,
    fence: int | None = None,
    *,
    early: bool = False,
    wake_queues: bool | None = None,
    store: LeaseStore | None = None,
) -> bool:
    """Send a woken waiter's message now; whether it was sent.

    ``by`` says who woke it (the ``celery_lease_handoffs_total`` label); ``fence``: the waker's
    (the releaser's, or the last holder's), which a message listed at its first claim takes as
    its waiting execution's start (LINEAGE_HEADER); ``early``: sent before the release that
    hands the resource over (EARLY_HEADER); ``wake_queues``: whether the message may go to
    its queue's wake queue (None: as the waiting task's settings say); ``store``: the store
    whose wait list woke it, to check once the wake's grace is over that the turn went on
    (a turn check, see :class:`Waker`). A send that fails leaves the waiter to its back-stop
    copy and to the next pass over the wait lists. A polling place's payload (``POLL``) has
    nothing to send: its task comes back by itself; its turn is checked all the same.
    """
    if payload == POLL:
        if store is not None:  # (checked when the polling place's hold ends)
            get_waker().after_wake(app, store, resource, graces=POLL_TURN_GRACES)
        return True
    try:
        message = json.loads(payload)
        options = message["options"]
        headers = options.setdefault("headers", {})
        headers[WOKEN_HEADER] = _clock.wall()
        if early:
            headers[EARLY_HEADER] = len(EARLY_RETRY_DELAYS)
        if fence is not None:
            headers.setdefault(LINEAGE_HEADER, fence)
        via = headers.pop(ROUTE_HEADER, None)
        if wake_queues is None:
            wake_queues = task_wake_queues(app, message.get("task"))
        if isinstance(via, str) and wake_queues:
            to_wake_queue(options, headers, via)
        app.signature(message).apply_async()
    except Exception as exc:  # noqa: BLE001 - any broker failure: the back-stop covers it
        log.warning(
            "could not wake the next waiter of %r (its back-stop copy runs it later): %s",
            resource,
            exc,
        )
        return False
    events.count("celery_lease_handoffs_total", by=by)
    if store is not None:
        get_waker().after_wake(app, store, resource)
    return True


def pass_turn(
    app: Any, store: LeaseStore, resources: Sequence[str] | None = None, *, by: str = "turn"
) -> int:
    """Pass the turn on in ``store`` where nobody else will (its ``wake_due``) and send the
    wakes it hands back; how many were sent. ``resources``: only these (None: every wait
    list). A newly woken waiter gets a turn check of its own once its grace is over.

    Raises:
        LeaseStoreError: the store failed (wakes it marked meanwhile go out at a later pass).
    """
    sent = 0
    for due in store.wake_due(resources=resources):
        if due.payload == POLL:  # (a polling waiter: it comes back by itself)
            send_wake(app, due.payload, due.resource, by, store=None if due.again else store)
            continue
        again = "again" if due.again else None
        if send_wake(app, due.payload, due.resource, by, store=None if due.again else store):
            sent += 1
            log.info(
                "celery_lease: %s waiter of %r woken by %s%s",
                "a missed" if again else "the next",
                due.resource,
                "a turn check" if by == "turn" else f"the {by}",
                " once more (its first wake was not claimed)" if again else "",
            )
    return sent


class TurnCheck(NamedTuple):
    """A turn check a process has pending (see :meth:`Waker.drain`)."""

    due: float  # (time.monotonic(): the same clock in every process of a host)
    app: Any
    store: LeaseStore
    resource: str


class Waker:
    """This process's turn checks and passes over the wait lists: on a daemon thread of its
    own, or on an event loop (:meth:`run_on`, a prefork worker's main process).

    :meth:`after_wake` schedules a turn check of one resource once a wake's grace is over
    (the checks due together on one store go out in one ``wake_due``); :meth:`pass_every` a
    pass over every wait list of an app's stores every ``interval`` seconds (jittered). A
    store error is logged and the work tried again later; the thread never dies of one.
    """

    def __init__(self) -> None:
        self._pid = getpid()
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, tuple[Any, ...]]] = []
        self._order = itertools.count()
        #: (id(store), resource) -> when its latest turn check is due (earlier ones are moot:
        #: the latest wake decides whether the turn went on)
        self._turns: dict[tuple[int, str], float] = {}
        #: id() of each app passed over -> the number of its current chain of passes (a chain
        #: stopped and started again leaves the old one to end at its next turn)
        self._passing: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        #: The event loop the work runs on (None: the thread) and the thread that runs it.
        self._loop: Any = None
        self._loop_thread: threading.Thread | None = None
        #: The loop's timer entry for the soonest work: (when it is due, the entry).
        self._armed: tuple[float, Any] | None = None
        #: Batches of turn checks being run right now (drain waits for them too).
        self._checking = 0
        #: id() of each app -> how many of its passes failed in a row.
        self._failed_passes: dict[int, int] = {}

    def after_wake(self, app: Any, store: LeaseStore, resource: str, *, graces: float = 1) -> None:
        """Check, once the wake just sent on ``resource`` is past its grace (``graces`` of
        them: a polling place's turn is held longer), that the turn went on (the woken waiter
        claimed, or the next one is woken now)."""
        if not PASS_THE_TURN:
            return
        grace = float(getattr(store, "handoff_grace", 2.0))
        self.check_at(app, store, resource, _clock.monotonic() + grace * graces + TURN_SLACK)

    def check_at(self, app: Any, store: LeaseStore, resource: str, due: float) -> None:
        """Check the turn of ``resource`` in ``store`` at ``due`` (``time.monotonic()``; a
        prefork worker's main process takes the checks its exiting pool processes hand it)."""
        if not PASS_THE_TURN:
            return
        with self._cond:
            self._turns[(id(store), resource)] = due
            self._push(due, ("turn", app, store, resource))

    def pass_every(self, app: Any, interval: float, stores: Callable[[], list[LeaseStore]]) -> None:
        """Pass over the wait lists of the stores ``stores()`` names (``app``'s) every
        ``interval`` seconds, from now on (once per app)."""
        if not PASS_THE_TURN:
            return
        with self._cond:
            if id(app) in self._passing:
                return
            chain = self._passing[id(app)] = next(self._order)
            item = ("pass", app, interval, stores, chain)
            self._push(_clock.monotonic() + _jittered(interval), item)

    def stop_passes(self, app: Any) -> None:
        """No more passes over ``app``'s wait lists (its worker stops)."""
        with self._cond:
            self._passing.pop(id(app), None)

    def run_on(self, loop: Any) -> None:
        """Run the turn checks and passes on ``loop`` from now on, in the thread that calls
        this (the loop's): a kombu event loop (``call_later(delay, fn)``).

        For a prefork worker's main process: its pool processes are forked from that same
        thread (the pool's process handlers run on the loop), so a fork never lands in the
        middle of a pass, and no thread of ours is there to be forked. Each run holds the loop
        for its store calls, so the stores given to :meth:`pass_every` there should answer
        within a short timeout (see ``_passes.PARENT_CALL_TIMEOUT``).
        """
        with self._cond:
            # Armed afresh also when it is the same loop: a worker whose broker connection
            # failed cancels the timer entries its loop registered (celery.worker.loops), ours
            # among them, and registers with the loop again once it reconnected.
            if self._armed is not None:
                self._armed[1].cancel()
            self._loop, self._loop_thread = loop, threading.current_thread()
            self._armed = None
            self._cond.notify_all()  # (a thread of ours ends: the loop runs the work)
            self._arm()

    def drain(
        self,
        on_wait: Callable[[float], None] | None = None,
        hand_over: Callable[[list[TurnCheck]], list[TurnCheck]] | None = None,
    ) -> bool:
        """Run the turn checks this process has pending, before it exits; whether all ran.

        ``hand_over`` may take them first (a prefork pool process hands them to its worker's
        main process, which outlives it): it returns those it did not take. Each check left
        runs once its grace is over, or as soon as the store shows no wake of that resource
        in flight (its woken waiter claimed). They run on a thread of their own and the
        caller waits until the latest one is due plus ``EXIT_SLACK``, no longer: a store that
        does not answer cannot hold the exit. The passes stop; wakes these checks send get no
        check of their own (the passes of the workers catch them). ``on_wait`` is called
        once, with the seconds left, if the checks take longer than ``WAIT_NOTICE``.
        """
        with self._cond:
            self._passing.clear()
            pending = [
                (due, item)
                for due, _, item in self._heap
                if item[0] == "turn" and self._turns.get((id(item[2]), item[3])) == due
            ]
            for _, item in pending:  # (theirs now: the waker's thread skips them)
                del self._turns[(id(item[2]), item[3])]
            if not EXIT_TURNS:
                return True
            # A check the thread runs right now ends first (one store call, a few wakes).
            deadline = _clock.monotonic() + EXIT_SLACK
            while self._checking and _clock.monotonic() < deadline:
                self._cond.wait(deadline - _clock.monotonic())
        if pending and hand_over is not None:
            kept = hand_over([TurnCheck(due, *item[1:]) for due, item in pending])
            pending = [(check.due, ("turn", *check[1:])) for check in kept]
        if not pending:
            return True
        latest = max(due for due, _ in pending)
        done = threading.Event()
        threading.Thread(
            target=_run_at_exit,
            args=(sorted(pending, key=_due), done),
            name=EXIT_THREAD,
            daemon=True,
        ).start()
        if on_wait is not None and not done.wait(WAIT_NOTICE):
            on_wait(max(0.0, latest - _clock.monotonic()))
        if done.wait(max(0.0, latest + EXIT_SLACK - _clock.monotonic())):
            return True
        log.warning(
            "celery_lease: exiting without %d turn check(s): the store did not answer in time "
            "(the workers' passes over the wait lists pass the turn on)",
            len(pending),
        )
        return False

    def _push(self, due: float, item: tuple[Any, ...]) -> None:
        heapq.heappush(self._heap, (due, next(self._order), item))
        if self._loop is not None:
            if threading.current_thread() is self._loop_thread:
                self._arm()
            else:  # (the loop's timer is its thread's alone: kombu's call_soon wakes the loop)
                self._loop.call_soon(self._arm_on_loop)
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="celery-lease-waker", daemon=True
            )
            self._thread.start()
        self._cond.notify()

    def _arm(self) -> None:
        """Have the loop call :meth:`_on_loop` when the soonest work is due (under the lock,
        in the loop's thread)."""
        if not self._heap:
            return
        due = self._heap[0][0]
        if self._armed is not None:
            if self._armed[0] <= due and not self._armed[1].canceled:
                return
            self._armed[1].cancel()
        delay = max(0.0, due - _clock.monotonic())
        self._armed = (due, self._loop.call_later(delay, self._on_loop))

    def _arm_on_loop(self) -> None:
        with self._cond:
            if self._loop is not None:
                self._arm()

    def _on_loop(self) -> None:
        with self._cond:
            self._armed = None
            work = self._take_due()
        try:
            self._work(work)
        finally:
            with self._cond:
                if self._loop is not None:
                    self._arm()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._loop is not None:  # (handed over to an event loop)
                        self._thread = None
                        return
                    work = self._take_due()
                    if work:
                        break
                    if not self._heap:
                        # (idle: nothing to check and no pass; the next wake starts it again)
                        if not self._cond.wait(timeout=5.0) and not self._heap:
                            self._thread = None
                            return
                        continue
                    self._cond.wait(timeout=self._heap[0][0] - _clock.monotonic())
            self._work(work)

    def _take_due(self) -> list[tuple[Any, ...]]:
        """Take the work due now off the heap (under the lock): its turn checks in batches, one
        per store and up to TURN_BATCH resources, then its passes."""
        now = _clock.monotonic()
        batches: dict[tuple[int, int], tuple[Any, LeaseStore, list[str]]] = {}
        passes = []
        while self._heap and self._heap[0][0] <= now:
            due, _, item = heapq.heappop(self._heap)
            if item[0] != "turn":
                passes.append(item)
                continue
            _, app, store, resource = item
            if self._turns.get((id(store), resource)) != due:
                continue  # a later wake on that resource has its own check
            del self._turns[(id(store), resource)]
            batches.setdefault((id(app), id(store)), (app, store, []))[2].append(resource)
        work: list[tuple[Any, ...]] = [
            ("turns", app, store, resources[start : start + TURN_BATCH])
            for app, store, resources in batches.values()
            for start in range(0, len(resources), TURN_BATCH)
        ]
        self._checking += len(work)
        return work + passes

    def _work(self, work: list[tuple[Any, ...]]) -> None:
        for item in work:
            try:
                self._do(item)
            except Exception:
                log.exception("celery_lease: a turn check or wait-list pass failed")
            finally:
                if item[0] == "turns":
                    with self._cond:
                        self._checking -= 1
                        self._cond.notify_all()

    def _do(self, item: tuple[Any, ...]) -> None:
        if item[0] == "turns":
            _, app, store, resources = item
            try:
                pass_turn(app, store, resources, by="turn")
            except LeaseError as exc:  # the pass over every list covers it
                log.debug("celery_lease: turn check of %r failed: %s", resources, exc)
            return
        _, app, interval, stores, chain = item
        with self._cond:
            if self._passing.get(id(app)) != chain:
                return  # (stopped)
        delay = _jittered(interval)
        try:
            for store in stores():
                pass_turn(app, store, by="pass")
            self._failed_passes.pop(id(app), None)
        except LeaseError as exc:
            failed = self._failed_passes[id(app)] = self._failed_passes.get(id(app), 0) + 1
            if self._loop is not None:  # (each failure held the loop: back off, up to RETRY_CAP)
                delay = max(delay, min(RETRY_CAP, interval * 2**failed))
            log.warning(
                "celery_lease: a pass over the wait lists failed (the next in %.0f s): %s",
                delay,
                exc,
            )
        with self._cond:
            self._push(_clock.monotonic() + delay, item)


EXIT_THREAD = "celery-lease-exit-turns"


def _run_at_exit(pending: list[tuple[float, tuple[Any, ...]]], done: threading.Event) -> None:
    """Run the turn checks ``pending`` ((due, item), soonest first) for :meth:`Waker.drain`:
    each at its due time, or once no wake of its resource is in flight any more; then set
    ``done``."""
    try:
        left = pending
        while left:
            now = _clock.monotonic()
            waiting = []
            for due, item in left:
                _, app, store, resource = item
                if now < due and _in_flight(store, resource):
                    waiting.append((due, item))
                    continue
                try:
                    pass_turn(app, store, [resource], by="turn")
                except LeaseError as exc:
                    log.warning("celery_lease: turn check of %r at exit failed: %s", resource, exc)
            left = waiting
            if left:
                time.sleep(max(0.0, min(EXIT_POLL, left[0][0] - _clock.monotonic())))
    except Exception:
        log.exception("celery_lease: a turn check at exit failed")
    finally:
        done.set()


def _due(pending: tuple[float, tuple[Any, ...]]) -> float:
    return pending[0]


def _in_flight(store: LeaseStore, resource: str) -> bool:
    """Whether a wake of ``resource`` is in flight (a waiter woken and not claimed, its grace
    or polling hold not over); True when the store cannot tell now."""
    try:
        return any(waiter.woken for waiter in store.waiters(resource))
    except LeaseError:
        return True


def _jittered(interval: float) -> float:
    return interval * (1 + PASS_JITTER * (2 * random.random() - 1))


_waker: Waker | None = None
_waker_lock = threading.Lock()


def get_waker() -> Waker:
    """The waker of this process (a fresh one in a forked child)."""
    global _waker  # noqa: PLW0603 - one per process, replaced after fork
    waker = _waker
    if waker is not None and waker._pid == getpid():
        return waker
    with _waker_lock:
        if _waker is None or _waker._pid != getpid():
            _waker = Waker()
        return _waker


def drain_turns(
    on_wait: Callable[[float], None] | None = None,
    hand_over: Callable[[list[TurnCheck]], list[TurnCheck]] | None = None,
) -> bool:
    """Run this process's pending turn checks before it exits (:meth:`Waker.drain`): a
    prefork pool process on its way out, the CLI, a script that called ``release_lease`` or
    ``force_release``. At once (True) when it has none."""
    waker = _waker
    if waker is None or waker._pid != getpid():
        return True
    return waker.drain(on_wait, hand_over)


def _after_fork_in_child() -> None:
    global _waker  # noqa: PLW0603
    _waker = None


# Import-time side effect: a forked child starts without the parent's waker (its thread did
# not survive the fork); get_waker() makes a new one on first use.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
