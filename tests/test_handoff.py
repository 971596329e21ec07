"""The task side of the hand-off: the wake payload, the wake, and their metrics."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
from celery import Celery
from celery.exceptions import DuplicateTaskNameWarning, Ignore, Retry

from celery_lease import (
    LeaseBusyError,
    LeaseConfigError,
    Owner,
    _clock,
    _copies,
    _execution,
    lease_task,
    metrics,
)
from celery_lease._app import get_store
from celery_lease._message import LISTED_HEADER, STORE_DOWN_HEADER, WAITS_HEADER, wake_payload
from celery_lease._settings import LeaseSettings
from celery_lease._wakes import WOKEN_HEADER
from tests.conftest import unique


@pytest.fixture
def task():
    app = Celery("handoff_unit", broker="memory://")
    app.conf.lease_store_url = "memory://"
    app.conf.task_always_eager = False

    @lease_task(app=app, resource="r-{i}", name="handoff_unit.t")
    def t(i, run):
        return i

    t.push_request(
        id="0f0e0d0c-1111-2222-3333-444455556666",
        args=(1, "x"),
        kwargs={},
        headers={WAITS_HEADER: 2, WOKEN_HEADER: 1.0},
        delivery_info={"exchange": "", "routing_key": "q1"},
        retries=3,
    )
    yield t
    t.pop_request()


class TestWakePayload:
    def test_the_payload_is_this_execution_again_without_a_countdown(self, task):
        """Same task, id, arguments, queue and retries; one more wait; no stale wake time."""
        payload, keep = wake_payload(task, task._compiled(), task.request, (1, "x"), {})
        message = json.loads(payload)
        assert (message["task"], message["args"], message["kwargs"]) == (
            "handoff_unit.t",
            [1, "x"],
            {},
        )
        options = message["options"]
        assert options["task_id"] == task.request.id and options["queue"] == "q1"
        assert options["retries"] == 3 and "countdown" not in options
        assert options["headers"][WAITS_HEADER] == 3 and WOKEN_HEADER not in options["headers"]
        assert keep > task.lease_settings.ttl

    def test_no_payload_past_the_busy_budget(self, task):
        """An attempt that gives up when refused leaves no place to be woken in."""
        task.request.headers[WAITS_HEADER] = task.lease_settings.busy_max_waits
        assert wake_payload(task, task._compiled(), task.request, (1, "x"), {}) is None

    def test_arguments_json_cannot_write_wait_with_the_back_off(self, task):
        """No payload (so no place in the list) rather than a payload that cannot be sent."""
        assert wake_payload(task, task._compiled(), task.request, (object(),), {}) is None

    def test_circular_arguments_wait_with_the_back_off(self, task):
        """A circular argument gives no payload, not an error or a hang."""
        loop: list = []
        loop.append(loop)
        assert wake_payload(task, task._compiled(), task.request, (loop,), {}) is None

    def test_json_encoder_default_patched_after_import_applies(self, task, monkeypatch):
        """The recipe that patches json.JSONEncoder.default (objects with to_json()) works for
        the payload as for json.dumps, even when applied after celery_lease is imported."""

        class Money:
            def to_json(self):
                return {"money": 3}

        def default(encoder, value):
            if isinstance(value, Money):
                return value.to_json()
            raise TypeError(value)

        monkeypatch.setattr(json.JSONEncoder, "default", default)
        payload, _ = wake_payload(task, task._compiled(), task.request, (1, Money()), {})
        assert json.loads(payload)["args"] == [1, {"money": 3}]

    def test_a_circular_argument_at_a_raised_recursion_limit_does_not_crash(self):
        """Without json's circular-reference check, the C encoder recursed until the C stack
        overflowed when the process had raised its recursion limit (a segfault). In a
        subprocess, so that a crash fails this test instead of ending pytest."""
        code = """if True:
            import sys
            from celery import Celery
            from celery_lease import lease_task

            app = Celery("circ", broker="memory://")
            app.conf.lease_store_url = "memory://"

            @lease_task(app=app, resource="r-{k}", name="circ.t")
            def t(k, data):
                return k

            sys.setrecursionlimit(100000)
            loop = []
            loop.append(loop)
            t.push_request(id="0f0e0d0c-1111-2222-3333-444455556666", args=(1, loop),
                           kwargs={}, headers={}, delivery_info={"routing_key": "celery"},
                           is_eager=False, hostname="w@h")
            from celery_lease._message import wake_payload

            print(wake_payload(t, t._compiled(), t.request, (1, loop), {}))
        """
        done = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode, done.stdout.strip()) == (0, "None"), done.stderr[-2000:]

    def test_the_place_outlives_the_longest_back_stop_for_each_number_of_waits(self, task):
        """The kept place, worked out once per number of waits, is the same as computed anew."""
        settings = task.lease_settings
        for waits in (0, 2, 5, 0):
            task.request.headers[WAITS_HEADER] = waits
            _, keep = wake_payload(task, task._compiled(), task.request, (1, "x"), {})
            cap = task._compiled().busy_cap()
            longest = min(
                cap, max(min(cap, settings.busy_backoff_base * 2 ** min(waits, 30)), settings.ttl)
            )
            assert keep == longest + settings.ttl + 10.0


class TestWake:
    def test_a_wake_sends_the_message_stamped_and_counts(self, task, monkeypatch):
        """The woken message carries the wake time (hand-off latency) and is counted by cause."""
        sent = []
        monkeypatch.setattr(
            "celery.canvas.Signature.apply_async", lambda self, *a, **k: sent.append(self)
        )
        payload, _ = wake_payload(task, task._compiled(), task.request, (1, "x"), {})
        key = 'celery_lease_handoffs_total{by="release"}'
        before = metrics.snapshot().get(key, 0)
        _execution.wake(task, payload, "r-1", "release")
        assert metrics.snapshot()[key] == before + 1
        (signature,) = sent
        assert signature.id == task.request.id
        assert isinstance(signature.options["headers"][WOKEN_HEADER], float)

    def test_a_failed_wake_is_logged_not_raised(self, task, caplog):
        """The back-stop copy covers a wake that could not be sent."""
        # (at the library's logger: an earlier test in the process may leave the root at ERROR)
        with caplog.at_level("WARNING", logger="celery_lease"):
            _execution.wake(task, "{not json", "r-1", "release")
        assert "could not wake" in caplog.text


class TestWakeOptions:
    def test_the_options_are_what_celery_would_send_again(self, task):
        """The payload's options match Context.as_execution_options() (None values dropped),
        with every field set: the fast builder must not drift from Celery's."""
        from celery_lease._message import execution_options as _execution_options

        request = task.request
        request.update(
            root_id="r0",
            parent_id="p0",
            group="g0",
            group_index=2,
            shadow="sh",
            chord={"task": "c"},
            chain=[{"task": "n"}],
            callbacks=[{"task": "cb"}],
            errbacks=[{"task": "eb"}],
            expires="2030-01-01T00:00:00+00:00",
            timelimit=(30, 20),
            reply_to="rt",
            replaced_task_nesting=1,
            origin="gen1@host",
            stamped_headers=["s1"],
            stamps={"s1": "v1"},
        )
        expected = {
            k: v
            for k, v in request.as_execution_options().items()
            if v is not None and k not in ("headers", "retries")
        }
        assert _execution_options(request) == expected

    @pytest.mark.parametrize("fields", [{"id": "t1"}, {"id": "t1", "root_id": None, "x": 1}])
    def test_the_class_defaults_count_as_celery_reads_them(self, fields):
        """A request that sets few fields: the rest are the Context class's defaults (some not
        None), read from the request's own values on the fast path, getattr() otherwise."""
        from celery.app.task import Context

        from celery_lease._message import execution_options as _execution_options

        class OwnContext(Context):
            pass

        for request in (Context(fields), OwnContext(fields)):
            expected = {
                k: v
                for k, v in request.as_execution_options().items()
                if v is not None and k not in ("headers", "retries")
            }
            assert _execution_options(request) == expected

    def test_dead_letter_and_attempt_headers_are_not_carried(self, task):
        """RabbitMQ's x-death trail and our per-attempt headers stay behind."""
        task.request.headers.update({"x-death": [{"count": 1}], "custom": "kept"})
        payload, _ = wake_payload(task, task._compiled(), task.request, (1, "x"), {})
        headers = json.loads(payload)["options"]["headers"]
        assert isinstance(headers.pop(LISTED_HEADER), int)  # when the place was listed
        assert headers == {WAITS_HEADER: 3, "custom": "kept"}


def _wall_at(monkeypatch, wall):
    """The library's wall clock reads ``wall()`` for the test."""
    monkeypatch.setattr(_clock, "_REAL", [_clock._REAL[0], wall])


class TestSiblingThatGaveUpOnTheStore:
    """Review 5: a woken copy must read the result backend whenever its back-stop sibling
    may have given up on an unreachable store, whatever the workers' clocks say."""

    def _woken(self, task, listed):
        task.request.headers = {WAITS_HEADER: 1, WOKEN_HEADER: 1.0, LISTED_HEADER: listed}
        return task.request

    def test_a_place_listed_during_an_outage_counts_from_the_outage(self, task, monkeypatch):
        """A claim whose reply was lost can list the place while the budget, begun at this
        execution's first failed claim, runs on: the place counts as listed from then.
        Failed before: stamped with the listing's own time (1000 instead of 400)."""
        _wall_at(monkeypatch, lambda: 1000.0)
        task.request.headers = {WAITS_HEADER: 1, STORE_DOWN_HEADER: 400.0}
        payload, _ = wake_payload(task, task._compiled(), task.request, (1, "x"), {})
        assert json.loads(payload)["options"]["headers"][LISTED_HEADER] == 400
        task.request.headers = {WAITS_HEADER: 1, STORE_DOWN_HEADER: "not ours"}
        payload, _ = wake_payload(task, task._compiled(), task.request, (1, "x"), {})
        assert json.loads(payload)["options"]["headers"][LISTED_HEADER] == 1000

    @pytest.mark.parametrize("behind", [0.0, 60.0, 150.0])
    def test_a_waking_clock_behind_by_a_quarter_of_the_budget_still_reads(
        self, task, monkeypatch, behind
    ):
        """The sibling gave up ``store_down_max_wait`` (600 s) after the listing by its own
        clock; the woken copy's clock is ``behind`` seconds behind. Failed before at 60 and
        150 s (the woken copy saw 540 and 450 s, under the budget, and did not read)."""
        budget = task.lease_settings.store_down_max_wait
        listed = 10_000
        _wall_at(monkeypatch, lambda: listed + budget - behind)
        assert _copies.sibling_may_have_given_up(
            task, self._woken(task, listed), task.lease_settings
        )

    def test_a_recent_place_does_not_read(self, task, monkeypatch):
        """Places listed less than half the budget ago: the hand-off's path, no backend read."""
        budget = task.lease_settings.store_down_max_wait
        _wall_at(monkeypatch, lambda: 10_000 + budget * 0.49)
        assert not _copies.sibling_may_have_given_up(
            task, self._woken(task, 10_000), task.lease_settings
        )

    def test_negative_control_without_the_slack_a_clock_behind_skips_the_read(
        self, task, monkeypatch
    ):
        """With no slack (the code before), a clock 60 s behind skips the read."""
        budget = task.lease_settings.store_down_max_wait
        monkeypatch.setattr(_copies, "GAVE_UP_CLOCK_SLACK", 0.0)
        _wall_at(monkeypatch, lambda: 10_000 + budget - 60)
        assert not _copies.sibling_may_have_given_up(
            task, self._woken(task, 10_000), task.lease_settings
        )


@pytest.fixture(
    params=("memory", "redis", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres))
)
def bound_app(request, tmp_path):
    """An app on each store whose tasks may wake-list messages of at most 600 bytes."""
    app = Celery(unique("bound"), broker="memory://", backend="cache+memory://")
    if request.param == "memory":
        app.conf.lease_store_url = "memory://"
    elif request.param == "sqlite":
        app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
    else:
        app.conf.lease_store_url = request.getfixturevalue(f"{request.param}_server").url
        app.conf.lease_key_prefix = f"{unique('cl')}:"
        app.conf.lease_table_prefix = f"{unique('cl')}_"
    app.conf.lease_handoff_max_payload = 600
    yield app
    with contextlib.suppress(Exception):
        get_store(app).close()


class TestWakeMessageBound:
    """A task whose wake message is over lease_handoff_max_payload does not have it kept: it
    polls in its place in the wait list (invariant 12), and says so (message, log field,
    metric), on every store. Before (issue 32, item 2): it was not listed at all, and listed
    later arrivals overtook it."""

    @staticmethod
    def _deliver(task, blob):
        task.push_request(
            id=unique("task"),
            args=(blob,),
            kwargs={},
            is_eager=False,
            called_directly=False,
            delivery_info={"exchange": "", "routing_key": "q1"},
            headers={WAITS_HEADER: 0},
        )
        try:
            with pytest.raises(Retry) as caught:
                task(blob)
        finally:
            task.pop_request()
        exc = caught.value.exc
        assert isinstance(exc, LeaseBusyError)
        return exc

    def test_a_message_over_the_bound_waits_with_the_back_off_and_says_so(self, bound_app, caplog):
        r = unique("bound")  # (busy lines are logged once per resource and holder per 10 s)

        @lease_task(app=bound_app, resource=r, name=unique("bound.t"))
        def t(blob):
            raise AssertionError("the body must not run while another owner holds the lease")

        store = get_store(bound_app)
        held = store.acquire(r, Owner.new("other"), 30, identity="other-job")
        key = "celery_lease_wait_payload_too_large_total"
        before = metrics.snapshot().get(key, 0)
        with caplog.at_level(logging.INFO, logger="celery_lease"):
            big = self._deliver(t, "x" * 1000)
        assert (big.position, big.polling) == (1, True)
        assert "its wake message is " in str(big)
        assert "bytes, over lease_handoff_max_payload=600: it polls in its place" in str(big)
        assert metrics.snapshot().get(key, 0) == before + 1
        assert "wait_payload_too_large=" in caplog.text
        assert len(store.waiters(r)) == 1  # listed, its message not kept: its copy polls
        # Control: a small message joins the list with its message, and is not counted.
        small = self._deliver(t, "x")
        assert (small.position, small.polling) == (2, False)
        assert "lease_handoff_max_payload" not in str(small)
        assert metrics.snapshot().get(key, 0) == before + 1
        assert len(store.waiters(r)) == 2
        store.release(held)


class TestMessageOverTheWholeBudget:
    def test_it_is_reported_too_large_not_a_full_list(self, bound_app, caplog):
        """A wake message within lease_handoff_max_payload but bigger than the store's whole
        wait list budget (wait_bytes_cap) is reported as too large, naming both values, on an
        empty list. Before: "its wait list is full", which says nothing about why."""
        r = unique("budget")

        @lease_task(app=bound_app, resource=r, name=unique("budget.t"))
        def t(blob):
            raise AssertionError("the body must not run while another owner holds the lease")

        store = get_store(bound_app)
        store.wait_bytes_cap = 500  # below the app's lease_handoff_max_payload=600
        held = store.acquire(r, Owner.new("other"), 30, identity="other-job")
        key = "celery_lease_wait_payload_too_large_total"
        before = metrics.snapshot().get(key, 0)
        with caplog.at_level(logging.INFO, logger="celery_lease"):
            big = TestWakeMessageBound._deliver(t, "x" * 370)  # about 590 bytes
        assert big.position == 1 and big.polling and len(store.waiters(r)) == 1
        message = str(big)
        assert "no room" not in message
        assert "over the store's whole wait list budget (wait_bytes_cap 500 bytes; " in message
        assert "lease_handoff_max_payload=600)" in message
        assert metrics.snapshot().get(key, 0) == before + 1
        assert "wait_payload_too_large=" in caplog.text
        # Control: a message that fits the budget joins with its message.
        small = TestWakeMessageBound._deliver(t, "x")
        assert (small.position, small.polling) == (2, False)
        store.release(held)


class TestListedWaiterGrowingPastTheBound:
    """A listed waiter keeps its place and is re-armed by its next copy even when that copy's
    wake message is a few bytes longer because its celery_lease_waits counter gained a digit
    (9 -> 10): the bound is measured without the counter, on every store."""

    @staticmethod
    @contextlib.contextmanager
    def _delivered(task, blob, tid, waits):
        """``task``'s request as a worker delivers the copy with this counter."""
        task.push_request(
            id=tid,
            args=(blob,),
            kwargs={},
            is_eager=False,
            called_directly=False,
            delivery_info={"exchange": "", "routing_key": "q1"},
            headers={WAITS_HEADER: waits},
        )
        try:
            yield
        finally:
            task.pop_request()

    @classmethod
    def _deliver(cls, task, blob, tid, waits):
        # (a copy that waited before is sent again with Ignore, from the busy error)
        with cls._delivered(task, blob, tid, waits), pytest.raises((Retry, Ignore)) as caught:
            task(blob)
        if isinstance(caught.value, Ignore):
            return caught.value.__cause__
        return caught.value.exc

    @classmethod
    def _size(cls, task, blob, tid, waits):
        with cls._delivered(task, blob, tid, waits):
            return len(wake_payload(task, task._compiled(), task.request, (blob,), {})[0])

    def test_the_copy_one_counter_digit_longer_keeps_its_place(self, bound_app):
        r = unique("grow")

        @lease_task(app=bound_app, resource=r, name=unique("grow.t"))
        def t(blob):
            raise AssertionError("the body must not run while another owner holds the lease")

        store = get_store(bound_app)
        held = store.acquire(r, Owner.new("other"), 30, identity="other-job")
        tid = unique("task")
        # the copy that has waited 8 times carries celery_lease_waits 9: exactly at the bound
        n = next(n for n in range(1, 600) if self._size(t, "z" * n, tid, 8) == 600)
        assert self._size(t, "z" * n, tid, 9) == 601  # its next copy carries 10
        first = self._deliver(t, "z" * n, tid, 8)
        assert first.position == 1
        place = store.waiters(r)[0]
        again = self._deliver(t, "z" * n, tid, 9)
        assert again.position == 1, str(again)  # re-armed, not left to lapse
        assert "lease_handoff_max_payload" not in str(again)
        assert store.waiters(r)[0].expires_at >= place.expires_at
        # Control: a message over the bound without its counter (600 bytes and a digit of
        # counter take n + 1 bytes of arguments) polls in its place, its message not kept.
        other = self._deliver(t, "z" * (n + 2), unique("task"), 8)
        assert (other.position, other.polling) == (2, True)
        assert "over lease_handoff_max_payload=600" in str(other)
        store.release(held)


class TestHandoffMaxPayloadSetting:
    @pytest.mark.parametrize("value", [0, -1, "8k", 1.5, True])
    def test_a_bad_value_names_itself_and_the_fix(self, value):
        with pytest.raises(LeaseConfigError) as caught:
            LeaseSettings.resolve(None, {"handoff_max_payload": value})
        message = str(caught.value)
        assert f"lease_handoff_max_payload={value!r}" in message
        assert "whole number of bytes >= 1" in message and "lease_handoff=False" in message

    @pytest.mark.parametrize("value", [131073, 10**30, 2**63])
    def test_a_value_past_the_whole_wait_list_budget_is_refused(self, value):
        """A bound above a store's wait_bytes_cap (128 KiB) means nothing: such a message is
        never listed. Before: 10**30 was accepted."""
        with pytest.raises(LeaseConfigError) as caught:
            LeaseSettings.resolve(None, {"handoff_max_payload": value})
        message = str(caught.value)
        assert f"lease_handoff_max_payload={value!r}" in message
        assert "at most 131072" in message and "wait_bytes_cap" in message
        assert "lease_handoff=False" in message
        # Control: the whole budget itself is a valid bound.
        assert LeaseSettings.resolve(None, {"handoff_max_payload": 131072}).handoff_max_payload

    def test_the_default_lists_a_task_with_small_arguments(self):
        assert LeaseSettings().handoff_max_payload == 8192


class TestWakeQueue:
    """The wake queue a waiter's wake goes to (``Q.lease-wake``), and the route a woken copy
    takes as its own; real workers: tests/integration/test_handoff_wake_queue.py."""

    @pytest.mark.parametrize("value", ["yes", 1, 0, 0.5])
    def test_a_bad_setting_names_itself(self, value):
        with pytest.raises(LeaseConfigError) as caught:
            LeaseSettings.resolve(None, {"handoff_wake_queue": value})
        assert "lease_handoff_wake_queue=" in str(caught.value)
        assert "True or False" in str(caught.value)

    def test_on_by_default_for_redis_and_amqp_brokers_only(self):
        from celery_lease._app import wake_queues_on

        for broker, on in (
            ("redis://127.0.0.1:1/0", True),
            ("amqp://guest@127.0.0.1:1//", True),
            ("memory://", False),
        ):
            app = Celery(broker=broker)
            assert wake_queues_on(app) is on, broker
        app = Celery(broker="redis://127.0.0.1:1/0")
        app.conf.lease_handoff_wake_queue = False
        assert wake_queues_on(app) is False

    def _app(self, *queues):
        app = Celery(broker="redis://127.0.0.1:1/0")
        app.conf.task_queues = queues
        return app

    def test_the_one_consumed_queue_a_route_reaches(self):
        from kombu import Exchange, Queue

        from celery_lease._app import wake_queue_for

        app = self._app(
            Queue("a", Exchange("a"), routing_key="a"),
            Queue("b", Exchange("shared"), routing_key="k"),
            Queue("c", Exchange("shared"), routing_key="k"),
            Queue("t", Exchange("topic", type="topic"), routing_key="t.#"),
            Queue("d", Exchange("direct2"), routing_key="d"),
        )
        assert wake_queue_for(app, {"exchange": "", "routing_key": "a"}) == "a.lease-wake"
        assert wake_queue_for(app, {"exchange": "a", "routing_key": "a"}) == "a.lease-wake"
        assert wake_queue_for(app, {"exchange": "direct2", "routing_key": "d"}) == "d.lease-wake"
        # Several queues bound alike (a publish reaches each), a topic exchange, a queue this
        # worker does not consume, no route: not certain, so the waiter's own route.
        assert wake_queue_for(app, {"exchange": "shared", "routing_key": "k"}) is None
        assert wake_queue_for(app, {"exchange": "topic", "routing_key": "t.x"}) is None
        assert wake_queue_for(app, {"exchange": "", "routing_key": "t"}) is None
        assert wake_queue_for(app, {"exchange": "", "routing_key": "elsewhere"}) is None
        assert "elsewhere" not in app.amqp.queues  # (looked up without creating it)
        assert wake_queue_for(app, {"exchange": "", "routing_key": "a.lease-wake"}) is None
        assert wake_queue_for(app, None) is None
        app.amqp.queues.select(["b"])  # -Q b: "a" is not consumed
        assert wake_queue_for(app, {"exchange": "", "routing_key": "a"}) is None

    def test_a_woken_copy_takes_its_waiters_route_only_from_its_wake_queue(self):
        from celery.app.task import Context

        from celery_lease._message import take_sent_route as _take_sent_route
        from celery_lease._wakes import ROUTE_HEADER
        from celery_lease._wakes import to_wake_queue as _to_wake_queue

        options = {"queue": "q", "priority": 3}
        headers: dict = {}
        _to_wake_queue(options, headers, "q.lease-wake")
        assert options["queue"].name == "q.lease-wake" and options["priority"] == 3
        assert headers[ROUTE_HEADER] == ["q.lease-wake", "", "q"]
        options = {"exchange": "x", "routing_key": "k"}
        _to_wake_queue(options, headers, "k.lease-wake")
        assert options["queue"].name == "k.lease-wake"
        assert (options["exchange"], options["routing_key"]) == ("", "k.lease-wake")
        assert headers[ROUTE_HEADER] == ["k.lease-wake", "x", "k"]

        def copy(route, exchange, routing_key):
            request = Context(
                {ROUTE_HEADER: route, "delivery_info": {"exchange": exchange, "routing_key": rk}}
                if (rk := routing_key)
                else {}
            )
            _take_sent_route(request)
            return request.delivery_info, getattr(request, "lease_wake_queue", None)

        route = ["q.lease-wake", "x", "k"]
        assert copy(route, "", "q.lease-wake") == (
            {"exchange": "x", "routing_key": "k"},
            "q.lease-wake",
        )
        # Delivered on another route (a retry(queue=) copy that kept the header): ignored.
        assert copy(route, "", "r") == ({"exchange": "", "routing_key": "r"}, None)
        assert copy(route, "x", "q.lease-wake")[1] is None
        assert copy(["q", "x", "k"], "", "q")[1] is None  # not a wake queue's name
        assert copy("q.lease-wake", "", "q.lease-wake")[1] is None  # a waiter's mark

    @pytest.mark.parametrize("where", ["task_routes", "task_options"])
    def test_a_wake_goes_to_its_wake_queue_whatever_the_task_routes_say(self, where):
        """A route with an exchange and routing key (task_routes, or the task's own options)
        is merged into a send's options where they are missing: the wake must still be sent
        to its wake queue (default exchange, the wake queue's name), not to that route,
        where it would wait behind the queue's backlog."""
        from celery.signals import before_task_publish
        from kombu import Exchange, Queue

        from celery_lease._wakes import ROUTE_HEADER
        from celery_lease._wakes import to_wake_queue as _to_wake_queue

        app = Celery(unique("wake"), broker="memory://", set_as_current=False)
        app.conf.task_queues = (Queue("qa", Exchange("ex"), routing_key="ka"),)
        route = {"exchange": "ex", "exchange_type": "direct", "routing_key": "ka"}

        def t() -> None:
            pass

        if where == "task_routes":
            app.conf.task_routes = {"t": route}
            app.task(name="t", shared=False)(t)
        else:
            app.task(name="t", shared=False, **route)(t)
        sent = []

        def seen(sender=None, exchange=None, routing_key=None, **_):
            sent.append((exchange, routing_key))

        before_task_publish.connect(seen, weak=False)
        try:
            options = {"exchange": "ex", "routing_key": "ka"}  # the waiter's delivery route
            headers: dict = {}
            _to_wake_queue(options, headers, "qa.lease-wake")
            with warnings.catch_warnings():
                # (finalizing the app takes in the shared tasks other tests defined, some
                # under one name)
                warnings.simplefilter("ignore", DuplicateTaskNameWarning)
                app.finalize()
            app.signature("t", options={**options, "headers": headers}).apply_async()
        finally:
            before_task_publish.disconnect(seen)
        assert sent == [("", "qa.lease-wake")]
        assert headers[ROUTE_HEADER] == ["qa.lease-wake", "ex", "ka"]
