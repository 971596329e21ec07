"""The sweeper against real stores: hooks under a claim, failed cleanups flagged and kept."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_lease
from celery_lease import LeaseBusyError, Owner, _sweeper, metrics
from tests.cli_helpers import ROOT, Target, make_target
from tests.conftest import make_store


@pytest.fixture
def hooks() -> Iterator[None]:
    """Hooks registered by a test are forgotten after it."""
    saved = list(_sweeper._hooks)
    try:
        yield
    finally:
        _sweeper._hooks[:] = saved


def expire(store: Any, resource: str, label: str, ttl: float = 0.05) -> int:
    """Claim ``resource`` for ``ttl`` and wait (bounded) until it is expired; returns the fence."""
    fence = int(store.acquire(resource, Owner.new(label), ttl).fence)
    wait_expired(store, resource)
    return fence


def wait_expired(store: Any, resource: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.get(resource).expired:
        assert time.monotonic() < deadline, f"{resource} never expired"
        time.sleep(0.05)


def app_for(store_url: str) -> Celery:
    app = Celery("sweeper_test", broker="memory://", backend="cache+memory://")
    app.conf.update(lease_store_url=store_url, lease_ttl=1.0)
    return app


def _wake_of(marker: str) -> str:
    """A waiter's wake payload: a message of a task named ``marker``, to queue ``marker``."""
    return json.dumps({"task": marker, "args": [], "kwargs": {}, "options": {"queue": marker}})


def _sent(app: Celery, marker: str) -> list[str]:
    """The task names of the messages sent to queue ``marker`` of ``app``'s memory broker."""
    names = []
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(marker)
        try:
            while True:
                try:
                    message = queue.get(timeout=0.5)
                except queue.Empty:
                    return names
                names.append(message.headers["task"])
                message.ack()
        finally:
            queue.close()


class TestTaskAndSchedule:
    def test_sweep_is_a_task_and_one_line_schedules_it(self) -> None:
        """sweep_schedule adds a beat entry for the task (run in TestCommand), keeping others."""
        app = app_for("memory://")
        app.conf.beat_schedule = {"other": {"task": "x", "schedule": 5.0}}
        celery_lease.sweep_schedule(app, every=120)
        entry = app.conf.beat_schedule["celery_lease.sweep"]
        assert entry["task"] == "celery_lease.sweep"
        assert entry["schedule"] == 120.0
        assert entry["options"]["expires"] == 120.0
        assert "other" in app.conf.beat_schedule
        with pytest.raises(celery_lease.LeaseConfigError):
            celery_lease.sweep_schedule(app, every=0)

    def test_bad_hook_prefix_is_refused(self) -> None:
        """A prefix that no resource name can start with is a LeaseConfigError."""
        with pytest.raises(celery_lease.LeaseConfigError, match="on_expired prefix"):
            celery_lease.on_expired("no spaces")


class TestHooks:
    def test_failed_cleanup_is_flagged_kept_and_retried(
        self,
        real_store_kind: str,
        request: pytest.FixtureRequest,
        tmp_path: Path,
        names: str,
        hooks: None,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A hook that raises leaves the lease held and flagged; fixed, the next run reclaims
        it (the negative control: a working hook's lease is released)."""
        store = make_store(real_store_kind, request, tmp_path)
        app = app_for("memory://")
        broken = {"yes": True}
        seen: list[tuple[str, str, int, int]] = []

        @celery_lease.on_expired(names + "ok/")
        def close_ok(expired: celery_lease.ExpiredLease) -> None:
            with pytest.raises(LeaseBusyError):  # the sweeper holds it while cleaning
                store.acquire(expired.resource, Owner.new("intruder"), 5)
            seen.append(("ok", expired.holder_label, expired.fence, expired.lease.fence))

        @celery_lease.on_expired(names + "bad/")
        def close_bad(expired: celery_lease.ExpiredLease) -> None:
            seen.append(("bad", expired.holder_label, expired.fence, expired.lease.fence))
            if broken["yes"]:
                raise RuntimeError("profile dir is locked")

        signalled: list[dict[str, Any]] = []

        def on_failed(sender: Any, **kw: Any) -> None:
            signalled.append({"sender": sender, **kw})

        celery_lease.lease_cleanup_failed.connect(on_failed, weak=False)
        try:
            ok, bad, other = names + "ok/1", names + "bad/1", names + "nohook/1"
            ok_fence = expire(store, ok, "celery@w1:11:task-ok")
            bad_fence = expire(store, bad, "celery@w1:12:task-bad")
            expire(store, other, "celery@w1:13:task-other")
            live = store.acquire(names + "ok/live", Owner.new("celery@w1:14:live"), 60)
            failed_key = 'celery_lease_sweeps_total{result="cleanup_failed"}'
            failures_before = metrics.snapshot().get(failed_key, 0)

            with caplog.at_level(logging.WARNING, logger="celery_lease._sweeper"):
                report = celery_lease.run_sweep(app, store=store)
            assert report.reclaimed == [ok]
            assert report.cleanup_failed == [bad]
            assert store.get(ok) is None  # cleaned and released
            kept = store.get(bad)
            assert kept is not None and not kept.expired  # held by the sweeper, not released
            assert (
                f"cleaning up after fence {bad_fence} of celery@w1:12:task-bad" in kept.owner_label
            )
            assert store.get(other).owner_label == "celery@w1:13:task-other"  # no hook: untouched
            assert store.get(live.resource).fence == live.fence
            [ok_seen] = [entry for entry in seen if entry[0] == "ok"]
            assert ok_seen[1:3] == ("celery@w1:11:task-ok", ok_fence)
            assert ok_seen[3] > ok_fence  # the hook ran under a newer fence
            [line] = [r.getMessage() for r in caplog.records if "failed in" in r.getMessage()]
            assert bad in line and "celery@w1:12:task-bad" in line and "RuntimeError" in line
            assert metrics.snapshot()[failed_key] == failures_before + 1
            assert [(s["resource"], s["holder_label"], s["fence"]) for s in signalled] == [
                (bad, "celery@w1:12:task-bad", bad_fence)
            ]
            assert isinstance(signalled[0]["exception"], RuntimeError)

            wait_expired(store, bad)  # the sweeper's own claim runs out: tried again, flagged
            again = celery_lease.run_sweep(app, store=store)
            assert again.cleanup_failed == [bad] and again.reclaimed == []
            assert seen[-1][1:3] == ("celery@w1:12:task-bad", bad_fence)  # still the dead holder

            broken["yes"] = False  # negative control: the same lease, a working hook
            wait_expired(store, bad)
            fixed = celery_lease.run_sweep(app, store=store)
            assert fixed.reclaimed == [bad] and fixed.cleanup_failed == []
            assert store.get(bad) is None
            assert len(signalled) == 2
        finally:
            celery_lease.lease_cleanup_failed.disconnect(on_failed)
            store.close()

    def test_an_expired_lease_held_for_a_waiter_is_flagged_and_its_turn_kept(
        self,
        real_store_kind: str,
        request: pytest.FixtureRequest,
        tmp_path: Path,
        names: str,
        hooks: None,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A holder died while a task waits: the sweeper cannot claim past the waiter the free
        resource is held for, so it wakes that waiter (nobody else did) and flags the lease.
        Before (issue 27, item 3): the refused claim marked the waiter woken without sending
        its wake (it waited for its back-stop copy) and the lease was silently skipped."""
        store = make_store(real_store_kind, request, tmp_path)
        app = app_for("memory://")
        ran: list[str] = []
        celery_lease.on_expired(names)(lambda expired: ran.append(expired.resource))
        r = names + "browser/a"
        try:
            store.acquire(r, Owner.new("celery@w1:11:task-dead"), 0.3)
            with pytest.raises(LeaseBusyError):
                store.acquire(
                    r, Owner.new("w"), 5, identity="waiter", wait=_wake_of(names), wait_ttl=60
                )
            wait_expired(store, r)
            with caplog.at_level(logging.WARNING, logger="celery_lease._sweeper"):
                report = celery_lease.run_sweep(app, store=store)
            assert report.handed_over == [r] and report.reclaimed == [] and ran == []
            assert [(w.identity, w.woken) for w in store.waiters(r)] == [("waiter", True)]
            assert _sent(app, names) == [names]  # the waiter's message went out
            assert any(r in rec.getMessage() and "did not run" in rec.getMessage()
                       for rec in caplog.records)  # fmt: skip
        finally:
            store.close()

    def test_a_cleaned_up_lease_is_handed_to_a_task_that_came_meanwhile(
        self, request: pytest.FixtureRequest, tmp_path: Path, names: str, hooks: None
    ) -> None:
        """A task that arrived while the hook ran is woken by the sweeper's release (issue 32,
        item 3), not left to its back-stop copy."""
        store = make_store("sqlite", request, tmp_path)
        app = app_for("memory://")
        r = names + "browser/a"

        @celery_lease.on_expired(names)
        def cleanup(expired: celery_lease.ExpiredLease) -> None:
            with pytest.raises(LeaseBusyError):  # a task comes and waits
                store.acquire(
                    r, Owner.new("w"), 5, identity="waiter", wait=_wake_of(names), wait_ttl=60
                )

        try:
            expire(store, r, "celery@w1:11:task-dead")
            report = celery_lease.run_sweep(app, store=store)
            assert report.reclaimed == [r]
            assert [(w.identity, w.woken) for w in store.waiters(r)] == [("waiter", True)]
            assert _sent(app, names) == [names]
        finally:
            store.close()

    def test_dry_run_changes_nothing(
        self, request: pytest.FixtureRequest, tmp_path: Path, names: str, hooks: None
    ) -> None:
        """--dry-run lists the expired leases a run would reclaim and runs no hook."""
        store = make_store("sqlite", request, tmp_path)
        ran: list[str] = []
        celery_lease.on_expired(names)(lambda expired: ran.append(expired.resource))
        expire(store, names + "a", "celery@w1:11:task-a")
        report = celery_lease.run_sweep(app_for("memory://"), store=store, dry_run=True)
        assert report.expired == [names + "a"] and report.reclaimed == []
        assert ran == []
        assert store.get(names + "a").expired
        store.close()

    def test_limit_bounds_a_run(
        self, request: pytest.FixtureRequest, tmp_path: Path, names: str, hooks: None
    ) -> None:
        """A run reclaims at most ``limit`` expired leases; the next run goes on."""
        store = make_store("sqlite", request, tmp_path)
        celery_lease.on_expired(names)(lambda expired: None)
        for i in range(3):
            store.acquire(f"{names}{i}", Owner.new("w"), 0.05)
        wait_expired(store, f"{names}2")
        first = celery_lease.run_sweep(app_for("memory://"), store=store, limit=2)
        second = celery_lease.run_sweep(app_for("memory://"), store=store, limit=2)
        assert len(first.reclaimed) == 2 and len(second.reclaimed) == 1
        store.close()


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    made = make_target("sqlite", request, tmp_path)
    made.extra_env["CLI_TTL"] = "1.0"
    try:
        yield made
    finally:
        made.store.close()


class TestCommand:
    def test_sweep_command_flags_a_failed_cleanup(self, target: Target) -> None:
        """`celery lease sweep` runs the app's hooks; a failed one exits 1 with one line and
        keeps the lease, and once fixed the same lease is reclaimed (negative control)."""
        store, marks = target.store, Path(target.extra_env["CLI_MARKS"])
        marks.mkdir()
        (marks / "broken").touch()
        fence = expire(store, "fragile/p1", "celery@w1:12:task-f")
        expire(store, "disposable/d1", "celery@w1:13:task-d")

        dry = json.loads(target.run_subprocess("sweep", "--dry-run", "--json").stdout)
        assert sorted(dry["expired"]) == ["disposable/d1", "fragile/p1"]

        done = target.run_subprocess("sweep")
        assert done.returncode == 1
        warning, error = done.stderr.strip().splitlines()  # the log line, then the reason
        assert error == (
            "Error: cleanup failed for 1 expired lease(s): fragile/p1; see the WARNING log lines"
        )
        assert "cleanup of expired lease 'fragile/p1' (holder 'celery@w1:12:task-f'" in warning
        assert "reclaimed:      1" in done.stdout
        assert (marks / "disposable_d1").read_text().split("\n")[0] == "celery@w1:13:task-d"
        assert store.get("disposable/d1") is None
        assert (
            f"cleaning up after fence {fence} of celery@w1:12:task-f"
            in store.get("fragile/p1").owner_label
        )

        (marks / "broken").unlink()
        wait_expired(store, "fragile/p1")
        done = target.run_subprocess("sweep", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["reclaimed"] == ["fragile/p1"]
        holder, old_fence, new_fence = (marks / "fragile_p1").read_text().split()
        assert holder == "celery@w1:12:task-f" and int(old_fence) == fence < int(new_fence)
        assert store.get("fragile/p1") is None

        # The same through the celery_lease.sweep task, registered on the app by the import.
        expire(store, "disposable/d2", "celery@w1:14:task-d2")
        code = (
            "import json; from tests.cli_app import app; "
            "print(json.dumps(app.tasks['celery_lease.sweep'].apply(kwargs={'limit': 10}).get()))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, **target.env(), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["reclaimed"] == ["disposable/d2"] and result["cleanup_failed"] == []
        assert store.get("disposable/d2") is None


class TestRecords:
    def test_records_past_retention_are_swept(
        self, real_store_kind: str, request: pytest.FixtureRequest, tmp_path: Path, names: str
    ) -> None:
        """A run deletes identity records past retention through the store's sweep_expired,
        and none before (the negative control)."""
        store = make_store(real_store_kind, request, tmp_path, retention=1.0)
        app = app_for("memory://")
        try:
            lease = store.acquire(names + "r", Owner.new("w"), 5, identity="job-1")
            store.release(lease, outcome="done", result="1")
            assert celery_lease.run_sweep(app, store=store).swept == 0  # within retention
            assert store.identity_get(names + "r", "job-1") is not None
            deadline = time.monotonic() + 15
            while store.identity_get(names + "r", "job-1") is not None:
                assert time.monotonic() < deadline, "the record never passed retention"
                time.sleep(0.05)
            report = celery_lease.run_sweep(app, store=store)
            assert report.swept >= 1
            assert celery_lease.run_sweep(app, store=store).swept == 0
        finally:
            store.close()
