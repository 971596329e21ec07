"""The Redis scripts' wait-list fast paths decide exactly as the full paths do.

Two of the Redis scripts' steps skip reading and rewriting every line of a wait list: a claim by
the list's first waiter on a free resource cuts its line off the text, and a release with no
wake in flight reads only up to the line it wakes and edits that line (the "!!<resource>" mark
tells it no wake is in flight). Here two stores share one server: one with the scripts as
shipped, one with both fast paths switched off in the script text (the full paths). A seeded
random run of claims (newcomers, re-armed waiters, woken heads, copies of older attempts,
retried claims, with and without a place, early-wake claims), releases (with and without an
outcome) and lapses (places, leases and graces that run out) is applied to both in lockstep, on
a resource each, and after every step their answers and wait lists (order, woken) must agree.

The steps come in bursts at fixed 0.5 s periods. Every time a step sets (a grace of 0.2 s, its
hold of 10 graces after a missed wake, leases and places of 0.3, 0.8 or 60 s) ends 0.2-0.3 s plus
a multiple of the period after it, so it ends between bursts, never between the two stores'
runs of one step: both see the same side of every deadline. A run with a burst that took too
long for that (a loaded machine) proves nothing and is run again.

The negative controls break one fast path each (the release ignores the in-flight mark; the
claim takes the first line even when it has lapsed) and show the comparison catches it.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from celery_lease import IdentityDoneError, LeaseBusyError, Owner
from celery_lease.stores.redis import scripts as lua
from celery_lease.stores.redis.connection import Script
from tests.conftest import make_store, redis_admin

PERIOD = 0.5  # seconds between burst starts
GRACE = 0.2
SHORT = 0.3  # a lease or place that lapses before the next burst
LONG = 60.0
NAMES = [f"w{k}" for k in range(5)]

#: The text that turns each fast path on, and what turns it off (the full path).
CLAIM_FAST = "if member and wgot[1] and string.sub(wgot[1], 1, #ARGV[5] + 1) == ARGV[5] .. ' ' then"
RELEASE_FAST = "if tonumber(waiting[3] or '0') <= now then"
#: The negative controls' breakages.
BROKEN = {
    "release_ignores_in_flight": (RELEASE_FAST, "if true then"),
    "claim_takes_lapsed_head": ("if free and e and tonumber(e) > now and", "if free and e and"),
    "claim_ignores_older_attempt": (
        "not (ARGV[12] ~= '' and a ~= '' and tonumber(ARGV[12]) < tonumber(a))",
        "true",
    ),
    "claim_ignores_holder": ("free = tonumber(e) <= now", "free = true"),
}


def patched(source: str, swaps: list[tuple[str, str]]) -> str:
    for old, new in swaps:
        assert old in source, f"the script no longer holds {old!r}: update this test"
        source = source.replace(old, new)
    return source


def with_scripts(store: Any, swaps: list[tuple[str, str]]) -> Any:
    """``store`` with its claim and release scripts' text changed by ``swaps``."""
    for attr, name in (
        ("_acquire", "ACQUIRE"),
        ("_release", "RELEASE"),
        ("_release_outcome", "RELEASE_OUTCOME"),
    ):
        source = getattr(lua, name)
        if any(old in source for old, _ in swaps):
            source = patched(source, [(o, n) for o, n in swaps if o in source])
        setattr(store, attr, Script(store._connections, source))
    return store


FULL = [(CLAIM_FAST, "if false then"), (RELEASE_FAST, "if false then")]


class Side:
    """One store, its resource, and what the run holds there."""

    def __init__(self, store: Any, resource: str) -> None:
        store.handoff_grace = GRACE
        self.store = store
        self.resource = resource
        self.lease: Any = None  # the lease the run holds, if any
        self.owners: dict[str, Owner] = {}  # each name's last owner (a retried claim reuses it)

    def claim(self, name: str, retry: bool, wait: bool, ttl: float, attempt: int | None) -> Any:
        owner = self.owners.get(name) if retry else None
        owner = owner or Owner.new(f"host:1:{name}")
        self.owners[name] = owner
        try:
            lease = self.store.acquire(
                self.resource,
                owner,
                ttl,
                identity=name,
                wait=f"{name}-payload" if wait else None,
                wait_ttl=ttl,
                attempt=attempt,
                early_wake=True,
                own_wake=True,
            )
        except LeaseBusyError as busy:
            return ("busy", busy.holder_label, busy.duplicate, busy.position, busy.wake)
        except IdentityDoneError as done:
            return ("done", done.owner_label)
        self.lease = lease
        assert lease.own_wake in (None, f"{name}-payload")
        return (
            "claimed",
            name,
            lease.identity_state,
            lease.recovered,
            lease.next_wake,
            lease.own_wake,
        )

    def release(self, outcome: str | None) -> Any:
        lease, self.lease = self.lease, None
        if lease is None:
            return ("nothing held",)
        released = self.store.release(lease, outcome=outcome, result="1" if outcome else None)
        return ("released", released, lease.handoff)

    def sweep(self) -> Any:
        return ("swept", self.store.sweep_expired(limit=1000))

    def view(self) -> list[tuple[str, bool]]:
        return [(w.identity, w.woken) for w in self.store.waiters(self.resource)]


class Steps:
    """The random steps (the same for both sides), weighted towards what the fast paths meet:
    claims by the list's head, copies of an older attempt, places that lapse."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.attempts = dict.fromkeys(NAMES, 0)  # each name's current attempt

    def next(self, waiting: list[tuple[str, bool]]) -> tuple[str, tuple[Any, ...]]:
        rng = self.rng
        if rng.random() < 0.3:
            return "release", (rng.choice([None, None, "retry", "done"]),)
        if waiting and rng.random() < 0.5:
            name = waiting[0][0] if rng.random() < 0.7 else rng.choice(waiting)[0]
        else:
            name = rng.choice(NAMES)
        if rng.random() < 0.1:
            self.attempts[name] += 1
        current = self.attempts[name]
        roll = rng.random()
        attempt = None if roll < 0.15 else current - 1 if roll < 0.35 and current else current
        return "claim", (
            name,
            rng.random() < 0.1,  # retried: the same owner again (a claim whose reply was lost)
            rng.random() < 0.9,  # with a place
            SHORT if rng.random() < 0.4 else LONG,
            attempt,
        )


def hold(name: str) -> tuple[str, tuple[Any, ...]]:
    return "claim", (name, False, False, LONG, None)  # a claim without a place, held long


def wait(name: str, ttl: float = LONG) -> tuple[str, tuple[Any, ...]]:
    return "claim", (name, False, True, ttl, None)  # a claim with a place (refused: listed)


RELEASE = ("release", (None,))

#: Runs that reach the rarer branches for certain (each period a burst of steps).
SCENARIOS: dict[str, list[list[tuple[str, tuple[Any, ...]]]]] = {
    # the first line has lapsed (a free resource held for the next waiter): not the fast claim
    "lapsed head": [
        [hold("h"), wait("w0", SHORT), wait("w1")],
        [RELEASE, wait("w0"), wait("w1")],
    ],
    # a release while a wake is in flight wakes nobody (after a missed wake nothing is held)
    "release in flight": [
        [hold("h"), wait("w0"), wait("w1"), wait("w2"), wait("w3"), RELEASE],
        [hold("w1"), RELEASE, hold("w4"), RELEASE, wait("w2"), wait("w3")],
    ],
    # the claiming head leaves only lapsed lines: the list ends, and with it the hold after
    # the head's missed wake (review: the fast claim kept it)
    "only lapsed lines behind": [
        [hold("h"), wait("w0"), wait("w1", SHORT), RELEASE],
        [wait("w0"), wait("y"), RELEASE, hold("z")],
    ],
    # the claiming head had the list's latest lapse: a sweep once the rest lapsed ends the list
    # and its hold (review: the fast claim left the lapse index at the head's lapse)
    "latest lapse claimed": [
        [hold("h"), wait("w0"), wait("w1", 0.8), RELEASE],
        [wait("w0")],
        [("sweep", ()), wait("y"), RELEASE, hold("z")],
    ],
    # a copy of an older attempt at the head claims as nobody listed
    "older attempt": [
        [hold("h"), ("claim", ("w0", False, True, LONG, 2)), RELEASE],
        [("claim", ("w0", False, True, LONG, 1)), ("claim", ("w0", False, True, LONG, 2))],
    ],
}


def compare(fast: Side, full: Side, plan: Any, periods: int, what: str) -> str | None:
    """Run both sides in lockstep, ``plan(period, waiting)`` giving each period's steps; the
    first disagreement, or None."""
    start = time.monotonic()
    history: list[str] = []
    for period in range(periods):
        # (every deadline ends 0.2-0.3 s into a period; a burst takes a few ms)
        pause = start + period * PERIOD - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        for kind, args in plan(period, fast.view):
            answers = [getattr(side, kind)(*args) for side in (fast, full)]
            views = [fast.view(), full.view()]
            history.append(f"{period}: {kind}{args} -> {answers[0]}; list {views[0]}")
            if answers[0] != answers[1] or views[0] != views[1]:
                if time.monotonic() - start - period * PERIOD >= 0.15:
                    raise Overran(f"{what}: period {period}'s burst ran past 0.15 s")
                return (
                    f"{what}, period {period}: {kind}{args}\n"
                    f"  fast: {answers[0]}, list {views[0]}\n"
                    f"  full: {answers[1]}, list {views[1]}\n"
                    "steps so far:\n  " + "\n  ".join(history[-25:])
                )
        if time.monotonic() - start - period * PERIOD >= 0.15:
            raise Overran(f"{what}: period {period}'s burst ran past 0.15 s")
    return None


class Overran(Exception):
    """A burst ran so long (a loaded machine) that a deadline may have fallen between the two
    stores' runs of one step: the comparison proves nothing either way, so it is run again."""


def compare_until_timely(sides: Any, swaps: list[tuple[str, str]], run: int) -> str | None:
    """``compare`` on fresh sides for run ``run``, again (up to eight tries) while bursts
    overran; a box too loaded for every try proves nothing either way: the test is skipped
    (saying so), not failed."""
    for _ in range(8):
        what, plan, periods = runs()[run]
        try:
            return compare(*sides(swaps), plan, periods, what)
        except Overran as overran:
            print(f"{overran}: running it again")
            last = overran
    pytest.skip(f"every try overran on a loaded machine (last: {last})")


def random_plan(seed: int) -> Any:
    steps = Steps(seed)
    rng = random.Random(seed)

    def plan(period: int, view: Any) -> Any:
        for _ in range(rng.randint(1, 6)):
            yield steps.next(view())

    return plan


def scenario_plan(name: str) -> Any:
    return lambda period, view: SCENARIOS[name][period] if period < len(SCENARIOS[name]) else []


@pytest.fixture
def sides(request, tmp_path):
    def make(swaps_fast: list[tuple[str, str]]) -> tuple[Side, Side]:
        a = with_scripts(make_store("redis", request, tmp_path), swaps_fast)
        b = with_scripts(make_store("redis", request, tmp_path), FULL)
        request.addfinalizer(a.close)
        request.addfinalizer(b.close)
        return Side(a, "hot"), Side(b, "hot")

    return make


def runs() -> list[tuple[str, Any, int]]:
    """Every run: the scenarios, then three seeded random runs of 24 periods."""
    out = [(f"scenario {n!r}", scenario_plan(n), len(p) + 1) for n, p in SCENARIOS.items()]
    return out + [(f"seed {seed}", random_plan(seed), 24) for seed in (11, 12, 13)]


@pytest.mark.parametrize("run", range(len(SCENARIOS) + 3))
def test_fast_paths_decide_as_the_full_paths(sides, run):
    mismatch = compare_until_timely(sides, [], run)
    assert mismatch is None, mismatch


@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_negative_control_a_broken_fast_path_is_caught(sides, breakage):
    for run in range(len(runs())):  # until one tells the broken fast path apart
        caught = compare_until_timely(sides, [BROKEN[breakage]], run)
        if caught:
            print(caught)
            return
    raise AssertionError(f"{breakage}: no run told the broken fast path apart")


def test_the_in_flight_mark_is_set_by_a_wake_and_dropped_when_its_waiter_claims(request, tmp_path):
    """The mark the release's fast path reads: set by each wake, dropped once the woken waiter
    claims, gone with the list. (Were it left behind, every release within the grace of the
    last wake would take the full path: slower, not wrong, so the comparisons above cannot
    tell.)"""
    store = make_store("redis", request, tmp_path)
    request.addfinalizer(store.close)
    side = Side(store, "marked")
    (waits,) = store._keys(store.shard_of("marked"), "waits")

    def mark() -> Any:
        with redis_admin(store) as admin:
            return admin.hget(waits, "!!marked")

    side.claim("h", False, False, LONG, None)
    for name in ("w0", "w1"):
        assert side.claim(name, False, True, LONG, None)[0] == "busy"
    assert mark() is None
    assert side.release(None)[2] == "w0-payload"  # wakes w0
    assert mark() is not None
    assert side.claim("w0", False, True, LONG, None)[0] == "claimed"
    assert mark() is None  # the woken waiter left the list
    assert side.release(None)[2] == "w1-payload"
    assert mark() is not None
    side.claim("x", False, False, LONG, None)  # (held for w1: refused)
    assert side.claim("w1", False, True, LONG, None)[0] == "claimed"
    assert side.view() == [] and mark() is None  # the list is gone, and its mark
