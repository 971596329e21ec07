"""A lease store outage with a real worker: tasks fail on their own budget, the log stays calm.

The store is a redis-server this test starts and stops (the broker and result backend are the
session's Redis and stay up). With the store stopped, every claim is refused; each task is sent
again with the busy backoff until ``lease_store_down_max_wait`` (2 s here) has passed since its
first failed claim, then it ends FAILURE with a LeaseStoreError that says the store refused
connections and names the setting. Each pool process warns about the outage once per minute,
not once per attempt. When the store is back the next task runs and the recovery is logged.
"""

from __future__ import annotations

import re
import time

import pytest

from celery_lease import LeaseStoreError
from tests.tooling.servers import RedisServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASKS = 20
MAX_WAIT = 2.0
CONCURRENCY = 2
OUTAGE_WARNING = re.compile(r"WARNING.*the lease store \S+ (refuses connections|is failing)")


def test_a_store_outage_fails_tasks_on_their_own_budget_with_few_warnings(
    it_app, start_worker, events, queue, tmp_path
):
    """20 tasks, store down: all FAILURE (refused, lease_store_down_max_wait), few warnings."""
    try:
        server = RedisServer(tmp_path / "store").start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        env = {
            "CL_STORE": server.url,
            "CL_TTL": "5",
            "CL_STORE_DOWN_MAX_WAIT": str(MAX_WAIT),
        }
        worker = start_worker(env, queue=queue, concurrency=CONCURRENCY)
        assert isinstance(it_app.exclusive.apply_async((0,), queue=queue).get(timeout=30), int)

        server.stop()  # now every connection to the store is refused
        started = time.monotonic()
        results = [it_app.exclusive.apply_async((n,), queue=queue) for n in range(1, TASKS + 1)]
        errors = []
        for result in results:
            with pytest.raises(LeaseStoreError) as caught:
                result.get(timeout=120)  # on main: 1,000 busy waits each, far past this
            errors.append(caught.value)
        failed_after = time.monotonic() - started
        log = worker.log()
        warnings = OUTAGE_WARNING.findall(log)
        print(
            f"{TASKS} tasks failed {failed_after:.1f}s after the store stopped; "
            f"{len(warnings)} outage warnings; "
            f"{len(re.findall('could not claim its lease', log))} per-attempt lines"
        )
        assert all(r.state == "FAILURE" for r in results)
        for error in errors:
            assert error.refused, error
            assert "refuses connections" in str(error), error
            assert f"lease_store_down_max_wait={MAX_WAIT:g}s" in str(error), error
        assert 1 <= len(warnings) <= CONCURRENCY + 1  # one per pool process (and a spare)
        assert "the outcome is unknown" not in " ".join(map(str, errors))
        assert [e["res"] for e in events.where(ev="enter")] == [0]  # no body ran without a lease

        server.start()  # the store is back: the next claim works and the recovery is told
        assert isinstance(it_app.exclusive.apply_async((99,), queue=queue).get(timeout=30), int)
    finally:
        server.close()
    assert "answers again after" in worker.log()


def test_postgres_down_when_the_store_is_first_made_fails_on_the_same_budget(
    it_app, start_worker, events, queue
):
    """PostgreSQL refuses connections before the worker ever reached it: making the store
    (which creates its tables) is an outage like a failed claim: FAILURE on
    lease_store_down_max_wait, saying refused (it was 31 s and "keeps failing")."""
    url = f"postgresql+psycopg://app:secret@127.0.0.1:{free_port()}/db"
    env = {"CL_STORE": url, "CL_TABLE_PREFIX": "down_", "CL_STORE_DOWN_MAX_WAIT": str(MAX_WAIT)}
    worker = start_worker(env, queue=queue, concurrency=1)
    results = [it_app.exclusive.apply_async((n,), queue=queue) for n in range(2)]
    for result in results:
        with pytest.raises(LeaseStoreError) as caught:
            result.get(timeout=120)
        error = caught.value
        assert error.refused, error
        assert "refuses connections" in str(error), error
        assert f"lease_store_down_max_wait={MAX_WAIT:g}s" in str(error), error
        assert "secret" not in str(error), error
    assert len(OUTAGE_WARNING.findall(worker.log())) == 1  # one per pool process
    assert events.where(ev="enter") == []
