"""The Celery app: SQLite for the broker (kombu's SQLAlchemy transport), results and leases.

Everything lives in one directory (``EXAMPLE_DATA``, default ``./example-data``), so the project
runs on a machine with no servers. This is the development setup: the SQLAlchemy transport does
not redeliver a message whose worker crashed, so use Redis or PostgreSQL in production.
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from kombu.transport import sqlalchemy as kombu_sqlalchemy

import celery_lease

DATA = Path(os.environ.get("EXAMPLE_DATA", "example-data")).resolve()
DATA.mkdir(parents=True, exist_ok=True)

app = Celery(
    "proj",
    broker=f"sqla+sqlite:///{DATA}/broker.db",
    backend=f"db+sqlite:///{DATA}/results.db",
    include=["example_project.proj.tasks"],
)
app.conf.update(
    lease_store_url=f"sqlite:///{DATA}/leases.db",
    lease_ttl=10,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    lease_busy_backoff_base=0.2,
    lease_busy_backoff_cap=1.0,
)
# Poll the SQLite broker every 50 ms instead of every second. (kombu's SQLAlchemy transport hands
# broker_transport_options to create_engine, so polling_interval cannot be set there.)
kombu_sqlalchemy.Transport.polling_interval = 0.05

celery_lease.install(app)  # the --lease-* worker options need the app module to add them
