"""celery_lease.contrib.flower on Celery's own event state objects (what Flower hands the hook)."""

from __future__ import annotations

import copy
import json
import time

import pytest
from celery import Celery
from celery.events.state import State

from celery_lease import Owner, lease_task
from celery_lease._app import get_store
from celery_lease.contrib import flower
from tests.conftest import unique


@pytest.fixture
def app(tmp_path):
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"

    @lease_task(app=app, resource="inv:{n}", name="charge", shared=False)
    def charge(n):
        return n

    @app.task(name="plain", shared=False)
    def plain(n):
        return n

    flower._cache.clear()
    return app


def task_from_events(*events: dict) -> object:
    state = State()
    now = time.time()
    for n, event in enumerate(events):
        state.event(
            {
                "hostname": "w1@h",
                "clock": n + 1,
                "timestamp": now + n,
                "local_received": now + n,
                **event,
            }
        )
    return state.tasks[events[0]["uuid"]]


class TestAnnotate:
    def test_a_busy_task_shows_the_holder_from_the_store(self, app):
        """The lease field names resource, holder label and fence, read from the store."""
        held = get_store(app).acquire("inv:7", Owner.new("holder-x"), 30)
        task = task_from_events(
            {
                "type": "task-received",
                "uuid": "t1",
                "name": "charge",
                "args": "(7,)",
                "kwargs": "{}",
            },
            {
                "type": "task-lease-busy",
                "uuid": "t1",
                "resource": "inv:7",
                "holder": "holder-x",
                "fence": held.fence,
                "action": "wait",
            },
        )
        # Negative control: Flower's view of the task (and the copy it hands the hook) has
        # dropped the event's fields.
        assert "holder-x" not in json.dumps(task.as_dict(), default=str)
        assert not hasattr(copy.copy(task), "holder")
        shown = flower.annotate(copy.copy(task), app)
        assert shown.lease.startswith(f"resource inv:7: held by holder-x with fence {held.fence}")
        assert shown.as_dict()["lease"] == shown.lease
        assert held.owner.token not in json.dumps(shown.as_dict(), default=str)
        assert "lease" not in task._fields  # Flower's own object is untouched

    def test_a_task_holding_its_lease_is_shown_as_this_task(self, app):
        """The holder's label names this task id (followed by its task name and arguments):
        "held by this task". Failed before: the name after the task id hid it."""
        label = "celery@w1:12:t3 charge (3,)"
        held = get_store(app).acquire("inv:3", Owner.new(label), 30)
        task = task_from_events(
            {
                "type": "task-received",
                "uuid": "t3",
                "name": "charge",
                "args": "(3,)",
                "kwargs": "{}",
            }
        )
        shown = flower.annotate(copy.copy(task), app).lease
        assert shown.startswith(
            f"resource inv:3: held by this task ({label}) with fence {held.fence}"
        )

    def test_the_resource_comes_from_the_arguments_without_an_event(self, app):
        """A task that never waited: the resource template over Flower's argument text."""
        task = task_from_events(
            {
                "type": "task-received",
                "uuid": "t2",
                "name": "charge",
                "args": "[]",
                "kwargs": "{'n': 8}",
            }
        )
        assert flower.annotate(copy.copy(task), app).lease == "resource inv:8: free"

    def test_other_tasks_and_cut_arguments_are_left_alone(self, app):
        """No resource to show: the task comes back as it was."""
        for name, args in (("plain", "(1,)"), ("charge", "(12345...,)"), ("unknown", "(1,)")):
            task = task_from_events(
                {"type": "task-received", "uuid": name, "name": name, "args": args, "kwargs": "{}"}
            )
            assert not hasattr(flower.annotate(copy.copy(task), app), "lease")
