"""The Celery app of the lease_routes integration tests (``tests/integration/test_routes.py``).

The app module is the only one that names celery_lease: it calls ``celery_lease.install(app)``
and reads ``lease_routes`` from ``CL_ROUTES`` (JSON; unset: no routes, the negative control).
Its tasks are in modules that import nothing from celery_lease: ``routed_tasks`` (plain
``@app.task``) and ``tests.routed_pkg`` (``@shared_task``, as an installed package's).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

import celery_lease
from celery_lease import FenceGate, current_lease

env = os.environ
app = Celery(
    "lease_routes_it",
    broker=env.get("CL_BROKER", "memory://"),
    include=["tests.integration.routed_tasks", "tests.routed_pkg.tasks"],
)
celery_lease.install(app)
app.conf.update(
    result_backend=env.get("CL_BACKEND", env.get("CL_BROKER", "cache+memory://")),
    lease_store_url=env.get("CL_STORE", "memory://"),
    lease_ttl=float(env.get("CL_TTL", "1.0")),
    lease_key_prefix=env.get("CL_PREFIX", "celery_lease:"),
    lease_table_prefix=env.get("CL_TABLE_PREFIX", "celery_lease_"),
    lease_busy_backoff_base=0.05,
    lease_busy_backoff_cap=0.3,
    lease_lost_retry_delay=0.2,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=env.get("CL_QUEUE", "celery"),
    result_expires=600,
    worker_proc_alive_timeout=30.0,
)
if env.get("CL_ROUTES"):
    app.conf.lease_routes = json.loads(env["CL_ROUTES"])

_gate: FenceGate | None = None


def fenced_write(key: str) -> Any:
    """The side effect of the routed tasks: admitted at a FenceGate sharing the lease store
    when the task holds a lease (the app's data layer, not the task, knows of fences); a
    plain write without one. Returns the fence written with (None without a lease)."""
    global _gate  # noqa: PLW0603
    try:
        lease = current_lease()
    except celery_lease.LeaseError:
        return None
    if _gate is None:
        url = env["CL_STORE"]
        if url.startswith("redis"):
            _gate = FenceGate(url, key_prefix=env.get("CL_PREFIX", "celery_lease:"))
        else:
            _gate = FenceGate(url, table_prefix=env.get("CL_TABLE_PREFIX", "celery_lease_"))
    _gate.admit(key, lease.fence)
    return lease.fence
