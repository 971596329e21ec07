"""The Redis transport's restore of unacked messages is not blocked by a dead worker's mutex.

Kombu restores a message whose worker has not acked it within the visibility timeout only
while holding the ``unacked_mutex`` key of the broker database; a worker SIGKILLed inside
that section leaves the key behind for ``unacked_mutex_expire`` (300 s by default). Every
redelivery test of the same test process then waits on a restore that never comes (seen in a
CI rehearsal: four tests of one file failing in a row after another test's kill). The
worker fixture clears a mutex left by an earlier test, and the test workers take it for a
few seconds only, so a kill inside a test costs at most that.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import redis

from tests.integration import worker_app

pytestmark = pytest.mark.integration


def test_a_mutex_left_by_an_earlier_tests_worker_is_cleared(
    it_app: Any, start_worker: Any, queue: str
) -> None:
    broker = redis.Redis.from_url(os.environ["CL_BROKER"])
    broker.set("unacked_mutex", "a worker SIGKILLed inside its restore", ex=300)
    start_worker({"CL_STORE": "memory://"}, queue=queue)
    # gone, or taken again by the new worker's own restore (for seconds, not minutes)
    assert broker.ttl("unacked_mutex") <= worker_app.UNACKED_MUTEX_EXPIRE


def test_the_test_workers_hold_the_restore_mutex_for_seconds_only() -> None:
    options = dict(worker_app.app.conf.broker_transport_options or {})
    assert options["unacked_mutex_expire"] == worker_app.UNACKED_MUTEX_EXPIRE <= 10
