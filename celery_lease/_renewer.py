"""One renewal thread per process for every lease the process holds.

The thread keeps time and does no I/O. It wakes when the next renewal is due (each lease every
``renew_interval``, with jitter) and hands the renewals due around then, one batch per store, to
a lane (:mod:`._lanes`), a thread that makes the store call (``RENEW_BATCH`` leases per round
trip, one batch after another: a batch that fails leaves the others' answers standing).
Meanwhile it watches two deadlines of every lease, whatever its store is doing: the self-fence
deadline (``ttl - margin`` after the last successful renewal was *sent*) and the hard runtime
cap. A lease found lost, or whose deadline passes without a successful renewal, has its hold's
``on_lost`` called (which stops the task body) from a thread of its own, so that nothing, a
hanging store call or another lease's slow callback, delays that interruption.

A renewal still unanswered one interval after it was sent is sent again on another lane (a
renewal is safe to repeat): a connection that stopped answering costs its leases one interval,
not their lease. A store can occupy at most two lanes, so a store that hangs cannot take the
lanes of the others, and independent leases never queue behind one slow call.

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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _clock
from . import _events as events
from . import _failpoints as failpoints
from ._errors import LeaseError, LeaseLostError
from ._lanes import PER_STORE, TOTAL, Lanes
from ._lease import Lease
from ._pid import getpid
from .stores._bounds import RENEW_BATCH

if TYPE_CHECKING:
    from .stores.base import LeaseStore

__all__ = ["Hold", "Renewer", "get_renewer"]

log = logging.getLogger(__name__)

THREAD_NAME = "celery-lease-renewer"
IDLE_EXIT = 5.0
JITTER = 0.15
#: random.uniform as the random module defines it. While random.uniform is still this one (a
#: test may pin it), a hold draws its jitter as _DRAWS.random() * JITTER: exactly what
#: uniform(0, JITTER) returns (0 + (JITTER - 0) * self.random()), without its Python frame.
_UNIFORM = random.uniform
_DRAWS: random.Random = _UNIFORM.__self__  # type: ignore[attr-defined]
MIN_RETRY = 0.02

#: What a renewal call reports per lease: renewed (None), lost, or its batch failed.
_Outcome = LeaseLostError | None | Exception


class Hold:
    """One lease the renewer keeps alive until it is dropped or lost."""

    __slots__ = (
        "call",
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
        self.hard_deadline = _clock.monotonic() + max_runtime
        # Counted from when the claim was sent, as the lease time and later renewals are:
        # counted from the hold (after the claim's reply), a round trip near ttl/3 made the
        # first renewal's reply arrive after the self-fence deadline.
        uniform = random.uniform
        jitter = _DRAWS.random() * JITTER if uniform is _UNIFORM else uniform(0, JITTER)
        self.next_due = lease.sent_monotonic + interval * (1 - jitter)
        self.on_lost = on_lost
        self.done = False
        #: The last renewal failed: retry at next_due itself, never earlier (see _due).
        self.retrying = False
        #: The renewal call in flight for this lease (the newest, if it was sent again).
        self.call: _Call | None = None


class _Call:
    """One renewal call: the holds it renews, on one store, and when to send it again."""

    __slots__ = ("holds", "resend_at", "resent", "store")

    def __init__(self, holds: list[Hold], now: float) -> None:
        self.holds = holds
        self.store = holds[0].store
        self.resend_at = now + min(h.interval for h in holds)
        self.resent = False


class Renewer:
    """Keeps the leases of this process alive (see the module docstring).

    Args:
        lanes: threads for store calls, at most (two per store at once). ``lanes=1`` is the
            negative control of the tests: every store's calls queue behind the one in flight.
    """

    def __init__(self, *, lanes: int = TOTAL) -> None:
        # The condition's lock, taken directly on the per-task paths (hold, drop): the same
        # lock ``with self._cond`` takes, without Condition.__enter__'s Python frame.
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._holds: set[Hold] = set()
        self._calls: set[_Call] = set()
        self._thread: threading.Thread | None = None
        self._lane_count = lanes
        self._lanes = self._new_lanes()
        self._wake_at = float("inf")
        self._lost: list[tuple[Hold, LeaseLostError]] = []
        self._closing = False
        self._pid = getpid()
        self._warmed: set[int] = set()  # id() of the stores whose renewal connection is open
        #: Renewal calls sent and failed (for tests and metrics).
        self.calls = 0
        self.failures = 0

    def _new_lanes(self) -> Lanes:
        return Lanes(
            total=self._lane_count,
            per_store=min(PER_STORE, self._lane_count),
            name=f"{THREAD_NAME}-lane",
        )

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
        with self._mutex:
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
            if self._lanes.submit(id(store), lambda: _warm_up(store), self._lane_freed):
                self._warmed.add(id(store))

    def _lane_freed(self, _result: object = None) -> None:
        with self._cond:
            self._cond.notify()  # a renewal may be waiting for that lane

    def drop(self, hold: Hold) -> None:
        """Stop renewing (the lease was released or the task ended). Never renews it again."""
        with self._mutex:
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
                    now = _clock.monotonic()
                    if not self._holds:
                        idle_since = idle_since or now
                        if self._closing or now - idle_since >= IDLE_EXIT:
                            self._thread = None
                            return
                        self._wait(idle_since + IDLE_EXIT - now)
                        continue
                    idle_since = None
                    self._declare_overdue(now)
                    blocked = self._send(now)
                    if not self._lost and self._holds:
                        self._wait(self._next_wake(blocked) - now)
                self._report_lost()
            except Exception:  # never die silently: log, back off briefly, go on
                log.exception("celery_lease renewal loop error; continuing")
                time.sleep(MIN_RETRY)

    def _wait(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self._wake_at = _clock.monotonic() + seconds
        self._cond.wait(seconds)
        self._wake_at = float("-inf")

    def _next_wake(self, blocked: set[int]) -> float:
        """The next deadline, due time or re-send time (a blocked store's wait for a lane)."""
        wake = float("inf")
        for h in self._holds:
            wake = min(wake, h.lease.deadline, h.hard_deadline)
            if h.call is None and id(h.store) not in blocked:
                wake = min(wake, h.next_due)
        for call in self._calls:
            if not call.resent and id(call.store) not in blocked:
                wake = min(wake, call.resend_at)
        return wake

    def _due(self, now: float) -> list[Hold]:
        # Coalesce: renew everything due within a third of its interval in this one call. A
        # retry after a failure is due at its own time only: the window is wider than the
        # retry gap, and would otherwise retry a failing store back to back.
        return [
            h
            for h in self._holds
            if h.call is None and h.next_due <= now + (0.0 if h.retrying else h.interval / 3)
        ]

    def _send(self, now: float) -> set[int]:
        """Hand due renewals to lanes (under the lock); returns the stores with no free lane."""
        blocked: set[int] = set()
        for call in list(self._calls):
            if call.resent or call.resend_at > now:
                continue
            # Unanswered for an interval: send it again on another lane (its connection may
            # be the one that stopped answering).
            pending = [h for h in call.holds if h.call is call and not h.done]
            if not pending:
                call.resent = True
            elif id(call.store) in blocked or not self._submit(pending, now):
                blocked.add(id(call.store))
            else:
                call.resent = True
        by_store: dict[int, list[Hold]] = {}
        for hold in self._due(now):
            by_store.setdefault(id(hold.store), []).append(hold)
        for key, holds in by_store.items():
            if key in blocked or not self._submit(holds, now):
                blocked.add(key)
        return blocked

    def _submit(self, holds: list[Hold], now: float) -> bool:
        store = holds[0].store
        assert store is not None
        call = _Call(holds, now)
        leases = [h.lease for h in holds]
        if not self._lanes.submit(
            id(store), lambda: _renew(store, leases), lambda result: self._finished(call, result)
        ):
            return False
        self.calls += 1
        self._calls.add(call)
        for hold in holds:
            hold.call = call
        return True

    def _finished(self, call: _Call, result: Sequence[_Outcome] | Exception) -> None:
        """A lane's call returned: record it, reschedule or lose its leases (on the lane)."""
        renewed = 0
        outcomes = [result] * len(call.holds) if isinstance(result, Exception) else result
        with self._cond:
            self._calls.discard(call)
            now = _clock.monotonic()
            current = {h for h in call.holds if h.call is call}
            for hold in current:
                hold.call = None
            failed: list[Hold] = []
            error: Exception | None = None
            for hold, outcome in zip(call.holds, outcomes, strict=True):
                if isinstance(outcome, LeaseLostError):
                    if not hold.done:
                        self._lose(hold, outcome)
                elif isinstance(outcome, Exception):
                    # Only this lease's batch failed (or was not sent after it): the others
                    # of the call count as they were answered. (A call sent again meanwhile
                    # has the last word; a dropped lease needs none.)
                    error = outcome
                    if hold in current and not hold.done:
                        failed.append(hold)
                else:
                    renewed += 1
                    if not hold.done and hold.call is None:
                        # Counted from when this renewal was sent, as its lease time is:
                        # counted from the reply, a slow link (a round trip near ttl/3)
                        # would let the next reply arrive after the self-fence deadline.
                        hold.next_due = hold.lease.sent_monotonic + hold.interval * (
                            1 - random.uniform(0, JITTER)
                        )
                        hold.retrying = False
            if error is not None and failed:
                self._failed(failed, error, now)
            self._declare_overdue(now)
            self._cond.notify()
        if renewed:
            events.count("celery_lease_renewals_total", renewed)
        self._report_lost()

    def _failed(self, holds: list[Hold], exc: Exception, now: float) -> None:
        self.failures += 1
        events.count("celery_lease_renewal_failures_total")
        if isinstance(exc, LeaseError):
            log.warning("celery_lease renewal failed: %s", exc)
        else:  # a bug or a driver error that escaped its store
            log.error("celery_lease renewal raised unexpectedly", exc_info=exc)
        for hold in holds:
            # Retry soon, until the self-fence deadline declares the lease lost.
            gap = min(hold.interval / 4, max(hold.lease.remaining() / 3, MIN_RETRY))
            hold.next_due = now + max(gap, MIN_RETRY)
            hold.retrying = True

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
        """Start the on_lost callbacks queued by _lose, each on a thread of its own."""
        while True:
            with self._cond:
                if not self._lost:
                    return
                hold, error = self._lost.pop(0)
            threading.Thread(
                target=_deliver, args=(hold, error), name=f"{THREAD_NAME}-lost", daemon=True
            ).start()

    def shutdown(self) -> None:
        """Forget every hold (their tasks release them) and stop the threads."""
        with self._cond:
            for hold in self._holds:
                hold.done = True
            self._holds.clear()
            self._calls.clear()
            self._closing = True
            self._cond.notify()
            thread = self._thread
            lanes, self._lanes = self._lanes, self._new_lanes()
            self._warmed.clear()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        lanes.shutdown()


def _renew(store: LeaseStore, leases: list[Lease]) -> list[_Outcome]:
    """Renew ``leases`` in batches of ``RENEW_BATCH``, one after another, on this lane.

    One outcome per lease: None (renewed), its LeaseLostError, or the exception of its batch.
    A batch that fails ends the call: its leases and those of the batches not yet sent get its
    exception (retried soon), the leases of the batches answered before it keep their answers.
    Each batch's leases count their lease time from when that batch was sent (the store takes
    the time as it sends it), so the self-fence deadline of a later batch is not pushed back.
    """
    failpoints.hit("inside_renew")
    if len(leases) <= RENEW_BATCH:
        return list(store.renew_many(leases))
    outcomes: list[_Outcome] = []
    for start in range(0, len(leases), RENEW_BATCH):
        try:
            outcomes += store.renew_many(leases[start : start + RENEW_BATCH])
        except Exception as exc:  # noqa: BLE001 - reported per lease by _finished
            return outcomes + [exc] * (len(leases) - len(outcomes))
    return outcomes


def _deliver(hold: Hold, error: LeaseLostError) -> None:
    try:
        hold.on_lost(hold, error)
    except Exception:
        log.exception("celery_lease on_lost callback failed for %r", hold.lease)


def _warm_up(store: LeaseStore) -> None:
    try:
        store.warm_up()
    except Exception as exc:  # noqa: BLE001 - the first renewal retries and reports it
        log.debug("warming up the renewal connection failed: %s", exc)


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def get_renewer() -> Renewer:
    """The renewer of this process (a fresh one in a forked child)."""
    global _renewer  # noqa: PLW0603 - one renewer per process, replaced after fork
    renewer = _renewer
    if renewer is not None and renewer._pid == getpid():
        return renewer
    with _renewer_lock:
        if _renewer is None or _renewer._pid != getpid():
            _renewer = Renewer()
        return _renewer


def _after_fork_in_child() -> None:
    global _renewer  # noqa: PLW0603
    _renewer = None


# Import-time side effect: a forked child starts without the parent's renewer (its thread did
# not survive the fork); get_renewer() makes a new one on first use.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
