"""Exclusion with real workers: no two bodies inside one resource at once, fences increase."""

from __future__ import annotations

import random

import pytest

from tests.integration.harness import check_exclusion, wait_results

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASKS = 50
RESOURCES = 5


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent"])
@pytest.mark.parametrize("kind", ["redis", "postgres", "sqlite"])
def test_no_two_bodies_share_a_resource(it_app, start_worker, store_env, events, queue, pool, kind):
    """50 tasks over 5 resources on 2 workers x 2: the enter/exit log never overlaps."""
    env = {**store_env(kind), "CL_TTL": "5"}
    # A gevent worker runs Celery's blocking loop, which refills its prefetch window once
    # every 2 s: with one message per slot the run is mostly that wait. A wider window keeps
    # the same 2 x 2 bodies competing for the resources, without the wait.
    extra = ("--prefetch-multiplier", "8") if pool == "gevent" else ()
    for _ in range(2):
        start_worker(env, queue=queue, pool=pool, concurrency=2, extra_args=extra)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed={seed} N={TASKS} resources={RESOURCES} pool={pool} store={kind}")
    results = [
        it_app.exclusive.apply_async((rng.randrange(RESOURCES),), {"hold": 0.02}, queue=queue)
        for _ in range(TASKS)
    ]
    fences = wait_results(results, timeout=180)
    log = events.all()
    try:
        per_resource = check_exclusion(log)
    except AssertionError:
        for event in log:
            print(event)
        raise
    completed = sorted(e["fence"] for e in log if e["ev"] == "exit" and e["completed"])
    assert sorted(fences) == completed  # every result is a body that ran to its end
    assert sum(len(v) for v in per_resource.values()) >= TASKS


def test_checker_catches_an_overlap():
    """Negative control: the exclusion checker flags two bodies inside one resource."""
    overlapping = [
        {"ev": "enter", "res": 1, "fence": 1},
        {"ev": "enter", "res": 1, "fence": 2},
        {"ev": "exit", "res": 1, "fence": 1},
        {"ev": "exit", "res": 1, "fence": 2},
    ]
    with pytest.raises(AssertionError, match="overlap"):
        check_exclusion(overlapping)
    with pytest.raises(AssertionError, match="did not increase"):
        check_exclusion(
            [
                {"ev": "enter", "res": 1, "fence": 5},
                {"ev": "exit", "res": 1, "fence": 5},
                {"ev": "enter", "res": 1, "fence": 4},
            ]
        )
