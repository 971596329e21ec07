"""LeaseTask and @lease_task in one process: templates, settings, eager and direct calls.

These run the task through Celery's own ``apply()`` (eager) and direct calls against real
stores; the behaviour inside real workers is covered by ``tests/integration``.
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass

import pytest
from celery import Celery

from celery_lease import (
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
    LeaseTask,
    Owner,
    StaleFenceError,
    current_lease,
    lease_task,
)
from celery_lease._app import get_store
from celery_lease._errors import IdentityDoneError, LeaseStoreError
from celery_lease._message import names_task as _names_task
from celery_lease._names import MAX_LABEL_LENGTH
from celery_lease._pid import getpid
from celery_lease._settings import LeaseSettings
from tests.conftest import unique


@pytest.fixture
def app(request, tmp_path):
    """A Celery app in eager-friendly mode whose leases live in a real SQLite store."""
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
    app.conf.lease_ttl = 5
    return app


@dataclass
class Account:
    id: int


class TestResourceTemplates:
    def test_template_binds_positional_keyword_and_default_arguments(self, app):
        """Arguments bind through the signature, defaults applied, attributes allowed."""

        @lease_task(app=app, resource="browser/{account.id}-{region}-{tier}")
        def drive(account, region, tier="basic"):
            return current_lease().resource

        assert drive.apply((Account(42), "eu")).get() == "browser/42-eu-basic"
        assert drive.apply((), {"account": Account(7), "region": "us", "tier": "pro"}).get() == (
            "browser/7-us-pro"
        )

    def test_var_keyword_arguments_are_visible_to_the_template(self, app):
        """Keys passed through **kwargs can be named in the template."""

        @lease_task(app=app, resource="job:{job_id}")
        def run(**options):
            return current_lease().resource

        assert run.apply((), {"job_id": 9}).get() == "job:9"

    def test_callable_resource(self, app):
        """A callable gets the task's arguments and returns the name."""

        @lease_task(app=app, resource=lambda a, b: f"pair:{min(a, b)}-{max(a, b)}")
        def pair(a, b):
            return current_lease().resource

        assert pair.apply((5, 3)).get() == "pair:3-5"

    @pytest.mark.parametrize(
        ("args", "needle"),
        [((), "needs 'account_id'"), ((None,), "is None"), (("a b",), "not a valid")],
    )
    def test_bad_resource_values_fail_before_anything_runs(self, app, args, needle):
        """Missing, None or unsafe values raise LeaseConfigError naming the argument."""
        ran = []

        @lease_task(app=app, resource="acct-{account_id}")
        def task(*account_id_or_nothing, **_):
            ran.append(1)

        @lease_task(app=app, resource="acct-{account_id}", name=unique("t"))
        def named(account_id=None):
            ran.append(1)

        target = task if needle.startswith("needs") else named
        with pytest.raises(LeaseConfigError, match=needle):
            target.apply(args, throw=True)
        assert ran == []

    def test_positional_fields_are_refused(self, app):
        """{0} is ambiguous across calls; the error, where the task is defined, says to name
        the argument."""
        with pytest.raises(LeaseConfigError, match="positional"):

            @lease_task(app=app, resource="x-{0}")
            def task(a):
                pass


class TestSettings:
    def test_task_overrides_app_defaults(self, app):
        """Decorator keywords win over app.conf lease_* keys, which win over defaults."""
        app.conf.lease_on_busy = "fail"

        @lease_task(app=app, resource="r", ttl=9, max_runtime=30)
        def task():
            pass

        settings = task.lease_settings
        assert (settings.ttl, settings.max_runtime, settings.on_busy) == (9.0, 30.0, "fail")
        assert settings.effective_renew_interval == 3.0
        assert settings.effective_margin == 2.25

    @pytest.mark.parametrize(
        ("options", "needle"),
        [
            ({"ttl": 0}, "lease_ttl"),
            ({"ttl": "60"}, "lease_ttl"),
            ({"on_busy": "wait"}, "lease_on_busy"),
            ({"ttl": 10, "renew_interval": 10}, "lease_renew_interval"),
            ({"busy_backoff_jitter": 2}, "jitter"),
            ({"busy_max_waits": -1}, "busy_max_waits"),
        ],
    )
    def test_bad_settings_name_the_key(self, app, options, needle):
        """Bad values fail at decoration time with the key in the message."""
        with pytest.raises(LeaseConfigError, match=needle):

            @lease_task(app=app, resource="r", **options)
            def task():
                pass

    def test_unknown_app_setting_is_refused(self):
        """A typo in an override is caught."""
        with pytest.raises(LeaseConfigError, match="unknown lease setting 'tll'"):
            LeaseSettings.resolve(None, {"tll": 5})

    def test_missing_store_url_is_a_clear_error(self, app):
        """No lease_store_url: no fallback to the broker, a message saying what to set."""
        app.conf.lease_store_url = None

        @lease_task(app=app, resource="r")
        def task():
            pass

        with pytest.raises(LeaseConfigError, match="lease_store_url is not set"):
            task.apply(throw=True)

    def test_resource_is_required(self):
        """@lease_task without resource= (and no base providing one) is refused."""
        with pytest.raises(LeaseConfigError, match="resource="):
            lease_task(ttl=5)

    def test_base_must_be_a_lease_task(self):
        from celery import Task

        with pytest.raises(LeaseConfigError, match="LeaseTask subclass"):
            lease_task(resource="r", base=Task)


class TestEagerAndDirect:
    def test_eventlet_pool_is_refused_before_any_claim(self, app, monkeypatch):
        """Under eventlet a lost lease could not be stopped: fail clearly, claim nothing."""
        import sys
        import types

        patcher = types.ModuleType("eventlet.patcher")
        patcher.is_monkey_patched = lambda name: name == "thread"  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "eventlet.patcher", patcher)

        @lease_task(app=app, resource="inv:{n}")
        def task(n):
            pass

        with pytest.raises(LeaseConfigError, match="eventlet"):
            task.apply((9,)).get()
        assert get_store(app).get("inv:9") is None
        monkeypatch.delitem(sys.modules, "eventlet.patcher")
        task.apply((9,)).get()  # the same task runs once eventlet is gone

    def test_eager_run_claims_a_real_lease_and_releases_it(self, app):
        """apply() holds a real lease visible in the store, released afterwards."""
        seen = {}

        @lease_task(app=app, resource="inv:{n}", bind=True)
        def task(self, n):
            lease = current_lease()
            assert self.request.lease is lease
            seen["info"] = get_store(app).get(lease.resource)
            return lease.fence

        fence = task.apply((1,)).get()
        assert seen["info"].fence == fence
        assert get_store(app).get("inv:1") is None

    def test_eager_busy_raises_at_once(self, app):
        """A held resource in eager mode raises LeaseBusyError instead of spinning."""

        @lease_task(app=app, resource="inv:{n}")
        def task(n):
            pass

        store = get_store(app)
        held = store.acquire("inv:2", Owner.new("someone-else"), 30)
        result = task.apply((2,))
        assert isinstance(result.result, LeaseBusyError)
        assert "someone-else" in str(result.result)
        store.release(held)

    def test_eager_skip_says_skipped_as_the_worker_does(self, app):
        """on_busy="skip" in eager mode raises at once a LeaseBusyError saying it was skipped
        (as settings.md and the worker's stored FAILURE do), not "retry later"."""

        @lease_task(app=app, resource="inv:{n}", on_busy="skip")
        def task(n):
            pass

        store = get_store(app)
        held = store.acquire("inv:4", Owner.new("someone-else"), 30)
        try:
            result = task.apply((4,))
        finally:
            store.release(held)
        assert isinstance(result.result, LeaseBusyError)
        assert str(result.result).startswith("skipped (on_busy='skip'): resource 'inv:4'")
        assert result.result.resource == "inv:4"

    def test_task_always_eager_claims_and_fails_fast_when_busy(self, app):
        """With task_always_eager, delay() runs in place under a real lease, never spinning."""
        app.conf.task_always_eager = True
        app.conf.task_eager_propagates = True

        @lease_task(app=app, resource="inv:{n}")
        def task(n):
            return current_lease().fence

        assert task.delay(3).get() > 0
        store = get_store(app)
        held = store.acquire("inv:3", Owner.new("someone-else"), 30)
        try:
            with pytest.raises(LeaseBusyError, match="someone-else"):
                task.delay(3)
        finally:
            store.release(held)
        assert store.get("inv:3") is None

    def test_direct_call_claims_like_any_execution(self, app):
        """task(...) holds a lease unless allow_direct_call is set."""

        @lease_task(app=app, resource="d:{n}", bind=True)
        def task(self, n):
            assert self.request.lease is current_lease()
            return current_lease().fence

        @lease_task(app=app, resource="d:{n}", allow_direct_call=True)
        def free(n):
            with pytest.raises(LeaseError, match="no lease is held"):
                current_lease()
            return "no lease"

        assert task(1) >= 1
        held = get_store(app).acquire("d:1", Owner.new("other"), 30)
        with pytest.raises(LeaseBusyError):
            task(1)
        assert free(1) == "no lease"
        get_store(app).release(held)

    def test_lost_lease_in_eager_mode_raises(self, app):
        """A lease taken away mid-body ends an eager run with LeaseLostError."""

        @lease_task(app=app, resource="l:{n}")
        def task(n):
            get_store(app).force_release(current_lease().resource)
            current_lease().guard()

        result = task.apply((1,))
        assert isinstance(result.result, LeaseLostError)
        assert "l:1" in str(result.result)

    def test_body_result_is_not_success_when_the_lease_was_lost(self, app):
        """A body that swallows the loss still does not end in success."""

        @lease_task(app=app, resource="s:{n}")
        def task(n):
            lease = current_lease()
            get_store(app).force_release(lease.resource)
            with contextlib.suppress(LeaseLostError):
                lease.guard()
            return "pretend all is well"

        result = task.apply((1,))
        assert isinstance(result.result, LeaseLostError)

    def test_current_lease_outside_a_task(self):
        with pytest.raises(LeaseError, match="no lease is held"):
            current_lease()

    def test_subclassing_lease_task(self, app):
        """class X(LeaseTask) with lease_* attributes works like the decorator."""

        class Billing(LeaseTask):
            lease_resource = "invoice:{invoice_id}"
            lease_ttl = 7

        @app.task(base=Billing, bind=True)
        def charge(self, invoice_id):
            return (current_lease().resource, current_lease().ttl)

        assert charge.apply((17,)).get() == ("invoice:17", 7.0)


class TestErrors:
    @pytest.mark.parametrize(
        "error",
        [
            LeaseBusyError.held("r", "host:1:task", 7, 2.5),
            LeaseLostError.lost("r", 7, "taken_over", "other", 8),
            StaleFenceError.rejected("k", 3, 9),
            LeaseStoreError("down"),
            LeaseConfigError("bad"),
            LeaseError("root"),
            IdentityDoneError.completed("r", "job-1", 7, '"ok"', "host:1:task"),
        ],
    )
    def test_errors_survive_pickling_and_rebuilding_from_args(self, error):
        """Celery rebuilds exceptions with cls(*exc.args); pickling must round-trip too."""
        rebuilt = type(error)(*error.args)
        unpickled = pickle.loads(pickle.dumps(error))
        for copy in (rebuilt, unpickled):
            assert type(copy) is type(error)
            assert str(copy) == str(error)
            assert copy.args == error.args
        assert isinstance(error, LeaseError)

    def test_messages_name_resource_fence_and_holder(self):
        busy = LeaseBusyError.held("browser/account-42", "w1@host:123:abc", 17, 3.0)
        assert all(s in str(busy) for s in ("browser/account-42", "w1@host:123:abc", "17"))
        lost = LeaseLostError.lost("invoice:17", 4, "taken_over", "w2@host:9:def", 5)
        assert all(s in str(lost) for s in ("invoice:17", "4", "w2@host:9:def", "taken_over"))


def parse_holder(label: str) -> tuple[str | None, str | None, str | None]:
    from celery_lease._names import parse_holder  # (here: the tests failed before it existed)

    return parse_holder(label)


class TestHolderLabel:
    """The owner label a claim writes names the task and the arguments its sender recorded."""

    @pytest.fixture
    def label_of(self, app):
        """Deliver one copy of a lease task as a worker does; return the label its claim wrote."""
        seen: list[str] = []

        @lease_task(app=app, resource="label:{n}", identity=False, name="proj.drive_browser")
        def task(n, mode="slow"):
            seen.append(current_lease().owner_label)

        def deliver(task_id="6f1c-aa", hostname="celery@w1", **request):
            task.push_request(
                id=task_id,
                hostname=hostname,
                args=(42,),
                kwargs={"mode": "fast"},
                is_eager=False,
                called_directly=False,
                delivery_info={"exchange": "", "routing_key": "celery"},
                **request,
            )
            try:
                task(42, mode="fast")
            finally:
                task.pop_request()
            return seen.pop()

        return deliver

    def test_the_label_names_the_task_and_its_recorded_arguments(self, label_of):
        """host:pid:task-id, then the task's name and Celery's argsrepr and kwargsrepr (what
        `celery inspect active` shows), which the CLI's parser reads back. Failed before:
        the label stopped at the task id."""
        label = label_of(argsrepr="(42,)", kwargsrepr="{'mode': 'fast'}")
        assert label == f"celery@w1:{getpid()}:6f1c-aa proj.drive_browser (42,) {{'mode': 'fast'}}"
        assert parse_holder(label) == ("6f1c-aa", "proj.drive_browser", "(42,) {'mode': 'fast'}")

    def test_without_recorded_arguments_only_the_name(self, label_of):
        """A message whose sender recorded no argument text (eager runs, direct calls, protocol
        1) and a task with no arguments: the name alone; no repr is made at claim time."""
        assert label_of() == f"celery@w1:{getpid()}:6f1c-aa proj.drive_browser"
        label = label_of(argsrepr="()", kwargsrepr="{}")
        assert label == f"celery@w1:{getpid()}:6f1c-aa proj.drive_browser"

    def test_arguments_are_shortened_and_secrets_left_out(self, label_of):
        """Long argument text is cut (at most 80 characters, ending in ...); a URL password
        and an owner-token-like hex run are masked, also where the cut runs through them."""
        token = "0123456789abcdef" * 3
        argsrepr = f"('redis://:hunter2@db:6379/0', '{token}', '{'x' * 500}')"
        label = label_of(argsrepr=argsrepr, kwargsrepr="{}")
        task_id, name, args = parse_holder(label)
        assert (task_id, name) == ("6f1c-aa", "proj.drive_browser")
        assert args.startswith("('redis://:***@db:6379/0', '012345...', 'xxx"), args
        assert args.endswith("...") and len(args) <= 80  # (MAX_LABEL_ARGUMENTS)
        assert "hunter2" not in label and token not in label
        for cut in range(8, 70):  # wherever the cut falls, no part of the password shows
            argsrepr = f"({'y' * cut!r}, 'postgresql://u:hunter2hunter2@db/app')"
            label = label_of(argsrepr=argsrepr, kwargsrepr="{}")
            assert "hunter" not in label and "er2" not in label, label

    def test_the_label_stays_within_the_store_limit_and_keeps_the_task_id(self, label_of):
        """Whatever the host name's length, the label fits the stores' 200 characters and the
        task id is never cut for the note: the arguments go first, then the name."""
        argsrepr = f"({'z' * 300!r},)"
        read = []
        for length in (2, 100, 150, 175):
            label = label_of(hostname="celery@" + "h" * length, argsrepr=argsrepr, kwargsrepr="{}")
            assert len(label) <= MAX_LABEL_LENGTH, len(label)
            assert Owner.new(label).label == label  # (nothing cut or cleaned by the owner)
            task_id, name, args = parse_holder(label)
            read.append((task_id, name, args and args[:4]))
        named = ("6f1c-aa", "proj.drive_browser")
        assert read == [(*named, "('zz"), (*named, "('zz"), (*named, None), ("6f1c-aa", None, None)]

    @pytest.mark.parametrize(("task_id", "other"), [("a b", "a"), ("50%", "50"), ("a%20b", "a b")])
    def test_odd_task_ids_are_written_so_the_label_names_only_them(self, label_of, task_id, other):
        """A space or % in a task id is percent-encoded in the label: the label reads back as
        that task id, and a task id equal to its first word (or to its decoding) is another."""
        label = label_of(task_id=task_id, argsrepr="(1,)", kwargsrepr="{}")
        assert parse_holder(label) == (task_id, "proj.drive_browser", "(1,)")
        assert _names_task(label, task_id)
        assert not _names_task(label, other)


class TestBusyDuplicates:
    """A busy claim by a copy of the running execution is re-armed whatever on_busy says."""

    @staticmethod
    def _deliver(task, task_id, waits=0):
        """Run the task as a worker would (not eager, not direct) under a given task id."""
        task.push_request(
            id=task_id,
            args=(1,),
            kwargs={},
            is_eager=False,
            called_directly=False,
            delivery_info={"redelivered": True},
            headers={"celery_lease_waits": waits},
        )
        try:
            result = task(1)
        finally:
            task.pop_request()
        # (what Celery's tracer stores once the copy returns, before its next copy comes)
        task.backend.store_result(task_id, result, "SUCCESS")
        return result

    @pytest.mark.parametrize("on_busy", ["retry", "skip", "fail"])
    @pytest.mark.parametrize("waits", [0, 3])
    def test_a_duplicate_is_rearmed_not_skipped_or_failed(self, app, on_busy, waits):
        """Same identity live under another owner: Retry, also once busy_max_waits is spent
        (a copy that already waited is sent again without storing RETRY: Ignore)."""
        from celery.exceptions import Ignore, Retry

        @lease_task(app=app, resource="dup:{n}", on_busy=on_busy, busy_max_waits=3)
        def task(n):
            raise AssertionError("the body of a duplicate must not run")

        task_id = unique("task")
        held = get_store(app).acquire("dup:1", Owner.new("original"), 30, identity=task_id)
        if waits:
            with pytest.raises(Ignore, match="sent again in"):
                self._deliver(task, task_id, waits)
        else:
            with pytest.raises(Retry) as caught:
                self._deliver(task, task_id, waits)
            assert isinstance(caught.value.exc, LeaseBusyError) and caught.value.exc.duplicate
        get_store(app).release(held)

    @pytest.mark.parametrize(
        ("on_busy", "waits", "raised"),
        [("skip", 0, "Ignore"), ("fail", 0, "Ignore"), ("retry", 3, "LeaseBusyError")],
    )
    def test_other_work_still_follows_on_busy(self, app, on_busy, waits, raised):
        """A holder running another identity is contention: on_busy and the budget apply."""

        @lease_task(app=app, resource="dup:{n}", on_busy=on_busy, busy_max_waits=3)
        def task(n):
            raise AssertionError("the body must not run while another owner holds the lease")

        held = get_store(app).acquire("dup:1", Owner.new("other"), 30, identity="other-job")
        with pytest.raises(Exception) as caught:  # the expected type is the parameter
            self._deliver(task, unique("task"), waits)
        assert type(caught.value).__name__ == raised
        get_store(app).release(held)


class TestSupersededAttempt:
    """A back-stop copy of an attempt a woken copy already ran and retried ends unrun."""

    @staticmethod
    def _deliver(task, task_id, retries, waits=1, **headers):
        """One copy of the execution as a worker runs it: attempt ``retries``, waited once."""
        task.push_request(
            id=task_id,
            args=(1,),
            kwargs={},
            retries=retries,
            is_eager=False,
            called_directly=False,
            delivery_info={"exchange": "", "routing_key": "celery"},
            headers={"celery_lease_waits": waits, **headers},
        )
        try:
            result = task(1)
        finally:
            task.pop_request()
        # (what Celery's tracer stores once the copy returns, before its next copy comes)
        task.backend.store_result(task_id, result, "SUCCESS")
        return result

    @pytest.fixture(params=["memory", "sqlite"])
    def store_app(self, request, app):
        if request.param == "memory":
            app.conf.lease_store_url = "memory://"
        return app

    def _scenario(self, app):
        from celery.exceptions import Ignore, Retry

        ran: list[int] = []

        @lease_task(app=app, resource="sup:{n}", bind=True, max_retries=5)
        def task(self, n):
            ran.append(self.request.retries)
            if self.request.retries < 1:
                raise Retry("user retry")  # what self.retry() raises once it sent attempt 1
            return "done"

        task_id = unique("task")
        with pytest.raises(Retry):  # the woken copy runs attempt 0 and retries
            self._deliver(task, task_id, retries=0)
        other = get_store(app).acquire("sup:1", Owner.new("other"), 30, identity="other-job")
        with pytest.raises(Retry):  # attempt 1 is refused: another waiter holds the resource
            self._deliver(task, task_id, retries=1, waits=0)
        get_store(app).release(other, outcome="done")
        outcome = []
        try:  # attempt 0's back-stop copy comes back and finds the resource free
            outcome.append(self._deliver(task, task_id, retries=0))
        except Ignore:
            outcome.append("dropped")
        except Retry:
            outcome.append("ran again")
        outcome.append(self._deliver(task, task_id, retries=1, waits=1))  # attempt 1's copy
        try:  # and its duplicate, after the run's SUCCESS was stored
            outcome.append(self._deliver(task, task_id, retries=1, waits=1))
        except Ignore:
            outcome.append("dropped")
        return ran, outcome

    def test_the_back_stop_of_a_retried_attempt_does_not_run_it_again(self, store_app):
        """Each attempt's body runs once; the newer attempt still runs and its result counts.
        Failed before: attempt 0's body ran twice ([0, 0, 1])."""
        ran, outcome = self._scenario(store_app)
        assert ran == [0, 1]
        assert outcome == ["dropped", "done", "dropped"]

    def test_another_task_id_sharing_the_identity_waits_for_the_result(self, store_app):
        """A separate send sharing an identity template, arriving while the identity's newer
        attempt is still to run, is not dropped (it would never get a result: the newer
        attempt stores its own under the other task id): it waits as a duplicate of running
        work and ends with the recorded result. Failed before: Ignore (PENDING for ever)."""
        from celery.exceptions import Retry

        ran: list[tuple[str, int]] = []

        @lease_task(app=store_app, resource="sup:{n}", identity="sup-job-{n}", bind=True)
        def task(self, n):
            ran.append((self.request.id, self.request.retries))
            if self.request.retries < 1:
                raise Retry("user retry")
            return "done"

        first, second = unique("first"), unique("second")
        with pytest.raises(Retry):  # the first send runs attempt 0 and retries
            self._deliver(task, first, retries=0)
        with pytest.raises(Retry) as caught:  # the second send: the job is at attempt 1
            self._deliver(task, second, retries=0, waits=0)
        assert caught.value.exc.duplicate
        assert self._deliver(task, first, retries=1) == "done"
        assert self._deliver(task, second, retries=0, waits=2) == "done"  # the recorded one
        assert ran == [(first, 0), (first, 1)]

    def test_negative_control_without_the_attempt_the_copy_runs_again(self, store_app, monkeypatch):
        """With the attempt left out of the identity's record, and of the claims (the wait
        list would otherwise keep the resource held for the newer attempt), the stale copy
        runs the body."""
        from celery_lease import _attempt, _copies

        for room in (_attempt, _copies):
            monkeypatch.setattr(room, "identity_outcome", lambda outcome, attempt: outcome)
        store = get_store(store_app)
        acquire = store.acquire

        def without_attempt(*args, attempt=None, **kwargs):
            return acquire(*args, **kwargs)

        monkeypatch.setattr(store, "acquire", without_attempt)
        ran, outcome = self._scenario(store_app)
        assert ran == [0, 0, 1]
        assert outcome[0] == "ran again"


class TestFailedCopy:
    """A copy of an execution whose body already ran and failed ends unrun; other work runs."""

    _deliver = staticmethod(TestSupersededAttempt._deliver)

    @pytest.fixture(params=["memory", "sqlite"])
    def store_app(self, request, app):
        if request.param == "memory":
            app.conf.lease_store_url = "memory://"
        return app

    @staticmethod
    def _task(app, ran, identity=None, fail=ValueError, **options):
        @lease_task(app=app, resource="fc:{n}", identity=identity, bind=True, **options)
        def task(self, n):
            ran.append((self.request.id, self.request.retries))
            if fail is not None:
                raise fail(f"run {len(ran)}")
            return "done"

        return task

    def _ends(self, task, task_id, retries=0, waits=1, **headers):
        from celery.exceptions import Ignore

        try:
            return self._deliver(task, task_id, retries=retries, waits=waits, **headers)
        except Ignore:
            return "dropped"
        except ValueError:
            return "failed"

    def test_the_other_copies_of_a_failed_execution_do_not_run_it(self, store_app):
        """Its woken copy fails; its back-stop copy and copies of older waits end Ignore'd (the
        FAILURE stays). Failed before: each ran the body again ([run 1, run 2, ...])."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran)
        task_id = unique("task")
        assert self._ends(task, task_id) == "failed"  # the woken copy
        assert [self._ends(task, task_id, waits=w) for w in (1, 2, 3)] == ["dropped"] * 3
        assert ran == [(task_id, 0)]
        info = get_store(store_app).identity_get("fc:1", task_id)
        assert (info.state, info.attempt) == ("failed", 0)  # the record as it was

    @pytest.mark.parametrize("stored", ["failure", "nothing"])
    def test_a_dropped_copy_stores_a_failure_unless_one_is_there(self, store_app, stored):
        """The run's FAILURE stays when it is stored; when it is not (Celery stored STARTED
        over it for this copy with task_track_started, or the run's worker died after its
        release and before Celery stored it: here, the run is called directly and nothing
        stores it) a FAILURE naming the earlier failure is stored, else the task would read as
        running or waiting for ever. Failed before (``nothing``): PENDING."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran)
        task_id = unique("task")
        assert self._ends(task, task_id, waits=0) == "failed"
        if stored == "failure":
            store_app.backend.mark_as_failure(task_id, ValueError("run 1"))
        assert self._ends(task, task_id) == "dropped"
        meta = store_app.backend.get_task_meta(task_id, cache=False)
        assert meta["status"] == "FAILURE"
        if stored == "failure":
            assert str(meta["result"]) == "run 1"
            return
        assert "already ran and failed" in str(meta["result"])

    @pytest.mark.parametrize("check", ["on", "off"])
    def test_a_task_id_sent_again_after_its_failure_runs(self, store_app, check):
        """A task id that ran and failed is sent again (a fresh message) while the resource is
        busy: its copies carry the fence of the holder that refused it (the waiting
        execution's start), older than the failed run's: they run. A copy of the same wait
        whose sibling failed after that start is dropped. Negative control (``off``: no
        start carried, the rule for old workers' copies): the re-sent copy is dropped.
        Failed before: dropped (the body never ran again)."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran)
        task_id = unique("task")
        assert self._ends(task, task_id, waits=0) == "failed"  # the first send
        store = get_store(store_app)
        holder = store.acquire("fc:1", Owner.new("other"), 30, identity="other-job")
        store.release(holder)
        since = {"celery_lease_since_fence": holder.fence} if check == "on" else {}
        if check == "off":
            assert self._ends(task, task_id, **since) == "dropped"
            assert len(ran) == 1
            return
        assert self._ends(task, task_id, **since) == "failed"  # the re-sent message's copy
        assert self._ends(task, task_id, waits=2, **since) == "dropped"  # its sibling
        assert ran == [(task_id, 0), (task_id, 0)]

    @pytest.mark.parametrize("task_ids", [("2024:{}", "{}"), ("a:{}:c", "{}:c")])
    def test_a_task_id_that_is_the_tail_of_the_failed_ones_runs(self, store_app, task_ids):
        """The record's owner label is host:pid:<task id>, read from the left: a task id that
        is the tail of the failed one's after a colon is another task. Failed before
        (2024:42 then 42): dropped."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran, identity="fc-job-{n}")
        base = unique("id")
        failed, other = (task_id.format(base) for task_id in task_ids)
        assert self._ends(task, failed, waits=0) == "failed"
        assert self._ends(task, other) == "failed"
        assert self._ends(task, other, waits=2) == "dropped"  # its own copies still are
        assert ran == [(failed, 0), (other, 0)]

    @pytest.mark.parametrize("stored", ["FAILURE", "RETRY"])
    def test_a_woken_copy_after_its_sibling_exited_follows_the_backend(self, store_app, stored):
        """A copy's body ends with SystemExit (the record says ``retry``). Celery stored a
        WorkerLostError FAILURE (acks early): the woken copy ends unrun. Nothing final stored
        (acks_late and reject_on_worker_lost redeliver it): it runs."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran, fail=SystemExit)
        task_id = unique("task")
        with pytest.raises(SystemExit):
            self._deliver(task, task_id, retries=0, waits=1)
        if stored == "FAILURE":
            store_app.backend.mark_as_failure(task_id, RuntimeError("worker lost"))
        else:
            store_app.backend.mark_as_retry(task_id, RuntimeError("busy"))
        woken = {"celery_lease_woken_at": 1.0}
        if stored == "FAILURE":
            assert self._ends(task, task_id, **woken) == "dropped"
            assert len(ran) == 1
            info = get_store(store_app).identity_get("fc:1", task_id)
            assert info.state == "retry"  # the record as it was
            return
        with pytest.raises(SystemExit):
            self._deliver(task, task_id, retries=0, waits=1, **woken)
        assert len(ran) == 2

    def test_a_copy_of_an_earlier_attempt_of_a_failed_one_is_dropped(self, store_app):
        """Attempt 2 fails (``failed:2``): copies of attempts 0..2 end unrun, a later attempt
        (self.retry(throw=False) sent before the failure) runs."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran)
        task_id = unique("task")
        assert self._ends(task, task_id, retries=2) == "failed"
        assert [self._ends(task, task_id, retries=r) for r in (0, 1, 2)] == ["dropped"] * 3
        # (its first delivery: a back-stop copy of it would find the FAILURE stored)
        assert self._ends(task, task_id, retries=3, waits=0) == "failed"
        assert ran == [(task_id, 2), (task_id, 3)]

    @pytest.mark.parametrize("retries", [0, 2])
    def test_another_task_id_sharing_the_identity_runs_after_a_failure(self, store_app, retries):
        """A failure is not done: a new send sharing the identity (template, idempotency key)
        runs the body, as a recovery. Failed before with the failure at attempt 2: the new
        send (attempt 0) was dropped as superseded (Ignore: PENDING for ever)."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran, identity="fc-job-{n}")
        first, second = unique("first"), unique("second")
        assert self._ends(task, first, retries=retries) == "failed"
        assert self._ends(task, second, waits=1) == "failed"  # (a waiter's copy, too)
        assert ran == [(first, retries), (second, 0)]

    def test_a_redelivery_of_the_failed_message_itself_runs(self, store_app):
        """A message the hand-off did not copy (no waits counted: the original, redelivered
        because its worker died before Celery stored the failure) runs again, as before."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran)
        task_id = unique("task")
        assert self._ends(task, task_id, waits=0) == "failed"
        assert self._ends(task, task_id, waits=0) == "failed"
        assert len(ran) == 2

    @pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
    def test_a_body_stopped_by_the_worker_is_not_a_failure(self, store_app, stop):
        """SystemExit / KeyboardInterrupt out of the body: Celery stores no failure and the
        message comes back; the record says ``retry``, so a copy runs the attempt again."""
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran, fail=stop)
        task_id = unique("task")
        with pytest.raises(stop):
            self._deliver(task, task_id, retries=0, waits=1)
        assert get_store(store_app).identity_get("fc:1", task_id).state == "retry"
        with pytest.raises(stop):
            self._deliver(task, task_id, retries=0, waits=1)
        assert len(ran) == 2

    def test_without_an_identity_nothing_is_recorded_and_copies_run(self, store_app):
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran, identity=False)
        task_id = unique("task")
        assert [self._ends(task, task_id, waits=w) for w in (1, 2)] == ["failed", "failed"]
        assert len(ran) == 2

    def test_negative_control_without_the_check_the_copies_run_again(self, store_app, monkeypatch):
        from celery_lease import _copies

        monkeypatch.setattr(_copies, "copy_of_failed", lambda lease, request: False)
        ran: list[tuple[str, int]] = []
        task = self._task(store_app, ran)
        task_id = unique("task")
        assert [self._ends(task, task_id, waits=w) for w in (1, 1, 2)] == ["failed"] * 3
        assert ran == [(task_id, 0)] * 3


class TestRequestFields:
    def test_fields_read_from_the_instance_are_not_context_class_attributes(self):
        """request_get reads a Context's __dict__: every name it is asked is one Context.get
        would otherwise find only there (no class attribute, no default of Celery's)."""
        from celery.app.task import Context

        from celery_lease import _message, _wakes

        names = {
            value
            for module in (_message, _wakes)
            for key, value in vars(module).items()
            if key.endswith("_HEADER") and isinstance(value, str) and value.startswith("celery_")
        }
        names |= {"idempotency_key", "argsrepr", "kwargsrepr"}
        assert names > {"celery_lease_unique", "celery_lease_wake_route"}
        assert not [name for name in names if hasattr(Context, name)]

    def test_request_get_matches_context_get(self):
        """A Context's fields, present or missing, read the same as through Context.get; any
        other request object is asked through its own get."""
        from celery.app.task import Context

        from celery_lease._message import request_get

        request = Context(id="t1", celery_lease_unique="k", argsrepr="(1,)")
        for name in ("celery_lease_unique", "argsrepr", "celery_lease_polls", "kwargsrepr"):
            assert request_get(request, name) == request.get(name)
        assert request_get({"celery_lease_unique": "k"}, "celery_lease_unique") == "k"

    def test_task_request_is_the_tasks_own_request(self, app):
        """task_request reads what task.request reads: the default request outside an
        execution, the innermost pushed one inside, each thread its own, and a task class's
        own request property where it has one."""
        import threading

        from celery_lease._message import task_request

        @lease_task(app=app, resource="r:{n}")
        def proxy(n):
            return n

        task = app.tasks[proxy.name]  # (the task object, as Celery calls it)
        assert task_request(proxy) is proxy.request
        assert task_request(task) is task.request  # none pushed: the default request
        task.push_request(id="outer")
        try:
            assert task_request(task) is task.request
            assert task_request(task).id == "outer"
            task.push_request(id="inner")
            assert task_request(task).id == "inner"
            task.pop_request()
            seen = []
            thread = threading.Thread(target=lambda: seen.append(task_request(task)))
            thread.start()
            thread.join()
            assert seen[0].id is None and seen[0] is not task_request(task)
        finally:
            task.pop_request()
        assert task_request(task) is task.request

        class Own(type(task)):
            abstract = True

            @property
            def request(self):
                return "own"

        assert task_request(Own()) == "own"
