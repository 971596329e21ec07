"""Lease events and the counting entry points the rest of the package calls.

Counters and histograms live in :mod:`celery_lease.metrics` (in-process counts, mirrored to
``prometheus_client`` when it is installed, multiprocess under a prefork worker).

Events are Celery ``task-lease-*`` events (``task-lease-busy``, ``task-lease-lost``,
``task-lease-recovered``), sent only when the worker sends task events (``-E``) and the
``lease_send_events`` setting is on. Flower counts them in ``flower_events_total{type=...}``.
Fields never carry an owner token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import metrics
from .metrics import METRICS, register_prometheus

__all__ = [
    "METRICS",
    "Recorder",
    "count",
    "observe",
    "observe_hold",
    "record",
    "register_prometheus",
    "send_event",
]

log = logging.getLogger(__name__)
_unknown: set[str] = set()


def count(name: str, amount: float = 1, **labels: str) -> None:
    """Add ``amount`` to the counter ``name``; never raises (a metric must not fail a task)."""
    try:
        metrics.inc(name, amount, **labels)
    except KeyError as exc:
        if name not in _unknown:
            _unknown.add(name)
            log.warning("celery_lease: not counted: %s", exc)
    except Exception:  # a full disk under the multiprocess directory, ...
        log.exception("celery_lease: counting %s failed", name)


def observe(name: str, seconds: float, **labels: str) -> None:
    """Record ``seconds`` in the histogram ``name``; never raises."""
    try:
        metrics.observe(name, seconds, **labels)
    except KeyError as exc:
        if name not in _unknown:
            _unknown.add(name)
            log.warning("celery_lease: not recorded: %s", exc)
    except Exception:
        log.exception("celery_lease: recording %s failed", name)


def record(counter: metrics.Series, histogram: metrics.Series, seconds: float) -> None:
    """Count one in ``counter`` and record ``seconds`` in ``histogram``; never raises."""
    try:
        metrics.record(counter, histogram, seconds)
    except Exception:
        log.exception("celery_lease: recording %s failed", histogram.name)


class Recorder:
    """A counter and a histogram a hot path updates together: ``recorder.record(seconds)``
    does what :func:`record` does (counts one, records ``seconds``, never raises), for a claim
    (claims, claim latency) or a release (releases, hold time).

    The series' keys and Prometheus updates are bound into one function when first used and
    again after the metrics mode changes (``metrics._generation``), instead of being looked up
    on every call: the per-call work is one frame, the lock and the updates. The lock and
    ``metrics.METRICS`` are not bound: they are read per call, so a replaced ``METRICS`` counts.
    """

    __slots__ = ("counter", "histogram", "record")

    def __init__(self, counter: metrics.Series, histogram: metrics.Series) -> None:
        self.counter, self.histogram = counter, histogram
        #: Count one and record ``seconds``; never raises.
        self.record: Callable[[float], None] = self._bind_and_record

    def _bind_and_record(self, seconds: float) -> None:
        try:
            self._bind()
        except Exception:
            log.exception("celery_lease: recording %s failed", self.histogram.name)
            return
        self.record(seconds)

    def _bind(self) -> None:
        generation = metrics._generation
        count, hist = self.counter.entry(), self.histogram.entry()
        name, labelled, count_key, sum_key = (
            count.name,
            count.labelled,
            hist.count_key,
            hist.sum_key,
        )
        count_add, hist_add, hist_name = count.add, hist.add, hist.name
        rebind = self._bind_and_record

        def record(seconds: float) -> None:
            if metrics._generation != generation:
                rebind(seconds)
                return
            try:
                # metrics._lock and metrics.METRICS are read per call, as metrics.record reads
                # them: code that replaces METRICS (a test resetting the counts) sees these too.
                with metrics._lock:
                    values = metrics.METRICS
                    values[name] += 1
                    if labelled is not None:
                        values[labelled] += 1
                    values[count_key] += 1
                    values[sum_key] += seconds  # type: ignore[assignment]
                if count_add is not None:
                    count_add(1)
                if hist_add is not None:
                    hist_add(seconds)
            except Exception:
                log.exception("celery_lease: recording %s failed", hist_name)

        self.record = record


def observe_hold(seconds: float) -> None:
    observe("celery_lease_hold_seconds", seconds)


def send_event(
    app: Any, hostname: str | None, task_id: str | None, type_: str, **fields: Any
) -> None:
    """Send a ``task-lease-*`` event if this worker sends task events; never raises."""
    conf = app.conf
    if not (conf.get("lease_send_events", True) and conf.get("worker_send_task_events")):
        return
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(type_, uuid=task_id, **fields)
    except Exception as exc:  # noqa: BLE001 - events are best effort, never fatal
        log.debug("could not send %s event: %s", type_, exc)
