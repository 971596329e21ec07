"""Leases in Flower: each task's page says which lease it wants, who holds it, and why it waits.

Flower keeps only the fields it knows from each event, so a ``task-lease-busy`` event shows as
state ``LEASE-BUSY`` and nothing more. This module is a ``format_task`` hook that adds a
``lease`` field to every task Flower shows (the task page and the tasks table), read from the
lease store when the page is drawn: the resource, who holds it (owner label, never the token),
its fence and when it expires. (The state, ``LEASE-BUSY`` then ``RETRY``, and the exception
Flower shows already name the resource, holder and fence of the moment the task was refused.)

``flowerconfig.py`` next to where Flower runs (``celery -A proj flower``):

```python
from celery_lease.contrib.flower import format_task
```

The resource comes from the task's ``resource`` template applied to its arguments as Flower
shows them (Flower hands the hook a copy of the task without the fields of ``task-lease-*``
events; when Flower cut a long argument short there is no resource to show). Store reads are
cached for :data:`CACHE_SECONDS`, so a table of a hundred tasks on one resource costs one read.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable
from typing import Any

from .. import _clock
from .._errors import LeaseError
from .._eventlog import redact
from .._names import holder_task_id

__all__ = ["CACHE_SECONDS", "annotate", "format_task", "make_format_task"]

#: Seconds a lease read from the store is reused.
CACHE_SECONDS = 1.0
_cache: dict[tuple[int, str], tuple[float, Any]] = {}
_lock = threading.Lock()


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
    """Add a ``lease`` field to Flower's copy of ``task``; return it (unchanged if no lease)."""
    resource = _resource_of(task, app)
    if resource is None:
        return task
    task.lease = redact(
        f"resource {resource}: {_current(app, resource, getattr(task, 'uuid', None))}"
    )
    fields = tuple(getattr(task, "_fields", ()))
    if "lease" not in fields:
        # Right after the state: the page shows it first among the details, the reason why.
        at = fields.index("state") + 1 if "state" in fields else len(fields)
        task._fields = (*fields[:at], "lease", *fields[at:])
    return task


def _resource_of(task: Any, app: Any) -> str | None:
    resource = getattr(task, "resource", None)
    if isinstance(resource, str) and resource:
        return resource
    from .._task import LeaseTask

    definition = app.tasks.get(getattr(task, "name", None) or "")
    if not isinstance(definition, LeaseTask):
        return None
    try:
        args = _literal(getattr(task, "args", None), ())
        kwargs = _literal(getattr(task, "kwargs", None), {})
        return definition.lease_resource_for(tuple(args), dict(kwargs))
    except (LeaseError, ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _literal(text: Any, empty: Any) -> Any:
    if text is None or text == "":
        return empty
    if not isinstance(text, str):
        return text
    return ast.literal_eval(text)


def _current(app: Any, resource: str, task_id: str | None) -> str:
    from .._app import get_store

    key = (id(app), resource)
    now = _clock.monotonic()
    with _lock:
        cached = _cache.get(key)
    if cached is not None and now - cached[0] < CACHE_SECONDS:
        info = cached[1]
    else:
        try:
            info = get_store(app).get(resource)
        except LeaseError as exc:
            return f"lease store unavailable ({exc})"
        with _lock:
            if len(_cache) > 10_000:
                _cache.clear()
            _cache[key] = (now, info)
    if info is None:
        return "free"
    who = info.owner_label
    if task_id and holder_task_id(who) == task_id:
        who = f"this task ({who})"
    if info.expired:
        return f"expired lease of {who} with fence {info.fence}, not released"
    return f"held by {who} with fence {info.fence}, expires in {info.expires_in:.1f}s"
