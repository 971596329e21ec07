"""lease_routes with real workers: plain tasks leased by configuration alone.

The workers run ``tests.integration.routes_app``, whose tasks (``routed_tasks``: plain
``@app.task``; ``tests.routed_pkg``: ``@shared_task``, an "installed package") import nothing
from celery_lease. ``CL_ROUTES`` gives the app its ``lease_routes``; without it (the negative
controls) the same calls overlap and a paused holder's write lands after its successor's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import pytest

from tests.integration.harness import check_exclusion, sigstop_outside_store, wait_results
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "tests.integration.routes_app"
TTL = 1.0
#: The tasks, sent by name (this process does not import the task modules).
HOLD = "tests.integration.routed_tasks.hold"
SYNC = "tests.routed_pkg.tasks.sync_account"
ROUTES = {
    "tests.integration.routed_tasks.*": {"resource": "res-{n}"},
    "tests.routed_pkg.*": {"resource": "account-{account}", "ttl": 2.0},
}


@pytest.fixture
def routes_app(it_app: Any) -> Any:
    """The routes app in the test process (publishing only), on the session's broker."""
    import importlib

    module = importlib.import_module(APP)
    module.app.conf.broker_url = os.environ["CL_BROKER"]
    module.app.conf.result_backend = os.environ["CL_BACKEND"]
    return module.app


def _env(store_env: Any, kind: str, routed: bool) -> dict[str, str]:
    env = {**store_env(kind), "CL_TTL": str(TTL)}
    if routed:
        env["CL_ROUTES"] = json.dumps(ROUTES)
    return env


def _overlaps(log: list[dict[str, Any]]) -> int:
    """How many times a body entered a resource another body was inside."""
    inside: dict[Any, int] = {}
    overlaps = 0
    for event in log:
        if event["ev"] == "enter":
            overlaps += inside.get(event["res"], 0) > 0
            inside[event["res"]] = inside.get(event["res"], 0) + 1
        elif event["ev"] == "exit":
            inside[event["res"]] -= 1
    return overlaps


def _run_calls(routes_app: Any, queue: str, seed: int) -> list[Any]:
    rng = random.Random(seed)
    send = routes_app.send_task
    results = [send(HOLD, (rng.randrange(2),), {"hold": 0.1}, queue=queue) for _ in range(12)]
    results += [
        send(SYNC, (f"a{rng.randrange(2)}",), {"hold": 0.1}, queue=queue) for _ in range(12)
    ]
    return results


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_routed_plain_and_shared_tasks_never_overlap(
    routes_app, start_worker, store_env, events, queue, kind
):
    """24 calls over 4 resources on 2 workers x 2: a plain @app.task and a @shared_task, leased
    only by lease_routes, never share a resource, and each resource's fences rise."""
    env = _env(store_env, kind, routed=True)
    for _ in range(2):
        start_worker(env, queue=queue, concurrency=2, app=APP)
    seed = random.randrange(1 << 30)
    print(f"seed={seed} store={kind}")
    fences = wait_results(_run_calls(routes_app, queue, seed), timeout=180)
    log = events.all()
    per_resource = check_exclusion([e for e in log if e["ev"] in ("enter", "exit")])
    assert all(isinstance(fence, int) for fence in fences)
    assert set(per_resource) <= {0, 1, "a0", "a1"}
    assert sum(len(v) for v in per_resource.values()) >= 24


def test_negative_control_without_routes_the_same_calls_overlap(
    routes_app, start_worker, store_env, events, queue
):
    """The same workers and calls without CL_ROUTES: the bodies overlap, no fence is held."""
    env = _env(store_env, "redis", routed=False)
    for _ in range(2):
        start_worker(env, queue=queue, concurrency=2, app=APP)
    fences = wait_results(_run_calls(routes_app, queue, random.randrange(1 << 30)), timeout=180)
    assert fences == [None] * len(fences)
    assert _overlaps(events.all()) > 0


def _stale_writes(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Writes by the paused first holder (tag A, its first execution) that landed after the
    second holder (tag B) wrote to the same resource."""
    first = next(e for e in log if e["ev"] == "enter" and e["tag"] == "A")
    b_wrote = [i for i, e in enumerate(log) if e["ev"] == "write" and e["tag"] == "B"]
    if not b_wrote:
        return []
    return [
        e
        for e in log[b_wrote[0] :]
        if e["ev"] == "write"
        and e["tag"] == "A"
        and e["task"] == first["task"]
        and e["fence"] == first["fence"]
    ]


def _paused_holder(routes_app, start_worker, env, events, queue, coord) -> list[dict[str, Any]]:
    """A's body enters and waits; its pool process is SIGSTOPped past the ttl; B takes the
    resource and writes; then A is let go (SIGCONT) to write. Returns the event log."""
    worker_a = start_worker(env, queue=queue + "-a", concurrency=1, app=APP)
    start_worker(env, queue=queue + "-b", concurrency=1, app=APP)
    go = events.key_for("go")
    first = routes_app.send_task(HOLD, (7,), {"go": go, "tag": "A"}, queue=queue + "-a")
    entered = events.wait(timeout=60, ev="enter", tag="A")
    pid = entered["pid"]
    assert worker_a.owns(pid)
    sqlite = env["CL_STORE"].removeprefix("sqlite:///") if "sqlite" in env["CL_STORE"] else None
    sigstop_outside_store(pid, sqlite)
    try:
        time.sleep(TTL * 2.5)
        second = routes_app.send_task(HOLD, (7,), {"hold": 0.05, "tag": "B"}, queue=queue + "-b")
        events.wait(timeout=60, ev="exit", tag="B")
    finally:
        coord.set(go, 1)
        os.kill(pid, signal.SIGCONT)
    second.get(timeout=60)
    first.get(timeout=90)  # (routed: its re-run after the lost lease; plain: its only run)
    wait_for(lambda: events.where(ev="exit", tag="A"), 30, "A to exit")
    return events.all()


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_a_paused_routed_holder_is_fenced_out(
    routes_app, start_worker, store_env, events, queue, coord, kind
):
    """The paused holder of a routed plain task never writes after its successor: its write
    is refused at the gate or it stops on its own, and it runs again with a newer fence."""
    log = _paused_holder(
        routes_app, start_worker, _env(store_env, kind, True), events, queue, coord
    )
    a_first = next(e for e in log if e["ev"] == "enter" and e["tag"] == "A")
    b = next(e for e in log if e["ev"] == "enter" and e["tag"] == "B")
    assert b["fence"] > a_first["fence"]
    assert _stale_writes(log) == []
    written = [e["fence"] for e in log if e["ev"] == "write"]
    assert written == sorted(written) and a_first["fence"] not in written
    rerun = [e for e in log if e["ev"] == "enter" and e["tag"] == "A"][-1]
    assert rerun["fence"] > b["fence"]


def test_negative_control_a_paused_plain_holder_writes_late(
    routes_app, start_worker, store_env, events, queue, coord
):
    """Without the route, the paused holder's write lands after its successor's."""
    log = _paused_holder(
        routes_app, start_worker, _env(store_env, "redis", False), events, queue, coord
    )
    assert len(_stale_writes(log)) == 1
