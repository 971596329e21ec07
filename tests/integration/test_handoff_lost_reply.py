"""A waiter whose first claim listed its place but whose reply was lost (real workers, review 3).

Worker B reaches the store through a proxy that drops every reply: W's claim is refused and
lists W's place, but B only sees the call fail (LeaseStoreError, the outcome unknown) and sends
W again, as W'. The holder's release wakes W's place; the woken copy K runs on worker C, which
consumes B's wake queue and reaches the store. W' must then end unrun: K's SUCCESS or FAILURE
stays, and `link` or `link_error` runs once. W' was sent as a message that never waited (no
busy wait counted), so it stored RETRY over K's final state when the store failed again and,
claiming later, returned the recorded result (link twice) or ran a failed body again.
"""

from __future__ import annotations

import pytest

from tests.conftest import unique
from tests.integration.harness import backend_meta, explain_stuck, worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]


@pytest.mark.parametrize(
    ("body", "heal", "check"),
    [("ok", "now", "on"), ("fail", "now", "on"), ("fail", "late", "on"), ("fail", "now", "off")],
)
def test_a_copy_of_a_claim_whose_listing_reply_was_lost_ends_unrun(
    it_app, start_worker, store_env, events, queue, coord, body, heal, check
):
    """``now``: replies come through again once K ended; ``late``: only after W' met the
    failing store once more. Negative control (``off``: a lost claim reply is taken as
    never listed, as before): the failed body runs twice. Failed before: link twice
    (``ok``), the body twice (``fail-now``), RETRY over K's FAILURE then the body twice
    (``fail-late``)."""
    from tests.tooling.proxy import TcpProxy

    env = {**store_env("redis"), "CL_TTL": "2"}
    if check == "off":
        env["CL_LISTED_ON_LOSS"] = "off"
    port = int(env["CL_STORE"].rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        # B makes no pass over the wait lists: a pass's reply lost (and its connection reset)
        # just before W's claim made that claim open a new connection, whose handshake reply
        # was lost, so it never reached the store (seen in a rehearsal: W never listed, K
        # never sent). W's claim must be the only call B makes after lose_replies.
        env_b = {**env, "CL_STORE": proxy.url_for(env["CL_STORE"]), "CL_PASS_THE_TURN": "0"}
        qa, qb = queue + "a", queue + "b"
        worker_a = start_worker(env, queue=qa, pool="threads", concurrency=3)
        worker_b = start_worker(env_b, queue=qb, pool="threads", concurrency=3)
        worker_c = start_worker(env, queue=qb + ".lease-wake", pool="threads", concurrency=3)
        n = unique("lr")
        # B's connection and scripts are warm: the lost reply is the claim's own
        assert it_app.fifo_hold.apply_async((n + "w", 9, 0.0), queue=qb).get(timeout=30) == 9
        go_h = events.key_for("go-h")
        it_app.fifo_gate.apply_async((n, 0, go_h), queue=qa)
        events.wait(ev="enter", res=n, k=0)
        proxy.lose_replies(10**6)
        task = it_app.fifo_hold if body == "ok" else it_app.fifo_fail
        waiter = task.apply_async(
            (n, 1, 1.0),
            queue=qb,
            link=it_app.note_callback.si(label="link").set(queue=qa),
            link_error=it_app.note_callback.s(label="err").set(queue=qa),
        )
        wait_for(
            lambda: any(
                e["ev"] in ("retry", "store_requeued") for e in events.where(task=waiter.id)
            ),
            30,
            "W' to be sent again",
        )
        store = worker_store(env)
        try:
            listed = [w.identity for w in store.waiters(f"fifo-{n}")]
        finally:
            store.close()
        assert listed == [waiter.id], f"W's lost claim must have listed its place: {listed}"
        # B's threads busy until K ended (and its prefetch full: acks_late), so the wake
        # goes to C. (They were busy for 6 s before: CI once waited 30 s for K, and a wake
        # that came after they ended could go to B, whose replies are lost.)
        go_b = events.key_for("go-b")
        for i in range(3):
            it_app.plain_step.apply_async((n, 100 + i, 0.0, go_b), queue=qb)
        wait_for(lambda: len(events.where(ev="enter", res=n, plain=True)) == 3, 30, "blockers")
        coord.rpush(go_h, 1)  # H releases: wakes the place W's lost claim listed
        try:
            events.wait(ev="enter", res=n, k=1, timeout=30)
        except TimeoutError:
            workers = [worker_a, worker_b, worker_c]
            why = explain_stuck(it_app.app, [waiter.id], workers=workers, tail=30)
            raise AssertionError(f"K never ran:\n{why}") from None

        def state() -> str:
            return str(backend_meta(it_app.app, [waiter.id])[waiter.id]["status"])

        wait_for(lambda: state() in ("SUCCESS", "FAILURE"), 30, "K to end")
        after_k = state()
        coord.rpush(go_b, 1, 1, 1)  # B may run W' again
        wait_for(lambda: events.where(ev="callback"), 30, "K's callback")
        ended = events.where(ev="callback")[0]["t"]
        if heal == "late":  # W' meets the store failing again after K's final state
            wait_for(
                lambda: (
                    [
                        e
                        for e in events.where(task=waiter.id)
                        if e["t"] > ended and e["ev"] in ("retry", "store_requeued")
                    ]
                    or "dropped a copy" in worker_b.log()
                ),
                30,
                "W' to meet the failing store again",
            )
        again = state()
        proxy.lose_replies(0)
        wait_for(
            lambda: (
                "dropped a copy" in worker_b.log()
                or "returned the recorded result" in worker_b.log()
                or len(events.where(ev="callback")) >= 2
            ),
            40,
            "W' to end",
        )
    final = state()
    runs = events.where(ev="enter", res=n, k=1)
    callbacks = [e["label"] for e in events.where(ev="callback")]
    print(
        f"[{body}-{heal}-{check}] after K {after_k}, then {again}; body runs {len(runs)}; "
        f"callbacks {callbacks}; final {final}"
    )
    if check == "off":
        assert len(runs) == 2 and callbacks == ["err", "err"]
        return
    assert len(runs) == 1 and again == after_k == final
    assert callbacks == (["link"] if body == "ok" else ["err"])
    assert "dropped a copy" in worker_b.log()
