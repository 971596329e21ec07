"""Lease metrics: what celery_lease counts, and how a worker exposes it to Prometheus.

Every counter and histogram is listed in :data:`COUNTERS` and :data:`HISTOGRAMS`; names follow
``celery_lease_<noun>_<event>_total``. Counting always updates this process's plain counters
(:func:`snapshot`); with ``prometheus_client`` installed (the ``prometheus`` extra) it also
updates Prometheus metrics registered in the default registry.

**Prefork.** A prefork worker runs tasks in pool children, so the main process's own counters
stay at 0. ``celery -A proj worker --lease-metrics-port 9808`` therefore switches
``prometheus_client`` to its multiprocess mode before the pool forks: each process writes its
values to a file in a per-worker temporary directory (``PROMETHEUS_MULTIPROC_DIR``, or the one
you set), and the main process serves the sum over all of them on the port. The directory is
removed when the worker exits. The same option works for the solo, threads and gevent pools.

Flower's own ``/metrics`` does not carry these metrics: Flower is a different process with its
own registry. Scrape the worker's port.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = [
    "COUNTERS",
    "HISTOGRAMS",
    "MetricsServer",
    "enable_multiprocess",
    "inc",
    "observe",
    "snapshot",
    "start_server",
]

log = logging.getLogger(__name__)

#: counter name -> (help text, label names).
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "celery_lease_claims_total": ("Leases claimed", ()),
    "celery_lease_claim_conflicts_total": (
        "Claims refused because another owner held the resource",
        (),
    ),
    "celery_lease_takeovers_total": (
        "Claims that recovered work an earlier owner did not finish",
        (),
    ),
    "celery_lease_renewals_total": ("Leases renewed", ()),
    "celery_lease_renewal_failures_total": ("Renewal calls that failed (store error)", ()),
    "celery_lease_leases_lost_total": (
        "Leases lost while a task held them, by reason (expired, taken_over, released, "
        "force_released, renew_failed, max_runtime, stale_fence, ...)",
        ("reason",),
    ),
    "celery_lease_expired_while_running_total": (
        "Task bodies still running when their lease ran out (expired, renewal failed past the "
        "self-fence deadline, runtime cap)",
        (),
    ),
    "celery_lease_releases_total": ("Leases released by their owner", ()),
    "celery_lease_stale_fence_rejections_total": ("Writes rejected for a stale fence", ()),
    "celery_lease_gate_admit_failures_total": (
        "Claims whose new fence a gate of gates= did not admit, by reason: stale (the gate had "
        "admitted a newer fence: the lease is lost, the task runs again later), unreachable "
        "(the gate failed: the lease is given back and the claim waits as on a store outage), "
        "slow (the admits ended past the self-fence deadline: the same), config (a key the "
        "gate refuses)",
        ("reason",),
    ),
    "celery_lease_busy_waits_total": ("Tasks re-queued to wait for a busy resource", ()),
    "celery_lease_wait_list_full_total": (
        "Refused claims that asked to join the wait list and found no room for their message "
        "(they poll in their place instead, or past the places' cap wait with the back-off)",
        (),
    ),
    "celery_lease_wait_payload_too_large_total": (
        "Refused claims of tasks whose wake message is over lease_handoff_max_payload: their "
        "message is not kept and they poll in their place instead",
        (),
    ),
    "celery_lease_duplicates_total": (
        "Deliveries of work already completed, suppressed (not run again)",
        (),
    ),
    "celery_lease_effects_total": (
        "Ledgered effects by outcome: recorded (done now), replayed (found done, receipt "
        "returned), reconciled (an earlier owner's begun effect resolved by reconcile_effect), "
        "superseded (a newer owner took the intent over before it was recorded done)",
        ("outcome",),
    ),
    "celery_lease_reconciliations_total": (
        "Earlier owners' unfinished work reconciled, by outcome: receipt, redo, unresolved "
        "(begun effects), ok, failed (the task's reconcile hook)",
        ("outcome",),
    ),
    "celery_lease_handoffs_total": (
        "Waiting tasks woken at once: by the release that handed the resource over (release), "
        "by a claim that found the head waiter never woken (claim), by a turn check after a "
        "woken waiter missed its grace (turn), by a pass over the wait lists (pass), by an "
        "eviction (evict) or the sweeper (sweep)",
        ("by",),
    ),
    "celery_lease_sweeps_total": (
        "Sweeper results: records past retention swept, expired leases reclaimed, cleanups failed",
        ("result",),
    ),
}

#: histogram name -> (help text, label names, buckets in seconds).
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]] = {
    "celery_lease_acquire_seconds": (
        "Claim latency (one store acquire call), by result: claimed, busy, duplicate, error",
        ("result",),
        (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    ),
    "celery_lease_handoff_seconds": (
        "Hand-off latency: from the wake (the woken task's message sent) to its claim",
        (),
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    ),
    "celery_lease_wait_list_length": (
        "Length of the resource's wait list when a refused claim joined it (its place)",
        (),
        (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
    ),
    "celery_lease_hold_seconds": (
        "Seconds a task held its lease, from claim to release",
        (),
        (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0),
    ),
}

#: name (and ``name{label="value"}``) -> value, for this process. Kept under this name for code
#: that read ``celery_lease._events.METRICS``; :func:`snapshot` is the public way to read it.
METRICS: Counter[str] = Counter()
_lock = threading.Lock()


def snapshot() -> dict[str, float]:
    """This process's counts: ``{name: total}`` plus ``{'name{label="value"}': count}``.

    Histograms appear as ``<name>_count`` and ``<name>_sum``. In a prefork worker each pool
    process has its own; scrape ``--lease-metrics-port`` for the worker's sum.
    """
    with _lock:
        return dict(METRICS)


def _key(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


class _Entry:
    """One series, worked out once: its snapshot keys and its Prometheus child, with the call
    that updates the child (a counter's ``add(1)``, a histogram's ``add(seconds)``)."""

    __slots__ = ("add", "child", "count_key", "labelled", "name", "sum_key")

    def __init__(
        self, name: str, labels: dict[str, str], declared: tuple[str, ...], kind: str = "c"
    ) -> None:
        if tuple(sorted(labels)) != tuple(sorted(declared)):
            raise KeyError(f"{name} takes the labels {declared}, got {tuple(labels)}")
        self.name = name
        self.labelled = _key(name, labels) if labels else None
        self.count_key = f"{name}_count"
        self.sum_key = f"{name}_sum"
        prometheus = _prometheus()
        self.child = None if prometheus is None else prometheus.child(name, labels)
        self.add: Callable[[float], None] | None = (
            None if self.child is None else _updater(self.child, kind)
        )


def _updater(child: Any, kind: str) -> Callable[[float], None]:
    """What ``child.inc(1)`` (counter) or ``child.observe(seconds)`` (histogram) does, without
    the checks and the bucket scan each call repeats (the counter's for a positive amount: the
    general :func:`inc` keeps ``child.inc``, which refuses a negative one).

    A claim and a release each count one and observe one: through the public calls that is a
    label check, a lock and a linear bucket scan per update, about half of what the package's
    metrics cost a task. Our children are always observable (labels given exactly as declared),
    and no exemplars are recorded, so the value objects are updated directly (``_value``,
    ``_sum``, ``_buckets``, ``_upper_bounds``: in prometheus_client since 0.4, in both its
    single- and multiprocess modes). A child without them (another version) keeps the public
    calls.
    """
    if kind == "c":
        value = getattr(child, "_value", None)
        if value is not None and callable(getattr(value, "inc", None)):
            return value.inc  # type: ignore[no-any-return]
        return child.inc  # type: ignore[no-any-return]
    total = getattr(child, "_sum", None)
    buckets = getattr(child, "_buckets", None)
    bounds = getattr(child, "_upper_bounds", None)
    if (
        total is None
        or not isinstance(buckets, list)
        or not isinstance(bounds, list)
        or len(buckets) != len(bounds)
        or not bounds
        or bounds != sorted(bounds)
    ):
        return child.observe  # type: ignore[no-any-return]
    add_sum = total.inc
    add_one = [bucket.inc for bucket in buckets]
    upper = tuple(bounds)
    last = len(upper)

    def observe(seconds: float) -> None:
        add_sum(seconds)
        # The first bucket whose upper bound holds it (the last bound is +Inf); NaN: none.
        i = bisect_left(upper, seconds)
        if i < last and seconds <= upper[i]:
            add_one[i](1)

    return observe


_entries: dict[Any, _Entry] = {}
_generation = 0  # bumped whenever _entries is cleared (a Series looks its entry up again)


def _entry(kind: str, name: str, labels: dict[str, str]) -> _Entry:
    key = (kind, name, *labels.items()) if labels else (kind, name)
    entry = _entries.get(key)
    if entry is None:
        declared = COUNTERS[name][1] if kind == "c" else HISTOGRAMS[name][1]
        entry = _entries[key] = _Entry(name, labels, declared, kind)
    return entry


def inc(name: str, amount: float = 1, **labels: str) -> None:
    """Add ``amount`` to the counter ``name`` (one of :data:`COUNTERS`) with these labels.

    Raises:
        KeyError: ``name`` is not a celery_lease counter, or the labels are not its labels.
    """
    entry = _entry("c", name, labels)
    with _lock:
        METRICS[name] += amount  # type: ignore[assignment]
        if entry.labelled is not None:
            METRICS[entry.labelled] += amount  # type: ignore[assignment]
    if entry.child is not None:
        entry.child.inc(amount)


def observe(name: str, seconds: float, **labels: str) -> None:
    """Record ``seconds`` in the histogram ``name`` (one of :data:`HISTOGRAMS`).

    Raises:
        KeyError: ``name`` is not a celery_lease histogram, or the labels are not its labels.
    """
    entry = _entry("h", name, labels)
    with _lock:
        METRICS[entry.count_key] += 1
        METRICS[entry.sum_key] += seconds  # type: ignore[assignment]
    if entry.add is not None:
        entry.add(seconds)


class Series:
    """One counter or histogram series for a hot path: its entry is looked up once (and again
    after the metrics mode changes), not per call.

    Raises:
        KeyError: ``name`` is not a celery_lease counter (kind "c") or histogram (kind "h").
    """

    __slots__ = ("_entry", "_generation", "kind", "labels", "name")

    def __init__(self, kind: str, name: str, **labels: str) -> None:
        (COUNTERS if kind == "c" else HISTOGRAMS)[name]  # a typo fails at import
        self.kind, self.name, self.labels = kind, name, labels
        self._entry: _Entry | None = None
        self._generation = -1

    def entry(self) -> _Entry:
        entry = self._entry
        if entry is None or self._generation != _generation:
            entry = self._entry = _entry(self.kind, self.name, self.labels)
            self._generation = _generation
        return entry


def record(counter: Series, histogram: Series, seconds: float) -> None:
    """Add 1 to ``counter`` and record ``seconds`` in ``histogram``, under one lock: what every
    claim (claims and claim latency) and every release (releases and hold time) counts."""
    count, hist = counter.entry(), histogram.entry()
    with _lock:
        METRICS[count.name] += 1
        if count.labelled is not None:
            METRICS[count.labelled] += 1
        METRICS[hist.count_key] += 1
        METRICS[hist.sum_key] += seconds  # type: ignore[assignment]
    if count.add is not None:
        count.add(1)
    if hist.add is not None:
        hist.add(seconds)


# -- prometheus_client ----------------------------------------------------------------------------
class _Prometheus:
    """The Prometheus metric objects of this process (rebuilt when the mode changes)."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        self.metrics: dict[str, Any] = {}
        self.children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for name, (doc, labels) in COUNTERS.items():
            self.metrics[name] = Counter(name, doc, labels, registry=None)
        for name, (doc, labels, buckets) in HISTOGRAMS.items():
            self.metrics[name] = Histogram(name, doc, labels, registry=None, buckets=buckets)
        for metric in self.metrics.values():
            try:
                REGISTRY.register(metric)
            except ValueError:  # a name clash with the user's own metrics: theirs win
                log.warning("celery_lease metric %s is already registered; not exposed", metric)
        self._registered = list(self.metrics.values())

    def child(self, name: str, labels: dict[str, str]) -> Any:
        key = (name, tuple(sorted(labels.items())))
        child = self.children.get(key)
        if child is None:
            metric = self.metrics[name]
            child = metric.labels(**labels) if labels else metric
            self.children[key] = child
        return child

    def unregister(self) -> None:
        from prometheus_client import REGISTRY

        for metric in self._registered:
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(metric)


_prom: _Prometheus | None = None
_prom_missing = False
_prom_lock = threading.Lock()


def _prometheus() -> _Prometheus | None:
    global _prom, _prom_missing  # noqa: PLW0603 - built once per process, on first use
    prom = _prom
    if prom is not None or _prom_missing:
        return prom
    with _prom_lock:
        if _prom is None and not _prom_missing:
            try:
                _prom = _Prometheus()
            except ImportError:
                _prom_missing = True
        return _prom


def register_prometheus() -> bool:
    """Register the metrics in ``prometheus_client``'s default registry (idempotent).

    Returns False when prometheus_client is not installed.
    """
    return _prometheus() is not None


# -- multiprocess mode and the worker's exporter ---------------------------------------------------
_multiprocess_dir: str | None = None


def enable_multiprocess(directory: str | None = None) -> str:
    """Switch this process and the processes it forks from now on to multiprocess metrics.

    Call it before the pool forks (the ``--lease-metrics-port`` option does). Without
    ``directory`` it uses ``PROMETHEUS_MULTIPROC_DIR`` when set (wipe it before the worker
    starts, or old counts are added in), else a fresh temporary directory removed when this
    process exits.

    Returns:
        The directory the processes write their values to.

    Raises:
        ImportError: prometheus_client is not installed.
    """
    global _prom, _multiprocess_dir, _generation  # noqa: PLW0603 - the mode is per process tree
    from prometheus_client import values

    with _prom_lock:
        if _multiprocess_dir is not None and directory in (None, _multiprocess_dir):
            return _multiprocess_dir
        if directory is None:
            directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory is None:
            directory = tempfile.mkdtemp(prefix="celery-lease-metrics-")
            atexit.register(_remove_dir, directory, os.getpid())
        os.makedirs(directory, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        # prometheus_client picks its value class when it is imported, which happened before
        # the worker parsed its options: pick again, and rebuild our metrics on it.
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        if _prom is not None:
            _prom.unregister()
            _prom = None
        _entries.clear()
        _generation += 1
        _multiprocess_dir = directory
    _prometheus()
    return directory


def _remove_dir(directory: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the atexit hook
        shutil.rmtree(directory, ignore_errors=True)


def mark_process_dead(pid: int | None = None) -> None:
    """Tell the multiprocess files that ``pid`` (default: this process) exited.

    Counters and histograms of a dead process keep counting in the sum (they are totals);
    only live gauges are dropped. Called in each pool process as it shuts down.
    """
    if _multiprocess_dir is None:
        return
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(  # type: ignore[no-untyped-call]
            os.getpid() if pid is None else pid, _multiprocess_dir
        )
    except OSError as exc:  # pragma: no cover - the directory is gone already
        log.debug("marking process %s dead failed: %s", pid, exc)


class MetricsServer:
    """The HTTP server a worker exposes its lease metrics on (see :func:`start_server`)."""

    def __init__(self, server: Any, thread: threading.Thread, address: str, port: int) -> None:
        self.server = server
        self.thread = thread
        self.address = address
        self.port = port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(2.0)

    def __repr__(self) -> str:
        return f"<MetricsServer http://{self.address}:{self.port}/metrics>"


def start_server(port: int, address: str = "0.0.0.0") -> MetricsServer:  # noqa: S104
    """Serve the metrics of this process and, in multiprocess mode, of all its children.

    Args:
        port: the TCP port (0 picks a free one; see ``MetricsServer.port``).
        address: the address to bind (``0.0.0.0`` for every interface, as Prometheus
            exporters do; ``127.0.0.1`` for this host only).

    Raises:
        ImportError: prometheus_client is not installed.
        OSError: the port is taken.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    registry = REGISTRY
    if _multiprocess_dir is not None:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=_multiprocess_dir)  # type: ignore[no-untyped-call]
    server, thread = start_http_server(port, address, registry=registry)
    return MetricsServer(server, thread, address, server.server_address[1])
