"""Lanes: the threads that carry the renewer's store calls, so that one call that hangs holds up
nothing but itself.

The renewer's own thread only keeps time (which lease is due, whose deadline passed); every
store call it makes runs on a lane, one call at a time per lane:

* a store gets at most ``per_store`` lanes at once (2): a renewal still unanswered one interval
  after it was sent is sent again on a second lane (a renewal is safe to repeat), so one dead
  connection, or a server process that stopped answering on it, does not starve the store's
  other connections;
* there are at most ``total`` lanes (4) in the process: a store that hangs holds at most
  ``per_store`` of them, the others serve the other stores;
* an idle lane serves any store, the most recently idle first, and exits after ``idle_exit``
  seconds (60) without work.

A call's ``done`` callback runs on its lane once the call returns, after the lane is free again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

from . import _clock

__all__ = ["IDLE_EXIT", "PER_STORE", "TOTAL", "Lanes"]

log = logging.getLogger(__name__)

PER_STORE = 2
TOTAL = 4
IDLE_EXIT = 60.0

Job = tuple[Hashable, Callable[[], Any], Callable[[Any], None]]


class _Lane:
    __slots__ = ("cond", "job")

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self.job: Job | None = None


class Lanes:
    """Up to ``total`` threads running calls, at most ``per_store`` of them for one key."""

    def __init__(
        self,
        *,
        total: int = TOTAL,
        per_store: int = PER_STORE,
        idle_exit: float = IDLE_EXIT,
        name: str = "celery-lease-lane",
    ) -> None:
        if total < 1 or per_store < 1:
            raise ValueError("a renewer needs at least one lane")
        self.total = total
        self.per_store = min(per_store, total)
        self.idle_exit = idle_exit
        self.name = name
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self._idle: list[_Lane] = []  # the most recently idle last
        self._busy: dict[Hashable, int] = {}
        self._closed = False

    def submit(self, key: Hashable, call: Callable[[], Any], done: Callable[[Any], None]) -> bool:
        """Run ``call()`` on a free lane, then ``done(its result or exception)`` on that lane.

        Returns False, running nothing, when ``key`` already has ``per_store`` calls in flight
        or every lane is busy; try again once a call has finished.
        """
        with self._lock:
            if self._closed or self._busy.get(key, 0) >= self.per_store:
                return False
            if self._idle:
                lane = self._idle.pop()
            elif len(self._lanes) < self.total:
                lane = _Lane(self._lock)
                self._lanes.append(lane)
                threading.Thread(
                    target=self._run,
                    args=(lane,),
                    name=f"{self.name}-{len(self._lanes)}",
                    daemon=True,
                ).start()
            else:
                return False
            lane.job = (key, call, done)
            self._busy[key] = self._busy.get(key, 0) + 1
            lane.cond.notify()
            return True

    @property
    def count(self) -> int:
        """Lanes alive (busy or idle)."""
        return len(self._lanes)

    def shutdown(self) -> None:
        """Idle lanes exit now, busy ones once their call returns; no call is taken after."""
        with self._lock:
            self._closed = True
            for lane in self._idle:
                lane.cond.notify()

    def _run(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                idle_until = _clock.monotonic() + self.idle_exit
                while lane.job is None:
                    left = idle_until - _clock.monotonic()
                    if self._closed or left <= 0:
                        self._lanes.remove(lane)
                        if lane in self._idle:
                            self._idle.remove(lane)
                        return
                    lane.cond.wait(left)
                key, call, done = lane.job
            try:
                result: Any = call()
            except Exception as exc:  # noqa: BLE001 - handed to done(), which reports it
                result = exc
            with self._lock:
                lane.job = None
                left_busy = self._busy[key] - 1
                if left_busy:
                    self._busy[key] = left_busy
                else:
                    del self._busy[key]
                self._idle.append(lane)
            try:
                done(result)
            except Exception:
                log.exception("celery_lease lane callback failed")
