"""The task side of the hand-off: the wake payload, the wake, and their metrics."""

from __future__ import annotations

import json

import pytest
from celery import Celery

from celery_lease import lease_task, metrics
from celery_lease._task import WAITS_HEADER, WOKEN_HEADER


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
        payload, keep = task._wake_payload(task.request, (1, "x"), {}, task.lease_settings)
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
        assert task._wake_payload(task.request, (1, "x"), {}, task.lease_settings) is None

    def test_arguments_json_cannot_write_wait_with_the_back_off(self, task):
        """No payload (so no place in the list) rather than a payload that cannot be sent."""
        assert task._wake_payload(task.request, (object(),), {}, task.lease_settings) is None


class TestWake:
    def test_a_wake_sends_the_message_stamped_and_counts(self, task, monkeypatch):
        """The woken message carries the wake time (hand-off latency) and is counted by cause."""
        sent = []
        monkeypatch.setattr(
            "celery.canvas.Signature.apply_async", lambda self, *a, **k: sent.append(self)
        )
        payload, _ = task._wake_payload(task.request, (1, "x"), {}, task.lease_settings)
        key = 'celery_lease_handoffs_total{by="release"}'
        before = metrics.snapshot().get(key, 0)
        task._wake(payload, "r-1", "release")
        assert metrics.snapshot()[key] == before + 1
        (signature,) = sent
        assert signature.id == task.request.id
        assert isinstance(signature.options["headers"][WOKEN_HEADER], float)

    def test_a_failed_wake_is_logged_not_raised(self, task, caplog):
        """The back-stop copy covers a wake that could not be sent."""
        task._wake("{not json", "r-1", "release")
        assert "could not wake" in caplog.text


class TestWakeOptions:
    def test_the_options_are_what_celery_would_send_again(self, task):
        """The payload's options match Context.as_execution_options() (None values dropped),
        with every field set: the fast builder must not drift from Celery's."""
        from celery_lease._task import _execution_options

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

    def test_dead_letter_and_attempt_headers_are_not_carried(self, task):
        """RabbitMQ's x-death trail and our per-attempt headers stay behind."""
        task.request.headers.update({"x-death": [{"count": 1}], "custom": "kept"})
        payload, _ = task._wake_payload(task.request, (1, "x"), {}, task.lease_settings)
        headers = json.loads(payload)["options"]["headers"]
        assert headers == {WAITS_HEADER: 3, "custom": "kept"}
