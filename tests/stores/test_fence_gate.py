"""FenceGate over every store: the newest fence wins, stale ones are refused, atomically."""

from __future__ import annotations

import threading

import pytest

from celery_lease import FenceGate, LeaseBusyError, LeaseConfigError, Owner, StaleFenceError
from celery_lease._events import METRICS
from celery_lease.fencing import check_fencing_token, fencing_headers
from tests.conftest import make_store


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


# -- a gate sharing the lease store (issue 33) ----------------------------------------------------
LONG = 30.0
SHORT = 0.05


def _taken_over(store, resource: str, old) -> object:
    """A newer owner's lease on ``resource`` once ``old`` (claimed with a short ttl) ran out.

    Polls with a deadline: the stores' clocks are their servers'. ``old`` is never released:
    its holder is paused, as the old owner of a takeover is.
    """
    from tests.tooling.servers import wait_for

    def claim():
        try:
            return store.acquire(resource, Owner.new("newer"), LONG)
        except LeaseBusyError:
            return None

    return wait_for(claim, 10, f"{resource} to be taken over from fence {old.fence}")


def _admits_after_takeover(gate, store, resource: str) -> tuple[bool, int, int]:
    """The failing scenario of issue 33: the old owner wrote once, froze, its lease ran out, a
    newer owner claimed and has not written yet; the old owner writes again. Returns whether
    that write was admitted, the old fence and the newer one."""
    old = store.acquire(resource, Owner.new("old"), SHORT)
    gate.admit(resource, old)
    newer = _taken_over(store, resource, old)
    assert newer.fence > old.fence
    try:
        gate.admit(resource, old)
    except StaleFenceError as exc:
        refused = (exc.key, exc.fence, exc.highest)
    else:
        return True, old.fence, newer.fence
    assert refused == (resource, old.fence, newer.fence)  # (names both fences)
    return False, old.fence, newer.fence


class TestGateSharingTheLeaseStore:
    """For a key that is a lease resource, a gate on the lease store refuses every fence older
    than the newest the store granted, from the grant on: also while the newer holder has not
    written yet."""

    def test_an_old_owner_is_refused_before_the_newer_one_writes(self, store, names):
        """Takeover after expiry: the old owner's next write is refused, naming the newer fence;
        the refusal changes nothing and the newer owner's first write passes."""
        gate = FenceGate(store=store)
        resource = names + "acct/1"
        admitted, old, newer = _admits_after_takeover(gate, store, resource)
        assert not admitted
        assert gate.highest(resource) == old  # the refusal recorded nothing
        assert gate.admit(resource, newer) == newer
        with pytest.raises(StaleFenceError):
            gate.admit(resource, old)

    def test_negative_control_a_gate_apart_from_the_lease_store_admits_it(
        self, store, names, request, tmp_path
    ):
        """The same scenario through a gate on another store of the same kind (it shares no
        grants with the lease store): the old owner's write gets in. The check above is what
        refuses it."""
        apart = _apart(store, request, tmp_path)
        try:
            admitted, _, _ = _admits_after_takeover(FenceGate(store=apart), store, names + "a/1")
        finally:
            apart.close()
        assert admitted

    def test_a_fence_nobody_admitted_yet_is_refused_too(self, store, names):
        """Neither owner ever wrote: the old fence is still refused once a newer is granted."""
        gate = FenceGate(store=store)
        resource = names + "acct/2"
        old = store.acquire(resource, Owner.new("old"), LONG)
        assert store.release(old)
        newer = store.acquire(resource, Owner.new("newer"), LONG)
        with pytest.raises(StaleFenceError) as caught:
            gate.admit(resource, old.fence)
        assert caught.value.highest == newer.fence
        assert gate.highest(resource) is None
        assert gate.admit(resource, newer) == newer.fence

    def test_a_force_released_holder_is_refused_at_once(self, store, names):
        """force_release bumps the resource's fence: the evicted holder is stale even before
        anyone claims again."""
        gate = FenceGate(store=store)
        resource = names + "acct/3"
        lease = store.acquire(resource, Owner.new("evicted"), LONG)
        assert gate.admit(resource, lease) == lease.fence
        store.force_release(resource)
        with pytest.raises(StaleFenceError) as caught:
            gate.admit(resource, lease)
        assert caught.value.highest > lease.fence
        newer = store.acquire(resource, Owner.new("newer"), LONG)
        assert gate.admit(resource, newer) == newer.fence

    def test_check_fencing_token_refuses_the_old_owner(self, store, names):
        """An HTTP gateway's check over a gate on the lease store: the old owner's token gets
        StaleFenceError (409) although the newer owner never called."""
        gate = FenceGate(store=store)
        resource = names + "acct/4"
        old = store.acquire(resource, Owner.new("old"), SHORT)
        newer = _taken_over(store, resource, old)
        with pytest.raises(StaleFenceError):
            check_fencing_token(f"{resource};{old.fence}", gate)
        with pytest.raises(StaleFenceError):
            check_fencing_token(fencing_headers(old), gate)
        assert check_fencing_token(fencing_headers(newer), gate) == newer.fence

    def test_other_keys_keep_the_gate_rule_alone(self, store, names):
        """The rule follows the key: a key that is no resource, or another resource, admits
        by the fences admitted there only, as before."""
        gate = FenceGate(store=store)
        resource = names + "acct/5"
        old = store.acquire(resource, Owner.new("old"), LONG)
        assert store.release(old)
        store.acquire(resource, Owner.new("newer"), LONG)
        assert gate.admit(names + "acct/5:row", old) == old.fence
        assert gate.admit(names + "acct/6", old) == old.fence
        assert gate.admit(names + "acct/6", old.fence) == old.fence  # the same fence again

    def test_racing_claims_never_let_an_older_fence_in(self, store, names):
        """Claims and admits racing on one resource: no admit that started after a newer grant
        returned lets an older fence in (the check and the grant are atomic), and every
        refusal names a fence newer than the refused one."""
        gate = FenceGate(store=store)
        resource = names + "race"
        violations, errors, refusals, grants = _race(gate, store, resource)
        assert not errors, errors
        assert len(grants) >= 10 and refusals
        assert not violations, violations

    def test_negative_control_racing_through_a_gate_apart_lets_old_fences_in(
        self, store, names, request, tmp_path
    ):
        """The same race through a gate that does not share the lease store: the check above
        finds older fences admitted after newer grants."""
        apart = _apart(store, request, tmp_path)
        try:
            # (only the admitter of the fence before the newest: nobody admits the newest one,
            # so each round's old fence gets in through such a gate)
            gate = FenceGate(store=apart)
            violations, errors, _, _ = _race(gate, store, names + "race", offsets=(1,))
        finally:
            apart.close()
        assert not errors, errors
        assert violations


def _apart(store, request, tmp_path):
    """Another store of the same kind as the ``store`` fixture's, sharing none of its data."""
    (tmp_path / "apart").mkdir()
    return make_store(request.node.callspec.params["store"], request, tmp_path / "apart")


def _race(gate, store, resource: str, rounds: int = 12, offsets: tuple[int, ...] = (0, 1)):
    """One thread claims and releases ``resource`` ``rounds`` times; meanwhile one thread per
    offset admits the newest granted fence (offset 0) or an earlier one (1: the one before).
    Returns (violations, errors, refusals, grants): a violation is an admitted fence older than
    a fence whose grant had returned before that admit began."""
    import time

    grants: list[tuple[float, int]] = []  # (monotonic time the grant returned, fence)
    admits: list[tuple[float, int]] = []  # (monotonic time the admit began, fence), admitted
    refusals: list[tuple[int, int | None]] = []
    errors: list[BaseException] = []
    done = threading.Event()
    lock = threading.Lock()

    def claimer() -> None:
        try:
            for _ in range(rounds):
                lease = store.acquire(resource, Owner.new("c"), LONG)
                with lock:
                    grants.append((time.monotonic(), lease.fence))
                time.sleep(0.005)
                store.release(lease)
        except BaseException as exc:  # pragma: no cover - reported by the test
            errors.append(exc)
        finally:
            done.set()

    def admitter(offset: int) -> None:
        try:
            while not done.is_set():
                with lock:
                    known = [fence for _, fence in grants]
                if len(known) <= offset:
                    time.sleep(0.001)
                    continue
                fence = known[-1 - offset]  # the newest grant, or an older one
                began = time.monotonic()
                try:
                    gate.admit(resource, fence)
                except StaleFenceError as exc:
                    refusals.append((fence, exc.highest))
                else:
                    with lock:
                        admits.append((began, fence))
        except BaseException as exc:  # pragma: no cover - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=admitter, args=(n,)) for n in offsets]
    threads.append(threading.Thread(target=claimer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    violations = [
        (fence, newer)
        for began, fence in admits
        for returned, newer in grants
        if returned < began and newer > fence
    ]
    errors += [
        AssertionError(f"refusal of {fence} named {highest}")
        for fence, highest in refusals
        if highest is None or highest <= fence
    ]
    return violations, errors, refusals, grants


def _same_url(kind, request, tmp_path):
    """(url, options) of a fresh lease store of ``kind``: a gate made from them shares it."""
    from tests.conftest import unique

    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        return url, {"key_prefix": f"{unique('cl')}:"}
    if kind == "redis_cluster":
        url = request.getfixturevalue("redis_cluster").url
        return url, {"cluster": True, "key_prefix": f"{unique('cl')}:"}
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/leases.db", {"table_prefix": f"{unique('cl')}_"}
    url = request.getfixturevalue("postgres_server").url
    return url, {"table_prefix": f"{unique('cl')}_"}


@pytest.mark.parametrize("kind", ["redis", "redis_cluster", "sqlite", "postgres"])
class TestGateFromTheLeaseStoreUrl:
    def test_a_gate_made_from_the_same_url_and_prefix_knows_the_grants(
        self, kind, request, tmp_path, names
    ):
        """FenceGate(url, prefix) of the lease store's own URL and prefix refuses the old owner
        while the newer one has not written: it reads the same fence counter."""
        from celery_lease.stores import store_from_url

        url, options = _same_url(kind, request, tmp_path)
        with store_from_url(url, **options) as store:
            gate = FenceGate(url, **options)
            try:
                admitted, _, newer = _admits_after_takeover(gate, store, names + "acct/1")
                assert not admitted
                assert gate.admit(names + "acct/1", newer) == newer
            finally:
                gate.close()

    def test_negative_control_another_prefix_shares_nothing(self, kind, request, tmp_path, names):
        """A gate on the same server under another prefix is a gate apart: it admits the old
        owner's write (the prefix is what makes it the lease store's)."""
        from celery_lease.stores import store_from_url

        url, options = _same_url(kind, request, tmp_path)
        _, other = _same_url(kind, request, tmp_path)
        with store_from_url(url, **options) as store:
            gate = FenceGate(url, **other)
            try:
                admitted, _, _ = _admits_after_takeover(gate, store, names + "acct/1")
            finally:
                gate.close()
        assert admitted


@pytest.mark.parametrize("kind", ["redis", "redis_cluster"])
class TestRedisGateLayout:
    """Gates live in a hash per shard, in the slot of the resource of the same name; what the
    earlier layout (a string per key, ``<prefix>gate:<key>``) admitted still counts."""

    def test_a_gate_and_its_resource_share_a_slot(self, kind, request, tmp_path, names):
        """The gate script's keys (gates and fences hash) map to one slot for any key."""
        store = make_store(kind, request, tmp_path)
        try:
            for i in range(40):
                key = f"{names}k{i}"
                gates, fences = store._keys(store.shard_of(key), "gates", "fences")
                if store.cluster:
                    assert store.client.keyslot(gates) == store.client.keyslot(fences)
                assert store.gate_admit(key, i) == (True, i)
                assert store.client.hget(gates, key) == str(i).encode()
        finally:
            store.close()

    def test_a_fence_admitted_under_the_earlier_layout_still_counts(
        self, kind, request, tmp_path, names
    ):
        """A gate string the previous version wrote keeps refusing older fences after the
        upgrade (also on a cluster, where it is in another slot); newer ones pass and are kept
        in the gates hash."""
        store = make_store(kind, request, tmp_path)
        try:
            key = names + "doc/1"
            gates = store._keys(store.shard_of(key), "gates")[0]
            store.client.set(f"{store.key_prefix}gate:{key}", 50)  # as the previous version did
            gate = FenceGate(store=store)
            assert store.client.hget(gates, key) is None  # (the new layout alone knows nothing)
            assert gate.highest(key) == 50
            for _ in range(2):  # (a refusal changes nothing: the second asks the string again)
                with pytest.raises(StaleFenceError) as caught:
                    gate.admit(key, 40)
                assert caught.value.highest == 50
            assert store.client.hget(gates, key) is None
            assert gate.admit(key, 50) == 50
            assert store.client.hget(gates, key) == b"50"
            with pytest.raises(StaleFenceError):
                gate.admit(key, 49)
            assert gate.admit(key, 60) == 60
            assert gate.highest(key) == 60
            assert store.client.get(f"{store.key_prefix}gate:{key}") == b"50"  # never written
        finally:
            store.close()
