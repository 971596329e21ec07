"""The structured lease log line: one per event, repeats rate-limited, no secrets in full."""

from __future__ import annotations

import logging
import random
import time

import pytest
from celery import Celery

from celery_lease import Owner, current_lease, lease_task
from celery_lease import _eventlog as eventlog
from celery_lease._app import get_store
from tests.conftest import unique

TOKEN = "5f0c" + "a1" * 14  # 32 hex digits, the shape of an owner token


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock the test moves by hand."""
    now = [1000.0]
    monkeypatch.setattr(eventlog, "monotonic", lambda: now[0])
    eventlog.reset()
    yield now
    eventlog.reset()


def lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == eventlog.LOGGER]


class TestRedactFastPaths:
    @staticmethod
    def reference(value: object) -> str:
        """redact as it was before its fast paths: both regexes over every text."""
        text = str(value)
        if "://" in text:
            text = eventlog._URL.sub(lambda m: eventlog.mask_url(m.group(0)), text)
        return eventlog._TOKEN.sub(r"\1...", text)

    def test_the_fast_paths_change_nothing(self):
        """redact skips its regexes only where they would find nothing: over texts built to sit
        on those edges (hex runs of 30..66 digits, upper-case ones, URLs with and without a
        password or a query, text outside latin-1) it gives what the regexes alone give."""
        rng = random.Random(27)
        parts = [
            "x", " ", "'", ":", "/", "@", "?", "é", "\u20ac", "\U0001f600", "\x00", "AB",
            "redis://db:6379/0", "redis://u:pw@db/0", "https://h/p?password=pw&a=1",
            "postgresql://u:p%40ss@h/db?sslpassword=x", "://", "-",
        ]  # fmt: skip
        for _ in range(3000):
            pieces = []
            for _ in range(rng.randint(0, 6)):
                if rng.random() < 0.4:
                    digits = "0123456789abcdef" if rng.random() < 0.8 else "0123456789ABCDEF"
                    pieces.append("".join(rng.choice(digits) for _ in range(rng.randint(28, 66))))
                else:
                    pieces.append(rng.choice(parts))
            text = "".join(pieces)
            assert eventlog.redact(text) == self.reference(text), repr(text)


class TestRateLimit:
    def test_busy_waits_on_one_holder_log_once_per_window_then_say_how_many(self, clock, caplog):
        """Many tasks waiting for one holder give one line per window; the next says repeats."""
        caplog.set_level(logging.INFO, logger=eventlog.LOGGER)
        fields = {"resource": "inv:7", "fence": 41, "holder": "w1@h:311:abc"}
        assert eventlog.lease_log("busy", logging.INFO, task_id="t0", **fields)
        for n in range(1, 6):
            clock[0] += 1.0
            assert not eventlog.lease_log("busy", logging.INFO, task_id=f"t{n}", **fields)
        assert len(lines(caplog)) == 1
        clock[0] += eventlog.REPEAT_WINDOW
        assert eventlog.lease_log("busy", logging.INFO, task_id="t9", **fields)
        last = lines(caplog)[-1]
        assert "repeats=5" in last.getMessage()
        assert last.lease["repeats"] == 5

    def test_other_resources_holders_and_tasks_are_not_repeats(self, clock, caplog):
        """A different resource or holder is news; a non-busy event repeats per task only."""
        caplog.set_level(logging.INFO, logger=eventlog.LOGGER)
        log = eventlog.lease_log
        assert log("busy", logging.INFO, resource="a", fence=1, holder="h1", task_id="t1")
        assert log("busy", logging.INFO, resource="b", fence=1, holder="h1", task_id="t1")
        assert log("busy", logging.INFO, resource="a", fence=2, holder="h2", task_id="t1")
        assert log("skipped", logging.INFO, resource="a", fence=2, holder="h2", task_id="t1")
        assert log("skipped", logging.INFO, resource="a", fence=2, holder="h2", task_id="t2")
        assert not log("skipped", logging.INFO, resource="a", fence=2, holder="h2", task_id="t2")
        assert len(lines(caplog)) == 5

    def test_negative_control_without_the_window_every_repeat_is_a_line(
        self, clock, caplog, monkeypatch
    ):
        """With the window at 0 the same burst gives a line each: the limit is what cut it."""
        monkeypatch.setattr(eventlog, "REPEAT_WINDOW", 0.0)
        caplog.set_level(logging.INFO, logger=eventlog.LOGGER)
        for n in range(6):
            eventlog.lease_log(
                "busy", logging.INFO, resource="r", fence=1, holder="h", task_id=f"t{n}"
            )
        assert len(lines(caplog)) == 6


class TestRedaction:
    def test_tokens_and_passwords_are_cut_from_every_field(self, clock, caplog):
        """An owner token or a URL password in any field shows in neither message nor record."""
        caplog.set_level(logging.INFO, logger=eventlog.LOGGER)
        eventlog.lease_log(
            "lost",
            logging.WARNING,
            resource="inv:1",
            fence=3,
            holder=f"w1@h:1:{TOKEN}",
            task_id="t1",
            error=f"token {TOKEN} at redis://user:hunter2@db.example:6379/0 failed",
        )
        (record,) = lines(caplog)
        text = record.getMessage() + repr(record.lease)
        assert TOKEN not in text
        assert "hunter2" not in text
        assert TOKEN[:6] + "..." in text  # enough to tell owners apart
        assert "redis://user:***@db.example:6379/0" in text

    def test_negative_control_an_unredacted_line_would_show_them(self):
        """The check above can fail: the raw text holds both secrets."""
        raw = f"token {TOKEN} at redis://user:hunter2@db.example:6379/0"
        assert TOKEN in raw and "hunter2" in raw
        assert TOKEN not in eventlog.redact(raw) and "hunter2" not in eventlog.redact(raw)

    def test_resource_names_are_shown_as_they_are(self, clock, caplog):
        """A resource holding a hex digest is a name, not a secret: it is not cut."""
        caplog.set_level(logging.INFO, logger=eventlog.LOGGER)
        eventlog.lease_log(
            "busy", logging.INFO, resource=f"file:{TOKEN}", fence=1, holder="h", task_id="t"
        )
        assert f"resource=file:{TOKEN}" in lines(caplog)[0].getMessage()


class TestTaskEvents:
    def test_real_tasks_log_claims_takeovers_and_duplicates_without_owner_tokens(
        self, caplog, tmp_path
    ):
        """Each lease event of real executions is one line naming resource, fence, holder and
        task id; no owner token is printed."""
        caplog.set_level(logging.DEBUG, logger="celery_lease")
        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
        tokens: list[str] = []

        @lease_task(app=app, resource="inv:{n}", identity="charge:{n}")
        def charge(n):
            tokens.append(current_lease().owner.token)
            return n

        store = get_store(app)
        stale = store.acquire("inv:1", Owner.new("crashed-worker"), 0.2, identity="charge:1")
        tokens.append(stale.owner.token)
        eventlog.reset()
        deadline = time.time() + 10
        while store.get("inv:1") is not None and not store.get("inv:1").expired:
            assert time.time() < deadline
            time.sleep(0.05)
        first = charge.apply((1,))
        assert first.get() == 1
        again = charge.apply((1,))
        assert again.get() == 1
        records = lines(caplog)
        events = [(r.lease["event"], r.lease["task_id"]) for r in records]
        assert ("claimed", first.id) in events
        assert ("recovered", first.id) in events
        assert ("released", first.id) in events
        assert ("duplicate", again.id) in events
        recovered = next(r for r in records if r.lease["event"] == "recovered")
        assert recovered.lease["resource"] == "inv:1"
        assert recovered.lease["previous_holder"] == "crashed-worker"
        assert recovered.lease["fence"] > stale.fence
        text = caplog.text + repr([r.__dict__ for r in caplog.records])
        assert tokens and all(token not in text for token in tokens)
