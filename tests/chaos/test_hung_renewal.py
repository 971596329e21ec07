"""One hanging renewal call blinds nothing: deadlines are watched independently of store I/O.

Two real Redis stores in one process (tasks with different ttls get different stores): the
"hung" one reaches Redis through the loopback proxy, which the test blackholes (nothing is
forwarded, nothing is closed, the socket timeout is far away); the "healthy" one is direct.

* The healthy store's leases keep renewing, those held before the hang and one claimed during it.
* The hung store's leases are declared lost at their self-fence deadline, not when the hung call
  gives up.

Negative control: ``Renewer(lanes=1)`` makes every store's calls share one thread, so the healthy
leases queue behind the hung call and are lost although their store answers. (Before renewals
ran on lanes, the renewer thread itself waited on the hung call and watched only that call's
leases: a healthy lease was lost about a second past its deadline.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

from celery_lease import Owner
from celery_lease._renewer import Renewer
from celery_lease.stores.redis import RedisLeaseStore
from tests.conftest import unique
from tests.tooling.proxy import TcpProxy
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.chaos_ci]

TTL = 1.5
INTERVAL = TTL / 3
MARGIN = TTL / 4
LATE = 0.25  # declared this long after its deadline counts as late (measured: 1-4 ms)


@dataclass
class Outcome:
    lost: dict[str, tuple[str, float, float]] = field(default_factory=dict)  # reason, at, deadline
    healthy: list = field(default_factory=list)
    hung: list = field(default_factory=list)
    blackholed_at: float = 0.0


def run(redis_server, renewer: Renewer) -> Outcome:
    """Hold 2 leases on each store, blackhole one store, claim one more on the healthy store."""
    outcome = Outcome()

    def on_lost(hold, error):
        outcome.lost[hold.lease.resource] = (error.reason, time.monotonic(), hold.lease.deadline)

    def hold(store, resource):
        lease = store.acquire(resource, Owner.new("w"), TTL)
        lease.margin = MARGIN
        renewer.hold(lease, interval=INTERVAL, max_runtime=60, on_lost=on_lost)
        return lease

    with TcpProxy(urlsplit(redis_server.url).port) as proxy:
        hung_store = RedisLeaseStore(
            url=proxy.url_for(redis_server.url), key_prefix=f"{unique('hung')}:", socket_timeout=60
        )
        healthy_store = RedisLeaseStore(url=redis_server.url, key_prefix=f"{unique('ok')}:")
        try:
            outcome.hung = [hold(hung_store, f"hung-{i}") for i in range(2)]
            outcome.healthy = [hold(healthy_store, f"ok-{i}") for i in range(2)]
            start = renewer.calls
            wait_for(lambda: renewer.calls >= start + 4, 10, "renewals of both stores")
            proxy.blackhole()
            outcome.blackholed_at = time.monotonic()
            outcome.healthy.append(hold(healthy_store, "ok-claimed-during-the-hang"))
            wait_for(
                lambda: all(lease.resource in outcome.lost for lease in outcome.hung),
                10,
                "the hung store's leases to be lost",
            )
            # Let the healthy leases live through two full ttls after the hang began.
            wait_for(
                lambda: (
                    time.monotonic() > outcome.blackholed_at + 2 * TTL
                    or any(lease.resource in outcome.lost for lease in outcome.healthy)
                ),
                10,
                "two ttls",
            )
        finally:
            renewer.shutdown()
            proxy.heal()
            hung_store.close()
            healthy_store.close()
    return outcome


def report(outcome: Outcome) -> None:
    for resource, (reason, at, deadline) in sorted(outcome.lost.items()):
        print(f"{resource}: lost ({reason}) {1000 * (at - deadline):+.1f} ms after its deadline")


def test_a_hung_store_costs_only_its_own_leases(redis_server):
    """Healthy leases keep renewing; the hung store's are lost right at their deadline."""
    outcome = run(redis_server, Renewer())
    report(outcome)
    assert not [lease.resource for lease in outcome.healthy if lease.resource in outcome.lost]
    for lease in outcome.healthy:
        # Renewed (sent) well after the hang began: not merely not yet declared lost.
        assert lease.sent_monotonic > outcome.blackholed_at + TTL, lease.resource
    for lease in outcome.hung:
        reason, at, deadline = outcome.lost[lease.resource]
        assert reason == "renew_failed"
        assert deadline - 0.01 <= at < deadline + LATE, (lease.resource, at - deadline)


def test_negative_control_one_lane_loses_the_healthy_leases(redis_server):
    """With one lane the healthy store's renewals wait behind the hung call: the test sees it."""
    outcome = run(redis_server, Renewer(lanes=1))
    report(outcome)
    assert [lease.resource for lease in outcome.healthy if lease.resource in outcome.lost]
