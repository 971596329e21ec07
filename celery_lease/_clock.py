"""The library's own clocks: the real ``time.monotonic`` and ``time.time``, never a test's fake.

Leases are timed by the worker's monotonic clock and the store's clock. A user's test may freeze
time (freezegun) around a leased task; that must neither stop, expire nor extend a lease, while
the task body, the user's code, sees the frozen clock. freezegun replaces ``time.monotonic`` and
``time.time`` and every module attribute bound to them; it does not look inside containers. So
the real functions are kept in a list here (when freezegun was imported first, its own
``real_*`` references, taken before any freeze) and every timing read in the package goes
through :func:`monotonic` or :func:`wall`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["monotonic", "wall"]


def _real_clocks() -> list[Callable[[], float]]:
    api = sys.modules.get("freezegun.api")  # imported (maybe freezing) before celery_lease
    if api is not None:
        return [api.real_monotonic, api.real_time]
    return [time.monotonic, time.time]


#: [monotonic, wall]: in a list, where freezegun's module patching does not reach them.
_REAL = _real_clocks()


def monotonic() -> float:
    """The real ``time.monotonic()``, whatever a test has frozen."""
    return _REAL[0]()


def wall() -> float:
    """The real ``time.time()``, whatever a test has frozen."""
    return _REAL[1]()
