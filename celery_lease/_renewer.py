"""One renewal thread per process for every lease the process holds.

The thread wakes when the next renewal is due (each lease every ``renew_interval``, with
jitter), renews all leases due around then in one batched store call, and watches two deadlines
per lease: its self-fence deadline (``ttl - margin`` after the last successful renewal was
*sent*) and its hard runtime cap. When a lease is found lost, or a deadline passes without a
successful renewal, it calls the hold's ``on_lost`` (which stops the task body). Store calls run
on a helper I/O thread so a store that hangs (a network black hole) cannot stop the watchdog.

The thread never dies silently: any unexpected error is logged and the loop goes on; leases
whose renewals keep failing are declared lost at their deadline. It exits once nothing has
been held for ``IDLE_EXIT`` seconds (and is started again on the next hold), and is recreated
in a forked child.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from . import _events as events
from . import _failpoints as failpoints
from ._errors import LeaseError, LeaseLostError, LeaseStoreError
from ._lease import Lease

__all__ = ["Hold", "Renewer", "get_renewer"]

log = logging.getLogger(__name__)

THREAD_NAME = "celery-lease-renewer"
IDLE_EXIT = 5.0
JITTER = 0.15
MIN_RETRY = 0.02


class Hold:
    """One lease the renewer keeps alive until it is dropped or lost."""

    __slots__ = (
        "done",
        "hard_deadline",
        "interval",
        "lease",
        "next_due",
        "on_lost",
        "retrying",
        "store",
    )

    def __init__(
        self,
        lease: Lease,
        interval: float,
        max_runtime: float,
        on_lost: Callable[[Hold, LeaseLostError], None],
    ) -> None:
        self.lease = lease
        self.store = lease.store
        self.interval = interval
        self.hard_deadline = time.monotonic() + max_runtime
        # Counted from when the claim was sent, as the lease time and later renewals are:
        # counted from the hold (after the claim's reply), a round trip near ttl/3 made the
        # first renewal's reply arrive after the self-fence deadline.
        self.next_due = lease.sent_monotonic + interval * (1 - random.uniform(0, JITTER))
        self.on_lost = on_lost
        self.done = False
        #: The last renewal failed: retry at next_due itself, never earlier (see _due).
        self.retrying = False


class Renewer:
    """Keeps the leases of this process alive (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holds: set[Hold] = set()
        self._thread: threading.Thread | None = None
        self._io: ThreadPoolExecutor | None = None
        self._wake_at = float("inf")
        self._lost: list[tuple[Hold, LeaseLostError]] = []
        self._closing = False
        self._pid = os.getpid()
        self._warmed: set[int] = set()  # id() of the stores whose I/O connection is open
        #: Renewal calls sent, failed and leases declared lost (for tests and metrics).
        self.calls = 0
        self.failures = 0

    # -- public ------------------------------------------------------------------------------
    def hold(
        self,
        lease: Lease,
        *,
        interval: float,
        max_runtime: float,
        on_lost: Callable[[Hold, LeaseLostError], None],
    ) -> Hold:
        """Start renewing ``lease`` every ``interval`` s, for at most ``max_runtime`` s."""
        hold = Hold(lease, interval, max_runtime, on_lost)
        self.prepare(hold.store)
        with self._cond:
            self._closing = False
            self._holds.add(hold)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
                self._thread.start()
            elif min(hold.next_due, hold.lease.deadline) < self._wake_at:
                self._cond.notify()
        return hold

    def prepare(self, store: Any) -> None:
        """Open the renewal connection to ``store`` now, ahead of a claim (once per store).

        On a slow link a connection handshake at the first renewal could take the whole renew
        window; called before the claim, it overlaps the claim's own round trip instead.
        ``hold`` calls it too, for callers that did not.
        """
        if store is None or id(store) in self._warmed:
            return
        with self._cond:
            if id(store) in self._warmed:
                return
            # The executor first: a new I/O thread has no connections, so making one clears
            # the marks (marking before that made the next lease warm up a second time).
            io = self._io_executor()
            self._warmed.add(id(store))
        io.submit(_warm_up, store)

    def drop(self, hold: Hold) -> None:
        """Stop renewing (the lease was released or the task ended). Never renews it again."""
        with self._cond:
            hold.done = True
            self._holds.discard(hold)

    def held(self) -> list[Lease]:
        with self._cond:
            return [h.lease for h in self._holds]

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        idle_since: float | None = None
        while True:
            try:
                with self._cond:
                    now = time.monotonic()
                    if not self._holds:
                        idle_since = idle_since or now
                        if self._closing or now - idle_since >= IDLE_EXIT:
                            self._thread = None
                            return
                        self._wait(idle_since + IDLE_EXIT - now)
                        continue
                    idle_since = None
                    self._declare_overdue(now)
                    due = self._due(now)
                    if not due and not self._lost and self._holds:
                        self._wait(self._next_wake() - now)
                        continue
                self._report_lost()
                if due:
                    self._renew(due)
                    self._report_lost()
            except Exception:  # never die silently: log, back off briefly, go on
                log.exception("celery_lease renewal loop error; continuing")
                time.sleep(MIN_RETRY)

    def _wait(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self._wake_at = time.monotonic() + seconds
        self._cond.wait(seconds)
        self._wake_at = float("-inf")

    def _next_wake(self) -> float:
        return min(min(h.next_due, h.lease.deadline, h.hard_deadline) for h in self._holds)

    def _due(self, now: float) -> list[Hold]:
        # Coalesce: renew everything due within a third of its interval in this one call. A
        # retry after a failure is due at its own time only: the window is wider than the
        # retry gap, and would otherwise retry a failing store back to back.
        return [
            h for h in self._holds if h.next_due <= now + (0.0 if h.retrying else h.interval / 3)
        ]

    def _declare_overdue(self, now: float) -> None:
        """Leases past their runtime cap or self-fence deadline are lost (under the lock)."""
        for hold in list(self._holds):
            if now >= hold.hard_deadline:
                reason = "max_runtime"
            elif now >= hold.lease.deadline:
                reason = "renew_failed"
            else:
                continue
            self._lose(hold, LeaseLostError.lost(hold.lease.resource, hold.lease.fence, reason))

    def _lose(self, hold: Hold, error: LeaseLostError) -> None:
        """Mark the hold lost (under the lock); its callback runs once the lock is released."""
        self._holds.discard(hold)
        if hold.done:
            return
        hold.done = True
        self._lost.append((hold, hold.lease.mark_lost(error)))

    def _report_lost(self) -> None:
        """Run the on_lost callbacks queued by _lose, outside the lock (they may do I/O)."""
        while self._lost:
            hold, error = self._lost.pop(0)
            try:
                hold.on_lost(hold, error)
            except Exception:
                log.exception("celery_lease on_lost callback failed for %r", hold.lease)

    def _renew(self, due: list[Hold]) -> None:
        by_store: dict[int, list[Hold]] = {}
        for hold in due:
            by_store.setdefault(id(hold.store), []).append(hold)
        for holds in by_store.values():
            self._renew_batch(holds)

    def _renew_batch(self, holds: list[Hold]) -> None:
        store = holds[0].store
        assert store is not None
        with self._cond:
            io = self._io_executor()
        self.calls += 1
        failpoints.hit("inside_renew")
        sent = time.monotonic()
        future: Future[list[LeaseLostError | None]] = io.submit(
            store.renew_many, [h.lease for h in holds]
        )
        results = self._await(future, holds)
        with self._cond:
            now = time.monotonic()
            if isinstance(results, BaseException):
                self.failures += 1
                events.count("celery_lease_renewal_failures_total")
                for hold in holds:
                    # Retry soon, until the self-fence deadline declares the lease lost.
                    gap = min(hold.interval / 4, max(hold.lease.remaining() / 3, MIN_RETRY))
                    hold.next_due = now + max(gap, MIN_RETRY)
                    hold.retrying = True
                self._declare_overdue(now)
                return
            renewed = sum(result is None for result in results)
            for hold, result in zip(holds, results, strict=True):
                if hold.done:
                    continue
                if result is None:
                    # Counted from when this renewal was sent, as its lease time is: counted
                    # from the reply, a slow link (a round trip near ttl/3) would let the next
                    # reply arrive after the self-fence deadline.
                    hold.next_due = sent + hold.interval * (1 - random.uniform(0, JITTER))
                    hold.retrying = False
                else:
                    self._lose(hold, result)
        if renewed:
            events.count("celery_lease_renewals_total", renewed)

    def _io_executor(self) -> ThreadPoolExecutor:
        """The I/O thread's executor (call under the lock)."""
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix=f"{THREAD_NAME}-io")
            self._warmed.clear()  # a new thread has no connections yet
        return self._io

    def _await(
        self, future: Future[list[LeaseLostError | None]], holds: list[Hold]
    ) -> list[LeaseLostError | None] | BaseException:
        """Wait for the store's answer, declaring leases lost as their deadlines pass."""
        while True:
            with self._cond:
                pending = [h for h in holds if not h.done]
                if not pending:
                    future.add_done_callback(_log_late_failure)
                    return LeaseStoreError("every lease in the batch was lost while waiting")
                wait = min(min(h.lease.deadline, h.hard_deadline) for h in pending)
            try:
                return future.result(timeout=max(0.0, wait - time.monotonic()))
            except FutureTimeout:
                with self._cond:
                    self._declare_overdue(time.monotonic())
                self._report_lost()
            except LeaseError as exc:
                log.warning("celery_lease renewal failed: %s", exc)
                return exc
            except Exception as exc:  # a bug or a driver error that escaped its store
                log.exception("celery_lease renewal raised unexpectedly")
                return exc

    def shutdown(self) -> None:
        """Forget every hold (their tasks release them) and stop both threads."""
        with self._cond:
            for hold in self._holds:
                hold.done = True
            self._holds.clear()
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        with self._cond:
            io, self._io = self._io, None
            self._warmed.clear()
        if io is not None:
            io.shutdown(wait=False, cancel_futures=True)


def _warm_up(store: Any) -> None:
    warm_up = getattr(store, "warm_up", None)
    if warm_up is None:
        return
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - the first renewal retries and reports it
        log.debug("warming up the renewal connection failed: %s", exc)


def _log_late_failure(future: Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        log.debug("late renewal call failed: %s", exc)


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def get_renewer() -> Renewer:
    """The renewer of this process (a fresh one in a forked child)."""
    global _renewer  # noqa: PLW0603 - one renewer per process, replaced after fork
    renewer = _renewer
    if renewer is not None and renewer._pid == os.getpid():
        return renewer
    with _renewer_lock:
        if _renewer is None or _renewer._pid != os.getpid():
            _renewer = Renewer()
        return _renewer


def _after_fork_in_child() -> None:
    global _renewer  # noqa: PLW0603
    _renewer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
