"""Publish order under a skewed publisher clock, and which resources ``wake_due`` counts against
its limit (invariants 12 and 16 of protocol.py), over every store.

Every store: memory, Redis, Redis Cluster, SQLite, and PostgreSQL with and without its
wait-list functions (the one-statement forms). The stores read their own clock; the tests stamp
publish times from this host's clock, which is the servers' clock too (they run on loopback).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from celery_lease import LeaseBusyError, Owner
from celery_lease.stores._bounds import SINCE_SKEW, WAKE_DUE_SKIP
from tests.conftest import make_store, store_or_fallback
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
    yield from store_or_fallback(request.param, request, tmp_path)


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


def beside(store: Any, resource: str, prefix: str) -> str:
    """A resource name in ``resource``'s Redis shard (a store without shards: the first), so
    that Redis's per-shard limit is the limit over both."""
    shard_of = getattr(store, "shard_of", None)
    for k in itertools.count():
        name = f"{prefix}{k}"
        if shard_of is None or shard_of(name) == shard_of(resource):
            return name
    raise AssertionError("unreachable")


def free_with_waiter(store: Any, resource: str, who: str, wait_ttl: float) -> None:
    """``resource`` with a holder that died (its lease ran out) and ``who`` waiting. (The
    holder's lease lasts a second: with 0.3 s a loaded box let it run out before the waiter's
    claim, which then took the resource instead of being listed.)"""
    claim(store, resource, "dead", ttl=1.0)
    listed(store, resource, who, wait_ttl=wait_ttl)
    wait_for(lambda: store.get(resource).expires_in <= 0, 5, "the holder's lease to run out")


class TestWakeDueLimit:
    """Invariant 16: ``wake_due(limit=n)`` passes the turn on at the first ``n`` resources that
    could take it (a wait list with a live place, no live lease), by when their lists lapse."""

    def test_a_held_resource_does_not_count_against_the_limit(self, every, names):
        """The reviewer's case (F8): 'a-held' is held, its waiter's place lapses first;
        'b-free' lost its holder and has a waiter listed later. Before, memory and Redis
        counted a-held against the limit, then skipped it: nothing was woken."""
        held = names + "a-held"
        free = beside(every, held, names + "b-free")
        claim(every, held, "h")
        listed(every, held, "wa", wait_ttl=100)
        free_with_waiter(every, free, "wb", wait_ttl=200)
        due = every.wake_due(limit=1)
        assert [(d.resource, d.payload, d.again) for d in due] == [(free, "payload-wb", False)]
        assert every.waiters(held)[0].woken is False  # (its holder's release wakes it)

    def test_a_list_whose_places_all_lapsed_does_not_count_against_the_limit(self, every, names):
        """A free resource whose every place lapsed (not swept yet) has nobody to wake: it
        lapses first, so it came first. Before, SQL kept counting it on every pass until the
        sweep; memory and Redis counted it once."""
        gone = names + "a-gone"
        free = beside(every, gone, names + "b-free")
        free_with_waiter(every, gone, "wa", wait_ttl=0.3)
        free_with_waiter(every, free, "wb", wait_ttl=200)
        wait_for(lambda: every.waiters(gone) == [], 5, "the place to lapse")
        due = every.wake_due(limit=1)
        assert [(d.resource, d.payload) for d in due] == [(free, "payload-wb")]

    def test_the_limit_counts_the_free_resources_in_order_of_their_lists_lapse(self, every, names):
        """Three held and three free resources, interleaved: limit 2 wakes the first two free
        ones. A free resource whose wake is in flight still counts (the pass reads its list to
        know), so limit 3 then wakes the third."""
        first = names + "r0"
        rs = [first, *(beside(every, first, f"{names}r{k}-") for k in range(1, 6))]
        for k, r in enumerate(rs):
            if k % 2:
                free_with_waiter(every, r, f"w{k}", wait_ttl=100 + k)
            else:
                claim(every, r, "h")
                listed(every, r, f"w{k}", wait_ttl=100 + k)
        assert [d.resource for d in every.wake_due(limit=2)] == [rs[1], rs[3]]
        assert every.wake_due(limit=2) == []
        assert [d.resource for d in every.wake_due(limit=3)] == [rs[5]]


class TestRedisWakeDueBound:
    def test_a_pass_reads_past_at_most_the_bound_of_held_resources(self, request, tmp_path, names):
        """Redis reads a shard's list index in Lua: it skips at most ``WAKE_DUE_SKIP`` held
        resources per shard and call (the cost of a call stays bounded), so a free resource
        behind more of them waits for its waiters' own copies, or a pass once fewer are held."""
        store = make_store("redis", request, tmp_path, shards=1)
        request.addfinalizer(store.close)
        for k in range(WAKE_DUE_SKIP):
            claim(store, f"{names}h{k}", "h")
            listed(store, f"{names}h{k}", "w", wait_ttl=100)
        free = names + "free"
        free_with_waiter(store, free, "wb", wait_ttl=200)
        assert [d.resource for d in store.wake_due(limit=1)] == [free]
        store.release(claim(store, free, "wb"))  # (it claims: the list is gone)
        free_with_waiter(store, free, "wc", wait_ttl=200)
        claim(store, names + "one-more", "h")
        listed(store, names + "one-more", "w", wait_ttl=100)
        assert store.wake_due(limit=1) == []  # past the bound
        assert [d.resource for d in store.wake_due(resources=[free])] == [free]
