"""Reporting a lease store outage: one warning per store and interval, not one per claim.

While the store is down every claim fails and its task is sent again after a short backoff,
on its own budget (``lease_store_down_max_wait``). A warning per attempt buried the log in
thousands of identical lines; instead each process says once per ``REPORT_EVERY`` seconds that
the store is down (refusing connections or failing), how many claims failed since the last
report and when tasks give up, and once, at INFO, when the store answers again.

A fence gate a task admits its fence at right after its claim (``gates=``) fails a claim the
same way when it cannot be reached; it is reported here too, under its own name (``what``).
"""

from __future__ import annotations

import logging
import threading

from . import _clock
from ._errors import LeaseStoreError

__all__ = ["REPORT_EVERY", "claim_failed", "claim_succeeded", "down"]

log = logging.getLogger(__name__)

#: Seconds between two warnings about the same store's outage in one process.
REPORT_EVERY = 60.0


class _Outage:
    __slots__ = ("failures", "reported_at", "since", "unreported", "what")

    def __init__(self, now: float, what: str) -> None:
        self.what = what
        self.since = now
        self.failures = 0
        self.unreported = 0
        self.reported_at: float | None = None


#: Stores (by masked URL) whose last claim in this process failed. Empty when all is well,
#: which is the one thing a successful claim looks at.
down: dict[str, _Outage] = {}
_lock = threading.Lock()


def claim_failed(
    store: str, exc: LeaseStoreError, max_wait: float, what: str = "lease store"
) -> None:
    """A claim on ``store`` failed: count it, and warn when no warning went out lately.

    ``what`` names the kind of thing that failed in the warning (``"fence gate"`` for a gate
    of ``gates=``, whose name is then ``store``).
    """
    now = _clock.monotonic()
    with _lock:
        outage = down.get(store)
        if outage is None:
            outage = down[store] = _Outage(now, what)
        outage.failures += 1
        outage.unreported += 1
        if outage.reported_at is not None and now - outage.reported_at < REPORT_EVERY:
            return
        outage.reported_at = now
        count, outage.unreported = outage.unreported, 0
        since = now - outage.since
    log.warning(
        "celery_lease: the %s %s %s: %d claim%s failed in this process in the last "
        "%.1fs; each task is sent again after a backoff and fails with LeaseStoreError once "
        "it has waited lease_store_down_max_wait=%gs (this warning repeats at most every %gs "
        "while it is down). Last error: %s",
        outage.what,
        store,
        "refuses connections" if exc.refused else "is failing",
        count,
        "" if count == 1 else "s",
        since,
        max_wait,
        REPORT_EVERY,
        exc,
    )


def claim_succeeded(store: str) -> None:
    """A claim on ``store`` got an answer: close its outage, if there was one."""
    with _lock:
        outage = down.pop(store, None)
    if outage is not None:
        log.info(
            "celery_lease: the %s %s answers again after %.1fs; %d claim%s failed in "
            "this process meanwhile",
            outage.what,
            store,
            _clock.monotonic() - outage.since,
            outage.failures,
            "" if outage.failures == 1 else "s",
        )
