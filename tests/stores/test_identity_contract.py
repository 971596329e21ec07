"""Identity, ledger and checkpoint contract over every store (invariants 6-10 of protocol.py)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from celery_lease import LeaseBusyError, LeaseConfigError, LeaseLostError, Owner
from celery_lease._errors import IdentityDoneError
from celery_lease.stores import MemoryLeaseStore, RedisLeaseStore
from celery_lease.stores.base import IdentityRecords
from tests.conftest import make_store, redis_admin
from tests.stores.test_contract import LONG, SHORT, expire
from tests.tooling.servers import wait_for


def claim(store, names, owner="w1", identity="job-1", ttl=LONG, resource="r"):
    return store.acquire(names + resource, Owner.new(owner), ttl, identity=identity)


class TestIdentity:
    def test_a_first_claim_marks_the_identity_running(self, store, names):
        """A new identity: nothing to recover; the record carries the claim's fence."""
        lease = claim(store, names)
        assert lease.identity == "job-1" and lease.identity_state is None
        assert not lease.recovered and lease.checkpoints == {}
        info = store.identity_get(names + "r", "job-1")
        assert (info.state, info.fence, info.owner_label, info.result) == (
            "running",
            lease.fence,
            "w1",
            None,
        )

    def test_a_done_identity_is_never_claimed_again(self, store, names):
        """After done, a claim of the same identity returns the result and claims nothing."""
        lease = claim(store, names)
        assert store.release(lease, outcome="done", result=json.dumps({"sent": 17}))
        with pytest.raises(IdentityDoneError) as caught:
            claim(store, names, owner="w2")
        err = caught.value
        assert (err.identity, err.fence) == ("job-1", lease.fence)
        assert json.loads(err.result) == {"sent": 17}
        # who completed it: a task's other copy tells its own run from another task id's
        assert err.owner_label == lease.owner.label
        assert store.get(names + "r") is None  # no lease was taken
        other = claim(store, names, identity="job-2")  # another identity runs normally
        assert other.fence > lease.fence

    def test_an_outcome_keeps_the_attempt_it_names(self, store, names):
        """A task's user retry records "retry:2": the next claim and identity_get read state "retry"
        and attempt 2; a bare outcome names attempt 0; a malformed one is refused."""
        for outcome, state, attempt in (("retry:2", "retry", 2), ("failed:3", "failed", 3)):
            first = claim(store, names, identity=f"job-{state}")
            assert store.release(first, outcome=outcome)
            info = store.identity_get(names + "r", f"job-{state}")
            assert (info.state, info.attempt) == (state, attempt)
            again = claim(store, names, owner="w2", identity=f"job-{state}")
            assert (again.identity_state, again.identity_attempt) == (state, attempt)
            assert again.recovered
            store.release(again)
        plain = claim(store, names, identity="job-plain")
        assert plain.identity_attempt == 0
        for bad in ("done:2", "retry:x", "retry:0", "retry:-1", "retry:123456789012"):
            with pytest.raises(LeaseConfigError):
                store.release(plain, outcome=bad)

    def test_an_unfinished_attempt_makes_the_next_claim_a_recovery(self, store, names):
        """retry / failed / a vanished owner: the next claim names the earlier attempt."""
        for outcome in ("retry", "failed"):
            first = claim(store, names, owner=f"w-{outcome}", identity=f"job-{outcome}")
            store.release(first, outcome=outcome)
            again = claim(store, names, owner="w2", identity=f"job-{outcome}")
            assert again.recovered and again.identity_state == outcome
            assert (again.previous_fence, again.previous_owner_label) == (
                first.fence,
                f"w-{outcome}",
            )
            store.release(again)

    def test_a_claim_names_the_owner_of_the_identity_record_it_found(self, store, names):
        """identity_owner_label: the owner the identity's record names (the failed attempt's;
        a task tells a copy of that execution by the task id in it), also when an expired,
        never released lease of other work lies between (previous_owner_label names that
        one); None for a first claim."""
        first = claim(store, names, owner="host:1:task-a", identity="job-f")
        assert first.identity_owner_label is None
        assert store.release(first, outcome="failed")
        claim(store, names, owner="crashed", identity="other", ttl=SHORT)
        expire(store, names + "r")
        again = claim(store, names, owner="host:2:task-b", identity="job-f")
        assert (again.identity_state, again.identity_owner_label) == ("failed", "host:1:task-a")
        assert again.previous_owner_label == "crashed"
        assert store.release(again, outcome="failed:2")
        third = claim(store, names, owner="w3", identity="job-f")
        assert (third.identity_state, third.identity_attempt) == ("failed", 2)
        assert third.identity_owner_label == "host:2:task-b"

    def test_a_retried_claim_names_the_owner_and_fence_of_the_identity_record(self, store, names):
        """A claim sent again after a lost reply (the same owner token) returns what the
        first attempt found: the identity record's owner label and fence (not those of an
        expired, never released lease of other work between, which previous_owner_label
        names). Failed before: Redis None, the memory store the other work's label."""
        first = claim(store, names, owner="host:1:task-a", identity="job-f")
        assert first.identity_fence is None
        assert store.release(first, outcome="failed")
        claim(store, names, owner="crashed", identity="other", ttl=SHORT)
        expire(store, names + "r")
        owner = Owner.new("host:2:task-a")
        again = store.acquire(names + "r", owner, LONG, identity="job-f")
        retried = store.acquire(names + "r", owner, LONG, identity="job-f")
        for lease in (again, retried):
            assert lease.fence == again.fence
            assert (lease.identity_state, lease.identity_owner_label) == (
                "failed",
                "host:1:task-a",
            )
            assert lease.identity_fence == first.fence
            assert lease.previous_owner_label == "crashed"
        store.release(retried)

    def test_a_crashed_owner_is_recovered_from_lease_and_identity(self, store, names):
        """Expired, never released: the takeover reports the crashed owner."""
        first = claim(store, names, owner="crashed", ttl=SHORT)
        expire(store, names + "r")
        second = claim(store, names, owner="next")
        assert second.recovered and second.identity_state == "running"
        assert (second.previous_owner_label, second.previous_fence) == ("crashed", first.fence)

    def test_a_live_duplicate_is_busy_not_done(self, store, names):
        """The same identity arriving while the first still runs waits; it is not skipped."""
        first = claim(store, names, owner="original")
        with pytest.raises(LeaseBusyError) as caught:
            claim(store, names, owner="duplicate")
        assert caught.value.holder_label == "original"
        assert store.identity_get(names + "r", "job-1").fence == first.fence

    def test_a_busy_claim_says_whether_the_holder_runs_the_same_identity(self, store, names):
        """duplicate=True only when the live holder runs this very identity."""
        claim(store, names, owner="original", identity="job-1")
        with pytest.raises(LeaseBusyError) as same:
            claim(store, names, owner="copy", identity="job-1")
        assert same.value.duplicate is True
        with pytest.raises(LeaseBusyError) as other:
            claim(store, names, owner="other work", identity="job-2")
        assert other.value.duplicate is False
        with pytest.raises(LeaseBusyError) as anonymous:
            claim(store, names, owner="no identity", identity=None)
        assert anonymous.value.duplicate is False

    def test_a_holder_of_an_earlier_attempt_is_not_a_duplicate(self, store, names):
        """Same identity, but the holder runs other work: that is contention, not a copy."""
        first = claim(store, names, owner="first", identity="job-1")
        store.release(first, outcome="retry")
        claim(store, names, owner="holder", identity="job-2")
        with pytest.raises(LeaseBusyError) as caught:
            claim(store, names, owner="again", identity="job-1")
        assert caught.value.duplicate is False

    def test_a_stale_owner_cannot_record_the_outcome(self, store, names):
        """The outcome is recorded only while the identity carries the releaser's fence."""
        old = claim(store, names, owner="old", ttl=SHORT)
        expire(store, names + "r")
        new = claim(store, names, owner="new")
        assert store.release(old, outcome="done", result="1") is False
        info = store.identity_get(names + "r", "job-1")
        assert (info.state, info.fence, info.result) == ("running", new.fence, None)
        store.release(new, outcome="done", result="2")
        with pytest.raises(IdentityDoneError) as caught:
            claim(store, names)
        assert caught.value.result == "2" and caught.value.fence == new.fence

    def test_bad_identity_and_outcome(self, store, names):
        with pytest.raises(LeaseConfigError, match="identity"):
            claim(store, names, identity="has space")
        plain = store.acquire(names + "p", Owner.new(), LONG)
        with pytest.raises(LeaseConfigError, match="identity="):
            store.release(plain, outcome="done")
        lease = claim(store, names)
        with pytest.raises(LeaseConfigError, match="outcome"):
            store.release(lease, outcome="finished")


class TestLedger:
    def test_intent_then_done_then_replay(self, store, names):
        """new -> done with a receipt; asking again gives the receipt back."""
        lease = claim(store, names)
        assert store.effect_begin(lease, "charge") == ("new", None, None)
        assert store.effect_done(lease, "charge", '{"id": "ch_1"}') is True
        state, fence, receipt = store.effect_begin(lease, "charge")
        assert (state, fence, json.loads(receipt)) == ("done", lease.fence, {"id": "ch_1"})

    def test_done_survives_the_owner_and_binds_the_identity(self, store, names):
        """A later owner of the identity sees done; another identity's key is separate."""
        first = claim(store, names, owner="w1", ttl=SHORT)
        store.effect_begin(first, "charge")
        store.effect_done(first, "charge", '"r1"')
        expire(store, names + "r")
        second = claim(store, names, owner="w2")
        assert store.effect_begin(second, "charge") == ("done", first.fence, '"r1"')
        store.release(second)
        other = claim(store, names, identity="job-9")
        assert store.effect_begin(other, "charge") == ("new", None, None)

    def test_an_unfinished_intent_is_handed_to_the_next_owner(self, store, names):
        """Intent without done: the next owner is told, and the old owner cannot finish it."""
        first = claim(store, names, owner="crashed", ttl=SHORT)
        assert store.effect_begin(first, "deploy")[0] == "new"
        expire(store, names + "r")
        second = claim(store, names, owner="next")
        assert store.effect_begin(second, "deploy") == ("intent", first.fence, None)
        assert store.effect_done(first, "deploy", '"late"') is False
        assert store.effect_done(second, "deploy", '"ok"') is True
        assert store.effect_begin(second, "deploy") == ("done", second.fence, '"ok"')

    def test_only_the_live_owner_can_begin_an_effect(self, store, names):
        """A stale or released lease is refused before any intent is written."""
        old = claim(store, names, owner="old", ttl=SHORT)
        expire(store, names + "r")
        with pytest.raises(LeaseLostError):
            store.effect_begin(old, "charge")
        new = claim(store, names, owner="new")
        with pytest.raises(LeaseLostError):
            store.effect_begin(old, "charge")
        assert store.effect_begin(new, "charge") == ("new", None, None)

    def test_the_ledger_needs_an_identity(self, store, names):
        plain = store.acquire(names + "p", Owner.new(), LONG)
        with pytest.raises(LeaseConfigError, match="identity"):
            store.effect_begin(plain, "charge")


class TestForceReleased:
    def test_effects_and_checkpoints_of_an_evicted_owner_say_force_released(self, store, names):
        """The ledger and checkpoints refuse the evicted owner with the reason force_released."""
        held = claim(store, names, owner="stuck")
        store.force_release(names + "r")
        with pytest.raises(LeaseLostError) as caught:
            store.effect_begin(held, "charge")
        assert caught.value.reason == "force_released"
        with pytest.raises(LeaseLostError) as caught:
            store.checkpoint(held, json.dumps({"page": 1}))
        assert caught.value.reason == "force_released"


class TestCheckpoints:
    def test_checkpoints_reach_the_next_owner(self, store, names):
        """Progress written by a crashed owner is handed to the one that recovers."""
        first = claim(store, names, owner="crashed", ttl=SHORT)
        store.checkpoint(first, json.dumps({"page": 3}))
        expire(store, names + "r")
        second = claim(store, names, owner="next")
        assert second.recovered and second.checkpoints == {"page": 3}

    def test_a_stale_owner_cannot_checkpoint(self, store, names):
        """After a takeover the old owner's checkpoint is refused and changes nothing."""
        old = claim(store, names, owner="old", ttl=SHORT)
        expire(store, names + "r")
        new = claim(store, names, owner="new")
        store.checkpoint(new, json.dumps({"step": "new"}))
        with pytest.raises(LeaseLostError):
            store.checkpoint(old, json.dumps({"step": "old"}))
        store.release(new, outcome="retry")
        third = claim(store, names, owner="third")
        assert third.checkpoints == {"step": "new"}


def facts(lease):
    """What a claim reports about the lease and the work it recovers."""
    return (
        lease.fence,
        lease.acquired_at,
        lease.expires_at,
        lease.recovered,
        lease.previous_owner_label,
        lease.previous_fence,
        lease.identity_state,
        lease.checkpoints,
    )


class TestRetriedClaim:
    """A claim repeated by the same owner (the store's retry after a lost reply) returns what
    the first attempt returned: the same lease and the same recovery facts."""

    def test_a_fresh_claim_retried_recovers_nothing(self, store, names):
        """No earlier work: the retry reports none either (not its own running record)."""
        owner = Owner.new("w1")
        first = store.acquire(names + "r", owner, LONG, identity="job-1")
        again = store.acquire(names + "r", owner, LONG, identity="job-1")
        assert facts(again) == facts(first)
        assert not again.recovered and again.identity_state is None

    def test_a_takeover_retried_still_names_the_expired_owner(self, store, names):
        """Lease-level recovery (no identity): previous owner and fence come back again."""
        crashed = claim(store, names, owner="crashed", identity=None, ttl=SHORT)
        expire(store, names + "r")
        owner = Owner.new("next")
        first = store.acquire(names + "r", owner, LONG)
        again = store.acquire(names + "r", owner, LONG)
        assert first.previous_fence == crashed.fence
        assert facts(again) == facts(first)

    def test_an_unfinished_identity_retried_keeps_state_and_checkpoints(self, store, names):
        """Identity recovery: state, previous fence and checkpoints come back again."""
        earlier = claim(store, names, owner="earlier")
        store.checkpoint(earlier, json.dumps({"page": 2}))
        store.release(earlier, outcome="retry")
        owner = Owner.new("next")
        first = store.acquire(names + "r", owner, LONG, identity="job-1")
        again = store.acquire(names + "r", owner, LONG, identity="job-1")
        assert (first.identity_state, first.previous_fence) == ("retry", earlier.fence)
        assert first.checkpoints == {"page": 2}
        assert facts(again) == facts(first)

    def test_a_crashed_identity_retried_reports_lease_and_identity(self, store, names):
        """Both kinds at once (expired lease, running identity): the same facts again."""
        crashed = claim(store, names, owner="crashed", ttl=SHORT)
        store.checkpoint(crashed, json.dumps({"page": 5}))
        expire(store, names + "r")
        owner = Owner.new("next")
        first = store.acquire(names + "r", owner, LONG, identity="job-1")
        again = store.acquire(names + "r", owner, LONG, identity="job-1")
        assert (first.previous_owner_label, first.previous_fence) == ("crashed", crashed.fence)
        assert first.identity_state == "running" and first.checkpoints == {"page": 5}
        assert facts(again) == facts(first)
        assert store.identity_get(names + "r", "job-1").result is None  # the facts stay hidden


class TestRetention:
    def test_records_expire_after_the_retention(self, request, tmp_path, names):
        """With a tiny retention a done identity is forgotten and runs again."""
        for kind in ("memory", "redis", "sqlite", "postgres"):
            (tmp_path / kind).mkdir()
            store = make_store(kind, request, tmp_path / kind, retention=0.2)
            try:
                lease = claim(store, names + kind)
                store.effect_begin(lease, "k")
                store.effect_done(lease, "k", "1")
                store.release(lease, outcome="done", result="1")
                wait_for(
                    lambda s=store, k=kind: s.identity_get(names + k + "r", "job-1") is None,
                    10,
                    f"{kind} identity to expire",
                )
                again = claim(store, names + kind)
                assert not again.recovered and again.identity_state is None
                assert store.effect_begin(again, "k") == ("new", None, None)
            finally:
                store.close()


class TestWrongOwner:
    """A fence is a number, not a secret: the owner token must match too."""

    @staticmethod
    def impostor(store, lease):
        from celery_lease import Lease

        return Lease(
            resource=lease.resource,
            owner=Owner.new("intruder"),
            fence=lease.fence,
            acquired_at=lease.acquired_at,
            expires_at=lease.expires_at,
            ttl=lease.ttl,
            sent_monotonic=0,
            store=store,
            identity=lease.identity,
        )

    def test_a_wrong_owner_cannot_record_the_outcome(self, store, names):
        lease = claim(store, names)
        before = store.identity_get(names + "r", "job-1")
        assert store.release(self.impostor(store, lease), outcome="done", result="1") is False
        assert store.identity_get(names + "r", "job-1") == before
        store.verify(lease)

    def test_a_wrong_owner_cannot_complete_an_effect(self, store, names):
        lease = claim(store, names)
        store.effect_begin(lease, "charge")
        assert store.effect_done(self.impostor(store, lease), "charge", '"forged"') is False
        assert store.effect_done(lease, "charge", '"real"') is True
        assert store.effect_begin(lease, "charge") == ("done", lease.fence, '"real"')


def stored(store, names):
    """How many identity, ledger and checkpoint records of this test the store physically keeps
    (whatever their retention): read around the store's API, which hides expired records."""
    if isinstance(store, MemoryLeaseStore):
        tables = (store._ids, store._ledger, store._ckpts)
        return sum(1 for table in tables for key in table if key[0].startswith(names))
    if isinstance(store, RedisLeaseStore):
        count = 0
        with redis_admin(store) as raw:
            for shard in range(store.shards):
                for kind in ("ids", "ledger", "ckpt"):
                    key = store._keys(shard, kind)[0]
                    count += sum(1 for f in raw.hkeys(key) if f.decode().startswith(names))
        return count
    with store.engine.connect() as conn:
        return sum(
            conn.execute(
                sa.select(sa.func.count()).where(table.c.resource.startswith(names))
            ).scalar()
            for table in (store.tables["ids"], store.tables["ledger"], store.tables["ckpt"])
        )


def past_retention(store, names, resource, identity):
    """Wait (polling, bounded) until the store clock has passed the record's retention."""
    wait_for(
        lambda: store.identity_get(names + resource, identity) is None,
        5,
        f"{identity} to pass its retention",
    )


def finished_run(store, names, resource, identity):
    """One run that leaves an identity, a checkpoint and a ledger entry behind."""
    lease = claim(store, names, owner="worker", identity=identity, resource=resource)
    store.checkpoint(lease, json.dumps({"step": 1}))
    assert store.effect_begin(lease, "charge") == ("new", None, None)
    assert store.effect_done(lease, "charge", '"receipt"')
    assert store.release(lease, outcome="done", result='"ok"')
    return lease


class TestSweep:
    """sweep_expired removes what retention has passed, bounded per call, and nothing else."""

    def test_sweep_removes_only_records_past_retention(self, store, names):
        """Old runs' records go; fresh ones, leases and the fence sequence stay."""
        store.retention = 0.2
        old = [finished_run(store, names, f"r{i}", f"old-{i}") for i in range(3)]
        assert stored(store, names) == 9  # an identity, a checkpoint and a ledger entry each
        past_retention(store, names, "r2", "old-2")
        store.retention = 3600.0
        finished_run(store, names, "r0", "fresh")
        held = claim(store, names, owner="holder", identity="live", resource="r1")
        removed = 0
        while True:
            got = store.sweep_expired(limit=1000)
            removed += got
            if got == 0:
                break
        assert removed > 0
        assert stored(store, names) == 4  # exactly the fresh run's 3 and the live identity
        assert store.identity_get(names + "r0", "fresh").state == "done"
        store.verify(held)  # a live lease is untouched
        again = claim(store, names, owner="next", identity="old-2", resource="r2")
        assert again.fence > old[2].fence  # lease rows (and their fences) are never swept
        assert not again.recovered and again.identity_state is None
        assert store.effect_begin(again, "charge") == ("new", None, None)

    def test_sweep_is_bounded_per_call(self, store, names):
        """No call removes more than its limit; repeated calls finish the job."""
        store.retention = 0.2
        for i in range(4):
            finished_run(store, names, f"r{i}", f"job-{i}")
        total = stored(store, names)
        past_retention(store, names, "r3", "job-3")
        calls = []
        while True:
            got = store.sweep_expired(limit=3)
            assert 0 <= got <= 3
            calls.append(got)
            if got == 0:
                break
        assert len(calls) >= 3 and stored(store, names) == 0
        assert total >= sum(calls) > 0

    @pytest.mark.parametrize("limit", [0, -1, True, 1.5, 10**9])
    def test_a_bad_limit_is_refused(self, store, limit):
        """The limit is an integer 1..100000."""
        with pytest.raises(LeaseConfigError, match="sweep limit"):
            store.sweep_expired(limit=limit)


class TestIdentityRecords:
    def test_checkpoints_and_recent_effects_of_one_identity(self, store, names):
        """identity_records shows the last checkpoint and the effects, newest first, of this
        identity only (not another identity's, nor another resource's)."""
        lease = claim(store, names)
        assert store.identity_records(names + "r", "job-1") == IdentityRecords(None, None, [])
        store.effect_begin(lease, "charge")
        store.effect_done(lease, "charge", '{"id": 7}')
        store.effect_begin(lease, "email")  # begun, never known done
        store.checkpoint(lease, '{"page": 3}')
        other = claim(store, names, identity="job-2", resource="s")
        store.effect_begin(other, "charge")
        store.release(lease, outcome="done", result="1")

        records = store.identity_records(names + "r", "job-1")
        assert records.checkpoints == '{"page": 3}' and records.checkpoint_fence == lease.fence
        by_key = {e.key: e for e in records.effects}
        assert set(by_key) == {"charge", "email"}
        assert (by_key["charge"].state, by_key["charge"].receipt) == ("done", '{"id": 7}')
        assert (by_key["email"].state, by_key["email"].receipt) == ("intent", None)
        assert {e.fence for e in records.effects} == {lease.fence}
        assert records.effects[0].expires_at >= records.effects[1].expires_at
        assert store.identity_records(names + "r", "job-1", limit=1).effects == records.effects[:1]
        assert store.identity_records(names + "r", "job-2") == IdentityRecords(None, None, [])
        assert [e.key for e in store.identity_records(names + "s", "job-2").effects] == ["charge"]
        with pytest.raises(LeaseConfigError):
            store.identity_records(names + "r", "job-1", limit=0)
        with pytest.raises(LeaseConfigError):
            store.identity_records(names + "r", "job*")
