"""Renewal with real workers: a slow call keeps its lease, a blocked renewal self-fences in
time, and one renewal thread serves every lease of a process.

* Healthy renewal: ``slow_call`` sleeps 3x the ttl; it keeps one fence throughout, the store
  shows its expiry moving forward, an intruder is refused every time, and it ends SUCCESS.
* Blocked renewal: the worker reaches its lease store through a loopback TcpProxy that the test
  blackholes once the body runs. The body must be interrupted before its lease can expire in the
  store (the store's own record of the expiry, read directly), and not before its self-fence
  deadline either (a failed renewal is uncertain, not lost). The task goes to RETRY with
  LeaseLostError and, once the proxy heals, completes with a newer fence.
* Negative control: the same measurement flags a body that ignores the interrupt.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_lease import LeaseBusyError, Owner
from tests.integration.harness import wait_results, worker_store
from tests.tooling.proxy import TcpProxy
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 1.0
RENEW_INTERVAL = TTL / 3  # the defaults
MARGIN = TTL / 4
SLOW = 3 * TTL  # the slow call's length
THREADS = 8


def check_stopped_in_time(stopped_at: float, expires_at: float, what: str) -> None:
    """The body stopped acting before its lease could expire in the store.

    Both are wall-clock times of this host (the store's clock is this host's clock).
    """
    assert stopped_at < expires_at, (
        f"{what}: the body still ran {stopped_at - expires_at:.3f}s after its lease expired in "
        "the store, where another owner could take it over"
    )


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


class TestHealthyRenewal:
    @pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent"])
    def test_slow_call_keeps_its_lease_and_fence(
        self, it_app, start_worker, store_env, events, queue, pool
    ):
        """A body blocked 3x the ttl keeps one fence, is never taken over, ends SUCCESS."""
        env = {**store_env("redis"), "CL_TTL": str(TTL)}
        start_worker(env, queue=queue, pool=pool, concurrency=2)
        store = worker_store(env)
        intruder = Owner.new("intruder")
        result = it_app.slow_call.apply_async((0, SLOW), queue=queue)
        start = events.wait(ev="start", res=0)
        expiries = set()
        refused = 0
        try:
            while not events.where(ev="done", res=0):
                info = store.get("slow-0")
                if info is None:  # released: the body is done, the done event is on its way
                    break
                assert info.fence == start["fence"] and not info.expired, info
                expiries.add(info.expires_at)
                try:
                    stolen = store.acquire("slow-0", intruder, TTL)
                except LeaseBusyError:
                    refused += 1
                else:
                    store.release(stolen)
                    pytest.fail(f"an intruder took over a live lease: {stolen}")
                time.sleep(0.1)
            outcome = result.get(timeout=30)
        finally:
            store.close()
        assert result.state == "SUCCESS"
        assert outcome["fence"] == start["fence"]
        log = events.all()
        assert [e["ev"] for e in log if e.get("res") == 0] == ["start", "done"]
        assert not [e for e in log if e["ev"] in ("retry", "failure", "interrupted")]
        done = events.wait(ev="done", res=0)
        assert done["fence"] == start["fence"]
        # Renewed all along (about 9 renewals in 3 s); refused the intruder every time.
        assert len(expiries) >= 4, expiries
        assert refused >= 10
        print(f"pool={pool}: {len(expiries)} expiries seen, intruder refused {refused}x")
        # Negative control of the in-time measurement used below: had renewal stopped when this
        # body started, its lease would have expired ttl later, while the body still ran.
        with pytest.raises(AssertionError, match="still ran"):
            check_stopped_in_time(done["t"], start["t"] + TTL, "healthy body")


class TestBlockedRenewal:
    @pytest.mark.parametrize(
        ("kind", "pool"), [("redis", "prefork"), ("postgres", "prefork"), ("redis", "gevent")]
    )
    def test_blackholed_store_self_fences_before_the_lease_expires(
        self, it_app, start_worker, store_env, events, queue, kind, pool
    ):
        """Renewals blackholed: interrupted after the self-fence deadline, before expiry.

        prefork: the body is stopped by SIGUSR1; gevent: its greenlet is killed.
        """
        base = store_env(kind)
        with TcpProxy(_port(base["CL_STORE"])) as proxy:
            env = {**base, "CL_STORE": proxy.url_for(base["CL_STORE"]), "CL_TTL": str(TTL)}
            start_worker(env, queue=queue, pool=pool)
            direct = worker_store(base)  # the test's view of the store, not through the proxy
            try:
                result = it_app.slow_call.apply_async((0, SLOW), queue=queue)
                start = events.wait(ev="start", res=0, attempt=0)
                blackholed_at = time.time()
                proxy.blackhole()
                stop = events.wait(timeout=10, ev="interrupted", res=0)
                record = direct.get("slow-0")  # the lost lease as the store still has it
                retried_in_partition = _wait_retry(events, start["task"], 2 * TTL)
                healed_at = time.time()
                proxy.heal()
                outcome = result.get(timeout=60)
            finally:
                direct.close()
        assert record is not None and record.fence == start["fence"]
        expires_at = record.expires_at.timestamp()
        after = stop["t"] - blackholed_at
        print(
            f"store={kind} pool={pool}: interrupted {after:.3f}s after the blackhole; lease "
            f"expiry in the store {expires_at - blackholed_at:.3f}s after it; RETRY recorded "
            f"{'during' if retried_in_partition else 'only after'} the partition"
        )
        check_stopped_in_time(stop["t"], expires_at, f"{kind} blackhole")
        assert stop["t"] <= blackholed_at + TTL
        # Not before the self-fence deadline: the last successful renewal was sent at most one
        # interval before the blackhole, and a renewal that failed is uncertain, not lost.
        assert after >= TTL - MARGIN - RENEW_INTERVAL - 0.05
        assert stop["reason"] == "renew_failed"
        retry = _wait_retry(events, start["task"], 10)
        assert retry is not None
        assert (retry["exc"], retry["reason"]) == ("LeaseLostError", "renew_failed")
        assert retry["fence"] == start["fence"]
        if kind == "redis":  # its client times out, so the RETRY is recorded mid-partition
            assert retried_in_partition is not None and retried_in_partition["t"] < healed_at
        # Healed: a later execution runs the whole slow call under a newer lease.
        assert result.state == "SUCCESS"
        assert outcome["fence"] > start["fence"]
        rerun = events.wait(ev="start", res=0, fence=outcome["fence"])
        retries = events.where(ev="retry", task=start["task"])
        lost = [e for e in retries if e["exc"] == "LeaseLostError"]
        assert all(e["reason"] == "renew_failed" for e in lost), lost
        assert {e["exc"] for e in retries} <= {"LeaseLostError", "LeaseStoreError"}, retries
        assert rerun["attempt"] == len(lost)
        if kind == "redis" and pool != "gevent":
            assert rerun["attempt"] == 1  # one lost-lease re-run
        elif kind == "redis":
            # One lost-lease re-run, or two on a loaded box: the re-run's own 1 s lease, renewed
            # from a gevent hub shared with the 3 s body, was lost again once in a CI rehearsal
            # (renew_failed, as asserted above: stopped in time, never two holders).
            assert 1 <= rerun["attempt"] <= 2, retries
        else:
            # A PostgreSQL claim sent during the partition hangs (no client-side timeout) and
            # completes at heal time with a lease already past its self-fence deadline: that
            # execution is lost at once, before its body, and costs one more re-run.
            assert 1 <= rerun["attempt"] <= 2, retries
        assert events.where(ev="done", res=0, fence=outcome["fence"])
        assert not events.where(ev="done", res=0, fence=start["fence"])

    def test_negative_control_a_body_that_ignores_the_interrupt_is_caught(
        self, it_app, start_worker, store_env, events, queue
    ):
        """The same measurement on a body that swallows the interrupt flags it."""
        base = store_env("redis")
        with TcpProxy(_port(base["CL_STORE"])) as proxy:
            env = {**base, "CL_STORE": proxy.url_for(base["CL_STORE"]), "CL_TTL": str(TTL)}
            start_worker(env, queue=queue)
            direct = worker_store(base)
            try:
                result = it_app.slow_call.apply_async((1, SLOW), {"ignore_loss": True}, queue=queue)
                start = events.wait(ev="start", res=1, attempt=0)
                proxy.blackhole()
                events.wait(timeout=10, ev="interrupted", res=1)
                record = direct.get("slow-1")
                done = events.wait(timeout=10, ev="done", res=1, fence=start["fence"])
                proxy.heal()
                wait_results([result], timeout=60)
            finally:
                direct.close()
        assert record is not None and record.fence == start["fence"]
        with pytest.raises(AssertionError, match="still ran"):
            check_stopped_in_time(done["t"], record.expires_at.timestamp(), "ignoring body")


def _wait_retry(events: Any, task_id: str, timeout: float) -> dict[str, Any] | None:
    """The first retry event of ``task_id`` within ``timeout`` s, or None."""
    try:
        return events.wait(timeout=timeout, ev="retry", task=task_id)
    except TimeoutError:
        return None


class TestOneRenewerPerProcess:
    def test_eight_leases_in_one_process_share_one_renewal_thread(
        self, it_app, start_worker, store_env, events, queue
    ):
        """Threads pool, 8 concurrent leases renewed several times: 1 renewer thread each saw."""
        env = {**store_env("redis"), "CL_TTL": str(TTL)}
        start_worker(env, queue=queue, pool="threads", concurrency=THREADS)
        store = worker_store(env)
        hold = 2.5
        results = [
            it_app.count_renewers.apply_async((n, hold), queue=queue) for n in range(THREADS)
        ]
        expiries: dict[int, set[Any]] = {n: set() for n in range(THREADS)}
        try:
            wait_for(lambda: len(events.where(ev="enter")) == THREADS, 30, "all 8 to enter")
            while len(events.where(ev="renewers")) < THREADS:
                for n in range(THREADS):
                    info = store.get(f"threads-{n}")
                    if info is not None:
                        expiries[n].add(info.expires_at)
                time.sleep(0.05)
            counts = wait_results(results, timeout=30)
        finally:
            store.close()
        log = events.all()
        reports = [e for e in log if e["ev"] == "renewers"]
        enters = [e for e in log if e["ev"] == "enter"]
        assert counts == [1] * THREADS
        assert all(e["min"] == e["max"] == 1 for e in reports), reports
        assert len({e["pid"] for e in enters + reports}) == 1  # one process held all 8
        # All 8 held their leases at once: every enter precedes the first report.
        assert log.index(enters[-1]) < log.index(reports[0])
        # ... long enough to be renewed several times each.
        assert all(len(seen) >= 4 for seen in expiries.values()), expiries
        assert all(r.state == "SUCCESS" for r in results)
