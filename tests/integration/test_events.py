"""Flower-visible ``task-lease-*`` events from a real worker started with ``-E``.

A receiver on the broker's event exchange (what Flower runs) collects every event. A busy
resource gives ``task-lease-busy`` (who holds it, its fence, the wait); a take-over of an expired
lease gives ``task-lease-recovered`` (the previous owner and fence); a lease lost mid-body
gives ``task-lease-lost``. Without ``-E`` the same busy wait sends nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_lease import Owner
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class EventLog:
    """Collects every event on the broker's event exchange in a background thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self.connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self.connection, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, name="event-log", daemon=True)

    def _run(self) -> None:
        try:
            self.receiver.capture(limit=None, timeout=None, wakeup=False)
        except Exception:  # the connection closes at the end of the test
            return

    def __enter__(self) -> EventLog:
        self.thread.start()
        # Ready once an event of our own comes back: the receiver's queue is bound.
        mark = f"probe-{time.monotonic_ns()}"

        def probe() -> bool:
            with self.app.events.default_dispatcher(hostname="test") as dispatcher:
                dispatcher.send("test-probe", mark=mark)
            return any(e.get("mark") == mark for e in list(self.events))

        wait_for(probe, 20, "the event receiver", interval=0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.receiver.should_stop = True
        self.connection.release()
        self.thread.join(5)

    def where(self, type_: str, **fields: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in list(self.events)
            if e.get("type") == type_ and all(e.get(k) == v for k, v in fields.items())
        ]


def test_busy_and_recovered_leases_are_visible_as_events(
    it_app, start_worker, store_env, events, queue
):
    env = {**store_env("redis"), "CL_TTL": "5"}
    start_worker(env, queue=queue, extra_args=("-E",))
    store = worker_store(env)
    try:
        with EventLog(it_app.app) as log:
            # Busy: the test holds res-7 while the task wants it.
            holder = store.acquire("res-7", Owner.new("test-holder"), 30)
            result = it_app.exclusive.apply_async((7,), queue=queue)
            busy = wait_for(
                lambda: log.where("task-lease-busy", uuid=result.id), 30, "a busy event"
            )[0]
            store.release(holder)
            result.get(timeout=30)
            # Recovered: an owner that "crashed" leaves res-8 to expire.
            crashed = store.acquire("res-8", Owner.new("crashed-owner"), 0.3)
            wait_for(lambda: store.get("res-8").expired, 10, "the lease to expire")
            fence = it_app.exclusive.apply_async((8,), queue=queue).get(timeout=30)
            recovered = wait_for(
                lambda: log.where("task-lease-recovered", resource="res-8"), 30, "a recovered event"
            )[0]
    finally:
        store.close()
    print(f"busy event: {busy}\nrecovered event: {recovered}")
    assert busy["resource"] == "res-7" and busy["action"] == "wait"
    assert busy["holder"] == "test-holder" and busy["fence"] == holder.fence
    assert busy["wait"] > 0 and 0 < busy["expires_in"] <= 30
    assert "@" in busy["hostname"]  # the worker that waited
    assert recovered["previous_owner"] == "crashed-owner"
    assert recovered["previous_fence"] == crashed.fence
    assert recovered["fence"] == fence > crashed.fence


def test_a_lease_lost_mid_body_is_visible_as_an_event(
    it_app, start_worker, store_env, events, queue
):
    """An admin force-releases a running task's lease: task-lease-lost names it and why."""
    env = {**store_env("redis"), "CL_TTL": "1"}
    start_worker(env, queue=queue, extra_args=("-E",))
    store = worker_store(env)
    try:
        with EventLog(it_app.app) as log:
            result = it_app.slow_call.apply_async((2, 2.0), queue=queue)
            start = events.wait(ev="start", res=2)
            assert store.force_release("slow-2") is not None
            lost = wait_for(
                lambda: log.where("task-lease-lost", resource="slow-2"), 30, "a lost event"
            )[0]
            outcome = result.get(timeout=30)  # re-run under a newer lease
    finally:
        store.close()
    print(f"lost event: {lost}")
    assert lost["uuid"] == result.id and lost["fence"] == start["fence"]
    assert lost["reason"] in ("force_released", "taken_over"), lost
    assert outcome["fence"] > start["fence"]


def test_no_events_without_task_events_on(it_app, start_worker, store_env, events, queue):
    """The same busy wait on a worker started without -E sends no task-lease event."""
    env = {**store_env("redis"), "CL_TTL": "5"}
    start_worker(env, queue=queue)
    store = worker_store(env)
    try:
        with EventLog(it_app.app) as log:
            holder = store.acquire("res-9", Owner.new("test-holder"), 30)
            result = it_app.exclusive.apply_async((9,), queue=queue)
            wait_for(lambda: events.where(ev="retry", task=result.id), 30, "a busy wait (retry)")
            store.release(holder)
            result.get(timeout=30)
            assert not [e for e in list(log.events) if e.get("type", "").startswith("task-lease")]
    finally:
        store.close()
