"""celery_lease.contrib.flower on Celery's own event state objects (what Flower hands the hook)."""

from __future__ import annotations

import copy
import json
import re
import time
from datetime import datetime, timezone

import pytest
from celery import Celery
from celery.events.state import State

from celery_lease import LeaseBusyError, Owner, lease_task
from celery_lease._app import get_store
from celery_lease.contrib import _flower_page, _flower_task, flower
from tests.conftest import unique
from tests.tooling.servers import wait_for


@pytest.fixture
def app(tmp_path):
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"

    @lease_task(app=app, resource="inv:{n}", name="charge", shared=False)
    def charge(n):
        return n

    @lease_task(app=app, resource="inv:{n}", identity="pay-{n}", name="pay", shared=False)
    def pay(n):
        return n

    @app.task(name="plain", shared=False)
    def plain(n):
        return n

    flower.clear_cache()
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
        assert shown.lease.startswith(
            f"not holding inv:7, not in its wait list: held by holder-x with fence {held.fence}"
        )
        assert shown.as_dict()["lease"] == shown.lease
        assert held.owner.token not in json.dumps(shown.as_dict(), default=str)
        assert "lease" not in task._fields  # Flower's own object is untouched

    def test_a_task_holding_its_lease_is_shown_as_this_task(self, app):
        """The holder's label names this task id (followed by its task name and arguments):
        it "holds". Failed before: the name after the task id hid it."""
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
        assert shown.startswith(f"holds inv:3 with fence {held.fence}")

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
        shown = flower.annotate(copy.copy(task), app)
        assert shown.lease == "not holding inv:8, not in its wait list: free"

    def test_other_tasks_and_cut_arguments_are_left_alone(self, app):
        """No resource to show: the task comes back as it was."""
        for name, args in (("plain", "(1,)"), ("charge", "(12345...,)"), ("unknown", "(1,)")):
            task = task_from_events(
                {"type": "task-received", "uuid": name, "name": name, "args": args, "kwargs": "{}"}
            )
            assert not hasattr(flower.annotate(copy.copy(task), app), "lease")


def received(uuid: str, *args: object, name: str = "charge") -> dict:
    return {
        "type": "task-received",
        "uuid": uuid,
        "name": name,
        "args": repr(tuple(args)),
        "kwargs": "{}",
    }


def label(task_id: str, pid: int = 4242) -> str:
    """A lease task's holder label, ``host:pid:task-id``."""
    return f"w1@h:{pid}:{task_id}"


class TestTheTruthPerTask:
    @pytest.mark.parametrize("copy_event", ["task-lease-busy", "task-retried"])
    def test_a_holder_is_not_shown_busy_by_a_copy_of_itself(self, app, copy_event):
        """A copy of the task refused while it holds its lease (its back-stop or a redelivery)
        sent the last event: Flower's state is that copy's, the page says STARTED and holds."""
        held = get_store(app).acquire("inv:7", Owner.new(label("t1")), 30, identity="t1")
        task = task_from_events(
            received("t1", 7),
            {"type": "task-started", "uuid": "t1"},
            {
                "type": copy_event,
                "uuid": "t1",
                "resource": "inv:7",
                "holder": label("t1"),
                "fence": held.fence,
            },
        )
        flowers_state = "LEASE-BUSY" if copy_event == "task-lease-busy" else "RETRY"
        assert task.state == flowers_state  # the control: what Flower made of the events
        shown = flower.annotate(copy.copy(task), app)
        assert shown.state == "STARTED"
        assert shown.lease.startswith(f"holds inv:7 with fence {held.fence}, expires in ")
        assert f"Flower's last event for this task id said {flowers_state}" in shown.lease
        assert task.state == flowers_state  # Flower's own object is untouched

    def test_a_finished_task_names_the_fence_it_ran_with_not_todays_holder(self, app):
        """After the task ended another task took the resource: the page names the fence the
        finished task ran with, and not the new holder."""
        store = get_store(app)
        ran = store.acquire("inv:9", Owner.new(label("t9")), 30, identity="t9")
        assert store.release(ran, outcome="done", result="9")
        now = store.acquire("inv:9", Owner.new(label("t10", pid=77)), 30, identity="t10")
        task = task_from_events(
            received("t9", 9),
            {"type": "task-started", "uuid": "t9"},
            {"type": "task-succeeded", "uuid": "t9", "result": "9", "runtime": 0.1},
        )
        shown = flower.annotate(copy.copy(task), app)
        assert shown.lease == f"ended (SUCCESS) with fence {ran.fence} on inv:9"
        assert shown.state == "SUCCESS"
        assert label("t10", pid=77) not in shown.lease and str(now.fence) not in shown.lease

    def test_a_task_that_ended_without_a_claim_says_no_fence_is_recorded(self, app):
        """Revoked before it ever claimed: ended, no fence of its own, nobody else's named."""
        get_store(app).acquire("inv:3", Owner.new(label("other")), 30, identity="other")
        task = task_from_events(
            received("t3", 3), {"type": "task-revoked", "uuid": "t3", "terminated": False}
        )
        shown = flower.annotate(copy.copy(task), app)
        assert shown.lease == "ended (REVOKED); no fence of it is recorded on inv:3"

    def test_a_waiter_shows_its_place_and_whom_it_waits_behind(self, app):
        """Two tasks wait for a held resource: the second is at place 2 of 2, behind the first
        and the holder (label and fence)."""
        store = get_store(app)
        holder = store.acquire("inv:5", Owner.new(label("th")), 30, identity="th")
        for task_id in ("w0", "w1"):
            with pytest.raises(LeaseBusyError) as refused:
                store.acquire("inv:5", Owner.new(label(task_id)), 30, identity=task_id, wait="{}")
            assert refused.value.position == int(task_id[1]) + 1
        task = task_from_events(
            received("w1", 5),
            {"type": "task-lease-busy", "uuid": "w1", "resource": "inv:5", "action": "wait"},
        )
        shown = flower.annotate(copy.copy(task), app)
        assert shown.lease.startswith(
            f"waits for inv:5 at place 2 of 2, behind w0 and the holder {label('th')} "
            f"(fence {holder.fence}, expires in "
        ), shown.lease
        assert shown.state == "LEASE-BUSY"  # true: it waits

    def test_a_task_neither_holding_nor_listed_says_so_and_who_holds(self, app):
        """Backing off outside the wait list (or not claimed yet): not holding, not listed, and
        the resource's holder."""
        holder = get_store(app).acquire("inv:6", Owner.new(label("th")), 30, identity="th")
        task = task_from_events(received("t6", 6))
        shown = flower.annotate(copy.copy(task), app)
        assert shown.lease.startswith(
            f"not holding inv:6, not in its wait list: held by {label('th')} with fence "
            f"{holder.fence}, expires in "
        ), shown.lease

    def test_a_task_with_its_own_identity_is_found_under_it(self, app):
        """identity= set: the wait list names the identity, not the task id; the task's page
        still finds its place, and once ended names the task that last ran the identity."""
        store = get_store(app)
        holder = store.acquire("inv:4", Owner.new(label("th")), 30, identity="pay-4-first")
        with pytest.raises(LeaseBusyError):
            store.acquire("inv:4", Owner.new(label("t4")), 30, identity="pay-4", wait="{}")
        waiting = task_from_events(received("t4", 4, name="pay"))
        shown = flower.annotate(copy.copy(waiting), app)
        assert shown.lease.startswith(
            f"waits for inv:4 at place 1 of 1, behind the holder {label('th')} (fence "
            f"{holder.fence}, "
        ), shown.lease
        assert store.release(holder)
        ran = store.acquire("inv:4", Owner.new(label("t5")), 30, identity="pay-4")
        assert store.release(ran, outcome="done", result="4")
        ended = task_from_events(
            received("t4", 4, name="pay"), {"type": "task-succeeded", "uuid": "t4", "result": "4"}
        )
        flower.clear_cache()
        assert flower.annotate(copy.copy(ended), app).lease == (
            f"ended (SUCCESS); its identity 'pay-4' on inv:4 was last run by {label('t5')} "
            f"with fence {ran.fence}"
        )

    def test_an_end_seen_after_a_cached_read_is_not_called_a_holding(self, app, monkeypatch):
        """Read while it held, then released and SUCCESS: within the cache period the page
        still says ended with its fence (the contradiction is checked on a fresh read)."""
        monkeypatch.setattr(_flower_task, "CACHE_SECONDS", 600.0)
        store = get_store(app)
        held = store.acquire("inv:2", Owner.new(label("t2")), 30, identity="t2")
        running = task_from_events(received("t2", 2), {"type": "task-started", "uuid": "t2"})
        assert flower.annotate(copy.copy(running), app).lease.startswith("holds inv:2")
        assert store.release(held, outcome="done", result="2")
        ended = task_from_events(
            received("t2", 2),
            {"type": "task-started", "uuid": "t2"},
            {"type": "task-succeeded", "uuid": "t2", "result": "2"},
        )
        shown = flower.annotate(copy.copy(ended), app)
        assert shown.lease == f"ended (SUCCESS) with fence {held.fence} on inv:2"


class TestLeasesPage:
    def test_contended_leases_come_first_with_holder_and_wait_list(self, app):
        """The rows: contended first, then held, then expired; each with its wait list."""
        store = get_store(app)
        store.acquire("pg/held", Owner.new(label("ta")), 30, identity="ta")
        busy = store.acquire("pg/busy", Owner.new(label("tb")), 30, identity="tb")
        for task_id in ("w0", "w1"):
            with pytest.raises(LeaseBusyError):
                store.acquire("pg/busy", Owner.new(label(task_id)), 30, identity=task_id, wait="{}")
        store.acquire("pg/gone", Owner.new(label("tc")), 0.05, identity="tc")
        wait_for(lambda: store.get("pg/gone").expired, 10, "the short lease to expire")
        rows, more = _flower_page.collect(store, prefix="pg/")
        assert [row.info.resource for row in rows] == ["pg/busy", "pg/held", "pg/gone"]
        assert [w.identity for w in rows[0].waiters] == ["w0", "w1"] and not more
        names = {"tb": "proj.charge", "w1": "proj.charge"}
        page = _flower_page.render(
            rows,
            more,
            store_url=store.url,
            read_at=datetime.now(timezone.utc),
            task_of=names.get,
            base="/flower",
        )
        assert "3 leases held, 1 contended (2 tasks waiting), 1 expired and never released." in (
            page
        )
        row = next(r for r in re.findall(r"<tr>.*?</tr>", page, re.S) if "pg/busy" in r)
        assert 'href="/flower/task/tb">proj.charge</a>' in row
        assert f">{busy.fence}</td>" in row and ">contended</span>" in row
        # Known tasks are linked, an identity Flower does not know is shown as text.
        assert row.index(">w0</span>") < row.index('href="/flower/task/w1"')
        assert busy.owner.token not in page

    def test_more_leases_than_the_limit_say_so(self, app):
        """Past the limit: the first ones, and a line saying there are more."""
        store = get_store(app)
        for n in range(3):
            store.acquire(f"lim/{n}", Owner.new(label(f"t{n}")), 30)
        rows, more = _flower_page.collect(store, prefix="lim/", limit=2)
        assert len(rows) == 2 and more
        page = _flower_page.render(
            rows, more, store_url=store.url, read_at=datetime.now(timezone.utc), limit=2
        )
        assert "Showing the first 2" in page

    def test_values_are_escaped(self, app):
        """A holder label is the user's text: it is escaped, never markup."""
        store = get_store(app)
        store.acquire("esc/1", Owner.new("<script>alert(1)</script>"), 30)
        rows, more = _flower_page.collect(store, prefix="esc/")
        page = _flower_page.render(
            rows, more, store_url=store.url, read_at=datetime.now(timezone.utc)
        )
        assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


class TestInstall:
    def test_the_route_goes_before_flowers_catch_all_once(self, monkeypatch):
        """Added right before the catch-all (so it is reached), and only once."""
        urls = pytest.importorskip("flower.urls")
        monkeypatch.setattr(urls, "handlers", list(urls.handlers))
        assert flower.add_leases_page()
        assert flower.add_leases_page()
        names = [getattr(route, "name", None) for route in urls.handlers]
        assert names.count(_flower_page.ROUTE_NAME) == 1
        assert names.index(_flower_page.ROUTE_NAME) == len(urls.handlers) - 2
        assert urls.handlers[-1][0] == r".*"

    def test_an_unexpected_route_list_adds_nothing_and_warns(self, monkeypatch, caplog):
        """A Flower whose route list does not end in its catch-all: no page, a warning."""
        urls = pytest.importorskip("flower.urls")
        changed = list(urls.handlers[:-1])
        monkeypatch.setattr(urls, "handlers", changed)
        assert not flower.add_leases_page()
        assert all(getattr(route, "name", None) != _flower_page.ROUTE_NAME for route in changed)
        assert "the Leases page is not added" in caplog.text
