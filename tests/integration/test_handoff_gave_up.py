"""A listed waiter whose copy gave up (real workers, review 4): its FAILURE stays.

A refused waiter lists a place (with its wake message) and re-queues a back-stop copy. When a
back-stop copy ends FAILURE without claiming (``busy_max_waits`` ran out: "gave up after N busy
waits"; or its worker could not reach the store for ``lease_store_down_max_wait``), the place its
earlier copy listed is still there, and the next release wakes it. The
woken copy must not run the body: the task's FAILURE stays and only its errback runs.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import unique
from tests.integration.harness import backend_meta
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]


def _callback(label: str, it_app: object, queue: str) -> object:
    return it_app.note_callback.s(label=label).set(queue=queue)  # type: ignore[attr-defined]


def _wait_state(result: object, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and result.state != state:  # type: ignore[attr-defined]
        time.sleep(0.1)


def _with_callbacks(it_app: Any, task: Any, n: str, qa: str, qb: str) -> Any:
    """Send waiter W (``task``, place 1 of resource ``n``) to ``qb``, with a link and an
    errback on ``qa`` that report their labels."""
    return task.apply_async(
        (n, 1, 0.1),
        queue=qb,
        link=it_app.note_callback.si(label="link").set(queue=qa),
        link_error=_callback("err", it_app, qa),
    )


def _busy_threads(it_app: Any, events: Any, n: str, qb: str, seconds: float) -> None:
    """Keep the three threads of ``qb``'s worker busy for ``seconds``: a wake sent to it
    meanwhile waits behind them."""
    for i in range(3):
        it_app.plain_step.apply_async((n, 100 + i, seconds), queue=qb)
    wait_for(lambda: len(events.where(ev="enter", res=n, plain=True)) == 3, 30, "blockers")


def _release_then_take(it_app: Any, events: Any, coord: Any, n: str, qa: str, grace: float) -> str:
    """H releases ``n`` (waking W's place); once ``grace`` seconds have passed (nothing is held
    for W then) X takes the free resource and holds it until its go key (returned) is set."""
    coord.rpush(events.key_for("go-h"), 1)
    released = events.wait(ev="exit", res=n, k=0)
    wait_for(lambda: time.time() > released["t"] + grace, 10, "the grace to pass")
    go_x: str = events.key_for("go-x")
    it_app.fifo_gate.apply_async((n, 2, go_x), queue=qa)
    events.wait(ev="enter", res=n, k=2, timeout=30)
    return go_x


def _give_up_on_the_store(
    it_app: Any, events: Any, proxy: Any, n: str, qa: str, qb: str, heal: bool = True
) -> tuple[Any, dict[str, Any]]:
    """Send waiter W to ``qb`` (whose worker reaches the store through ``proxy``) with a link
    and an errback on ``qa``; once it is listed, drop everything at the proxy until W's
    back-stop copy gives up on the store (FAILURE), then heal (unless not ``heal``). W and
    its FAILURE record."""
    waiter = _with_callbacks(it_app, it_app.fifo_hold, n, qa, qb)
    events.wait(ev="retry", task=waiter.id)  # refused and listed
    proxy.blackhole(drop=True)
    proxy.reset_all()
    _wait_state(waiter, "FAILURE", 60)
    gave_up = backend_meta(it_app.app, [waiter.id])[waiter.id]
    if heal:
        proxy.heal()
    return waiter, gave_up


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
        waiter, gave_up = _give_up_on_the_store(it_app, events, proxy, n, qa, qb)
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


@pytest.mark.parametrize("listed", ["first", "now"])
def test_a_place_re_armed_by_a_late_woken_copy_keeps_its_first_listing(
    it_app, start_worker, store_env, events, queue, coord, listed
):
    """Review 1: W on worker B (the store through a proxy) is listed behind holder H, then the
    proxy drops everything until W's back-stop copy gives up (FAILURE, store_down_max_wait
    4 s). Healed; B is busy with three plain tasks when H releases, so W's woken copy K waits
    past the 2 s grace and X takes the free resource. K is refused and re-arms W's place. X's
    release wakes it: that copy must read W's FAILURE (the place counts as listed from its
    first listing, more than half the budget ago) and end unrun. Negative control (``now``:
    the re-armed place counts as listed when re-armed, as before): the body runs, FAILURE
    becomes SUCCESS. Failed before: body ran once, callbacks ["err", "link"]."""
    from tests.tooling.proxy import TcpProxy

    # A 20 s back-stop countdown keeps W's place listed (wait_ttl = 20 + ttl + 10 s) until
    # after its back-stop copy gave up on the store.
    env = {
        **store_env("redis"),
        "CL_TTL": "2",
        "CL_BACKOFF_BASE": "20",
        "CL_BACKOFF_CAP": "20",
        "CL_STORE_DOWN_MAX_WAIT": "4",
        # (no turn checks: one sends K's missed wake once more, a copy that carries the first
        # listing and ends unrun in the negative control too, hiding what it shows)
        "CL_PASS_THE_TURN": "0",
    }
    if listed == "now":
        env["CL_LISTED_AT"] = "now"
    port = int(env["CL_STORE"].rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        env_b = {**env, "CL_STORE": proxy.url_for(env["CL_STORE"])}
        qa, qb = queue + "a", queue + "b"
        start_worker(env, queue=qa, pool="threads", concurrency=3)
        worker_b = start_worker(env_b, queue=qb, pool="threads", concurrency=3)
        n = unique("ra")
        it_app.fifo_gate.apply_async((n, 0, events.key_for("go-h")), queue=qa)
        events.wait(ev="enter", res=n, k=0)
        waiter, gave_up = _give_up_on_the_store(it_app, events, proxy, n, qa, qb)
        _busy_threads(it_app, events, n, qb, 6.0)  # the wake waits in qb.lease-wake
        go_x = _release_then_take(it_app, events, coord, n, qa, 3.0)
        # K comes once the blockers end: refused (X holds), it re-arms W's place
        events.wait(ev="requeued", task=waiter.id, timeout=40)
        coord.rpush(go_x, 1)  # X releases: wakes the re-armed place
        events.wait(ev="exit", res=n, k=2)
        wait_for(
            lambda: (
                events.where(ev="callback", label="link")
                or "dropped a copy of a finished task" in worker_b.log()
            ),
            30,
            "the copy woken from the re-armed place to end",
        )
    final = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    print(f"[{listed}] body runs {len(runs)}; callbacks {callbacks}; final {final['status']}")
    assert gave_up["status"] == "FAILURE"
    if listed == "now":
        assert len(runs) == 1 and final["status"] == "SUCCESS"
        return
    assert len(runs) == 0
    assert final["status"] == "FAILURE" and callbacks == ["err"]


def test_a_late_refused_copy_of_a_waiter_that_gave_up_does_not_fail_it_again(
    it_app, start_worker, store_env, events, queue, coord
):
    """Review 1: W (busy_max_waits=2) gives up (FAILURE, link_error). Its place's woken copy
    comes late (B busy past the grace), X took the resource meanwhile, and the copy is refused
    at its last allowed wait: it must end unrun (W's FAILURE is stored, its errback ran), not
    give up a second time. Failed before: link_error ran twice (["err", "err"])."""
    env = {**store_env("redis"), "CL_TTL": "1", "CL_BACKOFF_CAP": "1.0"}
    qa, qb = queue + "a", queue + "b"
    start_worker(env, queue=qa, pool="threads", concurrency=3)
    worker_b = start_worker(env, queue=qb, pool="threads", concurrency=3)
    n = unique("gb")
    it_app.fifo_gate.apply_async((n, 0, events.key_for("go-h")), queue=qa)
    events.wait(ev="enter", res=n, k=0)
    waiter = _with_callbacks(it_app, it_app.fifo_few_waits, n, qa, qb)
    _wait_state(waiter, "FAILURE", 30)
    _busy_threads(it_app, events, n, qb, 6.0)
    go_x = _release_then_take(it_app, events, coord, n, qa, 3.0)
    dropped = "dropped a copy of a finished task"
    wait_for(
        lambda: dropped in worker_b.log() or len(events.where(ev="callback")) >= 2,
        40,
        "the late woken copy to end",
    )
    coord.rpush(go_x, 1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    assert callbacks == ["err"], callbacks
    assert dropped in worker_b.log()
    assert not events.where(ev="enter", res=n, k=1)


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_back_stop_copy_at_its_last_wait_ends_unrun_after_its_woken_copy_gave_up(
    it_app, start_worker, store_env, events, queue, coord, check
):
    """Review 2: W (busy_max_waits=2) is listed behind H; its back-stop copy B1 is refused and
    re-arms W's place, sending back-stop B2 (its last allowed wait) 10-20 s later. H releases
    while worker B is busy, so W's woken copy K comes past the grace, X holds the resource by
    then, and K, refused at its last wait, gives up (FAILURE, errback). X releases. B2 then
    claims a free resource: it must read W's FAILURE before its claim and end unrun.
    Negative control (``off``: no copy reads its task's state): B2 runs the body, FAILURE
    becomes SUCCESS. Failed before: body ran once, callbacks ["err", "link"] (B2 sends no
    place to wake, and only copies that sent one read before their claim)."""
    env = {
        **store_env("redis"),
        "CL_TTL": "1",
        "CL_BACKOFF_BASE": "20",
        "CL_BACKOFF_CAP": "20",
        "CL_HANDOFF_GRACE": "1",
    }
    if check == "off":
        env["CL_FINISHED_READ"] = "off"
    qa, qb = queue + "a", queue + "b"
    start_worker(env, queue=qa, pool="threads", concurrency=3)
    worker_b = start_worker(env, queue=qb, pool="threads", concurrency=3)
    n = unique("lw")
    it_app.fifo_gate.apply_async((n, 0, events.key_for("go-h")), queue=qa)
    events.wait(ev="enter", res=n, k=0)
    waiter = _with_callbacks(it_app, it_app.fifo_few_waits, n, qa, qb)
    events.wait(ev="retry", task=waiter.id)  # listed
    events.wait(ev="requeued", task=waiter.id, timeout=40)  # B1 refused: re-armed, B2 sent
    _busy_threads(it_app, events, n, qb, 5.0)  # K waits behind them
    go_x = _release_then_take(it_app, events, coord, n, qa, 2.0)  # K woken, X holds
    events.wait(ev="failure", task=waiter.id, timeout=40)  # K refused at its last wait
    gave_up = backend_meta(it_app.app, [waiter.id])[waiter.id]
    coord.rpush(go_x, 1)
    events.wait(ev="exit", res=n, k=2)
    wait_for(
        lambda: (
            "dropped a copy of a finished task" in worker_b.log()
            or events.where(ev="callback", label="link")
        ),
        40,
        "back-stop copy B2 to end",
    )
    final = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    print(f"[{check}] gave up {gave_up['status']}; body runs {len(runs)}; callbacks {callbacks}")
    assert gave_up["status"] == "FAILURE"
    assert "gave up after 2 busy waits" in str(gave_up.get("result"))
    if check == "off":
        assert len(runs) == 1 and final["status"] == "SUCCESS"
        return
    assert len(runs) == 0
    assert final["status"] == "FAILURE" and callbacks == ["err"]


@pytest.mark.parametrize(("heal", "check"), [("never", "on"), ("after", "on"), ("never", "off")])
def test_a_woken_copy_on_an_unreachable_store_ends_unrun_after_its_waiter_gave_up(
    it_app, start_worker, store_env, events, queue, coord, heal, check
):
    """Review 2: W on worker B (the store through a proxy) is listed behind H; the proxy drops
    everything until W's back-stop copy gives up on the store (FAILURE, errback). H (its
    worker reaches the store) releases and wakes W's place; the woken copy K comes to B, whose
    store is still unreachable. K must read W's FAILURE and end unrun, not wait for the store
    (``never``: it stays unreachable; ``after``: healed once K was handled). Negative control
    (``off``: no copy reads its task's state): K waits out its own budget and gives up again,
    the errback runs twice. Failed before: K stored RETRY over W's FAILURE, then gave up again
    (["err", "err"]) or, healed, ran the body."""
    from tests.tooling.proxy import TcpProxy

    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    if check == "off":
        env["CL_FINISHED_READ"] = "off"
    port = int(env["CL_STORE"].rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        env_b = {**env, "CL_STORE": proxy.url_for(env["CL_STORE"]), "CL_STORE_DOWN_MAX_WAIT": "2"}
        qa, qb = queue + "a", queue + "b"
        start_worker(env, queue=qa, pool="threads", concurrency=3)
        worker_b = start_worker(env_b, queue=qb, pool="threads", concurrency=3)
        n = unique("ku")
        go_h = events.key_for("go-h")
        it_app.fifo_gate.apply_async((n, 0, go_h), queue=qa)
        events.wait(ev="enter", res=n, k=0)
        waiter, gave_up = _give_up_on_the_store(it_app, events, proxy, n, qa, qb, heal=False)
        wait_for(lambda: events.where(ev="callback", label="err"), 20, "the errback")
        coord.rpush(go_h, 1)  # H releases and wakes W's place: K comes to B
        released = events.wait(ev="exit", res=n, k=0)
        dropped = "dropped a copy of a finished task"

        def k_handled() -> bool:
            if dropped in worker_b.log():
                return True
            seen = [e for e in events.where(task=waiter.id) if e["t"] > released["t"]]
            return any(e["ev"] in ("retry", "store_requeued") for e in seen)

        wait_for(k_handled, 30, "K on B")
        states = backend_meta(it_app.app, [waiter.id])[waiter.id]["status"]
        if heal == "after":
            proxy.heal()
        wait_for(
            lambda: (
                dropped in worker_b.log()
                or len(events.where(ev="callback")) >= 2
                or events.where(ev="enter", res=n, k=1)
            ),
            30,
            "K to end",
        )
        proxy.heal()
    final = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    print(
        f"[{heal}/{check}] after K: {states}; body runs {len(runs)}; callbacks {callbacks}; "
        f"final {final['status']}"
    )
    assert gave_up["status"] == "FAILURE"
    if check == "off":
        assert callbacks == ["err", "err"]
        return
    assert states == "FAILURE" and dropped in worker_b.log()
    assert len(runs) == 0
    assert final["status"] == "FAILURE" and callbacks == ["err"]


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_late_woken_copy_on_an_unreachable_store_ends_unrun_after_its_waiter_succeeded(
    it_app, start_worker, store_env, events, queue, tmp_path, check
):
    """Review 2: H's worker pauses 10 s between its release and the wake (failpoint); W's
    back-stop copy runs W meanwhile (SUCCESS, link). Then worker B's store becomes unreachable
    (a proxy dropping everything) and the late woken copy K comes to B: it must read W's
    SUCCESS and end unrun, not wait out its store budget and give up. Negative control
    (``off``: no copy reads its task's state): K gives up, Celery keeps SUCCESS but runs the
    errback as well. Failed before: callbacks ["err", "link"]."""
    from tests.tooling.proxy import TcpProxy

    env = {**store_env("redis"), "CL_TTL": "2", "CL_BACKOFF_CAP": "1.0"}
    if check == "off":
        env["CL_FINISHED_READ"] = "off"
    env_a = {
        **env,
        "CELERY_LEASE_FAILPOINTS": "before_wake=sleep:10",
        "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
        "CL_EARLY_WAKE": "0",  # (these failpoints stop a wake sent after the release)
    }
    port = int(env["CL_STORE"].rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        env_b = {**env, "CL_STORE": proxy.url_for(env["CL_STORE"]), "CL_STORE_DOWN_MAX_WAIT": "2"}
        qa, qb = queue + "a", queue + "b"
        start_worker(env_a, queue=qa, pool="threads", concurrency=3)
        worker_b = start_worker(env_b, queue=qb, pool="threads", concurrency=3)
        n = unique("ls")
        it_app.fifo_hold.apply_async((n, 0, 1.5), queue=qa)
        events.wait(ev="enter", res=n, k=0)
        waiter = it_app.fifo_hold.apply_async(
            (n, 1, 0.1),
            queue=qb,
            link=it_app.note_callback.si(label="link").set(queue=qa),
            link_error=_callback("err", it_app, qa),
        )
        events.wait(ev="retry", task=waiter.id)  # listed
        _wait_state(waiter, "SUCCESS", 30)  # its back-stop copy ran it during the pause
        proxy.blackhole(drop=True)
        proxy.reset_all()
        dropped = "dropped a copy of a finished task"
        wait_for(
            lambda: dropped in worker_b.log() or len(events.where(ev="callback")) >= 2,
            40,
            "the late woken copy to end",
        )
        proxy.heal()
    final = backend_meta(it_app.app, [waiter.id])[waiter.id]
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    print(f"[{check}] body runs {len(runs)}; callbacks {callbacks}; final {final['status']}")
    assert len(runs) == 1 and final["status"] == "SUCCESS"
    if check == "off":
        assert callbacks == ["err", "link"]
        return
    assert callbacks == ["link"]


@pytest.mark.parametrize("check", ["on", "off"])
def test_two_copies_refused_at_their_last_wait_together_give_up_once(
    it_app, start_worker, store_env, events, queue, coord, tmp_path, check
):
    """W (busy_max_waits=2) has two woken copies at their last wait in flight, as the
    release's wake and the wake a turn check sent once more (its first was not claimed) make
    when W's worker is busy past the grace; both come together while X holds the resource.
    Each reads W's state (no final one yet) and pauses there (failpoint ``before_give_up``,
    2 s: the gap between that read and Celery storing the FAILURE, wide on a loaded box).
    Exactly one may give up: W ends FAILURE, its errback runs once, the other copy is sent
    again and ends unrun on that FAILURE. Negative control (``off``: no give-up mark): both
    give up, the errback runs twice. Failed before (and as CI's flake of
    test_a_back_stop_copy_at_its_last_wait_ends_unrun_after_its_woken_copy_gave_up): callbacks
    ["err", "err"]."""
    from celery_lease._message import WAITS_HEADER
    from celery_lease._wakes import WOKEN_HEADER

    env = {**store_env("redis"), "CL_TTL": "1", "CL_BACKOFF_CAP": "1.0"}
    env_b = {**env, "CELERY_LEASE_FAILPOINTS": "before_give_up=sleep:2"}
    if check == "off":
        env_b["CL_GIVE_UP_ONCE"] = "off"
    qa, qb = queue + "a", queue + "b"
    start_worker(env, queue=qa, pool="threads", concurrency=3)
    worker_b = start_worker(env_b, queue=qb, pool="threads", concurrency=3)
    n = unique("g2")
    go_x = events.key_for("go-x")
    it_app.fifo_gate.apply_async((n, 2, go_x), queue=qa)
    events.wait(ev="enter", res=n, k=2)
    task_id = f"w-{n}"
    for _ in range(2):  # two woken copies of W's place, each at its last allowed wait
        it_app.fifo_few_waits.apply_async(
            (n, 1, 0.1),
            task_id=task_id,
            queue=qb,
            headers={WAITS_HEADER: 2, WOKEN_HEADER: time.time()},
            link=it_app.note_callback.si(label="link").set(queue=qa),
            link_error=_callback("err", it_app, qa),
        )
    dropped = "dropped a copy of a finished task"
    wait_for(
        lambda: (
            len(events.where(ev="callback")) >= 2
            or (events.where(ev="callback") and dropped in worker_b.log())
        ),
        40,
        "both copies to end",
    )
    time.sleep(1)  # (a second errback, if any, has come by now)
    coord.rpush(go_x, 1)
    events.wait(ev="exit", res=n, k=2)
    final = backend_meta(it_app.app, [task_id])[task_id]
    callbacks = sorted(e["label"] for e in events.where(ev="callback"))
    runs = events.where(ev="enter", res=n, k=1)
    log_b = worker_b.log()
    print(f"[{check}] body runs {len(runs)}; callbacks {callbacks}; final {final['status']}")
    assert final["status"] == "FAILURE"
    assert "gave up after 2 busy waits" in str(final.get("result"))
    assert not runs
    if check == "off":
        assert callbacks == ["err", "err"]
        return
    assert callbacks == ["err"]
    assert "another copy of this task is giving up" in log_b and dropped in log_b
