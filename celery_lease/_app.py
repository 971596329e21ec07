"""Per-app wiring: the store of each app, the worker bootstep, worker options and signals.

``install(app)`` runs automatically when a lease task is bound to an app; call it yourself in
the module that creates the app if you want the ``--lease-*`` worker options (the command line
is parsed before task modules are imported).

Importing this module (which importing ``celery_lease`` does) installs five process-wide
hooks, marked where they happen below: an ``os.register_at_fork`` child hook that drops
inherited store connections, a ``worker_process_shutdown`` receiver and an ``atexit`` handler
that release the leases still held and run the turn checks still pending, a
``worker_process_init`` receiver that starts the passes over the wait lists in the first
prefork pool process of a worker without an event loop (one with a loop passes in its main
process, on it: ``LeaseBootstep.register_with_event_loop``), and a ``task_failure``
receiver that logs a lease task whose pool process died (``_workerlog``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, cast, runtime_checkable

from celery import bootsteps, signals

from . import _events as events
from . import metrics
from ._errors import LeaseConfigError, LeaseError
from ._names import mask_url
from ._renewer import get_renewer
from ._settings import MIN_STORE_CALL, LeaseSettings
from ._wakes import (
    WAKE_QUEUE_SUFFIX,
    TurnCheck,
    drain_turns,
    get_waker,
    wake_queue,
    wake_queues_on,
)
from ._workerlog import crash_recovery_warnings, on_task_failure, ttl_summary
from .stores import LeaseStore, store_from_url
from .stores.urls import store_kind

__all__ = [
    "WAKE_QUEUE_SUFFIX",
    "LeaseBootstep",
    "LeaseWakeQueues",
    "get_store",
    "install",
    "lease_stores",
    "overridden_store",
    "override_store",
    "release_all_held",
    "store_timeout",
    "wake_queue",
    "wake_queue_for",
    "wake_queues_on",
]

log = logging.getLogger(__name__)

_StoreKey = tuple[str, str, str, tuple[tuple[str, Any], ...]]
_stores: weakref.WeakKeyDictionary[Any, dict[_StoreKey, LeaseStore]] = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()
_installed: weakref.WeakSet[Any] = weakref.WeakSet()
# Lease task classes bound so far (see register_task_type): the bootstep resolves the settings
# of their tasks at worker start, so a bad one stops the worker there.
_lease_task_types: weakref.WeakSet[type] = weakref.WeakSet()
# What install() and the worker-start check also do, for modules above this one (_routes:
# lease_routes), which this module may not import: see on_install and on_check.
_install_hooks: list[Callable[[Any], None]] = []
_check_hooks: list[Callable[[Any], list[str]]] = []
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


# Import-time side effect (1 of 3): a forked child drops the store connections it inherited.
# Process-wide, so here rather than in install() (per app): a store made by get_store() without
# install() (the CLI, users' tests) needs it too, and registering twice would reset twice.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_stores_after_fork)


def release_all_held() -> int:
    """Release every lease this process still holds (shutdown path). Returns how many."""
    renewer = get_renewer()
    held = renewer.held()
    renewer.shutdown()
    released = 0
    for lease in held:
        if lease.store is None:
            continue
        try:
            released += bool(lease.store.release(lease))
        except LeaseError as exc:
            log.warning("could not release %r at shutdown: %s", lease, exc)
    if held:
        log.info("celery_lease released %d of %d held leases at shutdown", released, len(held))
    return released


def _on_process_shutdown(**_: Any) -> None:
    release_all_held()
    # A pool process recycled right after its release: its turn check is handed to the main
    # process (its pool slot is not held for it), or else runs before it exits.
    turns = _parent_turns if HAND_OVER_TURNS else None
    drain_turns(hand_over=None if turns is None else turns.hand_over)
    metrics.mark_process_dead()


def _at_exit() -> None:
    release_all_held()
    if _parent_turns is not None:  # (a prefork worker's main process whose loop has stopped)
        _parent_turns.take_leftovers()
    drain_turns()  # (the CLI, a script's release_lease or force_release: about a grace)


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


def _pass_over_waits(app: Any, call_timeout: float | None = None) -> None:
    """Pass the turn on over ``app``'s wait lists every renew interval in this process (see
    ``_wakes``): a wake whose sender died, or the waiters of a holder that died, go out within
    about the hand-off grace plus that interval. ``call_timeout``: through stores of their own
    whose calls wait at most that long (an event loop waits for them)."""
    settings = LeaseSettings.resolve(app.conf)
    get_waker().pass_every(
        app,
        settings.effective_renew_interval,
        lambda: lease_stores(app, call_timeout=call_timeout),
    )


#: Whether a prefork worker with an event loop (a Redis or AMQP broker) passes over the wait
#: lists in its main process, on that loop (the tests' negative control sets False: in its
#: first pool process, as a worker without an event loop does).
PASS_IN_PARENT = True
#: The longest one store call of a prefork worker's main process may wait for an answer: its
#: event loop (fetching, dispatching and acking every task) waits meanwhile. A pass makes one
#: call per store, and stops at an error until its next interval.
PARENT_CALL_TIMEOUT = 1.0

#: Apps whose prefork pool processes pass over the wait lists (see LeaseBootstep.start).
_pass_in_children: weakref.WeakSet[Any] = weakref.WeakSet()


class _ParentTurns:
    """How the pool processes of a prefork worker that passes on its event loop hand their
    pending turn checks to its main process when they exit, instead of waiting for them: a
    process recycled by ``--max-tasks-per-child`` right after its release would hold its pool
    slot for about a grace, and with one slot the woken waiter could not run meanwhile.

    A pipe made by the main process before it forks the pool. A pool process writes one line
    per check, ``[resource, due]`` in JSON (each written whole: under PIPE_BUF bytes); the main
    process reads them on its event loop and checks that resource at its due time in each
    store it passes over (the same wait lists as the pool process's store: only checks on a
    store the app's settings name are handed over).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.pid = os.getpid()
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)  # (a main process that stalls: keep them here)
        self._partial = b""

    def register_with(self, hub: Any) -> None:
        hub.add_reader(self.read_fd, self._read)  # (again after a reconnection: no harm)

    def hand_over(self, checks: list[TurnCheck]) -> list[TurnCheck]:
        """In a pool process: write the checks the main process can run; the others come
        back (and those a full or closed pipe did not take)."""
        if os.getpid() == self.pid:
            return checks
        named = {id(store) for store in _stores.get(self.app, {}).values()}
        kept: list[TurnCheck] = []
        for check in checks:
            line = json.dumps([check.resource, check.due]).encode() + b"\n"
            if check.app is not self.app or id(check.store) not in named:
                kept.append(check)
                continue
            try:
                if len(line) > select.PIPE_BUF or os.write(self.write_fd, line) != len(line):
                    kept.append(check)
            except OSError:
                kept.append(check)
        return kept

    def take_leftovers(self) -> None:
        """In the main process at its exit: take the checks its pool processes handed over
        after its event loop stopped (a warm shutdown: they exit as the pool is closed), for
        ``drain_turns`` to run."""
        if os.getpid() == self.pid:
            while self._read():
                pass

    def _read(self) -> bool:
        """Take the checks written so far (on the event loop); whether anything was read.
        Never raises: an error here would stop the worker's event loop."""
        try:
            data = os.read(self.read_fd, 65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            log.exception("celery_lease: reading the turn checks of the pool processes failed")
            return False
        try:
            self._schedule(data)
        except Exception:
            log.exception("celery_lease: the turn checks handed over by a pool process failed")
        return bool(data)

    def _schedule(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        checks = []
        for line in lines:
            try:
                resource, due = json.loads(line)
                checks.append((str(resource), float(due)))
            except (ValueError, TypeError):
                log.warning("celery_lease: a pool process handed over an unreadable turn check")
        if not checks:
            return
        waker = get_waker()
        for store in lease_stores(self.app, call_timeout=PARENT_CALL_TIMEOUT):
            for resource, due in checks:
                waker.check_at(self.app, store, resource, due)


#: This worker's, when its pool processes hand their turn checks to its main process.
_parent_turns: _ParentTurns | None = None
#: Whether they do (the tests' negative control sets False: each waits for its own).
HAND_OVER_TURNS = True


def _on_process_init(**_: Any) -> None:
    # Without an event loop in the main process (a broker transport without one, or
    # PASS_IN_PARENT off): one pool process passes (the first; a replacement takes its index):
    # every process would multiply the passes, and each holds a store connection of its own
    # while it passes. (Shrunk away by --autoscale, or recycled by --max-tasks-per-child
    # faster than one interval, it passes no more: see LeaseBootstep._start_passes.)
    from billiard.process import current_process

    if getattr(current_process(), "index", 0) not in (0, None):
        return
    for app in list(_pass_in_children):
        _pass_over_waits(app)


# Import-time side effect (4): the first pool process of a prefork worker without an event
# loop passes over the wait lists of the apps its worker started (connected here, in the
# parent, before it forks).
signals.worker_process_init.connect(_on_process_init, weak=False)


# Import-time side effects (2 and 3 of 3): a pool process that exits, and an interpreter that
# exits, release the leases still held, so the next owner need not wait for the ttl, and run
# the turn checks still pending (bounded by about a grace), so a wake it sent is passed on if
# its waiter never claims. Both are process-wide and idempotent (nothing held, nothing pending:
# nothing done), so they are connected once, when the first lease task module imports this one.
signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
atexit.register(_at_exit)

# Import-time side effect (5): a lease task whose prefork pool process died mid-task is logged
# with its resource and fence by the worker's main process, where Celery reports it.
signals.task_failure.connect(on_task_failure, weak=False)


class LeaseBootstep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: applies ``--lease-*`` options and checks the store at start."""

    label = "celery_lease"

    def __init__(
        self,
        worker: Any,
        lease_store_url: str | None = None,
        lease_ttl: float | None = None,
        lease_max_runtime: float | None = None,
        lease_metrics_port: int | None = None,
        lease_metrics_address: str | None = None,
        **options: Any,
    ) -> None:
        self.metrics_port = lease_metrics_port
        self.metrics_address = lease_metrics_address or "0.0.0.0"  # noqa: S104 - as exporters do
        self.metrics_server: metrics.MetricsServer | None = None
        #: A prefork worker's main process passes on its event loop (see _start_passes).
        self.passes_on_loop = False
        if lease_metrics_port is not None:
            # Now, in the main process before the pool forks: each child then writes its
            # counts where the main process can sum them.
            try:
                self.metrics_dir: str | None = metrics.enable_multiprocess()
            except ImportError:
                raise LeaseConfigError(
                    "--lease-metrics-port needs prometheus_client: pip install "
                    "'celery-lease[prometheus]'"
                ) from None
        conf = worker.app.conf
        for key, value in (
            ("lease_store_url", lease_store_url),
            ("lease_ttl", lease_ttl),
            ("lease_max_runtime", lease_max_runtime),
        ):
            if value is not None:
                conf[key] = value
        if getattr(worker, "task_events", False):
            conf["worker_send_task_events"] = True
        if _is_test_worker(worker):
            # celery.contrib.testing starts this worker in a thread and waits, with no timeout,
            # for it to be ready: an error raised in start() is only logged there and the test
            # hangs. So check here, in the test's thread, where an error fails the test at once.
            settings = _check_settings(worker.app)
            if not settings.store_url and overridden_store() is None:
                raise LeaseConfigError(
                    "lease_store_url is not set and no lease_store fixture is in effect while "
                    "this in-process test worker starts: start the worker after the lease_store "
                    "fixture (take lease_store in the worker fixture, in function scope), or set "
                    "app.conf.lease_store_url = 'memory://' for the tests (the lease_store "
                    "fixture still wins while a test runs)"
                )
        super().__init__(worker, **options)

    def start(self, worker: Any) -> None:
        if self.metrics_port is not None and self.metrics_server is None:
            try:
                self.metrics_server = metrics.start_server(self.metrics_port, self.metrics_address)
            except OSError as exc:
                raise LeaseConfigError(
                    f"--lease-metrics-port {self.metrics_port}: cannot listen on "
                    f"{self.metrics_address}:{self.metrics_port} ({exc})"
                ) from None
            log.info(
                "celery_lease metrics on http://%s:%d/metrics, summed over the pool "
                "processes through PROMETHEUS_MULTIPROC_DIR=%s",
                self.metrics_address,
                self.metrics_server.port,
                self.metrics_dir,
            )
        app = worker.app
        settings = _check_settings(app)  # bad settings stop the worker here
        tasks = _lease_task_settings(app)
        # Here, in the worker's main process, once per worker start.
        for warning in crash_recovery_warnings(app, tasks, _is_prefork(worker)):
            log.warning("celery_lease: %s", warning)
        for warning in _check_warnings(app):
            log.warning("celery_lease: %s", warning)
        try:
            store = get_store(app, settings)
            warnings = store.check_health()
        except LeaseConfigError:
            raise
        except LeaseError as exc:  # the store is down: tasks wait for it, the worker starts
            log.error(  # noqa: TRY400 - the message says it all; no traceback wanted
                "celery_lease store %s is not usable at start: %s",
                mask_url(settings.store_url),
                exc,
            )
            return
        for warning in warnings:
            log.warning("celery_lease: %s", warning)
        # Each task's own ttl: a task's ttl= overrides the app's lease_ttl.
        ttls = {task.name: each.ttl for task, each in tasks}
        log.info("celery_lease store %s ready (%s)", store.url, ttl_summary(settings.ttl, ttls))

    def _start_passes(self, worker: Any) -> None:
        """Pass over the wait lists once per worker: in this process, on the waker's thread,
        unless the pool forks. A prefork worker passes in its main process, on its event loop
        (started by register_with_event_loop), whichever pool processes come and go; never on
        a thread there (the loop forks the pool processes: a thread of ours could be forked
        in the middle of a store call). Without an event loop, its first pool process passes."""
        global _parent_turns  # noqa: PLW0603 - one worker per process; its pool inherits it
        app = worker.app
        if not _is_prefork(worker):
            _pass_over_waits(app)
        elif PASS_IN_PARENT and getattr(worker, "use_eventloop", False):
            self.passes_on_loop = True
            if _parent_turns is None or _parent_turns.app is not app:
                _parent_turns = _ParentTurns(app)
        else:
            _pass_in_children.add(app)

    def register_with_event_loop(self, worker: Any, hub: Any) -> None:
        """The worker's event loop starts (again, after a broker reconnection): a prefork
        worker's main process passes over the wait lists on it, through stores whose calls
        wait at most PARENT_CALL_TIMEOUT (the loop waits for them)."""
        if not self.passes_on_loop:
            return
        get_waker().run_on(hub)
        _pass_over_waits(worker.app, call_timeout=PARENT_CALL_TIMEOUT)
        if _parent_turns is not None:
            _parent_turns.register_with(hub)

    def create(self, worker: Any) -> None:
        # Here, before the consumer connects (start() runs after it did), so the warning
        # comes before the worker's first ack.
        warning = broker_pool_warning(worker.app, getattr(worker, "pool_cls", None), _most(worker))
        if warning is not None:
            log.warning("celery_lease: %s", warning)
        # Here, before any step starts: a prefork pool may fork its processes before start().
        self._start_passes(worker)

    def stop(self, worker: Any) -> None:
        server, self.metrics_server = self.metrics_server, None
        if server is not None:
            server.close()
        get_waker().stop_passes(worker.app)


#: Connections of the Redis broker's pool a green worker needs beyond one per task slot (the
#: consumer's own, which records each fetched message in the unacked hash, and one spare).
BROKER_POOL_SPARE = 2


def _most(worker: Any) -> int:
    """The most tasks the worker's pool runs at once: ``-c``, or the top of ``--autoscale``
    (the Pool step set ``max_concurrency`` before any step's ``create``)."""
    return max(int(getattr(worker, "concurrency", 0) or 0), int(worker.max_concurrency or 0))


def broker_pool_warning(app: Any, pool_cls: Any, concurrency: int) -> str | None:
    """Why a green worker's acks may fail on its Redis broker's connection pool, or None.

    Celery 5.7 acks a task from the greenlet that ran it (``Consumer.call_soon_ack``), so up to
    ``concurrency`` acks are in flight at once, and the Redis transport's pool of a channel
    holds ``max_connections`` (10 unless the broker transport options say otherwise) and raises
    ``MaxConnectionsError`` past that instead of waiting. Such an ack fails ("Couldn't ack":
    the message runs again after the visibility timeout and holds a prefetch slot until then),
    and when the error hits the consumer as it fetches a message, that message is lost.
    """
    from celery.worker.consumer import Consumer

    if not getattr(pool_cls, "is_green", False) or not hasattr(Consumer, "call_soon_ack"):
        return None  # (before Celery 5.7 the consumer's loop sent every ack itself)
    conn = app.connection_for_read()
    try:
        transport = conn.transport
        if getattr(transport, "driver_type", None) != "redis":
            return None
        options = conn.transport_options or {}
        limit = options.get("max_connections", getattr(transport.Channel, "max_connections", 0))
    finally:
        conn.release()
    needed = int(concurrency) + BROKER_POOL_SPARE
    if not limit or limit >= needed:  # (None: redis-py's own default, 100 and up)
        return None
    return (
        f"a -c {concurrency} green pool acks up to {concurrency} tasks at once, but the Redis "
        f"broker's connection pool holds {limit} (broker_transport_options max_connections): "
        'acks past it fail ("Couldn\'t ack"; the task runs again after the visibility '
        "timeout) and a message being fetched can be lost. Set broker_transport_options = "
        f"{{'max_connections': {int(concurrency) + 10}}} (at least {needed})"
    )


def _check_settings(app: Any) -> LeaseSettings:
    """Resolve the app's lease settings and each lease task's (a bad one raises
    ``LeaseConfigError``), and run the checks registered with ``on_check``. Not kept: a task
    resolves again at its first run (a test may change a setting after its worker started)."""
    settings = LeaseSettings.resolve(app.conf)
    _lease_task_settings(app)
    for check in _check_hooks:
        check(app)
    return settings


def _check_warnings(app: Any) -> list[str]:
    """The warnings of the checks registered with ``on_check`` (run after _check_settings)."""
    return [warning for check in _check_hooks for warning in check(app)]


def on_install(hook: Callable[[Any], None]) -> None:
    """Have ``install(app)`` also call ``hook(app)`` (``_routes``: the lease_routes entry)."""
    _install_hooks.append(hook)


def on_check(hook: Callable[[Any], list[str]]) -> None:
    """Have the worker's start check also call ``hook(app)``: it raises ``LeaseConfigError``
    to stop the worker, and returns warnings to log."""
    _check_hooks.append(hook)


def _lease_task_settings(app: Any) -> list[tuple[Any, LeaseSettings]]:
    """Each lease task of ``app`` with its settings, resolved now and not kept (see above)."""
    tasks = list(app.tasks.values())  # (first: reading them finalizes the app, binding them)
    lease_task_types = tuple(_lease_task_types)
    return [
        (task, cast("Any", task)._resolve_lease_settings())
        for task in tasks
        if isinstance(task, lease_task_types)
    ]


def _is_prefork(worker: Any) -> bool:
    """Whether the worker runs its tasks in prefork pool processes."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    pool = getattr(worker, "pool_cls", None)
    return isinstance(pool, type) and issubclass(pool, PreforkPool)


def _is_test_worker(worker: Any) -> bool:
    """True for the in-process worker of ``celery.contrib.testing`` (and its pytest plugin)."""
    testing = sys.modules.get("celery.contrib.testing.worker")
    return testing is not None and isinstance(worker, testing.TestWorkController)


def register_task_type(cls: type) -> None:
    """Note a lease task class bound to an app, whose tasks the bootstep checks at start.

    Called by ``LeaseTask.on_bound``: ``_task`` imports this module, never the other way round.
    """
    _lease_task_types.add(cls)


def install(app: Any) -> None:
    """Add the lease bootsteps and the ``--lease-*`` worker options to ``app`` (idempotent)."""
    if app in _installed:
        return
    _installed.add(app)
    for hook in _install_hooks:
        hook(app)
    app.steps["worker"].add(LeaseBootstep)
    app.steps["consumer"].add(LeaseWakeQueues)
    events.register_prometheus()
    try:
        from click import Option
    except ImportError:  # pragma: no cover - click comes with celery
        return
    app.user_options["worker"].update(
        {
            Option(["--lease-store-url"], default=None, help="celery_lease store URL."),
            Option(["--lease-ttl"], type=float, default=None, help="Lease ttl in seconds."),
            Option(
                ["--lease-max-runtime"],
                type=float,
                default=None,
                help="Hard cap on one execution's lease hold, seconds.",
            ),
            Option(
                ["--lease-metrics-port"],
                type=int,
                default=None,
                help="Serve celery_lease metrics (summed over the pool processes) on this "
                "port at /metrics.",
            ),
            Option(
                ["--lease-metrics-address"],
                default=None,
                help="Address for --lease-metrics-port (default 0.0.0.0).",
            ),
        }
    )


# -- wake queues ---------------------------------------------------------------------------------
_AMQP_NAME_MAX = 255


def _has_wake_queue(queue: Any) -> str | None:
    """The name of ``queue``'s wake queue, or None when it gets none: a wake queue itself, a
    worker's own queue (``worker_direct``, auto-delete or exclusive: one worker's), bindings of
    its own, an exchange other than a direct one, or a name too long for AMQP."""
    name = getattr(queue, "name", None)
    if not isinstance(name, str) or not name or name.endswith(WAKE_QUEUE_SUFFIX):
        return None
    if name.endswith(".dq2") or name.startswith("amq."):
        return None
    if getattr(queue, "auto_delete", False) or getattr(queue, "exclusive", False):
        return None
    if getattr(queue, "bindings", None) or getattr(queue, "alias", None):
        return None
    exchange = getattr(queue, "exchange", None)
    if exchange is not None and exchange.name and exchange.type != "direct":
        return None
    wake = name + WAKE_QUEUE_SUFFIX
    if len(wake.encode()) > _AMQP_NAME_MAX:
        return None
    return wake


def wake_queue_for(app: Any, delivery: Any) -> str | None:
    """The wake queue of the one task queue a message with this ``delivery_info`` came from,
    among those this worker consumes, or None when that is not certain (none or several match,
    or the queue gets no wake queue).

    A message sent through the default exchange ('') came from the queue its routing key
    names; through a direct exchange, from a consumed queue bound to it with that routing key.
    (A prefork child knows the queues its worker consumed when the child started; a queue added
    since matches nothing, so its wakes take their own route.)
    """
    if not delivery:
        return None
    exchange, routing_key = delivery.get("exchange"), delivery.get("routing_key")
    if not isinstance(routing_key, str) or not routing_key:
        return None
    consumed = app.amqp.queues.consume_from
    if exchange == "":
        if routing_key not in consumed:  # ('in': a missing name would create the queue)
            return None
        return _has_wake_queue(consumed[routing_key])
    found = None
    for queue in consumed.values():
        bound = queue.exchange is not None and queue.exchange.name == exchange
        if bound and queue.routing_key == routing_key:
            if found is not None:
                return None  # several: a publish on the route reaches each
            found = queue
    return None if found is None else _has_wake_queue(found)


class LeaseWakeQueues(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: beside each task queue Q the worker consumes, consume Q's wake queue
    (``Q.lease-wake``), where a woken waiter's message goes so it does not wait behind Q's
    backlog. Added with Q (start, reconnect, ``add_consumer``), cancelled with Q
    (``cancel_consumer``; a warm shutdown cancels the task consumer, wake queues and all), so
    the workers that get Q's wakes are always the ones that consume Q."""

    label = "celery_lease wake queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def include_if(self, c: Any) -> bool:
        return wake_queues_on(c.app) and _handoff_anywhere(c.app)

    def start(self, c: Any) -> None:
        consumer = c.task_consumer
        if consumer is None:
            return
        for queue in list(consumer.queues):
            _add_wake_queue(consumer, queue, consume=False)  # (the event loop consumes them)
        _wakes_first(consumer)
        if not getattr(c, "_lease_wake_wrapped", False):
            c._lease_wake_wrapped = True
            add, cancel = c.add_task_queue, c.cancel_task_queue

            def add_task_queue(queue: str, *args: Any, **kwargs: Any) -> None:
                add(queue, *args, **kwargs)
                consumer = c.task_consumer
                if consumer is not None:
                    for known in list(consumer.queues):
                        if known.name == queue:
                            _add_wake_queue(consumer, known, consume=True)

            def cancel_task_queue(queue: str) -> None:
                name = c.app.amqp.queues.aliases.get(queue, queue)
                name = getattr(name, "name", name)  # (an alias maps to its Queue)
                cancel(queue)
                consumer = c.task_consumer
                if consumer is not None and isinstance(name, str):
                    consumer.cancel_by_queue(name + WAKE_QUEUE_SUFFIX)

            c.add_task_queue, c.cancel_task_queue = add_task_queue, cancel_task_queue


def _wakes_first(consumer: Any) -> None:
    """Put each wake queue right before its task queue in ``consumer``'s queues, the order
    it consumes them in when the event loop starts: Redis's "priority" order serves them so
    (a wake of Q before Q's backlog, Q's before the queues after Q)."""
    queues = getattr(consumer, "_queues", None)
    if not isinstance(queues, dict):
        return
    order: dict[str, Any] = {}
    for name, queue in queues.items():
        if name.endswith(WAKE_QUEUE_SUFFIX) and name[: -len(WAKE_QUEUE_SUFFIX)] in queues:
            continue  # (placed before its task queue)
        wake = name + WAKE_QUEUE_SUFFIX
        if wake in queues:
            order[wake] = queues[wake]
        order[name] = queue
    if list(order) != list(queues):
        queues.clear()
        queues.update(order)


def _wake_before_its_queue(channel: Any, wake: str, name: str) -> None:
    """A wake queue consumed after its task queue (``add_consumer``): move it right before
    that queue in a Redis channel's order of the queues it serves (see _wakes_first)."""
    active = getattr(channel, "_active_queues", None)
    update = getattr(channel, "_update_queue_cycle", None)
    if not isinstance(active, list) or update is None or wake not in active or name not in active:
        return
    active.remove(wake)
    active.insert(active.index(name), wake)
    update()


def _handoff_anywhere(app: Any) -> bool:
    """Whether a task of ``app`` may wait in a wait list (and so be woken): ``lease_handoff``
    is not off, or a task turns it on for itself. Otherwise no wake is ever sent to a wake
    queue and the worker consumes none."""
    if app.conf.get("lease_handoff") is not False:
        return True
    return any(getattr(task, "lease_handoff", None) is True for task in list(app.tasks.values()))


def _add_wake_queue(consumer: Any, queue: Any, *, consume: bool) -> None:
    wake = _has_wake_queue(queue)
    if wake is None or consumer.consuming_from(wake):
        return
    if any(q.name == wake for q in consumer.queues):
        return
    consumer.add_queue(wake_queue(wake))
    if consume:
        consumer.consume()
        _wake_before_its_queue(consumer.channel, wake, queue.name)
    log.debug("celery_lease: consuming wake queue %s beside %s", wake, queue.name)
