"""Per-app wiring: install(), the worker bootstep and its start checks, and what it re-exports.

``install(app)`` runs automatically when a lease task is bound to an app; call it yourself in
the module that creates the app if you want the ``--lease-*`` worker options (the command line
is parsed before task modules are imported).

Importing this module (which importing ``celery_lease`` does) installs five process-wide
hooks: an ``os.register_at_fork`` child hook that drops inherited store connections
(``_app_stores``), a ``worker_process_shutdown`` receiver and an ``atexit`` handler that
release the leases still held and run the turn checks still pending, a ``worker_process_init``
receiver that starts the passes over the wait lists in the first prefork pool process of a
worker without an event loop (one with a loop passes in its main process, on it:
``LeaseBootstep.register_with_event_loop``; those three in ``_passes``), and here a
``task_failure`` receiver that logs a lease task whose pool process died (``_workerlog``).

The rest of the wiring lives in modules of their own and is re-exported here: the store of
each app (``_app_stores``), where a worker passes the turn on and what a process does on its
way out (``_passes``), and the consumer bootstep of the hand-off's wake queues
(``_wake_queues``).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any, cast

from celery import bootsteps, signals

from . import _events as events
from . import metrics
from ._app_stores import (
    _lease_task_types,
    get_store,
    lease_stores,
    overridden_store,
    override_store,
    store_timeout,
)
from ._errors import LeaseConfigError, LeaseError
from ._names import mask_url
from ._passes import is_prefork, pass_on_loop, release_all_held, start_passes
from ._settings import LeaseSettings
from ._wake_queues import (
    WAKE_QUEUE_SUFFIX,
    LeaseWakeQueues,
    wake_queue,
    wake_queue_for,
    wake_queues_on,
)
from ._wakes import get_waker
from ._workerlog import crash_recovery_warnings, on_task_failure, ttl_summary

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

_installed: weakref.WeakSet[Any] = weakref.WeakSet()
# What install() and the worker-start check also do, for modules above this one (_routes:
# lease_routes), which this module may not import: see on_install and on_check.
_install_hooks: list[Callable[[Any], None]] = []
_check_hooks: list[Callable[[Any], list[str]]] = []


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
        #: A prefork worker's main process passes on its event loop (see start_passes).
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
        for warning in crash_recovery_warnings(app, tasks, is_prefork(worker)):
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

    def register_with_event_loop(self, worker: Any, hub: Any) -> None:
        """The worker's event loop starts (again, after a broker reconnection): a prefork
        worker's main process passes over the wait lists on it (``_passes.pass_on_loop``)."""
        if self.passes_on_loop:
            pass_on_loop(worker.app, hub)

    def create(self, worker: Any) -> None:
        # Here, before the consumer connects (start() runs after it did), so the warning
        # comes before the worker's first ack.
        warning = broker_pool_warning(worker.app, getattr(worker, "pool_cls", None), _most(worker))
        if warning is not None:
            log.warning("celery_lease: %s", warning)
        # Here, before any step starts: a prefork pool may fork its processes before start().
        self.passes_on_loop = start_passes(worker)

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


def _is_test_worker(worker: Any) -> bool:
    """True for the in-process worker of ``celery.contrib.testing`` (and its pytest plugin)."""
    testing = sys.modules.get("celery.contrib.testing.worker")
    return testing is not None and isinstance(worker, testing.TestWorkController)


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
