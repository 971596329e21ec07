"""Identity, ledger, checkpoints and reconcile hooks at the task level (one process, eager).

The store underneath is real (SQLite or Redis); the multi-process guarantees are tested with
real workers in tests/integration.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_lease import (
    REDO,
    EffectUnresolvedError,
    LeaseConfigError,
    Owner,
    current_lease,
    lease_task,
)
from celery_lease._app import get_store
from celery_lease._events import METRICS
from tests.conftest import unique


@pytest.fixture(params=["sqlite", "redis"])
def app(request, tmp_path):
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    if request.param == "sqlite":
        app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
    else:
        app.conf.lease_store_url = request.getfixturevalue("redis_server").url
        app.conf.lease_key_prefix = unique("eo") + ":"
    app.conf.lease_ttl = 5
    return app


def headers(key):
    return {"headers": {"idempotency_key": key}}


class TestDedup:
    def test_a_completed_identity_returns_its_result_without_running(self, app):
        """A second delivery with the same idempotency key does not run the body."""
        runs = []

        @lease_task(app=app, resource="inv:{n}")
        def send(n):
            runs.append(n)
            return {"sent": n, "fence": current_lease().fence}

        first = send.apply((17,), **headers("send-17")).get()
        before = METRICS["celery_lease_duplicates_total"]
        again = send.apply((17,), **headers("send-17")).get()
        assert again == first and runs == [17]
        assert METRICS["celery_lease_duplicates_total"] == before + 1
        other = send.apply((17,), **headers("send-17-bis")).get()
        assert other["fence"] > first["fence"] and runs == [17, 17]

    def test_identity_template(self, app):
        """identity= works like resource=: the same invoice runs once whatever the task id."""
        runs = []

        @lease_task(app=app, resource="customer:{customer}", identity="invoice:{invoice}")
        def bill(customer, invoice):
            runs.append(invoice)
            return invoice * 10

        assert [bill.apply((1, 5)).get() for _ in range(3)] == [50, 50, 50]
        assert runs == [5]

    def test_task_id_is_the_default_identity(self, app):
        """Without a template or header, a redelivery (same task id) is recognised."""
        runs = []

        @lease_task(app=app, resource="r")
        def job():
            runs.append(current_lease().identity)
            return "ok"

        job.apply(task_id="fixed-id").get()
        job.apply(task_id="fixed-id").get()
        assert runs == ["fixed-id"]

    def test_dedup_can_be_turned_off(self, app):
        runs = []

        @lease_task(app=app, resource="r", identity=False)
        def job():
            assert current_lease().identity is None
            runs.append(1)

        job.apply(task_id="same").get()
        job.apply(task_id="same").get()
        assert runs == [1, 1]

    def test_a_failed_run_is_not_done(self, app):
        """A failure leaves the identity open: the next delivery runs, told of the failure."""
        seen = []

        @lease_task(app=app, resource="r")
        def flaky():
            lease = current_lease()
            seen.append((lease.identity_state, lease.recovered))
            if len(seen) == 1:
                raise RuntimeError("boom")
            return "second time lucky"

        assert isinstance(flaky.apply(**headers("k")).result, RuntimeError)
        assert flaky.apply(**headers("k")).get() == "second time lucky"
        assert seen == [(None, False), ("failed", True)]

    def test_bad_identity_values(self, app):
        @lease_task(app=app, resource="r", identity="x {n}")
        def job(n):
            pass

        with pytest.raises(LeaseConfigError, match="identity"):
            job.apply((1,), throw=True)


class TestEffects:
    def test_an_effect_runs_once_across_attempts(self, app):
        """Done effects come back as receipts when a failed attempt is run again."""
        charged = []

        @lease_task(app=app, resource="inv:{n}")
        def charge(n):
            lease = current_lease()
            receipt = lease.effect(f"charge:{n}")(lambda: charged.append(n) or f"ch_{n}")
            if len(charged) == 1 and not lease.recovered:
                raise RuntimeError("crash after the charge")
            return receipt

        assert isinstance(charge.apply((42,), **headers("c42")).result, RuntimeError)
        assert charge.apply((42,), **headers("c42")).get() == "ch_42"
        assert charged == [42]

    def test_context_manager_form(self, app):
        @lease_task(app=app, resource="r")
        def job():
            with current_lease().effect("email:welcome") as effect:
                assert not effect.done
                effect.receipt = {"message_id": "m1"}
            with current_lease().effect("email:welcome") as again:
                assert again.done and again.replayed and again.receipt == {"message_id": "m1"}
            return effect.receipt

        assert job.apply().get() == {"message_id": "m1"}

    def test_an_unfinished_effect_without_a_hook_stops_the_task(self, app):
        """Intent without done and no reconcile_effect: fail clearly, never replay."""
        store_box = {}

        @lease_task(app=app, resource="d:{n}")
        def deploy(n):
            lease = current_lease()
            store_box["store"] = lease.store
            lease.effect("deploy")(lambda: "v2")

        crash_after_intent(app, "d:1", "deploy-1", "deploy")
        result = deploy.apply((1,), **headers("deploy-1"))
        assert isinstance(result.result, EffectUnresolvedError)
        assert "reconcile_effect" in str(result.result)

    @pytest.mark.parametrize(("answer", "runs"), [("already-live", 0), (REDO, 1)])
    def test_reconcile_effect_decides(self, app, answer, runs):
        """The hook's receipt settles the effect; REDO runs it again."""
        calls, effects = [], []

        def reconcile_effect(key, lease):
            calls.append((key, lease.recovered))
            return answer

        @lease_task(app=app, resource="d:{n}", reconcile_effect=reconcile_effect)
        def deploy(n):
            return current_lease().effect("deploy")(lambda: effects.append(1) or "v2")

        crash_after_intent(app, "d:2", "deploy-2", "deploy")
        receipt = deploy.apply((2,), **headers("deploy-2")).get()
        assert calls == [("deploy", True)]
        assert len(effects) == runs
        assert receipt == ("v2" if answer is REDO else "already-live")

    def test_effects_need_an_identity(self, app):
        @lease_task(app=app, resource="r", identity=False)
        def job():
            current_lease().effect("x")

        with pytest.raises(LeaseConfigError, match="identity"):
            job.apply(throw=True)

    def test_a_bad_effect_key_is_named_as_the_effect_key(self, app):
        """lease.effect() given something other than a key says it is the effect's key that
        is bad (not "invalid lease resource"), shows it, and says what a key is."""

        @lease_task(app=app, resource="r")
        def job():
            current_lease().effect({"charge": 42})

        with pytest.raises(LeaseConfigError) as caught:
            job.apply(throw=True)
        message = str(caught.value)
        assert "lease.effect() key {'charge': 42}" in message, message
        assert "invalid lease resource" not in message
        assert "e.g. lease.effect('charge:inv-42')" in message


class TestCheckpointsAndReconcile:
    def test_reconcile_sees_the_checkpoints_of_the_attempt_that_did_not_finish(self, app):
        """A retry of a half-done job starts from its last checkpoint."""
        reconciled = []

        def reconcile(lease):
            reconciled.append((lease.identity_state, dict(lease.checkpoints)))

        @lease_task(app=app, resource="crawl:{site}", reconcile=reconcile)
        def crawl(site):
            lease = current_lease()
            start = lease.checkpoints.get("page", 0)
            for page in range(start, 3):
                lease.checkpoint("page", page + 1)
                if page == 1 and not lease.recovered:
                    raise RuntimeError("worker died on page 2")
            return lease.checkpoints

        assert isinstance(crawl.apply(("a",), **headers("crawl-a")).result, RuntimeError)
        assert crawl.apply(("a",), **headers("crawl-a")).get() == {"page": 3}
        assert reconciled == [("failed", {"page": 2})]

    def test_a_bad_step_name_is_named_as_the_checkpoint_step(self, app):
        """lease.checkpoint() given its data where the step name goes says it is the
        checkpoint's step name that is bad (not "invalid lease resource"), shows the value
        and says what to pass."""

        @lease_task(app=app, resource="crawl:{site}")
        def crawl(site):
            current_lease().checkpoint({"page": 3})

        with pytest.raises(LeaseConfigError) as caught:
            crawl.apply(("a",), throw=True)
        message = str(caught.value)
        assert "lease.checkpoint() step name {'page': 3}" in message, message
        assert "invalid lease resource" not in message
        assert "lease.checkpoint('page', {'page': 3})" in message


def crash_after_intent(app, resource, identity, key):
    """Leave what a crash between an effect's intent and its done leaves: an open intent."""
    store = get_store(app)
    lease = store.acquire(resource, Owner.new("crashed"), 5, identity=identity)
    assert store.effect_begin(lease, key)[0] == "new"
    store.release(lease, outcome="retry")


class TestACopyOfASucceededRun:
    """Two copies of one execution and a pause: copy A runs the body to its end and is paused
    before its release; its lease runs out and copy B claims, and is itself lost before its
    body's end (it records ``retry``); A resumes, its release finds the identity B's and
    records nothing, and Celery stores A's SUCCESS. The next copy (B's woken or back-stop
    sibling) claims, finds ``retry`` and the backend's SUCCESS, and ends unrun, as before. It
    now records the identity done with that SUCCESS's result, so a later delivery sharing the
    identity returns it without running the body. Before, the record was given back as found
    (``retry``) and stayed so: seen in CI (the lost-update counter on PostgreSQL, an
    acknowledged increment's identity never done)."""

    @staticmethod
    def deliver_woken(task, task_id, args, headers=None, waits=1000):
        """A woken copy of attempt 0, ``waits`` into its wait (1000: busy_max_waits, its last
        allowed one, so it reads the backend); it must end unrun (``Ignore``)."""
        from celery.exceptions import Ignore

        task.push_request(
            id=task_id,
            args=args,
            kwargs={},
            retries=0,
            is_eager=False,
            called_directly=False,
            delivery_info={"exchange": "", "routing_key": "celery"},
            headers={"celery_lease_waits": waits, "celery_lease_woken_at": 1.0, **(headers or {})},
        )
        try:
            with pytest.raises(Ignore):
                task(*args)
        finally:
            task.pop_request()

    def test_its_identity_ends_done_with_the_result_the_run_stored(self, app):
        from celery_lease._codec import decode

        runs = []

        @lease_task(app=app, resource="sr:{n}", bind=True, shared=False, name="proj.sr")
        def step(self, n):
            runs.append(self.request.id)
            return {"n": n, "fence": current_lease().fence}

        store, task_id = get_store(app), unique("id")
        # B's claim, lost before its body's end; A's SUCCESS stored by Celery.
        lost = store.acquire("sr:1", Owner.new(f"w1@host:11:{task_id}"), 5, identity=task_id)
        assert store.release(lost, outcome="retry")
        stored = {"n": 1, "fence": lost.fence - 1}
        step.backend.store_result(task_id, stored, "SUCCESS")
        self.deliver_woken(step, task_id, (1,), waits=1)  # the next copy, of the same attempt
        assert runs == []
        info = store.identity_get("sr:1", task_id)
        assert info is not None and info.state == "done", info
        assert decode(info.result) == stored
        held = store.get("sr:1")
        assert held is None or held.released, held  # given back
        # A new message of the same task id (sent again) returns the result, unrun.
        assert step.apply((1,), task_id=task_id).get() == stored and runs == []

    def test_an_idempotency_key_is_not_ended_by_the_task_ids_success_under_another(self, app):
        """The task id ran under key K1 and was sent again under K2 (new work): its copy
        that ends on the old SUCCESS leaves K2 as found, and K2 runs when delivered again.
        (Found by review of the first version, which recorded K2 done with K1's result.)"""
        runs = []

        @lease_task(app=app, resource="ik:{n}", bind=True, shared=False, name="proj.ik")
        def send(self, n):
            runs.append(self.request.headers.get("idempotency_key"))
            return {"n": n, "key": self.request.headers.get("idempotency_key")}

        store, task_id = get_store(app), unique("id")
        first = send.apply((1,), task_id=task_id, **headers("K1")).get()
        send.backend.store_result(task_id, first, "SUCCESS")
        self.deliver_woken(send, task_id, (1,), {"idempotency_key": "K2"})
        info = store.identity_get("ik:1", "K2")
        assert info is None or info.state != "done", info
        assert send.apply((1,), **headers("K2")).get() == {"n": 1, "key": "K2"}
        assert runs == ["K1", "K2"]

    def test_another_task_ids_owed_run_under_a_shared_identity_still_runs(self, app):
        """identity="invoice:{n}": T2's run is owed (its claim was lost: ``retry``) when a
        late copy of T1, which succeeded long ago, ends on T1's SUCCESS: the record stays
        T2's and T2 runs. (Found by review of the first version: T2 got T1's result.)"""
        runs = []

        @lease_task(
            app=app,
            resource="tb:{n}",
            identity="invoice:{n}",
            bind=True,
            shared=False,
            name="proj.tb",
        )
        def bill(self, n):
            runs.append(self.request.id)
            return {"n": n, "by": self.request.id}

        store, t1, t2 = get_store(app), unique("t1"), unique("t2")
        bill.backend.store_result(t1, {"n": 1, "by": t1}, "SUCCESS")
        lost = store.acquire("tb:1", Owner.new(f"w1@host:11:{t2}"), 5, identity="invoice:1")
        assert store.release(lost, outcome="retry")
        self.deliver_woken(bill, t1, (1,), {})
        info = store.identity_get("tb:1", "invoice:1")
        assert info is not None and info.state != "done", info
        assert bill.apply((1,), task_id=t2).get() == {"n": 1, "by": t2}
        assert runs == [t2]
