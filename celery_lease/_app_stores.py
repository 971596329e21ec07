"""The lease store of each app: made once per process and app, overridable in tests, reset on fork.

``get_store(app)`` makes the store the app's lease settings name (its call timeout worked out
from the ttl, see ``store_timeout``) and keeps it per app; ``override_store()`` puts another in
place for every lease task in the process (``celery_lease.testing``); ``lease_stores(app)``
names every store an app's lease tasks claim in (the passes over the wait lists go through
them). Importing this module installs one process-wide hook: an ``os.register_at_fork`` child
hook that drops inherited store connections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, cast, runtime_checkable

from ._errors import LeaseConfigError, LeaseError
from ._settings import MIN_STORE_CALL, LeaseSettings
from .stores import LeaseStore, store_from_url
from .stores.urls import store_kind

__all__ = [
    "AdoptsAppOptions",
    "get_store",
    "lease_stores",
    "overridden_store",
    "override_store",
    "register_task_type",
    "store_timeout",
]

# (the logger these lines had before they left _app.py: logging settings that name it still apply)
log = logging.getLogger("celery_lease._app")

_StoreKey = tuple[str, str, str, tuple[tuple[str, Any], ...]]
_stores: weakref.WeakKeyDictionary[Any, dict[_StoreKey, LeaseStore]] = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()
# Lease task classes bound so far (see register_task_type): the bootstep resolves the settings
# of their tasks at worker start, so a bad one stops the worker there.
_lease_task_types: weakref.WeakSet[type] = weakref.WeakSet()
# Stores put in place by override_store(), innermost last. Process-wide on purpose: a test's
# worker threads must see the store the test put in place.
_overrides: list[LeaseStore] = []


def store_timeout(settings: LeaseSettings) -> float:
    """Seconds one store call may take before it fails: ``ttl - margin - renew_interval``.

    That is how long a renewal sent on time can take and still be answered before the
    self-fence deadline, so the timeout and the promise agree: a round trip below ttl/3 (the
    window is 5/12 of the ttl by default) never times out. Floored at ``MIN_STORE_CALL``,
    which the settings check already demands of the window.
    """
    window = settings.ttl - settings.effective_margin - settings.effective_renew_interval
    return max(MIN_STORE_CALL, window)


def _store_options(settings: LeaseSettings, call_timeout: float | None = None) -> dict[str, Any]:
    """The options of the store ``settings`` name; ``call_timeout``: how long one call may wait
    for an answer, whatever the ttl (Redis's socket timeout, PostgreSQL's statement timeout and
    with it the connect and TCP user timeouts), at most."""
    options = dict(settings.store_options)
    options.setdefault("retention", settings.retention)
    timeout = store_timeout(settings) if call_timeout is None else call_timeout
    kind = store_kind(settings.store_url)  # (None: store_from_url refuses the URL anyway)
    key = {"redis": "socket_timeout", "postgresql": "statement_timeout"}.get(kind or "")
    if kind == "redis":
        options.setdefault("key_prefix", settings.key_prefix)
    elif kind in ("postgresql", "sqlite"):
        options.setdefault("table_prefix", settings.table_prefix)
    if key is not None:
        options.setdefault(key, timeout)
        if call_timeout is not None:
            options[key] = min(float(options[key]), call_timeout)
    return options


@contextlib.contextmanager
def override_store(store: LeaseStore) -> Iterator[LeaseStore]:
    """Make every lease task in this process use ``store``, whatever its settings say.

    For tests (``celery_lease.testing`` builds on it); overrides nest.
    """
    with _stores_lock:
        _overrides.append(store)
    try:
        yield store
    finally:
        with _stores_lock:
            _overrides.remove(store)


@runtime_checkable
class AdoptsAppOptions(Protocol):
    """A store put in place by ``override_store()`` that takes its options from the app of the
    task that claims (``celery_lease.testing``'s store)."""

    def adopt_app_options(self, options: Mapping[str, Any]) -> None:
        """Take the options every store takes (``max_ttl``, ``retention``) from ``options``."""
        ...


def overridden_store() -> LeaseStore | None:
    """The store put in place by the innermost ``override_store()``, or None."""
    return _overrides[-1] if _overrides else None


def get_store(
    app: Any, settings: LeaseSettings | None = None, *, call_timeout: float | None = None
) -> LeaseStore:
    """The lease store of ``app`` for these settings (made once per process and app).

    An ``override_store()`` in effect wins over the settings. ``call_timeout``: a store of its
    own whose calls wait at most that long for an answer (see ``_store_options``).

    Raises:
        LeaseConfigError: ``lease_store_url`` is not set or not usable.
    """
    override = overridden_store()
    if override is not None:
        return override
    if settings is None:
        settings = LeaseSettings.resolve(app.conf)
    if not settings.store_url:
        raise LeaseConfigError(
            "lease_store_url is not set: set app.conf.lease_store_url to redis://host:6379/0, "
            "postgresql+psycopg://user@host/db or sqlite:///path/leases.db (celery_lease "
            "never falls back to the broker URL)"
        )
    options = _store_options(settings, call_timeout)
    key: _StoreKey = (
        settings.store_url,
        settings.key_prefix,
        settings.table_prefix,
        tuple(sorted((k, repr(v)) for k, v in options.items())),
    )
    per_app = _stores.get(app)
    store = per_app.get(key) if per_app is not None else None
    if store is not None:
        return store
    with _stores_lock:
        per_app = _stores.setdefault(app, {})
        store = per_app.get(key)
        if store is None:
            store = store_from_url(settings.store_url, **options)
            per_app[key] = store
    return store


def _reset_stores_after_fork() -> None:
    for per_app in list(_stores.values()):
        for store in per_app.values():
            try:
                store.reset_after_fork()
            except Exception:
                log.exception("resetting %r after fork failed", store)


# Import-time side effect: a forked child drops the store connections it inherited.
# Process-wide, so here rather than in install() (per app): a store made by get_store() without
# install() (the CLI, users' tests) needs it too, and registering twice would reset twice.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_stores_after_fork)


def lease_stores(app: Any, *, call_timeout: float | None = None) -> list[LeaseStore]:
    """The stores ``app``'s lease tasks claim in: the app's, and any a task names itself (each
    once). A store that cannot be made now (its server is down) is left out. ``call_timeout``:
    stores of their own whose calls wait at most that long (see ``get_store``)."""
    found: dict[tuple[str, str, str], LeaseStore] = {}
    settings = [LeaseSettings.resolve(app.conf)]
    lease_task_types = tuple(_lease_task_types)
    for task in list(app.tasks.values()):
        if isinstance(task, lease_task_types):
            settings.append(cast("Any", task).lease_settings)
    for each in settings:
        if not each.store_url and overridden_store() is None:
            continue
        try:
            store = get_store(app, each, call_timeout=call_timeout)
        except LeaseError as exc:
            log.debug("celery_lease: store %s left out of the pass: %s", each.store_url, exc)
            continue
        # One per set of wait lists: tasks whose ttls differ have stores of their own (their
        # calls' timeouts differ), over the same lists.
        lists = (each.store_url, each.key_prefix, each.table_prefix)
        found.setdefault(("", "", "") if overridden_store() is not None else lists, store)
    return list(found.values())


def register_task_type(cls: type) -> None:
    """Note a lease task class bound to an app, whose tasks the bootstep checks at start.

    Called by ``LeaseTask.on_bound``: ``_task`` imports this module, never the other way round.
    """
    _lease_task_types.add(cls)
