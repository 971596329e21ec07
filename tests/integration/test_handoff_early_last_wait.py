"""An early-woken copy at its waiter's last allowed wait, refused past its short retries
because a slow release (1 s each way on the releaser's store connection) had not landed, must
not give up: the release then hands the resource to it and sends no second wake (the early one
went out). Found by a review; before the fix W ended FAILURE ("gave up after 2 busy waits")
and its body never ran. ``early=0`` (the wake after the release's reply) is the comparison:
W runs either way."""

from __future__ import annotations

import time

import pytest

from tests.conftest import unique

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]

ENV = {"CL_TTL": "10", "CL_BACKOFF_BASE": "5", "CL_BACKOFF_CAP": "10"}
LATENCY = 1.0


@pytest.mark.parametrize("early", ["1", "0"])
def test_an_early_copy_at_its_last_wait_does_not_give_up_on_a_slow_release(
    it_app, start_worker, store_env, events, queue, coord, early
):
    from tests.tooling.proxy import TcpProxy

    env = {**store_env("redis"), **ENV}
    port = int(env["CL_STORE"].rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        env_a = {**env, "CL_STORE": proxy.url_for(env["CL_STORE"]), "CL_EARLY_WAKE": early}
        qa, qb = queue + "a", queue + "b"
        start_worker(env_a, queue=qa, pool="threads", concurrency=2)
        start_worker(env, queue=qb, pool="threads", concurrency=2)
        n = unique("ew")
        assert it_app.fifo_hold.apply_async((n + "a", 9, 0.0), queue=qa).get(timeout=30) == 9
        assert it_app.fifo_hold.apply_async((n + "b", 9, 0.0), queue=qb).get(timeout=30) == 9
        go_h, go_w1 = events.key_for("go-h"), events.key_for("go-w1")
        it_app.fifo_gate.apply_async((n, 0, go_h), queue=qa)
        events.wait(ev="enter", res=n, k=0)
        first = it_app.fifo_gate.apply_async((n, 1, go_w1), queue=qa)
        events.wait(ev="retry", task=first.id)
        waiter = it_app.fifo_few_waits.apply_async((n, 2, 0.1), queue=qb)
        events.wait(ev="retry", task=waiter.id)  # listed (payload waits=1)
        # its back-stop copy, refused again, re-arms the place (payload waits=2, the last)
        events.wait(ev="requeued", task=waiter.id, timeout=30)
        coord.rpush(go_h, 1)
        events.wait(ev="enter", res=n, k=1, timeout=30)  # W1 claims: next_wake = W's payload
        proxy.set_latency(LATENCY)
        t0 = time.time()
        coord.rpush(go_w1, 1)
        try:
            result = waiter.get(timeout=30, propagate=False)
        finally:
            proxy.set_latency(0)
        print(f"[early={early}] W ended {waiter.state} after {time.time() - t0:.2f}s")
        assert waiter.state == "SUCCESS", f"W ended {waiter.state}: {result!r}"
    assert len(events.where(ev="enter", res=n, k=2)) == 1
