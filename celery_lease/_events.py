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
from typing import Any

from . import metrics
from .metrics import METRICS, register_prometheus

__all__ = [
    "METRICS",
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
