"""gates= with real prefork workers: a frozen owner's late write refused at a gate elsewhere.

The gate is a FenceGate in another store than the leases' (PostgreSQL, or another Redis
database), as an HTTP gateway or a database of its own would be: it learns fences only from
what is admitted there. Each trial:

1. worker A runs ``far_writer(account, "first")``, which claims (and, with ``gates=``, admits
   its fence at the gate), says where it is and stops right before its write; the test
   SIGSTOPs that pool process. The body has switched its interrupt off: an owner frozen where
   no interrupt reaches it, so only the gate can refuse its write;
2. worker B runs ``far_writer(account, "second")``: refused while A's lease lives, it claims
   once the lease ran out (with ``gates=`` its claim admits B's fence at the gate) and sits in
   a long model call before its own write;
3. the test lets A go on (SIGCONT) while B is still in that call: A's write reaches the gate.

With ``gates=`` the gate refuses it (StaleFenceError): it already holds B's fence. The negative
control runs the same steps with ``far_writer_ungated`` (no ``gates=``): the gate has seen no
newer fence, and A's stale write lands; the history check below catches it.

A second test stops the gate's redis-server: each claim gives its lease back and waits as on
a lease store outage; another task takes the resource meanwhile; once the gate is back the
waiting task runs, its fence admitted at the gate first.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest

from celery_lease import FenceGate
from tests.conftest import unique
from tests.integration.harness import sigstop, wait_results, worker_store
from tests.tooling.servers import RedisServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 2.0
TRIALS = 2  # per store combination


def check_writes_after_claims(log: list[dict[str, Any]]) -> None:
    """Every accepted write carries a fence >= every fence whose owner's body had started on
    the same account before it (the lease store had granted that fence by then).

    Stricter than "the fences of accepted writes never go down": a stale write that lands
    before the newer owner's first write passes that check, and is exactly the window a gate
    elsewhere leaves open without ``gates=``. Raises AssertionError naming the stale write.
    """
    granted: dict[str, int] = {}
    for event in log:
        account = event.get("account")
        if event["ev"] == "start":
            granted[account] = max(granted.get(account, 0), event["fence"])
        elif event["ev"] == "write":
            newest = granted.get(account, 0)
            assert event["fence"] >= newest, (
                f"stale write accepted on account {account}: fence {event['fence']} after "
                f"fence {newest} was granted and its owner had started ({event})"
            )


def _far_gate_env(kind: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """A fence gate in a store of ``kind`` that is not the lease store."""
    prefix = unique("far")
    if kind == "postgres":
        server = request.getfixturevalue("postgres_server")
        return {"CL_FAR_GATE": server.url, "CL_FAR_PREFIX": f"{prefix}_"}
    server = request.getfixturevalue("redis_server")
    # (the lease store is database 1, the broker 0 or above 15, the backend 2, the events 3)
    return {"CL_FAR_GATE": server.url.rsplit("/", 1)[0] + "/4", "CL_FAR_PREFIX": f"{prefix}:"}


def _gate(env: dict[str, str]) -> FenceGate:
    """The test's own client of the far gate (made before the workers: it creates the tables)."""
    url, prefix = env["CL_FAR_GATE"], env["CL_FAR_PREFIX"]
    if url.startswith("redis"):
        return FenceGate(url, key_prefix=prefix)
    return FenceGate(url, table_prefix=prefix)


def run_trial(
    task: Any, account: str, *, events: Any, coord: Any, worker_a: Any, queues: tuple[str, str]
) -> dict[str, Any]:
    """One frozen-owner trial (the module docstring's steps); returns what happened."""
    queue_a, queue_b = queues
    key = events.key_for
    first = task.apply_async((account, "first"), queue=queue_a)
    pid = None
    try:
        pid = int(wait_for(lambda: coord.get(key(f"ready:{account}")), 60, "A at its write"))
        assert worker_a.owns(pid), f"pid {pid} is not a pool process of worker A"
        sigstop(pid)
        stopped = time.monotonic()
        ready = events.where(ev="ready", account=account)[0]
        second = task.apply_async((account, "second"), queue=queue_b)
        # B claims once A's lease ran out, and sits in its model call before its write.
        call = events.wait(timeout=60, ev="model_call", account=account)
        assert call["fence"] > ready["fence"]
        # A goes on exactly where it stopped: its write goes to the gate now.
        coord.set(key(f"go:{account}"), 1)
        os.kill(pid, signal.SIGCONT)
        paused_for = time.monotonic() - stopped
        pid = None
        # A's first run ends (written or refused, then RETRY: its lease is lost either way).
        events.wait(timeout=60, ev="retry", task=first.id)
    finally:
        if pid is not None:  # never leave a pool process stopped behind a failed test
            os.kill(pid, signal.SIGCONT)
    coord.set(key(f"model_done:{account}"), 1)
    fences = wait_results([first, second], timeout=90)
    return {
        "old": ready["fence"],
        "newer": call["fence"],
        "first": fences[0],
        "second": fences[1],
        "paused_for": paused_for,
    }


@pytest.mark.parametrize(
    ("lease_store", "gate_store"),
    [("redis", "postgres"), ("postgres", "redis")],
    ids=["leases-redis-gate-postgres", "leases-postgres-gate-redis-db4"],
)
def test_a_frozen_owners_late_write_is_refused_at_a_gate_elsewhere(
    it_app, start_worker, store_env, events, coord, queue, request, lease_store, gate_store
):
    """With gates=, the gate already holds the newer owner's fence when the frozen owner's
    write arrives, although the newer owner has not written yet: refused, in every trial."""
    env = {**store_env(lease_store), **_far_gate_env(gate_store, request), "CL_TTL": str(TTL)}
    gate = _gate(env)
    queue_b = unique("q")
    try:
        worker_a = start_worker(env, queue=queue, concurrency=1, wait=False)
        worker_b = start_worker(env, queue=queue_b, concurrency=1, wait=False)
        worker_a.wait_ready()
        worker_b.wait_ready()
        trials = []
        for n in range(TRIALS):
            account = unique("a")
            trial = run_trial(
                it_app.far_writer,
                account,
                events=events,
                coord=coord,
                worker_a=worker_a,
                queues=(queue, queue_b),
            )
            trials.append((account, trial))
            print(f"trial {n}: {trial}")
        log = events.all()
        check_writes_after_claims(log)
        for account, trial in trials:
            writes = [e for e in log if e["ev"] == "write" and e["account"] == account]
            stale = [w for w in writes if w["fence"] == trial["old"]]
            assert stale == [], f"the frozen owner's write landed: {stale}"
            refused = [
                e
                for e in log
                if e["ev"] == "rejected" and e["account"] == account and e["fence"] == trial["old"]
            ]
            assert len(refused) == 1 and refused[0]["highest"] == trial["newer"], refused
            # B wrote, then A's re-run (a newer claim still) wrote: the gate keeps the newest.
            assert trial["first"] > trial["second"] == trial["newer"]
            assert gate.highest(f"account-{account}") == trial["first"]
    finally:
        gate.close()


def test_negative_control_without_gates_the_late_write_lands(
    it_app, start_worker, store_env, events, coord, queue, request
):
    """The same steps without gates=: the gate has seen no fence newer than the frozen
    owner's, so its write is accepted while the newer owner is in its model call, and the
    history check catches it."""
    env = {**store_env("redis"), **_far_gate_env("redis", request), "CL_TTL": str(TTL)}
    gate = _gate(env)
    queue_b = unique("q")
    try:
        worker_a = start_worker(env, queue=queue, concurrency=1, wait=False)
        worker_b = start_worker(env, queue=queue_b, concurrency=1, wait=False)
        worker_a.wait_ready()
        worker_b.wait_ready()
        account = unique("a")
        trial = run_trial(
            it_app.far_writer_ungated,
            account,
            events=events,
            coord=coord,
            worker_a=worker_a,
            queues=(queue, queue_b),
        )
        print(trial)
        log = events.all()
        stale = [
            e
            for e in log
            if e["ev"] == "write" and e["account"] == account and e["fence"] == trial["old"]
        ]
        assert len(stale) == 1, f"the scenario did not exercise the window: {log}"
        with pytest.raises(AssertionError, match="stale write accepted"):
            check_writes_after_claims(log)
    finally:
        gate.close()


def test_an_unreachable_gate_gives_the_lease_back_and_the_task_runs_once_it_is_back(
    it_app, start_worker, store_env, events, queue, tmp_path
):
    """The gate's redis-server stopped: the task's claims give the lease back and wait on the
    store-down budget (another task on the resource runs meanwhile); the server back, the
    task runs with its fence admitted at the gate before its write."""
    try:
        server = RedisServer(tmp_path / "gate").start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    env = {
        **store_env("redis"),
        "CL_FAR_GATE": server.url,
        "CL_FAR_PREFIX": f"{unique('far')}:",
        "CL_TTL": str(TTL),
        "CL_STORE_DOWN_MAX_WAIT": "120",
    }
    gate = _gate(env)
    store = worker_store(env)
    try:
        # (one pool process: the one whose claims failed is the one that sees the gate back)
        worker = start_worker(env, queue=queue, concurrency=1)
        account = unique("a")
        server.stop()
        waiting = it_app.far_writer.apply_async((account, "plain"), queue=queue)
        failure = events.wait(timeout=60, ev="retry", task=waiting.id)
        assert failure["exc"] == "LeaseStoreError", failure
        assert f"fence gate FarGate({server.url})" in failure["message"]
        # Meanwhile the resource is free: another task claims it, holds it, returns.
        touched = it_app.account_touch.apply_async((account,), queue=queue).get(timeout=60)
        assert not waiting.ready()
        assert touched > 0
        server.start()  # the gate is back (same port)
        fence = waiting.get(timeout=60)
        log = events.all()
        writes = [e for e in log if e["ev"] == "write" and e["account"] == account]
        assert [w["fence"] for w in writes] == [fence]
        assert fence > touched
        assert gate.highest(f"account-{account}") == fence
        assert store.get(f"browser/account-{account}") is None  # released at the end
        text = worker.log()
        assert f"the fence gate FarGate({server.url}) refuses connections" in text
        assert f"the fence gate FarGate({server.url}) answers again" in text
        assert not re.search(r"the lease store \S+ (refuses|is failing)", text)  # it never did
    finally:
        store.close()
        gate.close()
        server.close()
