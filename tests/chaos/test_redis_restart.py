"""Redis restarts keep fences increasing, and eviction settings are named, against real
redis-servers started per test.

Every test starts its own redis-server (never the session one), SIGKILLs and restarts it, and
checks the store's promises: fences never regress; a lease held before a restart is either still
valid or cleanly lost (renew raises LeaseLostError, never succeeds for a wrong owner); a restart
that lost the data is detected; and the health check flags settings that can lose leases. The
negative controls show that without the protections the same faults do break things: a plain
counter repeats after a restart without persistence, and allkeys-lru silently evicts a lease.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_lease import Lease, LeaseBusyError, LeaseLostError, LeaseStoreError, Owner
from celery_lease.stores.redis import RedisLeaseStore
from tests.conftest import missing
from tests.tooling.servers import RedisServer, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.chaos_ci]

LONG = 30.0
ROUNDS = 6  # SIGKILL + restart rounds per persistence mode (CI asks 20 in total)
PREFIX = "s7:"


@pytest.fixture
def start_redis(tmp_path) -> Iterator[Callable[..., RedisServer]]:
    """Start private redis-servers for one test; all are stopped (by PID) at its end."""
    started: list[RedisServer] = []

    def start(**options: Any) -> RedisServer:
        try:
            server = RedisServer(tmp_path / f"redis{len(started)}", **options)
        except FileNotFoundError as exc:
            missing(str(exc))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.close()


def store_on(server: RedisServer, **options: Any) -> RedisLeaseStore:
    return RedisLeaseStore(url=server.url, key_prefix=PREFIX, socket_timeout=2.0, **options)


def forged(lease: Lease) -> Lease:
    """The same resource and fence held by somebody else's token."""
    return Lease(
        resource=lease.resource,
        owner=Owner.new("intruder"),
        fence=lease.fence,
        acquired_at=lease.acquired_at,
        expires_at=lease.expires_at,
        ttl=lease.ttl,
        sent_monotonic=time.monotonic(),
        store=lease.store,
    )


class TestRestartWithAof:
    @pytest.mark.parametrize("appendfsync", ["always", "everysec"])
    def test_fences_never_regress_and_held_leases_survive_or_are_cleanly_lost(
        self, start_redis, appendfsync
    ):
        """SIGKILL + restart rounds: fences keep growing; leases stay valid or are lost cleanly.

        With ``appendfsync always`` every acknowledged claim is on disk before the reply, so
        every held lease must survive with its fence. With ``everysec`` an acknowledged write
        can be lost (a write postponed behind a slow fsync; on a machine crash, the last second),
        and then the owner must be told (LeaseLostError), never a wrong owner let in. A SIGKILL
        leaves what Redis wrote in the page cache, so here ``everysec`` rarely loses anything;
        a machine crash cannot be simulated on one host.
        """
        server = start_redis(appendonly=True, appendfsync=appendfsync)
        store = store_on(server)
        resources = [f"job/{i}" for i in range(12)]
        issued: dict[str, list[int]] = defaultdict(list)
        held: dict[str, Lease] = {}
        survived = lost = 0
        clean = ("taken_over", "released") + (("store_reset",) if appendfsync != "always" else ())
        try:
            for round_no in range(ROUNDS):
                for i, resource in enumerate(resources):
                    if resource in held:
                        continue
                    try:
                        lease = store.acquire(resource, Owner.new(f"round{round_no}"), LONG)
                    except LeaseBusyError:  # an acknowledged release was lost: safe, not live
                        assert appendfsync != "always", f"a release of {resource} was lost"
                        continue
                    assert all(lease.fence > old for old in issued[resource]), (
                        f"fence regression on {resource} in round {round_no}: {lease.fence} "
                        f"after {issued[resource]}"
                    )
                    issued[resource].append(lease.fence)
                    if (i + round_no) % 3 == 0:
                        assert store.release(lease)
                    else:
                        held[resource] = lease
                highest = max(f for fences in issued.values() for f in fences)

                server.restart()  # SIGKILL, then start and poll until it answers PING

                for resource, lease in list(held.items()):
                    with pytest.raises(LeaseLostError) as caught:
                        store.renew(forged(lease))
                    # (everysec: the shard may have lost its data, epoch and all: a write
                    # postponed behind a slow fsync under load; the owner is told store_reset)
                    assert caught.value.reason in clean
                    try:
                        store.renew(lease)
                    except LeaseLostError:
                        assert appendfsync != "always", f"{resource} lost under fsync always"
                        assert lease.lost is not None and lease.lost.reason in clean
                        assert store.get(resource) is None
                        del held[resource]
                        lost += 1
                        continue
                    survived += 1
                    info = store.get(resource)
                    assert (info.fence, info.owner_label) == (lease.fence, lease.owner_label)
                    store.verify(lease)
                    if round_no % 2:  # release some after the restart too
                        assert store.release(lease)
                        del held[resource]
                fresh = store.acquire(f"fresh/{round_no}", Owner.new(), LONG)
                assert fresh.fence > highest
            if appendfsync == "always":
                assert lost == 0 and store.data_loss_detected == 0
            assert survived + lost > ROUNDS * 4
        finally:
            store.close()

    def test_claims_racing_the_kill_never_repeat_or_regress_a_fence(self, start_redis):
        """A client claiming and releasing in a loop while the server is killed 5 times.

        Every acknowledged fence of a resource is greater than the ones acknowledged before it;
        a claim or release whose reply was lost is retried with the same owner token (the store
        hands back the same lease) until it has a definite answer, so nothing stays held.
        """
        server = start_redis(appendonly=True, appendfsync="always")
        store = store_on(server)
        acked: dict[str, list[int]] = defaultdict(list)
        errors: list[BaseException] = []
        store_errors = [0]
        cycles = [0]
        stop = threading.Event()

        def until_definite(op: Callable[[], Any]) -> Any:
            while True:
                try:
                    return op()
                except LeaseStoreError:
                    store_errors[0] += 1
                    if stop.wait(0.005):
                        raise

        def client() -> None:
            try:
                while not stop.is_set():
                    for resource in ("race/a", "race/b", "race/c"):
                        owner = Owner.new("racer")
                        lease = until_definite(
                            lambda r=resource, o=owner: store.acquire(r, o, LONG)
                        )
                        acked[resource].append(lease.fence)
                        until_definite(lambda lease=lease: store.release(lease))
                    cycles[0] += 1
            except LeaseStoreError:
                if not stop.is_set():
                    raise
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=client, name="s7-racer")
        thread.start()
        try:
            for _ in range(5):
                target = cycles[0] + 20
                wait_for(lambda t=target: cycles[0] >= t or errors, 20, "claims between kills")
                server.restart()
            target = cycles[0] + 20
            wait_for(lambda: cycles[0] >= target or errors, 20, "claims after the last kill")
        finally:
            stop.set()
            thread.join(20)
        assert not thread.is_alive()
        assert not errors, errors
        for resource, fences in acked.items():
            assert fences == sorted(set(fences)), f"{resource}: fences {fences} regressed"
            assert store.get(resource) is None  # every claim was released in the end
        print(f"restart race: {cycles[0]} cycles, {store_errors[0]} store errors across 5 kills")
        assert store.data_loss_detected == 0
        store.close()


class TestRestartWithoutPersistence:
    def test_data_loss_is_detected_leases_are_lost_and_fences_stay_above(self, start_redis, caplog):
        """No AOF, no RDB: a restart loses every lease and fence counter.

        The store must notice (``data_loss_detected`` grows by one for each shard at its first
        claim after the restart, with an ERROR log naming the shard), every lease held before
        must be lost for its owner, and every new fence must exceed every fence issued before
        (the time floor), so no fence ever repeats.
        """
        server = start_redis(appendonly=False)
        store = store_on(server, shards=8)
        resources = [f"job/{i}" for i in range(16)]
        all_fences: list[int] = []
        caplog.set_level(logging.ERROR, logger="celery_lease.stores.redis")
        try:
            for round_no in range(3):
                held = [store.acquire(r, Owner.new(f"round{round_no}"), LONG) for r in resources]
                all_fences += [lease.fence for lease in held]
                seen_shards = {store.shard_of(r) for r in resources}
                highest = max(all_fences)
                detected = store.data_loss_detected
                caplog.clear()

                server.restart()

                for lease in held:
                    with pytest.raises(LeaseLostError) as caught:
                        store.renew(lease)
                    assert caught.value.fence == lease.fence
                    with pytest.raises(LeaseLostError):
                        store.verify(lease)
                    assert store.release(lease) is False
                    assert store.get(lease.resource) is None
                assert store.data_loss_detected == detected  # renewals do not read the epoch

                shards_claimed: set[int] = set()
                for resource in resources:
                    shard = store.shard_of(resource)
                    before = store.data_loss_detected
                    lease = store.acquire(resource, Owner.new("after"), LONG)
                    first_in_shard = shard not in shards_claimed
                    shards_claimed.add(shard)
                    assert store.data_loss_detected == before + (1 if first_in_shard else 0)
                    assert lease.fence > highest, "a fence repeated after the data loss"
                    assert not lease.recovered  # nothing is known about the lost holder
                    all_fences.append(lease.fence)
                    store.release(lease)
                assert store.data_loss_detected == detected + len(seen_shards)
                records = [r for r in caplog.records if "lost its data" in r.getMessage()]
                assert len(records) == len(seen_shards)
                assert {r.levelno for r in records} == {logging.ERROR}
                logged = {int(re.search(r"shard (\d+) ", r.getMessage())[1]) for r in records}
                assert logged == seen_shards
                assert all(server.url in r.getMessage() for r in records)
            assert len(all_fences) == len(set(all_fences)), "a fence was issued twice"
        finally:
            store.close()

    def test_negative_control_a_plain_counter_repeats_after_the_same_restart(self, start_redis):
        """Negative control: the same restart makes a plain INCR counter (no floor) issue 1 again.

        This is the fault the fence floor protects against: without it, a fence issued after
        the restart would equal one issued before, and a stale owner would pass a fence check.
        """
        server = start_redis(appendonly=False)
        raw = redis.Redis.from_url(server.url)
        try:
            before = [int(raw.incr("plain:counter")) for _ in range(5)]
            assert before == [1, 2, 3, 4, 5]
            server.restart()
            raw.connection_pool.disconnect()
            after = int(raw.incr("plain:counter"))
            assert after in before, "the negative control failed to show a repeated counter"
            assert after <= max(before)
        finally:
            raw.close()


class TestEvictionSettings:
    @pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "allkeys-random"])
    def test_an_evicting_policy_is_flagged_or_refused(self, start_redis, policy):
        """Any maxmemory-policy but noeviction is a named warning, or an error on demand."""
        server = start_redis(appendonly=True, maxmemory_policy=policy, maxmemory="64mb")
        with store_on(server) as store:
            warnings = store.check_health()
            assert len(warnings) == 1
            assert "maxmemory-policy" in warnings[0] and policy in warnings[0]
        strict = store_on(server, require_noeviction=True)
        with strict, pytest.raises(LeaseStoreError, match="maxmemory-policy"):
            strict.check_health()

    def test_noeviction_with_aof_has_no_warning(self, start_redis):
        """The recommended settings pass the health check cleanly, even when strict."""
        server = start_redis(appendonly=True, maxmemory_policy="noeviction")
        with store_on(server, require_noeviction=True, require_persistence=True) as store:
            assert store.check_health() == []

    def test_no_persistence_is_flagged_or_refused(self, start_redis):
        """appendonly no and save '' is a persistence warning, or an error on demand."""
        server = start_redis(appendonly=False)
        with store_on(server) as store:
            warnings = store.check_health()
            assert len(warnings) == 1
            assert "appendonly" in warnings[0] and "maxmemory-policy" not in warnings[0]
        strict = store_on(server, require_persistence=True)
        with strict, pytest.raises(LeaseStoreError, match="appendonly"):
            strict.check_health()
        with redis.Redis.from_url(server.url) as admin:
            admin.config_set("save", "3600 1")
        with store_on(server, require_persistence=True) as rdb:  # RDB counts as persistence
            assert any("appendonly" in w for w in rdb.check_health())

    def test_negative_control_allkeys_lru_silently_evicts_a_live_lease(self, start_redis):
        """Negative control: under allkeys-lru a memory fill drops a live lease without a trace.

        Its owner only learns at the next renewal, and another owner can claim the resource
        meanwhile, which is why the health check flags the policy. The fence still grows (the
        time floor), so a fenced side effect keeps rejecting the evicted owner.
        """
        server = start_redis(appendonly=False, maxmemory_policy="allkeys-lru", maxmemory="4mb")
        raw = redis.Redis.from_url(server.url)
        with store_on(server, shards=1) as store:
            lease = store.acquire("evict/me", Owner.new("victim"), LONG)
            fill(raw)
            other = store.acquire("evict/me", Owner.new("intruder"), LONG)  # no LeaseBusyError
            assert other.fence > lease.fence
            with pytest.raises(LeaseLostError):
                store.renew(lease)
        raw.close()

    def test_noeviction_keeps_the_lease_and_refuses_writes(self, start_redis):
        """Under noeviction a full server refuses writes (LeaseStoreError), never drops a lease."""
        server = start_redis(appendonly=False, maxmemory_policy="noeviction")
        raw = redis.Redis.from_url(server.url)
        with store_on(server, shards=1) as store:
            lease = store.acquire("keep/me", Owner.new("holder"), LONG)
            fill(raw)  # 32 MB of data, then a 4 MB limit: the server is full whatever it frees
            raw.config_set("maxmemory", "4mb")
            with pytest.raises(redis.OutOfMemoryError):
                raw.set("one:more", "x")
            with pytest.raises(LeaseStoreError, match=r"OutOfMemory|maxmemory"):
                store.renew(lease)
            with pytest.raises(LeaseBusyError):
                store.acquire("keep/me", Owner.new("intruder"), LONG)
            store.verify(lease)
            assert store.get("keep/me").owner_label == "holder"
        raw.close()


def fill(raw: redis.Redis) -> None:
    """Write about 32 MB of junk (8x a 4 MB maxmemory): under an LRU policy that evicts nearly
    every key written before, whatever the LRU clock's one-second resolution says."""
    pipe = raw.pipeline(transaction=False)
    for i in range(4000):
        pipe.set(f"junk:{i}", b"x" * 8192)
        if i % 200 == 199:
            pipe.execute()
    pipe.execute()
