"""Lease events and metrics.

Metrics are in-process counters (``METRICS``, always on, cheap) mirrored to Prometheus when
``prometheus_client`` is installed. Names follow ``celery_lease_<noun>_<event>_total``.

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

__all__ = ["METRICS", "count", "observe_hold", "send_event"]

log = logging.getLogger(__name__)

#: metric name -> value, for this process.
METRICS: Counter[str] = Counter()
_lock = threading.Lock()
_prom: dict[str, Any] | None = None

_DESCRIPTIONS = {
    "celery_lease_claims_total": "Leases claimed",
    "celery_lease_claim_conflicts_total": "Claims refused because another owner held the lease",
    "celery_lease_takeovers_total": "Claims that took over an expired, never released lease",
    "celery_lease_renewals_total": "Lease renewals that succeeded",
    "celery_lease_renewal_failures_total": "Renewal calls that failed (store error)",
    "celery_lease_leases_lost_total": "Leases lost while a task held them",
    "celery_lease_releases_total": "Leases released by their owner",
    "celery_lease_stale_fence_rejections_total": "Writes rejected for a stale fence",
    "celery_lease_busy_waits_total": "Tasks re-queued to wait for a busy resource",
    "celery_lease_hold_seconds_total": "Seconds leases were held, summed",
}


def _prometheus() -> dict[str, Any]:
    global _prom  # noqa: PLW0603 - created once per process on first use
    if _prom is None:
        with _lock:
            if _prom is None:
                metrics: dict[str, Any] = {}
                try:
                    import prometheus_client
                except ImportError:
                    pass
                else:
                    for name, doc in _DESCRIPTIONS.items():
                        try:
                            metrics[name] = prometheus_client.Counter(
                                name.removesuffix("_total"), doc
                            )
                        except ValueError:  # already registered (module reloaded)
                            log.debug("prometheus metric %s already registered", name)
                _prom = metrics
    return _prom


def count(name: str, amount: float = 1) -> None:
    """Add ``amount`` to the counter ``name`` (and its Prometheus twin)."""
    METRICS[name] += amount  # type: ignore[assignment]
    counter = _prometheus().get(name)
    if counter is not None:
        counter.inc(amount)


def observe_hold(seconds: float) -> None:
    count("celery_lease_hold_seconds_total", seconds)


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
