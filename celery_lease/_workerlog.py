"""What a worker's main process says about its lease tasks.

At start (``_app.LeaseBootstep``): the lease ttl of each lease task on the "ready" line (a
task's ``ttl=`` overrides the app's ``lease_ttl``, so the app's alone says little).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ttl_summary"]

#: Task names listed in one line before "and N more".
NAMES_SHOWN = 3


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def _lease_tasks(count: int) -> str:
    return f"{count} lease task{'s' if count != 1 else ''}"


def ttl_summary(app_ttl: float, ttls: Mapping[str, float]) -> str:
    """The ttls of the worker's lease tasks for its "ready" line (task name -> ttl).

    ``ttl 60s for all 12 lease tasks``; when they differ, the ttl most of them have and the
    others by name: ``ttl 60s for 10 lease tasks; 15s for proj.browse, proj.pay``; with no
    lease task registered, the app's ``lease_ttl``.
    """
    if not ttls:
        return f"no lease tasks registered; lease_ttl {app_ttl:g}s"
    groups: dict[float, list[str]] = {}
    for name, ttl in sorted(ttls.items()):
        groups.setdefault(ttl, []).append(name)
    if len(groups) == 1:
        ((ttl, names),) = groups.items()
        if len(names) == 1:
            return f"ttl {ttl:g}s for its lease task {names[0]}"
        return f"ttl {ttl:g}s for all {_lease_tasks(len(names))}"
    # The biggest group first (on a tie, the app's ttl, then the shortest), the rest by ttl.
    main = min(groups, key=lambda t: (-len(groups[t]), t != app_ttl, t))
    parts = [f"ttl {main:g}s for {_lease_tasks(len(groups[main]))}"]
    parts += [f"{ttl:g}s for {_names(groups[ttl])}" for ttl in sorted(groups) if ttl != main]
    return "; ".join(parts)
