"""Leases in Flower: each task's page says whether it holds its lease, waits for it (at which
place, behind whom) or ended, and with which fence.

Flower keeps only the fields it knows from each event and merges the events of every copy of a
task (its back-stop copy, a redelivery) into one state, so by itself it shows ``LEASE-BUSY`` for
a task whose refused copy sent the last event, even while the task holds the lease. This module
is a ``format_task`` hook that decides from the lease store instead and adds a ``lease`` field
to every task Flower shows (the task page, and the rows of the tasks table's JSON):

- ``holds inv:7 with fence 41, expires in 9.2s``: the store's holder is this task id. Flower's
  state is then shown as STARTED whatever a copy's event said, and the field says what it said;
- ``waits for inv:7 at place 2 of 3, behind 1a2b... and the holder w1@host:311:9f2e... (fence
  41, expires in 9.2s)``: from the resource's wait list (the task's identity, its task id
  unless ``identity=`` is set);
- ``ended (SUCCESS) with fence 41 on inv:7``: Flower says the task ended; the fence is the one
  its identity record kept, never the resource's holder of today;
- ``not holding inv:7, not in its wait list: held by ...``: a task backing off outside the
  list, not started yet, or skipped.

``flowerconfig.py`` next to where Flower runs (``celery -A proj flower``):

```python
from celery_lease.contrib.flower import add_leases_page, format_task

add_leases_page()  # /leases: every lease held, its holder and fence, who waits for it
```

The resource comes from the task's ``resource`` template applied to its arguments as Flower
shows them (when Flower cut a long argument short there is no resource to show). Store reads are
cached for :data:`CACHE_SECONDS`. :func:`add_leases_page` adds a page of its own to Flower;
Flower has no plugin interface for pages, see its docstring for how and what that costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._eventlog import redact
from ._flower_task import CACHE_SECONDS, clear_cache, verdict

__all__ = [
    "CACHE_SECONDS",
    "add_leases_page",
    "annotate",
    "clear_cache",
    "format_task",
    "make_format_task",
]


def format_task(task: Any) -> Any:
    """Flower's ``format_task`` hook for the current Celery app (the one Flower runs with)."""
    from celery import current_app

    return annotate(task, current_app._get_current_object())


def make_format_task(app: Any) -> Callable[[Any], Any]:
    """A ``format_task`` hook bound to ``app`` (when Flower's current app is not yours)."""

    def format_task(task: Any) -> Any:
        return annotate(task, app)

    return format_task


def annotate(task: Any, app: Any) -> Any:
    """Add a ``lease`` field to Flower's copy of ``task`` (and set its ``state`` when the store
    proves Flower's wrong); return it, unchanged if it has no lease."""
    found = verdict(task, app)
    if found is None:
        return task
    task.lease = redact(found.text)
    if found.state is not None:
        task.state = found.state
    fields = tuple(getattr(task, "_fields", ()))
    if "lease" not in fields:
        # Right after the state: the page shows it first among the details, the reason why.
        at = fields.index("state") + 1 if "state" in fields else len(fields)
        task._fields = (*fields[:at], "lease", *fields[at:])
    return task


def add_leases_page(app: Any = None) -> bool:
    """Add a Leases page to Flower, at ``/leases`` (under its ``url_prefix``); call it in
    ``flowerconfig.py``.

    The page lists every lease held (up to ``?limit=``, 200 by default; ``?prefix=`` narrows
    it), contended ones first: the resource, its holder (a link to the holder's task page when
    Flower has seen it), fence and expiry, and its wait list, next first, each waiting task
    linked. It is read from the store when drawn, in Flower's thread pool, and asks for the same
    login as Flower's own pages.

    Flower has no plugin interface for pages: this adds a route to the list Flower builds its
    application from (``flower.urls.handlers``, right before its catch-all route), which Flower
    reads after ``flowerconfig.py``. A Flower whose list is not laid out that way gets no page
    and a warning; the ``format_task`` fields do not depend on it.

    Args:
        app: the Celery app whose ``lease_*`` settings name the store; default: the app Flower
            runs with (``celery -A proj flower``).

    Returns:
        Whether the page was added (or was there already).
    """
    from ._flower_page import install

    return install(app)
