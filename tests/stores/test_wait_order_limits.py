"""Publish order under a skewed publisher clock (invariant 12 of base.py), over every store.

Every store: memory, Redis, Redis Cluster, SQLite, and PostgreSQL with and without its
wait-list functions (the one-statement forms). The stores read their own clock; the tests stamp
publish times from this host's clock, which is the servers' clock too (they run on loopback).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_lease import LeaseBusyError, Owner
from celery_lease.stores._bounds import SINCE_SKEW
from tests.conftest import make_store
from tests.tooling.servers import wait_for

LONG = 30.0
#: Slack for a store clock read against this host's (SQLite's julianday('now') has ms steps).
SLACK_US = 50_000


@pytest.fixture(
    params=(
        "memory",
        "redis",
        "redis_cluster",
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("postgres_fallback", marks=pytest.mark.postgres),
    )
)
def every(request, tmp_path):
    """Each store (the Redis Cluster one too), PostgreSQL also without its functions."""
    kind = request.param
    instance = make_store(kind.removesuffix("_fallback"), request, tmp_path)
    if kind == "postgres_fallback":
        instance.sql.use_functions(False)
        instance.ledger_sql.use_functions(False)
    elif kind == "postgres":
        assert instance.sql.acquire_raw is instance.sql.fast_raw[0]  # the functions
    try:
        yield instance
    finally:
        instance.close()


def now_us() -> int:
    return int(time.time() * 1e6)


def claim(store: Any, resource: str, who: str, **options: Any) -> Any:
    return store.acquire(
        resource, Owner.new(who), options.pop("ttl", LONG), identity=who, **options
    )


def listed(store: Any, resource: str, who: str, since: int | None = None, **options: Any) -> int:
    """The place a refused claim of ``who`` (published at ``since``) takes."""
    with pytest.raises(LeaseBusyError) as busy:
        claim(store, resource, who, wait=f"payload-{who}", since=since, **options)
    return busy.value.position


def order(store: Any, resource: str) -> list[str]:
    return [w.identity for w in store.waiters(resource)]


def publish_skewed(store: Any, resource: str, skew: float) -> list[str]:
    """The reviewer's case (F7), store side: H holds; A is published first (with a countdown,
    so its claim arrives last), B 10 ms after it (its claim arrives first), both stamped by a
    publisher clock ``skew`` seconds ahead of the store's. The order the releases hand over in."""
    lease = claim(store, resource, "h")
    published = now_us() + round(skew * 1e6)
    listed(store, resource, "b", published + 10_000)
    listed(store, resource, "a", published)
    handed = []
    for _ in range(2):
        store.release(lease)
        who = lease.handoff.removeprefix("payload-")
        handed.append(who)
        lease = claim(store, resource, who)
    return handed


class TestPublishTimeAhead:
    """A claim's ``since=`` ahead of the store's clock (a publisher's clock a little fast)."""

    @pytest.mark.parametrize("skew", [0.02, 0.05, 2.0])
    def test_a_publisher_clock_a_little_ahead_keeps_publish_order(self, every, names, skew):
        """A, published first, runs first. Before: a publish time ahead of the store's clock
        counted as now, so B's place (arrived first) was stamped earlier than A's."""
        assert publish_skewed(every, names + "r", skew) == ["a", "b"]

    def test_negative_control_without_the_tolerance_arrival_decides(self, every, names):
        """With no tolerance (the rule before), the same steps run B first: the test above
        tells the two apart."""
        every.since_skew = 0.0
        assert publish_skewed(every, names + "r", 0.05) == ["b", "a"]

    def test_a_publish_time_far_ahead_counts_as_the_tolerance_ahead(self, every, names):
        """An hour ahead is placed as ``SINCE_SKEW`` ahead of the store's clock: a claim arriving
        now (no publish time) or published before that goes ahead of it, one published after
        that behind it. Such a place is overtaken for no longer than the tolerance."""
        r = names + "r"
        skew = round(SINCE_SKEW * 1e6)
        claim(every, r, "h")
        before = now_us()
        assert listed(every, r, "far", before + 3600 * 10**6) == 1
        after = now_us()
        stamped = int(every.waiters(r)[0].since.timestamp() * 1e6)
        assert before + skew - SLACK_US <= stamped <= after + skew + SLACK_US
        assert listed(every, r, "plain") == 1
        assert listed(every, r, "near", before + skew - 500_000) == 2
        assert listed(every, r, "past", now_us() + skew + 500_000) == 4
        assert order(every, r) == ["plain", "near", "far", "past"]

    def test_a_place_stamped_ahead_is_woken_held_for_and_lapses_like_any_other(self, every, names):
        """The publish time only orders the list: the place's lapse, its wake, the hold for it
        and the pass over a dead holder's list run on the store's clock as for any place."""
        every.handoff_grace = 0.5
        ahead = now_us() + 2_000_000
        gone = names + "gone"  # a place stamped ahead lapses after its wait_ttl all the same
        claim(every, gone, "h")
        listed(every, gone, "a", ahead, wait_ttl=0.3)
        wait_for(lambda: every.waiters(gone) == [], 5, "the place to lapse")

        r = names + "r"
        lease = claim(every, r, "h")
        assert listed(every, r, "a", ahead) == 1
        assert listed(every, r, "b", ahead + 1) == 2
        every.release(lease)
        assert lease.handoff == "payload-a"
        with pytest.raises(LeaseBusyError) as busy:
            claim(every, r, "b", wait="payload-b", since=ahead)
        assert busy.value.position == 2  # held for a, woken: b waits behind it
        assert "(hand-off)" in busy.value.holder_label
        claim(every, r, "a")

        dead = names + "dead"  # a holder that dies: the pass wakes the place stamped ahead
        claim(every, dead, "h", ttl=0.3)
        listed(every, dead, "a", ahead)
        wait_for(lambda: every.get(dead).expires_in <= 0, 5, "the holder's lease to run out")
        woken = every.wake_due(resources=[dead])
        assert [(d.payload, d.again) for d in woken] == [("payload-a", False)]
