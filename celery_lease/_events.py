"""Lease events and metrics.

Metrics are in-process counters (``METRICS``, always on, cheap), exposed to Prometheus by a
collector that reads them on scrape when ``prometheus_client`` is installed. Names follow
``celery_lease_<noun>_<event>_total``.

Events are Celery ``task-lease-*`` events (``task-lease-busy``, ``task-lease-lost``,
``task-lease-recovered``), sent only when the worker sends task events (``-E``) and the
``lease_send_events`` setting is on. Flower counts them in ``flower_events_total{type=...}``.
Fields never carry an owner token.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

__all__ = [
    "DESCRIPTIONS",
    "METRICS",
    "count",
    "observe_hold",
    "register_prometheus",
    "send_event",
]

log = logging.getLogger(__name__)

#: metric name -> value, for this process.
METRICS: Counter[str] = Counter()
_lock = threading.Lock()
_collector_registered = False

DESCRIPTIONS = {
    "celery_lease_claims_total": "Leases claimed",
    "celery_lease_claim_conflicts_total": "Claims refused because another owner held the lease",
    "celery_lease_takeovers_total": "Claims that recovered work an earlier owner did not finish",
    "celery_lease_renewal_failures_total": "Renewal calls that failed (store error)",
    "celery_lease_leases_lost_total": "Leases lost while a task held them",
    "celery_lease_releases_total": "Leases released by their owner",
    "celery_lease_stale_fence_rejections_total": "Writes rejected for a stale fence",
    "celery_lease_busy_waits_total": "Tasks re-queued to wait for a busy resource",
    "celery_lease_duplicates_total": "Deliveries of work already completed (not run again)",
    "celery_lease_effects_replayed_total": "Ledgered effects found done (receipt returned)",
    "celery_lease_reconciliations_total": "Ledgered effects found begun and not done",
    "celery_lease_hold_seconds_total": "Seconds leases were held, summed",
}


def count(name: str, amount: float = 1) -> None:
    """Add ``amount`` to the counter ``name`` (read by the Prometheus collector on scrape)."""
    with _lock:
        METRICS[name] += amount  # type: ignore[assignment]


def observe_hold(seconds: float) -> None:
    count("celery_lease_hold_seconds_total", seconds)


def register_prometheus() -> bool:
    """Expose the counters to ``prometheus_client``'s default registry (once per process).

    The collector reads :data:`METRICS` when scraped, so counting costs nothing more than a
    dict update. Returns False when prometheus_client is not installed.
    """
    global _collector_registered  # noqa: PLW0603 - once per process
    try:
        from prometheus_client.core import REGISTRY, CounterMetricFamily
    except ImportError:
        return False
    with _lock:
        if _collector_registered:
            return True
        _collector_registered = True

    class _Collector:
        def collect(self) -> Any:
            with _lock:
                values = dict(METRICS)
            for name, doc in DESCRIPTIONS.items():
                family = CounterMetricFamily(name.removesuffix("_total"), doc)
                family.add_metric([], values.get(name, 0))
                yield family

    REGISTRY.register(_Collector())
    return True


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
