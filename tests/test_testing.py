"""celery_lease.testing: a user's suite runs leased tasks without servers, and each helper
does what it says (each checked against the same code path without the helper)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from celery_lease import LeaseConfigError, Owner
from celery_lease.testing import TestLeaseStore, assert_no_stale_write_accepted, using_store
from tests.user_suite import myapp

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_sample_user_suite_passes() -> None:
    run = _run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests/user_suite"]
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "8 passed" in run.stdout


@pytest.fixture
def eager():
    myapp.app.conf.task_always_eager = True
    myapp.SENT.clear()
    yield
    myapp.app.conf.task_always_eager = False


def test_without_the_fixture_the_app_has_no_store(eager) -> None:
    """Control: the sample app names no store, so only the override lets its tasks run."""
    with pytest.raises(LeaseConfigError, match="lease_store_url is not set"):
        myapp.send_invoice.delay(17).get()
    with using_store():
        assert myapp.send_invoice.delay(17).get() == 1


def test_the_same_message_twice_runs_once_but_two_messages_run_twice(eager) -> None:
    from celery_lease.testing import send_twice

    with using_store():
        send_twice(myapp.send_invoice, (17,))
        assert myapp.SENT == [(17, 1)]
        myapp.send_invoice.delay(17)  # control: a new message is new work
        assert myapp.SENT == [(17, 1), (17, 2)]


def test_expire_makes_the_next_claim_a_takeover() -> None:
    store = TestLeaseStore()
    assert store.expire("agent/1") is None
    first = store.acquire("agent/1", Owner.fresh("a"), 60, identity="job")
    assert store.expire("agent/1").fence == first.fence
    second = store.acquire("agent/1", Owner.fresh("b"), 60, identity="job")
    assert second.fence == first.fence + 1
    assert second.previous_fence == first.fence
    # control: without expire() the resource is still held
    with pytest.raises(Exception, match="held"):
        store.acquire("agent/1", Owner.fresh("c"), 60)


@pytest.mark.parametrize(
    ("writes", "stale"),
    [
        ([1, 2, 2, 3], False),
        ([("a", 2), ("b", 1), ("a", 3)], False),
        ([1, 3, 2], True),
        ([("a", 2), ("b", 5), ("a", 1)], True),
    ],
)
def test_assert_no_stale_write_accepted(writes, stale) -> None:
    if stale:
        with pytest.raises(AssertionError, match="stale holder"):
            assert_no_stale_write_accepted(writes)
    else:
        assert_no_stale_write_accepted(writes)


FROZEN = """
import datetime, os, sys, threading, time
sys.path.insert(0, os.getcwd())
import freezegun
import celery_lease.testing
from celery_lease.testing import TestLeaseStore, using_store
if os.environ["CONTROL"] == "1":  # the library reading time.* as user code does
    import celery_lease._clock
    celery_lease._clock._REAL[:] = [lambda: time.monotonic(), lambda: time.time()]
from tests.user_suite import myapp
myapp.app.conf.task_always_eager = True
frozen = freezegun.freeze_time(datetime.datetime(2030, 1, 1))
store = TestLeaseStore()


def freeze_once_claimed():  # the test freezes the clock while the task holds its lease
    deadline = time.monotonic() + 30
    while store.get("browser/account-1") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    frozen.start()


freezer = threading.Thread(target=freeze_once_claimed)
with using_store(store):
    freezer.start()
    try:
        print(myapp.drive_browser.delay(1, 1.5).get())
    except Exception as exc:
        print(type(exc).__name__)
    finally:
        freezer.join()
        frozen.stop()
"""


@pytest.mark.parametrize(("control", "expected"), [("0", "done"), ("1", "LeaseLostError")])
def test_a_frozen_wall_clock_does_not_move_a_lease(control: str, expected: str) -> None:
    started = time.monotonic()
    run = _run(["-c", textwrap.dedent(FROZEN)], {"CONTROL": control})
    assert run.stdout.strip().splitlines()[-1:] == [expected], run.stdout + run.stderr
    assert time.monotonic() - started < 60


DEPTH = """
import datetime, json, os, sys, time
sys.path.insert(0, os.getcwd())
import freezegun
import celery_lease.testing  # as the pytest plugin does
from celery import Celery
from celery_lease import lease_task
from celery_lease.testing import using_store

app = Celery("depth", broker="memory://", backend="cache+memory://")
app.conf.task_always_eager = True


def h0(): return time.time()
def h1(): return h0()
def h2(): return h1()
def h3(): return h2()


@lease_task(app=app, resource="r/{n}")
def body(n):
    return [time.time(), h0(), h1(), h2(), h3(), time.monotonic(),
            datetime.datetime.now().timestamp()]


with using_store(), freezegun.freeze_time(datetime.datetime(2030, 1, 1)):
    print(json.dumps({"outside": [time.time(), time.monotonic()], "body": body.delay(1).get()}))
"""


def test_a_task_body_sees_the_frozen_clock_at_any_depth() -> None:
    """Only the library's lease timing keeps the real clock; the user's body code is frozen."""
    import json

    run = _run(["-c", textwrap.dedent(DEPTH)])
    assert run.returncode == 0, run.stdout + run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    frozen_wall, frozen_monotonic = seen["outside"]
    assert seen["body"] == [frozen_wall] * 5 + [frozen_monotonic, frozen_wall], seen


def test_the_gate_log_is_in_the_order_the_gate_decided() -> None:
    """A decision is logged with it: a later admit cannot slip into the log ahead of it."""
    import threading

    from celery_lease import FenceGate

    store = TestLeaseStore()
    first_logging, second_done = threading.Event(), threading.Event()

    under_store_lock = []

    class HeldLog(list):  # holds the first decision between the gate's choice and its log line
        def append(self, decision) -> None:
            under_store_lock.append(store._lock.locked())
            if decision.fence == 1:
                first_logging.set()
                second_done.wait(2.0)  # logged apart from the decision, fence 2 gets in here
            super().append(decision)

    store.gate_log = HeldLog()
    gate = FenceGate(store=store)

    def second() -> None:
        gate.admit("invoice:17", 2)
        second_done.set()

    first = threading.Thread(target=gate.admit, args=("invoice:17", 1))
    first.start()
    assert first_logging.wait(30)
    other = threading.Thread(target=second)
    other.start()
    first.join(30)
    other.join(30)
    assert under_store_lock == [True, True]  # logged with the decision, not after it
    assert [d.fence for d in store.gate_log] == [1, 2]
    store.assert_no_stale_write_accepted()


def _run_suite(
    where: Path, files: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a user's small suite (``files``, with the plugin opted in) in its own pytest."""
    files = {"conftest.py": 'pytest_plugins = ["celery_lease.testing"]\n', **files}
    for name, text in files.items():
        (where / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "."],
        cwd=where,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(where)])},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


LATER_TTL_APP = """
    import time

    from celery import Celery

    from celery_lease import current_lease, lease_task

    app = Celery("later_ttl", broker="memory://", backend="cache+memory://")
    app.conf.task_always_eager = True


    @lease_task(app=app, resource="browser/account-{account_id}", max_retries=0)
    def drive_browser(account_id, seconds):
        lease = current_lease()
        for _ in range(round(seconds / 0.02)):
            lease.check()
            time.sleep(0.02)
        return lease.ttl
"""

LATER_TTL_TESTS = """
    import pytest

    from celery_lease import LeaseLostError
    from celery_lease.testing import paused_renewals
    from later_ttl import app, drive_browser


    def test_first_runs_with_the_default_ttl(lease_store):
        assert drive_browser.delay(1, 0.1).get() == 60.0


    def test_a_later_test_sets_a_short_ttl(lease_store, monkeypatch):
        monkeypatch.setitem(app.conf, "lease_ttl", 1.0)
        with paused_renewals(), pytest.raises(LeaseLostError):
            drive_browser.delay(2, 3.0).get()
        assert lease_store.get("browser/account-2") is None


    def test_and_the_next_test_has_the_default_again(lease_store):
        assert drive_browser.delay(3, 0.1).get() == 60.0
"""


def test_a_later_test_s_settings_are_not_shadowed_by_an_earlier_run(tmp_path: Path) -> None:
    """Settings a task resolved in one test are forgotten before the next test runs."""
    run = _run_suite(
        tmp_path, {"later_ttl.py": LATER_TTL_APP, "test_later_ttl.py": LATER_TTL_TESTS}
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout


STORE_OPTIONS_APP = """
    from celery import Celery

    from celery_lease import current_lease, lease_task

    app = Celery("with_options", broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = "sqlite:///leases.db"
    app.conf.lease_store_options = {"max_ttl": 1800, "table_prefix": "myapp_"}
    app.conf.task_always_eager = True


    @lease_task(app=app, resource="report/{n}", ttl=900)
    def build_report(n):
        return current_lease().fence
"""

STORE_OPTIONS_TESTS = """
    import pytest

    from celery_lease import LeaseConfigError
    from celery_lease.testing import TestLeaseStore, using_store
    from with_options import build_report


    def test_the_fixture_takes_the_app_s_max_ttl(lease_store):
        assert build_report.delay(1).get() == 1
        assert lease_store.max_ttl == 1800


    def test_a_store_made_with_its_own_max_ttl_keeps_it():
        with using_store(TestLeaseStore(max_ttl=600)):
            with pytest.raises(LeaseConfigError, match="max_ttl"):
                build_report.delay(1).get()
"""


def test_the_test_store_honours_the_app_s_store_options(tmp_path: Path) -> None:
    """max_ttl from lease_store_options applies under the fixture; backend options are ignored."""
    run = _run_suite(
        tmp_path, {"with_options.py": STORE_OPTIONS_APP, "test_options.py": STORE_OPTIONS_TESTS}
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout
    assert not (tmp_path / "leases.db").exists()  # the app's own store was never made


SHORT_TTL_APP = """
    import time

    from celery import Celery

    from celery_lease import current_lease, lease_task

    app = Celery("short_ttl", broker="memory://", backend="cache+memory://")


    @lease_task(app=app, resource="report/{n}")
    def report(n):
        return current_lease().ttl


    @lease_task(app=app, resource="browser/account-{account_id}", ttl=60, max_retries=0)
    def drive_browser(account_id):
        return current_lease().ttl
"""

SHORT_TTL_TESTS = """
    import pytest
    from celery.contrib.testing.worker import start_worker

    from short_ttl import app, drive_browser, report


    @pytest.fixture
    def eager():
        app.conf.task_always_eager = True
        yield
        app.conf.task_always_eager = False


    @pytest.fixture
    def worker(lease_store):
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False) as w:
            yield w


    def test_a_task_s_own_ttl_set_in_a_test(eager, lease_store, monkeypatch):
        monkeypatch.setattr(drive_browser, "lease_ttl", 1.0)
        assert drive_browser.delay(1).get() == 1.0


    def test_settings_set_in_a_test_after_its_worker_started(worker, lease_store, monkeypatch):
        monkeypatch.setitem(app.conf, "lease_ttl", 2.0)
        monkeypatch.setattr(drive_browser, "lease_ttl", 1.0)
        assert report.delay(2).get(timeout=10) == 2.0
        assert drive_browser.delay(2).get(timeout=10) == 1.0


    def test_and_the_next_test_has_the_task_s_own_again(eager, lease_store):
        assert drive_browser.delay(3).get() == 60.0
        assert report.delay(3).get() == 60.0
"""


def test_a_setting_changed_in_the_test_body_applies_also_with_a_worker(tmp_path: Path) -> None:
    """A short ttl set in a test (``app.conf``, or the task's own ``lease_ttl`` for a task with
    ``ttl=``) is what the test's runs use, also when a worker fixture started before the body."""
    run = _run_suite(
        tmp_path, {"short_ttl.py": SHORT_TTL_APP, "test_short_ttl.py": SHORT_TTL_TESTS}
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout


BUSY_TESTS = """
    import time

    import pytest
    from celery.contrib.testing.worker import start_worker

    import celery_lease
    from celery_lease import Owner
    from short_ttl import app, report


    @pytest.fixture
    def worker(lease_store):
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False) as w:
            yield w


    def _waiting(lease_store, result):
        deadline = time.monotonic() + 10
        while not lease_store.waiters("report/4"):
            assert time.monotonic() < deadline, result.state
            time.sleep(0.05)


    def test_release_lease_hands_over_to_the_waiting_task(worker, lease_store):
        holder = lease_store.acquire("report/4", Owner.new("someone else"), 60)
        result = report.delay(4)
        _waiting(lease_store, result)
        celery_lease.release_lease(holder)
        assert result.get(timeout=10) == 60.0


    def test_the_store_s_own_release_wakes_nobody_as_in_production(worker, lease_store):
        holder = lease_store.acquire("report/4", Owner.new("someone else"), 60)
        result = report.delay(4)
        _waiting(lease_store, result)
        lease_store.release(holder)  # (the store holds the resource for the head: its wake
        time.sleep(1.5)              # is the releaser's to send, and would run it in ms)
        assert not result.ready()
        assert lease_store.get("report/4") is None
"""


def test_a_lease_the_test_holds_and_releases_wakes_its_waiter(tmp_path: Path) -> None:
    """A task waiting for a lease the test holds runs as soon as the test releases it with
    ``celery_lease.release_lease`` (not after its back-stop copy, a ttl later); the store's own
    ``release()`` wakes nobody, as a real store's does. Before (issue 27, item 4): the test
    store's release woke the waiter, which no store does in production."""
    run = _run_suite(tmp_path, {"short_ttl.py": SHORT_TTL_APP, "test_busy.py": BUSY_TESTS})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout


EARLY_WORKER_TESTS = """
    import pytest
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    from celery_lease import lease_task

    app = Celery("early_worker", broker="memory://", backend="cache+memory://")  # no store URL


    @lease_task(app=app, resource="report/{n}")
    def report(n):
        return n


    @pytest.fixture(scope="module")
    def worker():  # started before the function-scoped lease_store
        with start_worker(app, pool="threads", perform_ping_check=False) as w:
            yield w


    def test_runs_a_task(worker, lease_store):
        assert report.delay(1).get(timeout=10) == 1
"""


def test_a_worker_started_before_the_lease_store_fails_at_once_saying_what_to_do(
    tmp_path: Path,
) -> None:
    """A module-scoped in-process worker with ``lease_store_url`` unset, started before the
    ``lease_store`` fixture: the test errors at once naming both fixes (it hung for ever)."""
    run = _run_suite(tmp_path, {"test_early.py": EARLY_WORKER_TESTS}, timeout=60)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 error" in run.stdout
    assert "lease_store_url is not set" in run.stdout
    assert "lease_store fixture" in run.stdout and "memory://" in run.stdout
