"""Latency and resets between a renewer and a real Redis, through the loopback proxy.

* RTT below ttl/3: renewals keep the lease; no spurious loss over many renewals, also when
  the claim itself went over the slow link (its first renewal is due from the claim's send).
* RTT above the ttl: every renewal comes back too late; the renewer declares the lease lost at
  its self-fence deadline (while the renewal is still in flight), before the store expires it.
* A connection reset mid-renewal is survived: the renewal is repeated on a fresh connection (a
  renewal is safe to repeat) and the lease is kept, same fence.
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import pytest

from celery_lease import Owner
from celery_lease._renewer import Renewer
from celery_lease.stores.redis import RedisLeaseStore
from tests.conftest import unique
from tests.tooling.proxy import TcpProxy
from tests.tooling.servers import RedisServer, wait_for

pytestmark = [pytest.mark.chaos_ci]

TTL = 3.0
INTERVAL = TTL / 3
MARGIN = TTL / 4


@pytest.fixture(scope="module")
def redis_server():
    """A private redis-server: a test here flushes the script cache, which would also make
    the scripts of tests running at once on a shared server miss (they load them again, but a
    release's ``meanwhile`` then runs before the release lands)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def proxied(redis_server):
    port = urlsplit(redis_server.url).port
    with TcpProxy(port) as proxy:
        store = RedisLeaseStore(
            url=proxy.url_for(redis_server.url), key_prefix=f"{unique('s10')}:", socket_timeout=5
        )
        direct = RedisLeaseStore(url=redis_server.url, key_prefix=store.key_prefix)
        renewer = Renewer()
        try:
            yield proxy, store, direct, renewer
        finally:
            renewer.shutdown()
            store.close()
            direct.close()


def _hold(renewer, lease, lost):
    lease.margin = MARGIN
    return renewer.hold(
        lease,
        interval=INTERVAL,
        max_runtime=60,
        on_lost=lambda h, e: lost.append((e, time.monotonic())),
    )


def test_latency_below_a_third_of_the_ttl_loses_nothing(proxied):
    proxy, store, direct, renewer = proxied
    lost: list = []
    lease = store.acquire("s10/slow-net", Owner.new("w"), TTL)
    direct.client.script_flush()  # as after a restart: the renewal script must come back too
    proxy.set_latency(TTL / 8)  # each way: RTT = ttl/4
    hold = _hold(renewer, lease, lost)
    calls = renewer.calls
    wait_for(lambda: renewer.calls >= calls + 8 or lost, 30, "8 renewals")
    renewer.drop(hold)
    print(f"{renewer.calls - calls} renewals at RTT {TTL / 4:.3f}s, {renewer.failures} failed")
    assert not lost and renewer.failures == 0
    info = direct.get("s10/slow-net")
    assert info is not None and not info.expired and info.fence == lease.fence


@pytest.mark.parametrize("fraction", [0.75, 0.9])
def test_a_claim_over_the_slow_link_survives_its_first_renewal(proxied, fraction):
    """RTT of 0.75 and 0.9 x ttl/3 from the claim on: no loss, no failed renewal.

    (The first renewal was timed from the claim's reply instead of its send: its reply came
    back after the self-fence deadline and the lease was lost at its first renewal.)
    """
    proxy, store, direct, renewer = proxied
    direct.release(direct.acquire("s10/load-scripts", Owner.new("w"), TTL))  # one trip a claim
    rtt = fraction * TTL / 3
    proxy.set_latency(rtt / 2)
    lost: list = []
    renewer.prepare(store)  # as a task does right before its claim
    lease = store.acquire(f"s10/claim-{fraction}", Owner.new("w"), TTL)
    hold = _hold(renewer, lease, lost)
    wait_for(lambda: renewer.calls >= 4 or lost, 30, "4 renewals")
    renewer.drop(hold)
    proxy.set_latency(0)
    print(f"RTT {rtt:.3f}s: {renewer.calls} renewals, {renewer.failures} failed, {lost=}")
    assert not lost and renewer.failures == 0
    info = direct.get(lease.resource)
    assert info is not None and not info.expired and info.fence == lease.fence


def _concurrent_claims_over_a_slow_link(proxied, lanes):
    """Three leases claimed 0.3 s apart by three threads at RTT 0.9 x ttl/3; returns the losses."""
    proxy, store, direct, _ = proxied
    renewer = Renewer() if lanes is None else Renewer(lanes=lanes)
    direct.release(direct.acquire("s10/load-scripts", Owner.new("w"), TTL))  # one trip a claim
    proxy.set_latency(0.9 * TTL / 3 / 2)
    lost: list = []
    holds: list = []
    renewer.prepare(store)

    def claim(i):
        lease = store.acquire(f"s10/concurrent-{i}", Owner.new("w"), TTL)
        holds.append(_hold(renewer, lease, lost))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
    try:
        for thread in threads:
            thread.start()
            time.sleep(0.3)  # the stagger between the claims, not a wait for an outcome
        for thread in threads:
            thread.join(10)
        wait_for(lambda: renewer.calls >= 8 or lost, 30, "8 renewal calls")
    finally:
        renewer.shutdown()
        proxy.set_latency(0)
    print(f"lanes={lanes}: {renewer.calls} renewal calls, {renewer.failures} failed, {lost=}")
    return lost


def test_concurrent_claims_over_the_slow_link_do_not_queue_behind_each_other(proxied):
    """A new lease's first renewal is not held up by another lease's renewal in flight.

    (With one I/O thread, the second lease's first renewal waited for the first lease's
    renewal to come back, and its reply arrived after its self-fence deadline.)
    """
    assert not _concurrent_claims_over_a_slow_link(proxied, None)


def test_negative_control_one_lane_queues_the_first_renewals(proxied):
    """With one lane the same claims lose a lease: the test above would see the queueing."""
    assert _concurrent_claims_over_a_slow_link(proxied, 1)


def test_latency_above_the_ttl_is_a_loss_before_the_store_expiry(proxied):
    proxy, store, direct, renewer = proxied
    lost: list = []
    lease = store.acquire("s10/too-slow", Owner.new("w"), TTL)
    expires_at = direct.get("s10/too-slow").expires_at.timestamp()
    proxy.set_latency(TTL)  # each way: every reply arrives 2x ttl after it was asked
    _hold(renewer, lease, lost)
    wait_for(lambda: lost, 10, "the loss")
    error, at = lost[0]
    lost_wall = time.time() - (time.monotonic() - at)
    print(f"lost ({error.reason}) {expires_at - lost_wall:.3f}s before the store's expiry")
    assert error.reason == "renew_failed"
    assert at >= lease.deadline - 0.05  # not before its self-fence deadline
    # Before the store could expire the lease: no other owner could have had it yet.
    assert lost_wall < expires_at
    proxy.set_latency(0)


def test_a_reset_mid_renewal_is_survived_on_a_fresh_connection(proxied):
    proxy, store, direct, renewer = proxied
    lost: list = []
    lease = store.acquire("s10/reset", Owner.new("w"), TTL)
    deadline_before = lease.deadline
    proxy.set_latency(0.1)  # a renewal stays in flight for 0.2 s: long enough to cut it
    _hold(renewer, lease, lost)
    wait_for(lambda: renewer.calls >= 1, 10, "a renewal in flight")
    accepted = proxy.accepted
    proxy.reset_all()
    wait_for(lambda: lease.deadline > deadline_before or lost, 10, "a renewal after the reset")
    proxy.set_latency(0)
    print(f"{renewer.calls} renewal calls, {renewer.failures} failed, {lost=}")
    assert not lost
    assert proxy.accepted > accepted  # it got through on a new connection
    info = direct.get("s10/reset")
    assert info is not None and info.fence == lease.fence and not info.expired
