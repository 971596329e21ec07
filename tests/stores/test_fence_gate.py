"""FenceGate over every store: the newest fence wins, stale ones are refused, atomically."""

from __future__ import annotations

import threading

import pytest

from celery_lease import FenceGate, LeaseConfigError, Owner, StaleFenceError
from celery_lease._events import METRICS


class TestFenceGate:
    def test_admits_equal_or_newer_and_refuses_older(self, store, names):
        """A fence >= the highest admitted passes; an older one raises, naming both fences."""
        gate = FenceGate(store=store)
        key = names + "invoice-17"
        assert gate.highest(key) is None
        assert gate.admit(key, 5) == 5
        assert gate.admit(key, 5) == 5  # the same owner writes again
        assert gate.admit(key, 9) == 9
        before = METRICS["celery_lease_stale_fence_rejections_total"]
        with pytest.raises(StaleFenceError) as caught:
            gate.admit(key, 7)
        assert (caught.value.key, caught.value.fence, caught.value.highest) == (key, 7, 9)
        assert "7" in str(caught.value) and "9" in str(caught.value)
        assert gate.highest(key) == 9
        assert METRICS["celery_lease_stale_fence_rejections_total"] == before + 1

    def test_keys_are_independent_and_a_lease_can_be_admitted(self, store, names):
        """Each key has its own highest fence; a Lease stands for its fence."""
        gate = FenceGate(store=store)
        lease = store.acquire(names + "r", Owner.new(), 30)
        assert gate.admit(names + "a", lease) == lease.fence
        assert gate.admit(names + "b", 1) == 1
        with pytest.raises(StaleFenceError):
            gate.admit(names + "a", lease.fence - 1)

    def test_bad_input(self, store, names):
        gate = FenceGate(store=store)
        with pytest.raises(LeaseConfigError):
            gate.admit("bad key", 1)
        with pytest.raises(LeaseConfigError, match="integer"):
            gate.admit(names + "k", "7")

    def test_concurrent_admits_leave_the_highest(self, store, names):
        """Racing writers: the stored fence is the highest admitted, every refusal is right."""
        gate = FenceGate(store=store)
        key = names + "race"
        admitted, refused, errors = [], [], []

        def writer(fence):
            try:
                admitted.append(gate.admit(key, fence))
            except StaleFenceError as exc:
                refused.append((fence, exc.highest))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(f,)) for f in range(1, 41)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert gate.highest(key) == 40
        assert all(highest > fence for fence, highest in refused)

    def test_gate_from_url_needs_one_source(self):
        with pytest.raises(LeaseConfigError, match="exactly one"):
            FenceGate()
        gate = FenceGate("memory://")
        assert gate.admit("k", 3) == 3
        gate.close()


class _AdmitOnlyGateStore:
    """A user's gate store with just ``url`` and ``gate_admit``, the minimum FenceGate needs."""

    url = "custom://"

    def __init__(self) -> None:
        self.highest: dict[str, int] = {}

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        seen = self.highest.get(key)
        if seen is None or fence >= seen:
            self.highest[key] = fence
            return True, fence
        return False, seen


class TestCustomGateStore:
    def test_a_store_with_only_gate_admit_is_accepted_and_admits(self):
        """FenceGate takes a store that can only admit (no gate_highest, no close), as it did."""
        backend = _AdmitOnlyGateStore()
        gate = FenceGate(store=backend)  # type: ignore[arg-type]
        assert gate.admit("k", 5) == 5
        with pytest.raises(StaleFenceError):
            gate.admit("k", 4)
        assert backend.highest == {"k": 5}
        gate.close()  # not ours to close: nothing is called

    def test_highest_needs_gate_highest_and_says_so(self):
        """Asking such a gate for the highest fence fails naming what the store lacks."""
        gate = FenceGate(store=_AdmitOnlyGateStore())  # type: ignore[arg-type]
        with pytest.raises(LeaseConfigError, match="gate_highest"):
            gate.highest("k")

    def test_a_store_without_gate_admit_is_refused(self):
        """An object that cannot admit is refused when the gate is made (negative control)."""
        with pytest.raises(LeaseConfigError, match="cannot serve as a fence gate"):
            FenceGate(store=object())  # type: ignore[arg-type]
