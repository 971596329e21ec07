"""The demo's Celery app. By default everything is embedded in one directory (``EXAMPLE_DATA``):
kombu's SQLAlchemy transport on SQLite as the broker, SQLite for results and for the leases, so
it runs on a machine with no servers.

``DEMO_BROKER_URL`` and ``DEMO_STORE_URL`` switch to real servers (``run.py --broker/--store``:
``redis://``, ``amqp://`` for RabbitMQ). The embedded broker is for development and single
hosts: it does not redeliver the message of a worker that crashed (the demo re-sends it, as a
redelivering broker would); Redis or RabbitMQ with ``task_acks_late`` redeliver it themselves
(RabbitMQ at once, when the worker's connection closes: the demo then re-sends nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from kombu.transport import sqlalchemy as kombu_sqlalchemy

import celery_lease

DATA = Path(os.environ.get("EXAMPLE_DATA", "example-data")).resolve()
DATA.mkdir(parents=True, exist_ok=True)
# On shared servers each demo run uses its own queue and resource names, so that nothing left
# by an earlier run (a queued message, a done identity, a fence) changes this one.
RUN = os.environ.get("DEMO_RUN", "")
NS = f"demo-{RUN}/" if RUN else ""

app = Celery(
    "proj",
    broker=os.environ.get("DEMO_BROKER_URL") or f"sqla+sqlite:///{DATA}/broker.db",
    backend=f"db+sqlite:///{DATA}/results.db",
    include=["example_project.proj.tasks"],
)
app.conf.update(
    lease_store_url=os.environ.get("DEMO_STORE_URL") or f"sqlite:///{DATA}/leases.db",
    lease_ttl=3,  # short, so a crashed or frozen worker's lease runs out within the demo
    lease_busy_backoff_base=0.2,
    lease_busy_backoff_cap=1.0,
    lease_lost_retry_delay=0.5,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=f"demo-{RUN}" if RUN else "celery",
)
# Poll the SQLite broker every 50 ms instead of every second. (kombu's SQLAlchemy transport hands
# broker_transport_options to create_engine, so polling_interval cannot be set there.)
kombu_sqlalchemy.Transport.polling_interval = 0.05

celery_lease.install(app)  # the --lease-* worker options need the app module to add them
