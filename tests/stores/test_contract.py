"""The LeaseStore contract, asserted against every store (memory, Redis, SQLite, PostgreSQL).

Each test states one invariant from ``celery_lease.stores.protocol``. Expiry is driven by short ttls
and polled with a deadline (the real stores' clocks are their servers'), never by sleeping on
hope.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta, timezone

import pytest
import time_machine

from celery_lease import Lease, LeaseBusyError, LeaseConfigError, LeaseLostError, Owner
from celery_lease.stores import MemoryLeaseStore
from celery_lease.stores.base import BaseLeaseStore
from tests.conftest import make_store
from tests.tooling.servers import wait_for

LONG = 30.0
SHORT = 0.05


def snapshot(store: BaseLeaseStore, resource: str) -> tuple[object, ...] | None:
    """The stored state of a resource, minus the time-dependent ``expires_in``."""
    info = store.get(resource)
    if info is None:
        return None
    return (info.owner_label, info.fence, info.acquired_at, info.expires_at)


def expire(store: BaseLeaseStore, resource: str) -> None:
    """Wait (polling, bounded) until the resource's lease has expired on the store clock."""
    wait_for(lambda: store.get(resource).expired, 5, f"{resource} to expire")


class TestAcquire:
    def test_claim_returns_a_fenced_lease_timed_by_the_store(self, store, names):
        """A claim returns the owner's lease with a positive fence and aware UTC times."""
        owner = Owner.new("worker-1:pid-7")
        lease = store.acquire(names + "a", owner, LONG)
        assert lease.resource == names + "a"
        assert lease.owner == owner and lease.owner_label == "worker-1:pid-7"
        assert isinstance(lease.fence, int) and lease.fence > 0
        assert lease.acquired_at.tzinfo is timezone.utc
        held = lease.expires_at - lease.acquired_at
        assert timedelta(seconds=LONG - 0.01) <= held <= timedelta(seconds=LONG + 0.01)
        assert not lease.recovered and lease.previous_fence is None

    def test_only_one_owner_wins(self, store, names):
        """A second owner's claim on a live lease fails and names the holder and its fence."""
        first = store.acquire(names + "a", Owner.new("first"), LONG)
        with pytest.raises(LeaseBusyError) as caught:
            store.acquire(names + "a", Owner.new("second"), LONG)
        err = caught.value
        assert err.resource == names + "a"
        assert err.holder_label == "first" and err.fence == first.fence
        assert 0 < err.expires_in <= LONG
        assert "first" in str(err) and str(first.fence) in str(err)
        assert snapshot(store, names + "a")[1] == first.fence

    def test_claims_on_different_resources_are_independent(self, store, names):
        """Holding one resource does not block another."""
        a = store.acquire(names + "a", Owner.new(), LONG)
        b = store.acquire(names + "b", Owner.new(), LONG)
        assert a.resource != b.resource

    def test_retried_claim_with_the_same_owner_returns_the_same_lease(self, store, names):
        """A claim repeated after a lost reply (same owner token) is not a second claim."""
        owner = Owner.new()
        first = store.acquire(names + "a", owner, LONG)
        again = store.acquire(names + "a", owner, LONG)
        assert again.fence == first.fence

    def test_the_same_claim_after_its_lease_ran_out_is_a_new_claim(self, store, names):
        """Sent again once the lease ran out, the same owner's claim gets a new fence."""
        owner = Owner.new("same")
        first = store.acquire(names + "a", owner, SHORT)
        expire(store, names + "a")
        again = store.acquire(names + "a", owner, LONG)
        assert again.fence > first.fence and again.previous_fence == first.fence

    def test_fences_strictly_increase_across_release_and_reclaim(self, store, names):
        """Release never resets the fence: each new claim gets a greater one."""
        fences = []
        for _ in range(5):
            lease = store.acquire(names + "a", Owner.new(), LONG)
            fences.append(lease.fence)
            assert store.release(lease)
        assert fences == sorted(set(fences)) and len(fences) == 5

    def test_expired_lease_is_claimable_and_reports_the_previous_owner(self, store, names):
        """Taking over an expired, never released lease reports its owner and fence."""
        old = store.acquire(names + "a", Owner.new("crashed-worker"), SHORT)
        expire(store, names + "a")
        new = store.acquire(names + "a", Owner.new("next-worker"), LONG)
        assert new.fence > old.fence
        assert new.recovered
        assert new.previous_owner_label == "crashed-worker"
        assert new.previous_fence == old.fence

    def test_claim_after_a_release_is_not_a_recovery(self, store, names):
        """A cleanly released lease leaves nothing to reconcile for the next owner."""
        old = store.acquire(names + "a", Owner.new("clean"), LONG)
        store.release(old)
        new = store.acquire(names + "a", Owner.new(), LONG)
        assert not new.recovered and new.previous_owner_label is None


class TestRenew:
    def test_renew_moves_expiry_forward_from_store_now(self, store, names):
        """Renewal resets expiry to store-now + ttl and keeps the fence."""
        lease = store.acquire(names + "a", Owner.new(), 1.0)
        before = lease.expires_at
        assert store.renew(lease, LONG) is lease
        assert lease.expires_at > before + timedelta(seconds=LONG - 1.5)
        assert lease.ttl == LONG
        stored = snapshot(store, names + "a")
        assert stored[1:] == (lease.fence, lease.acquired_at, lease.expires_at)

    def test_non_owner_cannot_renew_and_nothing_changes(self, store, names):
        """A different owner token holding the same fence number is refused."""
        lease = store.acquire(names + "a", Owner.new("holder"), LONG)
        before = snapshot(store, names + "a")
        forged = Lease(
            resource=lease.resource,
            owner=Owner.new("intruder"),
            fence=lease.fence,
            acquired_at=lease.acquired_at,
            expires_at=lease.expires_at,
            ttl=LONG,
            sent_monotonic=time.monotonic(),
            store=store,
        )
        with pytest.raises(LeaseLostError) as caught:
            store.renew(forged)
        assert caught.value.reason == "taken_over" and caught.value.holder_label == "holder"
        assert not store.release(forged)
        with pytest.raises(LeaseLostError):
            store.verify(forged)
        assert snapshot(store, names + "a") == before

    def test_stale_fence_cannot_renew_or_release(self, store, names):
        """The previous holder (older fence) is refused after a takeover; state unchanged."""
        old = store.acquire(names + "a", Owner.new("old"), SHORT)
        expire(store, names + "a")
        new = store.acquire(names + "a", Owner.new("new"), LONG)
        before = snapshot(store, names + "a")
        with pytest.raises(LeaseLostError) as caught:
            store.renew(old, LONG)
        assert caught.value.fence == old.fence
        assert caught.value.holder_label == "new"
        assert "new" in str(caught.value) and str(old.fence) in str(caught.value)
        assert old.lost is caught.value
        with pytest.raises(LeaseLostError):
            old.check()
        assert store.release(old) is False
        assert snapshot(store, names + "a") == before
        store.verify(new)

    def test_expired_lease_cannot_be_renewed_even_if_nobody_took_it(self, store, names):
        """Its owner has already self-fenced, so renewal must not revive it."""
        lease = store.acquire(names + "a", Owner.new(), SHORT)
        expire(store, names + "a")
        with pytest.raises(LeaseLostError) as caught:
            store.renew(lease, LONG)
        assert caught.value.reason == "expired"
        assert store.get(names + "a").expired

    def test_renew_many_renews_all_in_one_call_and_reports_losses(self, store, names):
        """Live leases are renewed; lost ones come back as LeaseLostError, aligned by index."""
        live = [store.acquire(f"{names}{i}", Owner.new(), 1.0) for i in range(3)]
        gone = store.acquire(names + "gone", Owner.new(), LONG)
        store.release(gone)
        results = store.renew_many([live[0], gone, live[1], live[2]], LONG)
        assert results[0] is None and results[2] is None and results[3] is None
        assert isinstance(results[1], LeaseLostError) and results[1].reason == "released"
        for lease in live:
            assert lease.expires_at - lease.acquired_at > timedelta(seconds=LONG - 1)
        assert store.renew_many([]) == []

    def test_renew_many_tells_apart_two_handles_on_one_resource(self, store, names):
        """A stale and a live handle on the same resource get different answers."""
        old = store.acquire(names + "a", Owner.new("old"), SHORT)
        expire(store, names + "a")
        new = store.acquire(names + "a", Owner.new("new"), LONG)
        results = store.renew_many([old, new], LONG)
        assert isinstance(results[0], LeaseLostError) and results[1] is None

    def test_renewal_refreshes_the_self_fence_deadline(self, store, names):
        """check() is local; a renewal sent later moves its deadline later."""
        lease = store.acquire(names + "a", Owner.new(), 1.0)
        first = lease.deadline
        store.renew(lease)
        assert lease.deadline > first
        lease.check()


class TestRelease:
    def test_release_frees_the_resource(self, store, names):
        """After release the resource is free and get() shows no lease."""
        lease = store.acquire(names + "a", Owner.new(), LONG)
        assert store.release(lease) is True
        assert store.get(names + "a") is None
        store.acquire(names + "a", Owner.new(), LONG)

    def test_release_twice_is_a_harmless_no_op(self, store, names):
        """The second release reports False and changes nothing."""
        lease = store.acquire(names + "a", Owner.new(), LONG)
        assert store.release(lease) is True
        assert store.release(lease) is False

    def test_release_after_takeover_keeps_the_new_owners_lease(self, store, names):
        """A retried release of the expired owner never frees the new owner's lease."""
        old = store.acquire(names + "a", Owner.new("old"), SHORT)
        expire(store, names + "a")
        new = store.acquire(names + "a", Owner.new("new"), LONG)
        before = snapshot(store, names + "a")
        assert store.release(old) is False
        assert snapshot(store, names + "a") == before
        store.verify(new)


class TestReadAndAdmin:
    def test_get_reports_holder_without_the_token(self, store, names):
        """get() shows label, fence and times from the store clock, never the token."""
        owner = Owner.new("reader")
        lease = store.acquire(names + "a", owner, LONG)
        info = store.get(names + "a")
        assert (info.owner_label, info.fence, info.expires_at) == (
            "reader",
            lease.fence,
            lease.expires_at,
        )
        assert 0 < info.expires_in <= LONG and not info.expired
        assert owner.token not in repr(info) and owner.token not in repr(lease)
        assert store.get(names + "never") is None

    def test_list_pages_by_expiry_with_a_cursor(self, store, names):
        """list() walks every lease under a prefix, oldest expiry first, page by page."""
        for i in range(7):
            store.acquire(f"{names}{i}", Owner.new(), 10.0 + i)
        store.acquire(unique_other := names[:-1] + "-other/x", Owner.new(), LONG)
        seen, cursor = [], None
        while True:
            page = store.list(prefix=names, limit=3, cursor=cursor)
            assert len(page.leases) <= 3
            seen += [info.resource for info in page.leases]
            cursor = page.cursor
            if cursor is None:
                break
        assert seen == [f"{names}{i}" for i in range(7)]
        assert unique_other not in seen

    def test_list_expired_only_returns_just_the_expired(self, store, names):
        """The expiry index finds exactly the expired, never released leases."""
        store.acquire(names + "live", Owner.new(), LONG)
        store.acquire(names + "dead", Owner.new("crashed"), SHORT)
        released = store.acquire(names + "done", Owner.new(), SHORT)
        store.release(released)
        expire(store, names + "dead")
        page = store.list(prefix=names, expired_only=True)
        assert [(i.resource, i.owner_label) for i in page.leases] == [(names + "dead", "crashed")]
        assert page.leases[0].expired and page.cursor is None
        assert {i.resource for i in store.list(prefix=names).leases} == {
            names + "live",
            names + "dead",
        }

    def test_force_release_evicts_and_bumps_the_fence(self, store, names):
        """The evicted holder can neither renew nor release, and the next fence skips ahead."""
        held = store.acquire(names + "a", Owner.new("stuck"), LONG)
        evicted = store.force_release(names + "a")
        assert evicted.owner_label == "stuck" and evicted.fence == held.fence
        assert store.get(names + "a") is None
        with pytest.raises(LeaseLostError):
            store.renew(held)
        assert store.release(held) is False
        nxt = store.acquire(names + "a", Owner.new(), LONG)
        assert nxt.fence >= held.fence + 2
        assert store.force_release(names + "none") is None

    def test_highest_fence_outlives_the_lease(self, store, names):
        """highest_fence names the newest fence granted, held or released or force-released
        (its bump counted), and the next claim's fence is above it; None before any claim."""
        resource = names + "a"
        assert store.highest_fence(resource) is None
        first = store.acquire(resource, Owner.new(), LONG)
        assert store.highest_fence(resource) == first.fence
        store.release(first)
        assert store.get(resource) is None and store.highest_fence(resource) == first.fence
        second = store.acquire(resource, Owner.new(), LONG)
        store.force_release(resource)
        bumped = store.highest_fence(resource)
        assert bumped is not None and bumped > second.fence
        assert store.acquire(resource, Owner.new(), LONG).fence > bumped

    def test_force_release_warns_on_the_backend_logger(self, store, names, request, caplog):
        """The force-release warning is on the backend's own logger (as before stores became
        packages), so logging set up for ``celery_lease.stores.redis`` / ``.sql`` still sees it;
        the memory store logs nothing."""
        kind = request.node.callspec.params["store"]
        backend = "memory" if kind == "memory" else "redis" if kind.startswith("redis") else "sql"
        logger = None if backend == "memory" else f"celery_lease.stores.{backend}"
        held = store.acquire(names + "a", Owner.new("stuck"), LONG)
        with caplog.at_level("WARNING", logger="celery_lease"):
            store.force_release(names + "a")
        lines = [
            (r.name, r.levelname, r.getMessage())
            for r in caplog.records
            if r.getMessage().startswith("force-released lease on")
        ]
        if logger is None:
            assert lines == []
        else:
            message = f"force-released lease on {names + 'a'!r} held by 'stuck' with fence "
            message += str(held.fence)
            assert lines == [(logger, "WARNING", message)]

    def test_the_evicted_owner_learns_it_was_force_released(self, store, names):
        """Renew and verify say force_released (not released) until the next claim."""

        def loss(call, lease):
            copy = Lease(  # a fresh handle: a handle keeps the first loss it saw
                resource=lease.resource,
                owner=lease.owner,
                fence=lease.fence,
                acquired_at=lease.acquired_at,
                expires_at=lease.expires_at,
                ttl=lease.ttl,
                sent_monotonic=time.monotonic(),
                store=store,
            )
            with pytest.raises(LeaseLostError) as caught:
                call(copy)
            return caught.value.reason, caught.value.holder_label

        held = store.acquire(names + "a", Owner.new("stuck"), LONG)
        store.force_release(names + "a")
        assert loss(store.renew, held) == ("force_released", None)
        assert loss(store.verify, held) == ("force_released", None)
        released = store.acquire(names + "b", Owner.new("done"), LONG)
        store.release(released)
        assert loss(store.renew, released) == ("released", None)  # an ordinary release
        nxt = store.acquire(names + "a", Owner.new("next"), LONG)
        assert loss(store.verify, held) == ("taken_over", "next")
        store.release(nxt)
        assert loss(store.verify, held) == ("released", None)  # a later claim ends the mark

    def test_a_takeover_whose_lease_expired_too_is_not_called_the_holder(self, store, names):
        """The frozen owner's renewal, verify and checkpoint after its successor's lease ran
        out as well: "taken over by X (fence N), whose lease has since expired", no
        holder_label; while the successor is live (the control): "now held by X"."""
        frozen = store.acquire(names + "a", Owner.new("frozen"), SHORT)
        expire(store, names + "a")
        successor = store.acquire(names + "a", Owner.new("successor"), SHORT)
        expire(store, names + "a")
        for call in (store.renew, store.verify):
            with pytest.raises(LeaseLostError) as caught:
                call(frozen)
            error = caught.value
            assert (error.reason, error.holder_label) == ("taken_over", None), str(error)
            assert (
                f"taken over by 'successor' (fence {successor.fence}), whose lease has since "
                "expired"
            ) in str(error)
            assert "now held by" not in str(error)
            again = pickle.loads(pickle.dumps(error))
            assert (str(again), again.holder_label) == (str(error), None)
        live = store.acquire(names + "b", Owner.new("frozen"), SHORT)
        expire(store, names + "b")
        newer = store.acquire(names + "b", Owner.new("successor"), LONG)
        with pytest.raises(LeaseLostError) as caught:
            store.renew(live)
        assert caught.value.holder_label == "successor"
        assert f"now held by 'successor' with fence {newer.fence}" in str(caught.value)

    def test_health_check_answers(self, store):
        """check_health() returns a list of warnings (possibly empty) from a reachable store."""
        assert isinstance(store.check_health(), list)


class TestBadInput:
    @pytest.mark.parametrize(
        "resource",
        ["", "a b", "x{y}", "a*", "q?", "[r]", "é", "nul\x00", "x" * 201, None, 42, b"bytes"],
    )
    def test_bad_resource_names_are_refused_before_any_io(self, store, resource):
        """Names outside the documented set raise LeaseConfigError naming value and rule."""
        with pytest.raises(LeaseConfigError) as caught:
            store.acquire(resource, Owner.new(), LONG)
        assert "resource" in str(caught.value) and "A-Z" in str(caught.value)

    @pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), 10_000, "5", None, True])
    def test_bad_ttl_is_refused(self, store, names, ttl):
        """ttl must be a positive number of seconds no larger than max_ttl."""
        with pytest.raises(LeaseConfigError) as caught:
            store.acquire(names + "a", Owner.new(), ttl)
        assert "ttl" in str(caught.value)
        assert store.get(names + "a") is None

    def test_owner_must_be_an_owner(self, store, names):
        """A bare string is not an owner (a token must be secret and random)."""
        with pytest.raises(LeaseConfigError, match=r"Owner\.new"):
            store.acquire(names + "a", "me", LONG)

    def test_bad_list_arguments(self, store):
        """Cursor, limit and prefix are checked."""
        with pytest.raises(LeaseConfigError, match="cursor"):
            store.list(cursor="garbage")
        with pytest.raises(LeaseConfigError, match="limit"):
            store.list(limit=0)
        with pytest.raises(LeaseConfigError, match="prefix"):
            store.list(prefix="a b")


class TestClocks:
    @pytest.mark.parametrize("shift_hours", [1, -1])
    def test_worker_wall_clock_shift_changes_nothing(self, request, tmp_path, names, shift_hours):
        """A worker wall clock off by an hour neither expires nor extends a lease."""
        for kind in ("redis", "sqlite", "postgres"):
            store = make_store(kind, request, tmp_path)
            try:
                lease = store.acquire(f"{names}{kind}", Owner.new("w"), LONG)
                before = snapshot(store, lease.resource)
                with time_machine.travel(timedelta(hours=shift_hours), tick=True):
                    lease.check()  # the monotonic self-fence is untouched by wall time
                    with pytest.raises(LeaseBusyError):
                        store.acquire(lease.resource, Owner.new(), LONG)
                    info = store.get(lease.resource)
                    assert not info.expired and 0 < info.expires_in <= LONG
                    store.renew(lease)
                    assert abs((lease.expires_at - before[3]).total_seconds()) < 5
                    store.verify(lease)
            finally:
                store.close()

    def test_memory_store_runs_on_its_injected_clock(self, names):
        """The memory store's time moves only when its clock does (for users' tests)."""
        now = [1_000_000.0]
        store = MemoryLeaseStore(clock=lambda: now[0])
        lease = store.acquire(names + "a", Owner.new("first"), 10)
        with pytest.raises(LeaseBusyError):
            store.acquire(names + "a", Owner.new(), 10)
        now[0] += 10.001
        assert store.get(names + "a").expired
        taken = store.acquire(names + "a", Owner.new(), 10)
        assert taken.previous_fence == lease.fence


def test_lease_repr_and_pickled_errors_hide_the_token(store, names):
    """Neither the lease's repr nor its errors carry the owner token."""
    owner = Owner.new("x")
    lease = store.acquire(names + "a", owner, SHORT)
    expire(store, names + "a")
    store.acquire(names + "a", Owner.new(), LONG)
    with pytest.raises(LeaseLostError) as caught:
        store.renew(lease)
    blob = pickle.dumps(caught.value)
    assert owner.token.encode() not in blob
    assert owner.token not in repr(lease) + str(caught.value) + repr(owner)
