"""Log lines a person can act on (issue 33, item 5), in one process with Celery's own tracer.

What a real worker prints at start and when a pool process is killed is checked with real
workers in tests/integration/test_crash_settings.py.
"""

from __future__ import annotations

import logging
import time

import pytest
from celery import Celery

from celery_lease import LeaseLostError, LeaseTask, current_lease, lease_task
from celery_lease import _eventlog as eventlog
from celery_lease._app import get_store
from celery_lease._errors import LeaseStoreError
from tests.conftest import unique


def fresh_app(broker: str = "memory://") -> Celery:
    """An app whose leases live in the memory store (made once per app), with this module's
    lease tasks only: those of other test modules defined as shared tasks (the default) join
    every app finalized after them. Reading app.tasks finalizes this one, so they can be
    dropped, and a task defined from here on (``shared=False``) registers at once."""
    app = Celery(unique("app"), broker=broker, backend="cache+memory://")
    app.conf.lease_store_url = "memory://"
    app.conf.lease_ttl = 5
    for name, task in list(app.tasks.items()):
        if isinstance(task, LeaseTask):
            app.tasks.unregister(name)
    return app


@pytest.fixture
def app():
    eventlog.reset()
    yield fresh_app()
    eventlog.reset()


def lease_lines(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == eventlog.LOGGER and getattr(r, "lease", {}).get("event") == event
    ]


class TestLostHolder:
    """The lost lease's message says "no live holder now" only when the store said so."""

    def test_a_lease_lost_to_failing_renewals_does_not_claim_nobody_holds_it(
        self, app, caplog, monkeypatch
    ):
        """Renewals fail until the self-fence deadline: the owner never asked the store who
        holds the resource now. Said "no live holder now" before."""
        app.conf.lease_ttl = 0.6
        store = get_store(app)

        def renewals_fail(leases, ttl=None):
            raise LeaseStoreError("the store does not answer")

        monkeypatch.setattr(store, "renew_many", renewals_fail)

        @lease_task(app=app, resource="lost:{n}", shared=False)
        def task(n):
            lease = current_lease()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                lease.check()  # raises once the self-fence deadline has passed
                time.sleep(0.02)
            raise AssertionError("the lease was never lost")

        caplog.set_level(logging.INFO)
        result = task.apply((1,))
        assert isinstance(result.result, LeaseLostError)
        assert result.result.reason in ("renew_failed", "self_fenced")
        failure = [r.getMessage() for r in caplog.records if r.name == "celery.app.trace"]
        assert failure and "lost:1" in failure[0]
        assert "no live holder now" not in caplog.text
        assert "who holds it now is not known here" in failure[0]

    def test_a_force_released_lease_says_nobody_holds_it(self, app, caplog):
        """Positive control: the store read the record and found none."""

        @lease_task(app=app, resource="lost:{n}", shared=False)
        def task(n):
            get_store(app).force_release(current_lease().resource)
            current_lease().guard()

        caplog.set_level(logging.INFO)
        result = task.apply((1,))
        assert result.result.reason == "force_released"
        failure = [r.getMessage() for r in caplog.records if r.name == "celery.app.trace"]
        assert "no live holder now" in failure[0]


def body(n):
    return n


def start_worker_step(app: Celery, pool: object = None) -> None:
    """Run the lease bootstep's start as a worker's main process does."""
    from types import SimpleNamespace

    from celery_lease._app import LeaseBootstep

    worker = SimpleNamespace(app=app, pool_cls=pool, concurrency=2, max_concurrency=None)
    LeaseBootstep(worker).start(worker)


def ready_line(caplog: pytest.LogCaptureFixture) -> str:
    (line,) = [r.getMessage() for r in caplog.records if " ready (" in r.getMessage()]
    return line


class TestReadyLine:
    """The worker's "store ... ready" line shows each lease task's ttl, not the app's alone."""

    def test_tasks_with_their_own_ttl_are_named_with_it(self, app, caplog):
        """Two tasks override the app's 5 s: the line says 15 s and names the one left at 5 s.
        Said "ready (ttl 5s)" before, the app's lease_ttl, which no task here runs with but
        one."""

        @lease_task(app=app, resource="a:{n}", name="proj.plain", shared=False)
        def plain(n):
            return n

        @lease_task(app=app, resource="b:{n}", ttl=15, name="proj.browse", shared=False)
        def browse(n):
            return n

        @lease_task(app=app, resource="c:{n}", ttl=15, name="proj.pay", shared=False)
        def pay(n):
            return n

        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        line = ready_line(caplog)
        assert line.endswith("ready (ttl 15s for 2 lease tasks; 5s for proj.plain)"), line

    def test_one_ttl_for_all_is_said_once(self, app, caplog):
        """Every task runs with the app's ttl: one figure and the count."""
        for n in range(4):
            lease_task(app=app, resource="r:{n}", name=f"proj.t{n}", shared=False)(body)
        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        assert ready_line(caplog).endswith("ready (ttl 5s for all 4 lease tasks)")

    def test_no_lease_task_says_so(self, app, caplog):
        """A worker whose app registered no lease task (yet) does not pretend it has."""
        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        assert ready_line(caplog).endswith("ready (no lease tasks registered; lease_ttl 5s)")

    def test_many_names_are_cut(self, app, caplog):
        """Past three names a group says how many more."""
        for n in range(6):
            lease_task(app=app, resource="r:{n}", name=f"proj.long{n}", shared=False)(body)
        for n in range(5):
            lease_task(app=app, resource="s:{n}", ttl=1, name=f"proj.short{n}", shared=False)(body)
        caplog.set_level(logging.INFO, logger="celery_lease")
        start_worker_step(app)
        assert ready_line(caplog).endswith(
            "ready (ttl 5s for 6 lease tasks; 1s for proj.short0, proj.short1, proj.short2 "
            "and 2 more)"
        )


def warnings_at_start(app: Celery, pool: object, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_lease"):
        start_worker_step(app, pool)
    found = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return [w for w in found if "MemoryLeaseStore shares nothing" not in w]  # (the store's)


class TestCrashRecoveryWarnings:
    """At start, a worker warns once per setting that leaves a crashed step lost or waiting."""

    @pytest.fixture
    def prefork(self):
        from celery.concurrency import get_implementation

        return get_implementation("prefork")

    def define(self, app: Celery, **options: object) -> None:
        lease_task(app=app, resource="w:{n}", name=unique("proj.step"), shared=False, **options)(
            body
        )

    @pytest.mark.parametrize(
        ("options", "warned"),
        [
            ({"acks_late": True}, True),
            ({"acks_late": True, "reject_on_worker_lost": True}, False),
            ({"acks_late": True, "retry_on_worker_lost": True}, False),
            ({"acks_late": False}, False),  # (acked at its start: at most once, by choice)
        ],
    )
    def test_acks_late_without_reject_on_worker_lost(self, app, prefork, caplog, options, warned):
        """Named with the consequence and the fix; a setting that brings the step back, or
        acks early, is not warned about. No warning before."""
        self.define(app, **options)
        found = [w for w in warnings_at_start(app, prefork, caplog) if "WorkerLostError" in w]
        assert len(found) == warned, found
        if warned:
            assert "without task_reject_on_worker_lost" in found[0]
            assert "step never runs again" in found[0]
            assert "task_reject_on_worker_lost = True" in found[0]

    def test_app_settings_count_as_the_tasks(self, app, prefork, caplog):
        """task_acks_late and task_reject_on_worker_lost on the app reach every task."""
        app.conf.task_acks_late = True
        self.define(app)
        assert any("WorkerLostError" in w for w in warnings_at_start(app, prefork, caplog))
        app.conf.task_reject_on_worker_lost = True
        other = fresh_app()
        other.conf.update(app.conf)
        self.define(other)
        assert not any("WorkerLostError" in w for w in warnings_at_start(other, prefork, caplog))

    def test_not_on_a_pool_without_child_processes(self, app, caplog):
        """Threads (solo, gevent) run the task in the worker itself: no WorkerLostError."""
        from celery.concurrency import get_implementation

        self.define(app, acks_late=True)
        assert warnings_at_start(app, get_implementation("threads"), caplog) == []

    @pytest.mark.parametrize(
        ("visibility", "ttl", "warned"),
        [
            (None, 60, True),  # kombu's default, 3600 s
            (600, 60, False),  # ten ttls
            (601, 60, True),
            (300, 1, False),  # the five minute floor
            (301, 1, True),
        ],
    )
    def test_redis_visibility_timeout_far_above_the_ttl(self, caplog, visibility, ttl, warned):
        """Named with its value, the tasks, the consequence and a value that is not; none
        before."""
        app = fresh_app("redis://127.0.0.1:1/0")
        if visibility is not None:
            app.conf.broker_transport_options = {"visibility_timeout": visibility}
        self.define(app, acks_late=True, reject_on_worker_lost=True, ttl=ttl)
        found = [w for w in warnings_at_start(app, None, caplog) if "visibility_timeout" in w]
        assert len(found) == warned, found
        if not warned:
            return
        shown = 3600 if visibility is None else visibility
        assert f"the Redis broker's visibility_timeout is {shown}s" in found[0]
        assert ("kombu's default" in found[0]) is (visibility is None)
        assert "lease ttl of proj.step" in found[0]
        assert "unacked" in found[0] and "`celery lease ls` shows the resource free" in found[0]
        suggested = max(10 * ttl, 300)
        assert f"{{'visibility_timeout': {suggested}}}" in found[0]

    def test_sqs_default_visibility_timeout(self, caplog):
        """kombu's SQS default (1800 s), read from the transport as for Redis (boto3 is not
        installed here: a memory transport that says it is SQS stands in)."""
        from kombu.transport import memory

        class SQSChannel(memory.Channel):
            default_visibility_timeout = 1800

        class SQSLike(memory.Transport):
            Channel = SQSChannel
            driver_type = "sqs"

        app = fresh_app()
        app.conf.broker_transport = SQSLike
        self.define(app, acks_late=True, reject_on_worker_lost=True, ttl=15)
        (found,) = warnings_at_start(app, None, caplog)
        assert "the SQS broker's visibility_timeout is 1800s (kombu's default)" in found
        assert "{'visibility_timeout': 300}" in found

    @pytest.mark.parametrize("broker", ["memory://", "amqp://127.0.0.1:1//"])
    def test_no_visibility_warning_for_brokers_without_one(self, broker, caplog):
        """RabbitMQ gives a dead consumer's messages back at once."""
        app = fresh_app(broker)
        self.define(app, acks_late=True, reject_on_worker_lost=True)
        assert warnings_at_start(app, None, caplog) == []

    def test_no_visibility_warning_without_acks_late(self, caplog):
        """A task acked at its start leaves nothing unacked while it runs."""
        app = fresh_app("redis://127.0.0.1:1/0")
        self.define(app)
        assert warnings_at_start(app, None, caplog) == []


class TestWorkerLost:
    """A lease task whose pool process died is logged with its resource and fence."""

    def lost(self, task, task_id, **options):
        from billiard.exceptions import WorkerLostError

        from celery_lease._workerlog import on_task_failure

        error = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 3.")
        on_task_failure(sender=task, task_id=task_id, exception=error, **options)

    def test_the_dead_owners_lease_is_named(self, app, caplog):
        """The store still holds the lease under the task id: its fence and expiry are shown,
        with the setting that would have run the step again."""
        from celery_lease import Owner

        task = lease_task(app=app, resource="acct:{n}", name="proj.step", shared=False)(body)
        task_id = unique("id")
        held = get_store(app).acquire("acct:7", Owner.new(f"w1@host:311:{task_id}"), 5)
        caplog.set_level(logging.INFO)
        self.lost(task, task_id, args=(7,), kwargs={})
        (line,) = lease_lines(caplog, "worker_lost")
        assert line.startswith(f"task proj.step[{task_id}] worker_lost: resource=acct:7 ")
        assert f"fence={held.fence} holder=w1@host:311:{task_id} " in line
        assert 'error="Worker exited prematurely: signal 9 (SIGKILL) Job: 3."' in line
        assert 'fix="task_acks_late = True and task_reject_on_worker_lost = True"' in line

    def test_a_lease_no_longer_its_own_is_not_shown_as_its_fence(self, app, caplog):
        """Another owner's lease on the resource (taken over since) is not the dead one's."""
        from celery_lease import Owner

        task = lease_task(app=app, resource="acct:{n}", name="proj.step", shared=False)(body)
        get_store(app).acquire("acct:7", Owner.new("w2@host:9:other-task"), 5)
        caplog.set_level(logging.INFO)
        self.lost(task, unique("id"), args=(), kwargs={"n": 7})
        (line,) = lease_lines(caplog, "worker_lost")
        assert "resource=acct:7 " in line and "fence=" not in line
        assert "none of this task in the store" in line

    def test_other_failures_and_plain_tasks_are_left_alone(self, app, caplog):
        """Only a WorkerLostError of a lease task: every failure passes through here."""
        from billiard.exceptions import WorkerLostError

        from celery_lease._workerlog import on_task_failure

        plain = app.task(name="proj.plain", shared=False)(body)
        leased = lease_task(app=app, resource="acct:{n}", name="proj.step", shared=False)(body)
        caplog.set_level(logging.INFO)
        on_task_failure(sender=plain, task_id="t1", exception=WorkerLostError("x"), args=(1,))
        on_task_failure(sender=leased, task_id="t2", exception=ValueError("x"), args=(1,))
        assert lease_lines(caplog, "worker_lost") == []


class TestStaleFence:
    """A side effect's refusal (StaleFenceError in the body) is logged with the lease's
    resource and both fences."""

    def run(self, app, highest_known: bool):
        from celery_lease import Owner, StaleFenceError

        taken = {}

        @lease_task(app=app, resource="acct:{n}", shared=False)
        def step(n):
            lease = current_lease()
            store = get_store(app)
            store.force_release(lease.resource)  # a newer owner claims meanwhile
            newer = store.acquire(lease.resource, Owner.new("w2@host:9:newer-task"), 5)
            taken["fence"] = newer.fence
            # A gateway's 409 (it may not say which fence it accepted), or a FenceGate's.
            raise StaleFenceError.rejected(
                f"gw-{n}", lease.fence, newer.fence if highest_known else None
            )

        result = step.apply((7,))
        return result, taken["fence"]

    def test_a_refusal_naming_no_fence_is_completed_from_the_store(self, app, caplog):
        """The store tells the newer fence and its holder; the lost lease's message names the
        holder too. Before: no newer fence in the line, and "no live holder now"."""
        caplog.set_level(logging.INFO)
        result, newer = self.run(app, highest_known=False)
        assert isinstance(result.result, LeaseLostError)
        (line,) = lease_lines(caplog, "stale_fence")
        assert " stale_fence: resource=acct:7 fence=" in line
        own = int(line.split(" fence=", 1)[1].split(" ", 1)[0])
        assert own < newer
        assert f"key=gw-7 newer_fence={newer} newer_holder=w2@host:9:newer-task" in line
        assert f"now held by 'w2@host:9:newer-task' with fence {newer}" in str(result.result)

    def test_a_gates_refusal_names_its_fence(self, app, caplog):
        """A FenceGate says the fence it accepted: no store read needed."""
        caplog.set_level(logging.INFO)
        _, newer = self.run(app, highest_known=True)
        (line,) = lease_lines(caplog, "stale_fence")
        assert line.endswith(f"key=gw-7 newer_fence={newer}")


class TestEffectsSpared:
    """An effect the ledger or ``reconcile_effect`` keeps from running again says so."""

    def define(self, app, calls, outcome=None):
        def reconcile_effect(key, lease):
            return outcome

        @lease_task(
            app=app,
            resource="pay:{n}",
            identity="pay-{n}",
            reconcile_effect=reconcile_effect if outcome is not None else None,
            shared=False,
        )
        def pay(n, crash_in=False, crash_after=False):
            def charge():
                calls.append(n)
                if crash_in:
                    raise RuntimeError("crashed in the charge: did it happen?")
                return {"charged": n}

            receipt = current_lease().effect(f"charge-{n}")(charge)
            if crash_after:
                raise RuntimeError("crashed after the charge")
            return receipt

        return pay

    def test_a_done_effect_is_not_run_again_and_the_line_says_so(self, app, caplog):
        """The first run charged and crashed; the next finds it done in the ledger. Nothing
        was logged before (the run looked like any other)."""
        calls: list[int] = []
        pay = self.define(app, calls)
        assert isinstance(pay.apply((7,), {"crash_after": True}).result, RuntimeError)
        caplog.set_level(logging.INFO)
        again = pay.apply((7,))
        assert again.get() == {"charged": 7}
        assert calls == [7]
        (line,) = lease_lines(caplog, "effect_done")
        assert f"task {pay.name}[{again.id}] effect_done: resource=pay:7 " in line
        assert "identity=pay-7 key=charge-7 done_fence=" in line
        assert 'action="effect already done: not run again, its receipt returned"' in line

    @pytest.mark.parametrize("redo", [False, True])
    def test_a_reconciled_effect_says_what_reconcile_effect_decided(self, app, caplog, redo):
        """The first run crashed inside the charge; reconcile_effect finds it happened (its
        receipt) or not (REDO). Nothing was logged before."""
        from celery_lease import REDO

        calls: list[int] = []
        pay = self.define(app, calls, outcome=REDO if redo else {"charged": "found"})
        assert isinstance(pay.apply((7,), {"crash_in": True}).result, RuntimeError)
        caplog.set_level(logging.INFO)
        again = pay.apply((7,))
        assert again.get() == ({"charged": 7} if redo else {"charged": "found"})
        assert calls == ([7, 7] if redo else [7])
        (line,) = lease_lines(caplog, "reconciled")
        assert f"task {pay.name}[{again.id}] reconciled: resource=pay:7 " in line
        assert "identity=pay-7 key=charge-7 previous_fence=" in line
        if redo:
            assert "reconcile_effect said REDO: it did not take place, runs now" in line
        else:
            assert "returned its receipt: it took place, not run again" in line

    def test_two_effects_of_one_execution_are_two_lines(self, app, caplog):
        """Each effect key is its own line (repeats are counted per execution and key)."""
        calls: list[str] = []

        @lease_task(app=app, resource="pay:{n}", identity="two-{n}", shared=False)
        def both(n, crash_after=False):
            lease = current_lease()
            for key in ("charge", "email"):
                lease.effect(key)(lambda key=key: calls.append(key))
            if crash_after:
                raise RuntimeError("crashed after both")

        assert isinstance(both.apply((1,), {"crash_after": True}).result, RuntimeError)
        caplog.set_level(logging.INFO)
        both.apply((1,)).get()
        assert calls == ["charge", "email"]
        lines = lease_lines(caplog, "effect_done")
        assert [("key=charge " in x, "key=email " in x) for x in lines] == [
            (True, False),
            (False, True),
        ]


class TestBusyRetryLine:
    """Celery's retry line for a busy wait, as a worker's tracer logs it: one short sentence."""

    def refused(self, app, caplog, **options) -> str:
        from celery.app.trace import build_tracer

        from celery_lease import Owner

        task = lease_task(app=app, resource="r:{n}", name="proj.step", shared=False, **options)(
            body
        )
        get_store(app).acquire("r:1", Owner.new("w1@host:311:holder-task"), 30)
        task_id = unique("id")
        request = {
            "id": task_id,
            "delivery_info": {"exchange": "", "routing_key": "celery"},
            "headers": {},
            "retries": 0,
            "hostname": "w2@host",
            "is_eager": False,
        }
        caplog.set_level(logging.INFO)
        build_tracer(task.name, task, app=app, eager=False)(task_id, (1,), {}, request)
        (line,) = [
            r.getMessage()
            for r in caplog.records
            if r.name == "celery.app.trace" and " retry: " in r.getMessage()
        ]
        assert line.startswith(f"Task proj.step[{task_id}] retry: ")
        return line.split(" retry: ", 1)[1]

    def test_a_listed_waiter_says_the_release_wakes_it(self, app, caplog):
        """Was "Retry in 5.0s: LeaseBusyError(...)" (the back-stop's delay, and the repr)."""
        reason = self.refused(app, caplog)
        assert reason == (
            "busy: r:1 is held (fence 1): waiting at place 1 of its wait list, woken when it "
            "is released (back-stop copy in 5.0s)"
        )

    def test_a_waiter_that_polls_in_its_place_says_why(self, app, caplog):
        """Its wake message is over lease_handoff_max_payload: it polls in its place, and the
        line says so (the busy event line, which says it too, is logged once per 10 s)."""
        reason = self.refused(app, caplog, handoff_max_payload=1)
        assert reason.startswith("busy: r:1 is held (fence 1): polling at place 1 of its ")
        assert " (its wake message is " in reason
        assert "over lease_handoff_max_payload=1: it polls in its place" in reason
        assert "LeaseBusyError(" not in reason and "Retry in" not in reason


class TestDroppedCopies:
    """A copy of a waiting execution that ends unrun says which copy it was and why."""

    @staticmethod
    def deliver(task, task_id, retries=0, waits=1, **headers):
        """One copy as a worker runs it (see tests/test_task.py): Ignore'd -> "dropped"."""
        from celery.exceptions import Ignore

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
        except Ignore:
            return "dropped"
        except ValueError:
            task.backend.mark_as_failure(task_id, ValueError("run"))
            return "failed"
        finally:
            task.pop_request()
        task.backend.store_result(task_id, result, "SUCCESS")
        return result

    def define(self, app, fail=False):
        @lease_task(app=app, resource="fc:{n}", bind=True, shared=False, name="proj.step")
        def step(self, n):
            if fail:
                raise ValueError("run")
            return "done"

        return step

    def test_a_back_stop_copy_of_a_finished_task(self, app, caplog):
        """Its woken copy ran and the backend holds SUCCESS: the back-stop copy ends unrun,
        saying so. Before: no copy= and no why=."""
        step = self.define(app)
        task_id = unique("id")
        assert self.deliver(step, task_id, celery_lease_woken_at=1.0) == "done"
        caplog.set_level(logging.INFO)
        assert self.deliver(step, task_id) == "dropped"
        (line,) = lease_lines(caplog, "duplicate")
        assert f"task proj.step[{task_id}] duplicate: resource=fc:1 copy=back-stop " in line
        assert 'action="dropped a copy of a finished task"' in line
        assert (
            'why="its task id already ended SUCCESS in the result backend (another copy of it '
            'ran, or gave up): running it again would repeat that or store over it"'
        ) in line

    def test_a_back_stop_copy_of_a_failed_execution(self, app, caplog):
        """Its woken copy ran and failed; the backend is not read first here (it is what
        another task id sharing the identity may have changed): the claim tells."""
        app.conf.result_backend = None  # (nothing to read before the claim)
        step = self.define(app, fail=True)
        task_id = unique("id")
        assert self.deliver(step, task_id, celery_lease_woken_at=1.0) == "failed"
        caplog.set_level(logging.INFO)
        assert self.deliver(step, task_id) == "dropped"
        (line,) = lease_lines(caplog, "duplicate")
        assert "identity=" in line and "attempt=0 copy=back-stop " in line
        assert 'action="dropped a copy of a failed execution"' in line
        assert 'why="attempt 0 already ran and failed; its FAILURE stays"' in line


_README_START = """
import logging, sys
from types import SimpleNamespace
from typing import Any

from celery.concurrency import get_implementation

def open_logged_in_browser(account_id: int) -> Any: ...

exec(sys.stdin.read())
from celery_lease._app import LeaseBootstep

logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
worker = SimpleNamespace(
    app=app, pool_cls=get_implementation("prefork"), concurrency=2, max_concurrency=None
)
LeaseBootstep(worker).start(worker)
"""


def _readme_start_warnings(code: str) -> list[str]:
    """The crash-recovery warnings a prefork worker of the README's app logs at start, in a
    process of its own (the README's task is a shared one: it would join every app here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _README_START],
        input=code,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [
        line
        for line in done.stdout.splitlines()
        if "visibility_timeout" in line or "WorkerLostError" in line
    ]


def test_the_readme_example_starts_without_a_crash_recovery_warning():
    """README's "In a Celery app" block (Redis broker, ttl 60, acks_late and
    reject_on_worker_lost), as written but for its servers (an unused broker port, memory
    stores): a prefork worker starts without a crash-recovery warning, as its comment "a
    killed worker's step runs again" promises. Without its broker_transport_options line (the
    negative control, the README before) the Redis default visibility timeout, an hour, is
    warned about."""
    from pathlib import Path

    from tests.tooling import docblocks

    readme = docblocks.parse(Path(__file__).resolve().parent.parent / "README.md")
    (block,) = [b for b in readme.blocks if "def refresh_dashboard" in b.code]
    code = (
        block.code.replace("redis://127.0.0.1:6379/0", "redis://127.0.0.1:1/0")
        .replace('"redis://127.0.0.1:6379/1"', '"memory://"')
        .replace('"postgresql+psycopg://app@db/app"', '"memory://"')
    )
    assert "visibility_timeout" in code and "redis://127.0.0.1:1/0" in code
    assert "memory://" in code
    assert _readme_start_warnings(code) == []
    without = "\n".join(
        line for line in code.splitlines() if "broker_transport_options" not in line
    )
    (warning,) = _readme_start_warnings(without)
    assert "the Redis broker's visibility_timeout is 3600s (kombu's default)" in warning
