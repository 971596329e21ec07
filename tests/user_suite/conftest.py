from __future__ import annotations

import pytest
from celery.contrib.testing.worker import start_worker

from celery_lease import FenceGate

from . import myapp

pytest_plugins = ["celery_lease.testing"]


@pytest.fixture(autouse=True)
def _clean():
    myapp.SENT.clear()
    myapp.STEPS.clear()
    myapp.GATE = FenceGate("memory://")  # a fresh payment gateway per test


@pytest.fixture
def eager():
    myapp.app.conf.task_always_eager = True
    yield myapp.app
    myapp.app.conf.task_always_eager = False


@pytest.fixture
def worker(lease_store):
    with start_worker(
        myapp.app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=10
    ) as w:
        yield w
