"""A listed waiter whose copy gave up (real workers, review 4): its FAILURE stays.

A refused waiter lists a place (with its wake message) and re-queues a back-stop copy. When a
back-stop copy ends FAILURE without claiming (``busy_max_waits`` ran out: "gave up after N busy
waits"; or its worker could not reach the store for ``lease_store_down_max_wait``), the place its
earlier copy listed is still there, and the next release wakes it. The
woken copy must not run the body: the task's FAILURE stays and only its errback runs.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import unique
from tests.integration.harness import backend_meta

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]


def _callback(label: str, it_app: object, queue: str) -> object:
    return it_app.note_callback.s(label=label).set(queue=queue)  # type: ignore[attr-defined]


def _wait_state(result: object, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and result.state != state:  # type: ignore[attr-defined]
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("kind", "pool", "check"),
    [
        ("redis", "threads", "on"),
        ("postgres", "prefork", "on"),
        ("redis", "threads", "off"),
    ],
)
def test_a_waiter_that_gave_up_stays_failed_when_its_place_is_woken(
    it_app, start_worker, store_env, events, queue, kind, pool, check
):
    """Holder (6 s), waiter W with busy_max_waits=2: W's back-stop copy gives up (FAILURE,
    errback). The holder's release then wakes the place W's previous copy listed: the woken
    copy must end unrun (it reads W's FAILURE in the result backend, gives the resource back).
    Negative control (``off``: that read off): the woken copy runs the body, FAILURE becomes
    SUCCESS, link and link_error both run. Failed before: body ran once, SUCCESS, callbacks
    ["err", "link"] (redis, postgres, sqlite)."""
    env = {**store_env(kind), "CL_TTL": "1", "CL_BACKOFF_CAP": "1.0"}
    if check == "off":
        env["CL_GAVE_UP_READ"] = "off"
    start_worker(env, queue=queue, pool=pool, concurrency=4)
    n = unique("gu")
    holder = it_app.fifo_hold.apply_async((n, 0, 6.0), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_few_waits.apply_async(
        (n, 1, 0.1),
        queue=queue,
        link=it_app.note_callback.si(label="link").set(queue=queue),
        link_error=_callback("err", it_app, queue),
    )
    _wait_state(waiter, "FAILURE", 30)
    gave_up = backend_meta(it_app.app, [waiter.id])[waiter.id]
    assert holder.get(timeout=30) == 0
    nxt = it_app.fifo_hold.apply_async((n, 2, 0.1), queue=queue)
    assert nxt.get(timeout=30) == 2  # the resource was handed on
    time.sleep(3)  # any copy of the waiter still in flight has come by now
    final = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    print(
        f"[{kind}/{pool}/{check}] gave up: {gave_up['status']}; body runs {len(runs)}; "
        f"callbacks {callbacks}; final {final['status']} {str(final.get('result'))[:80]}"
    )
    assert gave_up["status"] == "FAILURE"
    assert "gave up after 2 busy waits" in str(gave_up.get("result"))
    if check == "off":
        assert len(runs) == 1 and final["status"] == "SUCCESS"
        return
    assert len(runs) == 0
    assert final["status"] == "FAILURE" and callbacks == ["err"]


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_waiter_that_gave_up_on_an_unreachable_store_stays_failed(
    it_app, start_worker, store_env, events, queue, check
):
    """Waiter W on a worker that reaches the store through a proxy: listed behind a 9 s
    holder, then the proxy drops everything until W's back-stop copy gives up (FAILURE
    LeaseStoreError after lease_store_down_max_wait=2 s, errback). The store is reachable
    again when the holder's release wakes W's place: the woken copy, listed longer ago than
    that budget, reads W's FAILURE and ends unrun. Negative control (``off``): the body runs,
    SUCCESS. Failed before: body ran once, final SUCCESS, callbacks ["err", "link"]."""
    from tests.tooling.proxy import TcpProxy

    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    port = int(env["CL_STORE"].rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        env_b = {**env, "CL_STORE": proxy.url_for(env["CL_STORE"]), "CL_STORE_DOWN_MAX_WAIT": "2"}
        if check == "off":
            env_b["CL_GAVE_UP_READ"] = "off"
        qa, qb = queue + "a", queue + "b"
        start_worker(env, queue=qa, pool="threads", concurrency=3)
        start_worker(env_b, queue=qb, pool="threads", concurrency=3)
        n = unique("sd")
        holder = it_app.fifo_hold.apply_async((n, 0, 9.0), queue=qa)
        events.wait(ev="enter", res=n, k=0)
        waiter = it_app.fifo_hold.apply_async(
            (n, 1, 0.1),
            queue=qb,
            link=it_app.note_callback.si(label="link").set(queue=qa),
            link_error=_callback("err", it_app, qa),
        )
        events.wait(ev="retry", task=waiter.id)  # refused and listed
        proxy.blackhole(drop=True)
        proxy.reset_all()
        _wait_state(waiter, "FAILURE", 30)
        gave_up = backend_meta(it_app.app, [waiter.id])[waiter.id]
        proxy.heal()
        assert holder.get(timeout=30) == 0
        nxt = it_app.fifo_hold.apply_async((n, 2, 0.1), queue=qa)
        assert nxt.get(timeout=30) == 2  # the resource was handed on
        time.sleep(3)
    final = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    print(
        f"[{check}] gave up: {gave_up['status']} {str(gave_up.get('result'))[:60]}; body runs "
        f"{len(runs)}; callbacks {callbacks}; final {final['status']}"
    )
    assert gave_up["status"] == "FAILURE"
    assert "lease_store_down_max_wait=2s" in str(gave_up.get("result"))
    if check == "off":
        assert len(runs) == 1 and final["status"] == "SUCCESS"
        return
    assert len(runs) == 0
    assert final["status"] == "FAILURE" and callbacks == ["err"]
