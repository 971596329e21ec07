"""Stateful property tests: each store answers every random operation as a reference model does.

A Hypothesis ``RuleBasedStateMachine`` drives one real store (memory, Redis, SQLite, PostgreSQL)
through random sequences of claims, short claims left to expire, renewals, releases,
verifications, forced releases and reads on three resources, and checks every answer against a
small model: per resource, the holder (owner token, label, fence, expired or not) and the floor
every next fence must exceed. Fences are compared by order only (the Redis store issues
``max(last + 1, server time in us)``, not 1, 2, 3).

Expiry is real: a short claim (2 ms) is polled, bounded, until the store itself reports it
expired; long claims (30 s) never expire within a run. Each run (example) uses fresh resource
names, so runs share one store per test.

Negative control: the same machine over deliberately broken memory stores (no fence bump
on force_release, a release that ignores the fence, renewal of an expired lease, a takeover that
forgets the previous owner) must fail.

Sizing: the default profile ``celery-lease-ci`` is CI-sized; setting
``CELERY_LEASE_HYPOTHESIS_EXAMPLES`` (and optionally ``CELERY_LEASE_HYPOTHESIS_STEPS``) selects
``celery-lease-soak`` with those sizes. The seed is printed; ``CELERY_LEASE_HYPOTHESIS_SEED``
replays it. No example database is written (``database=None``).
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from celery_lease import Lease, LeaseBusyError, LeaseLostError, Owner
from celery_lease.stores import MemoryLeaseStore
from tests.conftest import STORE_KINDS, make_store, unique

LONG = 30.0
SHORT = 0.002
EXPIRY_WAIT = 5.0
RESOURCES = range(3)

_COMMON = {
    "deadline": None,
    "database": None,  # nothing written under .hypothesis/ in the repo
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
SOAK_EXAMPLES = int(os.environ.get("CELERY_LEASE_HYPOTHESIS_EXAMPLES") or 0)
settings.register_profile("celery-lease-ci", max_examples=100, stateful_step_count=30, **_COMMON)
settings.register_profile(
    "celery-lease-soak",
    max_examples=max(SOAK_EXAMPLES, 1),
    stateful_step_count=int(os.environ.get("CELERY_LEASE_HYPOTHESIS_STEPS") or 100),
    **_COMMON,
)
PROFILE = "celery-lease-soak" if SOAK_EXAMPLES else "celery-lease-ci"


@dataclass
class Held:
    """The model's view of a resource's lease (live, or expired and never released)."""

    token: str
    label: str
    fence: int
    expired: bool
    #: (label, fence) of the owner its claim took over, reported again by a retried claim
    previous: tuple[str | None, int | None] = (None, None)


class StoreModel:
    """The reference model: what each resource's lease is and which fences may come next."""

    def __init__(self) -> None:
        self.holder: dict[int, Held | None] = dict.fromkeys(RESOURCES)
        #: every next fence must be greater than this (None: never claimed, anything goes)
        self.floor: dict[int, int | None] = dict.fromkeys(RESOURCES)
        self.fences: dict[int, list[int]] = {r: [] for r in RESOURCES}
        #: the fence force_release evicted, until the fence moves on (a claim, another eviction)
        self.forced: dict[int, int | None] = dict.fromkeys(RESOURCES)

    def live(self, r: int) -> Held | None:
        held = self.holder[r]
        return held if held is not None and not held.expired else None

    def is_current(self, r: int, lease: Lease) -> bool:
        held = self.holder[r]
        return held is not None and (held.token, held.fence) == (lease.owner.token, lease.fence)

    def lost_reason(self, r: int, lease: Lease) -> tuple[str, str | None]:
        """Why a renew/verify of ``lease`` must fail (reason, holder label); ("", None) if not."""
        held = self.holder[r]
        if held is None:
            return ("force_released" if self.forced[r] == lease.fence else "released"), None
        if (held.token, held.fence) != (lease.owner.token, lease.fence):
            # a successor whose lease expired too is named in the message, not as the holder
            return "taken_over", None if held.expired else held.label
        if held.expired:
            return "expired", None
        return "", None

    def claimed(self, r: int, lease: Lease) -> None:
        self.holder[r] = Held(
            lease.owner.token,
            lease.owner_label,
            lease.fence,
            expired=False,
            previous=(lease.previous_owner_label, lease.previous_fence),
        )
        self.floor[r] = lease.fence
        self.fences[r].append(lease.fence)
        self.forced[r] = None


class LeaseMachine(RuleBasedStateMachine):
    """One run: fresh resource names on the shared store, a fresh model."""

    store: Any = None  # set per test by machine_for()

    owners = Bundle("owners")
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.prefix = unique("prop") + "/"
        self.model = StoreModel()
        #: one handle per (resource, owner token, fence) ever issued in this run
        self.issued: dict[tuple[int, str, int], Lease] = {}
        self.labels = 0

    def name(self, r: int) -> str:
        return f"{self.prefix}r{r}"

    # -- owners ---------------------------------------------------------------------------
    @rule(target=owners)
    def new_owner(self) -> Owner:
        self.labels += 1
        return Owner.new(f"owner-{self.labels}")

    # -- claims ---------------------------------------------------------------------------
    def _claim(self, r: int, owner: Owner, ttl: float) -> Lease | None:
        """Claim and check the answer against the model; None when the model says busy."""
        live = self.model.live(r)
        if live is not None and live.token != owner.token:
            with pytest.raises(LeaseBusyError) as caught:
                self.store.acquire(self.name(r), owner, ttl)
            err = caught.value
            assert err.resource == self.name(r)
            assert (err.holder_label, err.fence) == (live.label, live.fence)
            assert err.expires_in > 0
            return None
        lease = self.store.acquire(self.name(r), owner, ttl)
        assert lease.resource == self.name(r) and lease.owner == owner
        if live is not None:  # the same owner's claim retried: the same lease, no new fence,
            assert lease.fence == live.fence  # and what the first claim recovered, again
            assert (lease.previous_owner_label, lease.previous_fence) == live.previous
            return lease
        floor = self.model.floor[r]
        assert floor is None or lease.fence > floor, f"fence {lease.fence} not above {floor}"
        expired = self.model.holder[r]
        if expired is not None:  # takeover of an expired, never released lease
            previous = (lease.previous_owner_label, lease.previous_fence)
            assert previous == (expired.label, expired.fence)
        else:
            assert not lease.recovered and lease.previous_owner_label is None
        self.model.claimed(r, lease)
        return lease

    def _keep(self, r: int, lease: Lease | None) -> Any:
        if lease is None:
            return multiple()
        self.issued.setdefault((r, lease.owner.token, lease.fence), lease)
        return multiple((r, lease))

    @rule(target=handles, r=st.sampled_from(RESOURCES), owner=owners)
    def acquire(self, r: int, owner: Owner) -> Any:
        return self._keep(r, self._claim(r, owner, LONG))

    @rule(target=handles, r=st.sampled_from(RESOURCES), owner=owners)
    def acquire_then_expire(self, r: int, owner: Owner) -> Any:
        """A claim whose owner crashes: it expires on the store clock, never released."""
        was_live = self.model.live(r) is not None
        lease = self._claim(r, owner, SHORT)
        if lease is not None and not was_live:
            deadline = time.monotonic() + EXPIRY_WAIT
            while not self.store.get(self.name(r)).expired:
                assert time.monotonic() < deadline, f"{self.name(r)} did not expire"
                time.sleep(0.001)
            held = self.model.holder[r]
            assert held is not None
            held.expired = True
        return self._keep(r, lease)

    # -- the owner's operations -----------------------------------------------------------
    def _refused(self, r: int, lease: Lease, call: Any) -> None:
        """``call`` must raise LeaseLostError for the model's reason, and mark the lease lost.

        A handle keeps the first loss recorded on it (``Lease.mark_lost``), so a handle already
        found lost gets that same error again whatever happened since.
        """
        reason, label = self.model.lost_reason(r, lease)
        known = lease.lost
        with pytest.raises(LeaseLostError) as caught:
            call(lease)
        err = caught.value
        assert lease.lost is err
        if known is not None:
            assert err is known
            return
        assert (err.resource, err.fence, err.reason) == (self.name(r), lease.fence, reason)
        if reason == "taken_over":
            assert err.holder_label == label

    @rule(handle=handles)
    def renew(self, handle: tuple[int, Lease]) -> None:
        r, lease = handle
        if self.model.lost_reason(r, lease)[0]:
            self._refused(r, lease, lambda h: self.store.renew(h, LONG))
        else:
            assert self.store.renew(lease, LONG) is lease
            assert lease.ttl == LONG

    @rule(handle=handles)
    def verify(self, handle: tuple[int, Lease]) -> None:
        r, lease = handle
        if self.model.lost_reason(r, lease)[0]:
            self._refused(r, lease, self.store.verify)
        else:
            self.store.verify(lease)

    @rule(handle=handles)
    def release(self, handle: tuple[int, Lease]) -> None:
        """True only for the current token and fence, expired or not; then the lease is gone."""
        r, lease = handle
        expected = self.model.is_current(r, lease)
        assert self.store.release(lease) is expected
        if expected:
            self.model.holder[r] = None

    @rule(handle=consumes(handles))
    def release_and_forget(self, handle: tuple[int, Lease]) -> None:
        """The same as release, but the handle leaves the bundle (keeps it from growing)."""
        self.release(handle)

    # -- administration and reads ---------------------------------------------------------
    @rule(r=st.sampled_from(RESOURCES))
    def force_release(self, r: int) -> None:
        held = self.model.holder[r]
        evicted = self.store.force_release(self.name(r))
        if held is None:
            assert evicted is None
            self.model.forced[r] = None  # the fence moved on again: the mark ends
        else:
            assert (evicted.owner_label, evicted.fence) == (held.label, held.fence)
            self.model.forced[r] = held.fence
        self.model.holder[r] = None
        if self.model.floor[r] is not None:
            self.model.floor[r] += 1  # the next claim's fence skips at least one number

    @rule(r=st.sampled_from(RESOURCES))
    def exclusion(self, r: int) -> None:
        """Ask the store about every (owner, fence) ever issued here: only the model's is live.

        Each is checked through a fresh twin of its handle, so the handles themselves keep no
        recorded loss and later renew/verify steps still see the store's own reasons.
        """
        live = self.model.live(r)
        passed = set()
        for (hr, token, fence), lease in self.issued.items():
            if hr != r:
                continue
            reason, label = self.model.lost_reason(r, lease)
            try:
                self.store.verify(twin(lease))
            except LeaseLostError as err:
                found: tuple[Any, ...] = (err.reason, err.fence, err.holder_label)
            else:
                found = ("", fence, None)
                passed.add((token, fence))
            wanted = (reason, fence, label)
            assert found == wanted, f"{self.name(r)} fence {fence}: store {found}, model {wanted}"
        assert len(passed) <= 1, f"{len(passed)} live owners on {self.name(r)}"
        assert passed == ({(live.token, live.fence)} if live else set())

    @invariant()
    def get_matches_the_model(self) -> None:
        for r in RESOURCES:
            info = self.store.get(self.name(r))
            held = self.model.holder[r]
            if held is None:
                assert info is None, f"{self.name(r)}: store has {info}, model has nothing"
                continue
            assert info is not None, f"{self.name(r)}: store has nothing, model has {held}"
            assert (info.owner_label, info.fence, info.expired) == (
                held.label,
                held.fence,
                held.expired,
            ), f"{self.name(r)}: store has {info}, model has {held}"
            if not held.expired:
                assert 0 < info.expires_in <= LONG

    @invariant()
    def fences_strictly_increase(self) -> None:
        for r in RESOURCES:
            fences = self.model.fences[r]
            assert all(a < b for a, b in itertools.pairwise(fences)), fences

    def teardown(self) -> None:
        for r in RESOURCES:  # leave nothing live behind on the shared store
            self.store.force_release(self.name(r))


def twin(lease: Lease) -> Lease:
    """A fresh handle on the same lease (same owner token and fence), with no loss recorded."""
    return Lease(
        resource=lease.resource,
        owner=lease.owner,
        fence=lease.fence,
        acquired_at=lease.acquired_at,
        expires_at=lease.expires_at,
        ttl=lease.ttl,
        sent_monotonic=time.monotonic(),
        store=lease.store,
    )


def machine_for(store: Any, seed_value: int) -> type[LeaseMachine]:
    """The state machine bound to one store, seeded."""
    machine = type(f"LeaseMachineOn{type(store).__name__}", (LeaseMachine,), {"store": store})
    return seed(seed_value)(machine)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_store_matches_the_model(kind, request, tmp_path):
    """Random operation sequences on the store agree with the reference model at every step."""
    chosen = settings.get_profile(PROFILE)
    seed_value = int(os.environ.get("CELERY_LEASE_HYPOTHESIS_SEED") or random.randrange(2**32))
    print(
        f"hypothesis stateful {kind}: profile={PROFILE} seed={seed_value} "
        f"max_examples={chosen.max_examples} steps={chosen.stateful_step_count} "
        f"(CELERY_LEASE_HYPOTHESIS_SEED={seed_value} replays it)"
    )
    store = make_store(kind, request, tmp_path)
    try:
        run_state_machine_as_test(machine_for(store, seed_value), settings=chosen)
    finally:
        store.close()


class _NoFenceBump(MemoryLeaseStore):
    """Broken: force_release leaves the fence sequence where it was."""

    def force_release(self, resource: str) -> Any:
        with self._lock:
            current = self._leases.pop(resource, None)
            return None if current is None else current.info(resource, self._now_us())


class _TokenOnlyRelease(MemoryLeaseStore):
    """Broken: release checks the owner token but not the fence."""

    def release(self, lease: Lease) -> bool:
        with self._lock:
            current = self._leases.get(lease.resource)
            if current is None or current.token != lease.owner.token:
                return False
            del self._leases[lease.resource]
            return True


class _RenewsExpired(MemoryLeaseStore):
    """Broken: an expired lease nobody took over can still be renewed and verified."""

    def _live_record(self, lease: Lease, now: int) -> Any:
        current = self._leases.get(lease.resource)
        if current is not None and (current.token, current.fence) == (
            lease.owner.token,
            lease.fence,
        ):
            return current
        return super()._live_record(lease, now)


class _ForgetsPreviousOwner(MemoryLeaseStore):
    """Broken: a takeover of an expired lease does not report its owner."""

    def acquire(self, resource: str, owner: Owner, ttl: float) -> Lease:
        lease = super().acquire(resource, owner, ttl)
        lease.previous_owner_label = lease.previous_fence = None
        return lease


@pytest.mark.parametrize(
    "broken", [_NoFenceBump, _TokenOnlyRelease, _RenewsExpired, _ForgetsPreviousOwner]
)
def test_the_machine_catches_a_broken_store(broken):
    """Negative control: the same machine over a deliberately broken memory store must fail."""
    quick = settings(
        settings.get_profile("celery-lease-ci"),
        phases=[Phase.generate],  # no shrinking: finding the bug is the point, not its size
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
    )
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        run_state_machine_as_test(machine_for(broken(), 1), settings=quick)
