"""Faults on a real RabbitMQ broker (issue 31): where RabbitMQ differs from Redis.

RabbitMQ redelivers a message when the channel that holds it unacked goes away (a SIGKILLed
worker's connection closes; a connection closed under a running task; a channel closed by the
server's ``consumer_timeout``), at once and with ``redelivered`` set, rather than after a
visibility timeout. Each test runs real workers on a fresh vhost of the session's node (or on
a node of its own with a short ``consumer_timeout``), a Redis lease store, and has a negative
control that switches one protection off in the workers and shows the harm it prevents.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from tests.conftest import missing, unique
from tests.integration.harness import Worker, children_of
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq, pytest.mark.slow]

TTL = 1.0


def amqp_producer(it_app: Any, url: str) -> Celery:
    """An app that sends to the AMQP broker at ``url`` (results: the suite's Redis backend)."""
    return Celery("rabbitmq_faults", broker=url, backend=it_app.app.conf.result_backend)


@contextlib.contextmanager
def producer_for(it_app: Any, url: str) -> Iterator[Celery]:
    producer = amqp_producer(it_app, url)
    try:
        yield producer
    finally:
        producer.close()


def local_ports_to(pid: int, port: int) -> set[int]:
    """The local ports of ``pid``'s TCP connections to 127.0.0.1:``port`` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and int(fields[2].split(":")[1], 16) == port:
            found.add(int(fields[1].split(":")[1], 16))
    return found


def close_connections_of(server: Any, pid: int) -> int:
    """Close, on the RabbitMQ side, every AMQP connection process ``pid`` has open; how many."""
    ports = local_ports_to(pid, server.port)
    out = server.ctl("list_connections", "--no-table-headers", "pid", "peer_port")
    closed = 0
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) == 2 and fields[1].strip().isdigit() and int(fields[1]) in ports:
            server.ctl("close_connection", fields[0], "closed by the test")
            closed += 1
    return closed


def wait_for_queues(predicate: Any, timeout: float, what: str) -> Any:
    """``wait_for`` a predicate over ``rabbitmqctl list_queues`` (one call per look, please):
    at least 5 looks, half a second apart, however long each call takes on a loaded box."""
    return wait_for(predicate, timeout, what, interval=0.5, min_polls=5)


def drained(vhost: Any, *names: str) -> bool:
    """Whether RabbitMQ holds no message of these queues, ready or unacked."""
    queues = vhost.queues()
    return all(queues.get(name, {}).get("messages", "0") == "0" for name in names)


def runs(coord: Any, events: Any, n: str, k: int) -> int:
    return int(coord.get(events.key_for(f"runs:{n}:{k}")) or 0)


def start_pair(start_worker: Any, env: dict[str, str], queue: str, **options: Any) -> list[Worker]:
    workers = [start_worker(env, queue=queue, wait=False, **options) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    return workers


# -- a SIGKILLed worker, a killed pool child ------------------------------------------------------
@pytest.mark.parametrize(
    ("kill", "protected"),
    [("worker", True), ("worker", False), ("child", True), ("child", False)],
    ids=["worker", "worker-negative_control", "child", "child-negative_control"],
)
def test_a_killed_workers_task_comes_back_from_rabbitmq_and_recovers_with_a_greater_fence(
    amqp_vhost, it_app, start_worker, store_env, events, coord, queue, kill, protected
):
    """Two prefork workers (one slot each); the one running the task is SIGKILLed whole
    (``worker``: its connection closes, RabbitMQ requeues the unacked message at once) or its
    pool child alone (``child``: the parent rejects it with requeue, reject_on_worker_lost).
    The copy reaches a live worker redelivered, waits while the dead owner's lease lives, takes
    it over (recovered, previous fence = the killed one's) with a greater fence, and the body
    has run twice in all: killed once, completed once. Negative controls: ``task_acks_late``
    off (``worker``: acked as it started, the message is gone from RabbitMQ) and
    ``task_reject_on_worker_lost`` off (``child``: WorkerLostError, the task FAILS); either
    way it never runs again."""
    flag = "CL_ACKS_LATE" if kill == "worker" else "CL_REJECT_ON_WORKER_LOST"
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": str(TTL),
        "CL_REPORT_STARTS": "1",
        flag: "1" if protected else "0",
    }
    workers = start_pair(start_worker, env, queue, concurrency=1)
    n, go = unique("k"), events.key_for("go")
    with producer_for(it_app, amqp_vhost.url) as producer:
        result = producer.send_task(it_app.rabbit_job.name, (n, 0, go), queue=queue)
        first = events.wait(ev="enter", res=n, k=0)
        (victim,) = [w for w in workers if w.owns(first["pid"])]
        killed_at = time.time()
        if kill == "worker":
            victim.kill()
        else:
            assert first["pid"] in children_of(victim.pid)
            os.kill(first["pid"], 9)
        coord.set(go, 1)
        if not protected:
            if kill == "child":  # (the parent reports the lost child when it notices it)
                wait_for(lambda: result.state == "FAILURE", 30, "WorkerLostError stored")
            watch = TTL + 2.0  # (a copy comes back within 0.1 s when it does)
            deadline = time.monotonic() + watch
            while time.monotonic() < deadline and runs(coord, events, n, 0) < 2:
                time.sleep(0.1)
            state = result.state
            print(
                f"{kill} killed, {flag}=0: {runs(coord, events, n, 0)} run(s) in {watch:.0f}s,"
                f" state {state}, queue {amqp_vhost.queues().get(queue)}"
            )
            assert runs(coord, events, n, 0) == 1, "it ran again: the control is broken"
            assert drained(amqp_vhost, queue), "RabbitMQ still has the message"
            assert state == ("FAILURE" if kill == "child" else "PENDING"), state
            return
        outcome = result.get(timeout=60)
    enters = events.where(ev="enter", res=n)
    copies = [e for e in events.where(ev="start", task=result.id) if e["t"] > killed_at]
    second = enters[-1]
    print(
        f"{kill} killed: copy back {copies[0]['t'] - killed_at:.3f}s after the kill "
        f"(redelivered={copies[0]['redelivered']}), body again after "
        f"{second['t'] - killed_at:.3f}s, {len(copies)} copies; fences {first['fence']} -> "
        f"{outcome['fence']}"
    )
    assert [e["run"] for e in enters] == [1, 2], enters
    assert copies[0]["redelivered"] is True, copies
    assert second["recovered"] is True and second["previous_fence"] == first["fence"], second
    assert outcome["fence"] > first["fence"] and outcome["run"] == 2, outcome
    assert result.state == "SUCCESS"
    if kill == "worker":
        assert not victim.owns(second["pid"])


# -- a connection closed under a running task ---------------------------------------------------
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "negative_control"])
def test_a_copy_redelivered_while_the_original_runs_is_rearmed_and_never_runs_twice(
    amqp_vhost, it_app, start_worker, store_env, events, coord, queue, dedup
):
    """The worker running a task loses its connection (closed by RabbitMQ, ``rabbitmqctl
    close_connection``): RabbitMQ requeues the unacked message while the body still runs, and
    a worker takes the copy. It finds the resource held by its own task id (a duplicate) and is
    re-armed, not run; once the original has finished (its ack fails: its channel is gone), the
    copy finds the identity done and ends with the recorded result. The body ran once; RabbitMQ
    holds no copy at the end. Negative control (``lease_dedup`` off): the copy runs the body a
    second time once the original released the resource."""
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": str(TTL),
        "CL_REPORT_STARTS": "1",
        "CL_DEDUP": "1" if dedup else "0",
    }
    workers = start_pair(start_worker, env, queue, pool="threads", concurrency=2)
    n, go = unique("d"), events.key_for("go")
    with producer_for(it_app, amqp_vhost.url) as producer:
        result = producer.send_task(it_app.rabbit_job.name, (n, 0, go), queue=queue)
        first = events.wait(ev="enter", res=n, k=0)
        (holder,) = [w for w in workers if w.owns(first["pid"])]
        closed_at = time.time()
        assert close_connections_of(amqp_vhost.server, holder.pid) >= 1
        copy = events.wait(ev="start", task=result.id, redelivered=True)
        if dedup:  # re-armed while the original runs
            wait_for(lambda: events.where(ev="retry", task=result.id), 30, "the copy re-armed")
        coord.set(go, 1)
        outcome = result.get(timeout=60)
        wait_for_queues(lambda: drained(amqp_vhost, queue), 60, "every copy consumed")
    body_runs = runs(coord, events, n, 0)
    retries = events.where(ev="retry", task=result.id)
    print(
        f"dedup={dedup}: copy redelivered {copy['t'] - closed_at:.3f}s after the close, "
        f"re-armed {len(retries)}x ({sorted({e['exc'] for e in retries})}); body ran "
        f"{body_runs}x"
    )
    if not dedup:
        assert body_runs == 2, "the copy did not run again: the control is broken"
        return
    assert body_runs == 1, events.where(res=n)
    assert outcome["run"] == 1 and result.state == "SUCCESS", outcome
    assert {e["exc"] for e in retries} <= {"LeaseBusyError", "IdentityDoneError"}, retries
    assert "closed by the test" in holder.log() or "Connection to broker lost" in holder.log()


# -- consumer_timeout ----------------------------------------------------------------------------
CONSUMER_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def short_timeout_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A RabbitMQ node of this module's own whose ``consumer_timeout`` is 3 s, checked every
    second (both are node-wide on 3.10, which has no per-queue timeout: the session's node
    keeps the defaults)."""
    from tests.tooling.rabbitmq import RabbitMQServer

    try:
        server = RabbitMQServer(
            tmp_path_factory.mktemp("rabbitmq-timeout"),
            config=(f"consumer_timeout = {int(CONSUMER_TIMEOUT * 1000)}",),
        ).start()
    except FileNotFoundError as exc:
        missing(str(exc))
    except (RuntimeError, TimeoutError) as exc:
        missing(f"RabbitMQ did not start: {exc}")
    # RabbitMQ 3.10 looks for timed-out deliveries at each channel's tick, once a minute by
    # default (measured: a 3 s timeout closed the channel after 60 s); a tick every second
    # makes it close 3-4 s after the delivery.
    server.ctl("eval", "application:set_env(rabbit, channel_tick_interval, 1000).")
    yield server
    server.close()


@pytest.fixture
def timeout_vhost(short_timeout_node: Any) -> Iterator[Any]:
    name = unique("v")
    url = short_timeout_node.add_vhost(name)
    try:
        yield SimpleNamespace(
            name=name,
            url=url,
            server=short_timeout_node,
            queues=lambda: short_timeout_node.list_queues(name),
        )
    finally:
        short_timeout_node.delete_vhost(name)


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "negative_control"])
def test_a_waiter_held_past_consumer_timeout_is_not_lost_and_runs_once(
    timeout_vhost, it_app, start_worker, store_env, events, coord, queue, dedup
):
    """consumer_timeout 3 s: a holder runs past it with its message unacked (acks_late),
    and a refused waiter's back-stop copy (a countdown of one ttl, 2 s) is held unacked in the
    same worker. RabbitMQ closes that channel ("delivery acknowledgement on channel 1 timed
    out") and requeues both; Celery takes the channel error as unrecoverable and the worker
    shuts down (warm: the holder's body runs on). A new worker (the supervisor's restart) gets
    both copies redelivered: the holder's is a duplicate of the running body (re-armed), the
    waiter's waits again. Once the holder ends, the waiter is woken and runs, and every later
    copy finds its identity done: each body ran once, none was lost. Negative control
    (``lease_dedup`` off): the holder's copy runs its body a second time. (Every countdown the
    library sets is below the timeout here; one above it, a 4 s back-stop, stopped the new
    worker the same way: docs/operations.md, RabbitMQ.)"""
    ttl = 2.0
    env = {
        **store_env("redis"),
        "CL_BROKER": timeout_vhost.url,
        "CL_TTL": str(ttl),
        "CL_BACKOFF_CAP": str(ttl),  # the back-stop copy: one ttl later
        "CL_REPORT_STARTS": "1",
        "CL_DEDUP": "1" if dedup else "0",
    }
    first = start_worker(env, queue=queue, pool="threads", concurrency=2)
    n, go = unique("t"), events.key_for("go")
    with producer_for(it_app, timeout_vhost.url) as producer:
        holder = producer.send_task(it_app.rabbit_job.name, (n, 0, go), queue=queue)
        events.wait(ev="enter", res=n, k=0)
        waiter = producer.send_task(it_app.rabbit_job.name, (n, 1), queue=queue)
        events.wait(ev="retry", task=waiter.id)
        refused = time.time()
        wait_for(
            lambda: "timed out" in first.log() and "Unrecoverable error" in first.log(),
            30,
            "RabbitMQ to close the channel and the worker to stop",
        )
        print(f"channel closed {time.time() - refused:.1f}s after the waiter was refused")
        second = start_worker(env, queue=queue, pool="threads", concurrency=2)
        copy = events.wait(30, ev="start", task=holder.id, redelivered=True)
        assert second.owns(copy["pid"])
        events.wait(30, ev="start", task=waiter.id, redelivered=True)
        coord.set(go, 1)
        outcomes = [holder.get(timeout=60), waiter.get(timeout=60)]
        wait_for_queues(lambda: drained(timeout_vhost, queue, queue + ".lease-wake"), 60, "drained")
    counts = [runs(coord, events, n, 0), runs(coord, events, n, 1)]
    redelivered = [e for e in events.where(ev="start") if e["redelivered"]]
    print(f"dedup={dedup}: bodies ran {counts}; {len(redelivered)} redelivered copies")
    if not dedup:
        assert counts[0] == 2, "the holder ran once: the control is broken"
        return
    assert counts == [1, 1], events.where(res=n)
    assert [o["k"] for o in outcomes] == [0, 1] and outcomes[1]["run"] == 1
    assert holder.state == waiter.state == "SUCCESS"


# -- prefetch ------------------------------------------------------------------------------------
WAITERS = 4


@pytest.mark.parametrize("raised", [True, False], ids=["eta_qos", "negative_control"])
def test_a_worker_whose_prefetch_holds_back_stop_copies_still_takes_new_work(
    amqp_vhost, it_app, start_worker, store_env, events, coord, queue, raised
):
    """One worker, two threads, prefetch 2 (multiplier 1). A holder keeps one resource; four
    waiters on it are refused, and each one's back-stop copy (a countdown of one ttl, 5 s) is
    held unacked in the worker. A task on another resource, sent then, starts at once: Celery
    raises the channel's prefetch by one for each countdown message it holds (classic queues,
    global QoS). Negative control (that raise switched off, as with quorum queues' static
    prefetch): the held copies fill the prefetch and the new task waits for the holder."""
    ttl = 5.0
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": str(ttl),
        "CL_BACKOFF_CAP": str(ttl),
        "CL_ETA_QOS": "on" if raised else "off",
    }
    start_worker(env, queue=queue, pool="threads", concurrency=2)
    n, other, go = unique("p"), unique("o"), events.key_for("go")
    with producer_for(it_app, amqp_vhost.url) as producer:
        holder = producer.send_task(it_app.rabbit_job.name, (n, 0, go), queue=queue)
        events.wait(ev="enter", res=n, k=0)
        waiters = [
            producer.send_task(it_app.rabbit_job.name, (n, k), queue=queue)
            for k in range(1, WAITERS + 1)
        ]
        wait_for(
            lambda: len(events.where(ev="retry")) >= (WAITERS if raised else 1),
            30,
            "the waiters refused",
        )
        sent = time.time()
        fresh = producer.send_task(it_app.rabbit_job.name, (other, 0), queue=queue)
        watch = ttl - 1.0  # (before any back-stop copy comes due)
        deadline = time.monotonic() + watch
        while time.monotonic() < deadline and not events.where(ev="enter", res=other):
            time.sleep(0.05)
        started = events.where(ev="enter", res=other)
        refused = len({e["task"] for e in events.where(ev="retry")})
        coord.set(go, 1)
        wait_for(lambda: fresh.ready() and all(w.ready() for w in waiters), 60, "all done")
    print(
        f"eta_qos={raised}: {refused} waiters refused; new task started "
        + (f"{started[0]['t'] - sent:.2f}s after it was sent" if started else f"not in {watch}s")
    )
    assert holder.state == fresh.state == "SUCCESS"
    assert all(w.state == "SUCCESS" for w in waiters)
    if not raised:
        assert not started, "the new task ran: the control is broken"
        return
    assert refused == WAITERS
    # within the watch (ttl - 1 s: before any held copy came due and freed the prefetch), the
    # line the control cannot cross; 0-0.6 s here
    assert started and started[0]["t"] - sent < watch, started


# -- the wake queue, a worker that cancels its consumer ----------------------------------------
IN_LINE = 6


def node(worker: Worker) -> str:
    return f"{worker.name}@{socket.gethostname()}"


@pytest.mark.parametrize("cancel_wake", [True, False], ids=["wake_queue", "negative_control"])
def test_waiters_run_in_line_through_the_wake_queue_and_a_cancelled_worker_gets_none(
    amqp_vhost, it_app, start_worker, store_env, events, queue, cancel_wake
):
    """Three workers consume Q (and so Q.lease-wake); worker A is told to stop consuming Q
    (``app.control.cancel_consumer``), which on RabbitMQ cancels its consumer of the wake queue
    too. A holder and six waiters, each sent once the one before was refused: at each release
    the next one is woken through Q.lease-wake, so they run in line, 1 to 6, and only on the
    two workers still consuming Q. Negative control (the wake queue's consumer left on A): A
    still takes wakes of the queue it was told to stop consuming."""
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": "5",
        "CL_BACKOFF_CAP": "5",
        "CL_CANCEL_WAKE": "on" if cancel_wake else "off",
    }
    a, *others = [
        start_worker(env, queue=queue, pool="threads", concurrency=2, wait=False) for _ in range(3)
    ]
    for worker in (a, *others):
        worker.wait_ready()
    control = amqp_producer(it_app, amqp_vhost.url)
    try:
        control.control.cancel_consumer(queue, destination=[node(a)], reply=True, timeout=10)
        wake = queue + ".lease-wake"

        def cancelled() -> bool:
            queues = amqp_vhost.queues()
            return (
                queues.get(wake, {}).get("consumers") == ("2" if cancel_wake else "3")
                and queues.get(queue, {}).get("consumers") == "2"
            )

        wait_for_queues(cancelled, 20, "A's consumer of Q cancelled")
        n, go = unique("f"), events.key_for("go")
        results = [control.send_task(it_app.fifo_gate.name, (n, 0, go), queue=queue)]
        events.wait(ev="enter", res=n, k=0)
        for k in range(1, IN_LINE + 1):
            results.append(control.send_task(it_app.fifo_hold.name, (n, k, 0.05), queue=queue))
            events.wait(ev="retry", task=results[-1].id)
        events.client.rpush(go, 1)
        wait_for(lambda: all(r.ready() for r in results), 60, "every task done")
    finally:
        control.close()
    entered = [e for e in events.where(ev="enter", res=n) if e["k"] > 0]
    order = [e["k"] for e in entered]
    hosts = {e["host"] for e in entered}
    via = {e["via"] for e in entered}
    print(f"cancel_wake={cancel_wake}: order {order}; hosts {sorted(hosts)}; via {via}")
    assert all(r.state == "SUCCESS" for r in results)
    assert via == {wake}, entered
    if not cancel_wake:
        assert node(a) in hosts, "A took no wake: the control is broken"
        return
    assert order == list(range(1, IN_LINE + 1)), entered
    assert node(a) not in hosts, entered


@pytest.mark.parametrize("consumes_wake", [True, False], ids=["wake_queue", "negative_control"])
def test_a_wake_stranded_when_its_only_consumer_died_runs_the_waiter_once_on_the_next_worker(
    amqp_vhost, it_app, start_worker, store_env, events, queue, tmp_path, consumes_wake
):
    """Worker A is the only consumer of Q (and so of Q.lease-wake). It holds the resource and
    has a refused waiter's back-stop copy; at the release it sends the wake and is SIGKILLed
    right after (failpoint ``after_wake``). The wake is then stranded: in Q.lease-wake, with no
    consumer; RabbitMQ gives A's back-stop copy back to Q. Worker B, started after, consumes
    both: the waiter runs once, woken through the wake queue, and its back-stop copy is dropped
    (the queues drain with one run). Negative control (B does not consume wake queues,
    ``lease_handoff_wake_queue`` off, as in a fleet where some workers do not): the wake stays
    stranded and the waiter runs from its back-stop copy once the hold for it lapsed."""
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": "2",
        "CL_BACKOFF_BASE": "0.05",
        "CL_BACKOFF_CAP": "3",
        "CL_EARLY_WAKE": "0",  # (the failpoint stops a wake sent after the release)
    }
    killer = {
        **env,
        "CELERY_LEASE_FAILPOINTS": "after_wake=kill",
        "CELERY_LEASE_FAILPOINTS_ONCE": str(tmp_path / "once"),
    }
    a = start_worker(killer, queue=queue, pool="threads", concurrency=2)
    wake = queue + ".lease-wake"
    n, go = unique("s"), events.key_for("go")
    with producer_for(it_app, amqp_vhost.url) as producer:
        producer.send_task(it_app.fifo_gate.name, (n, 0, go), queue=queue)
        events.wait(ev="enter", res=n, k=0)
        waiter = producer.send_task(it_app.fifo_hold.name, (n, 1, 0.05), queue=queue)
        events.wait(ev="retry", task=waiter.id)
        # A's other thread is taken by a task on another resource until A dies: the wake A
        # receives then waits for a free thread, unacked, and cannot run before the kill (with
        # a free thread it once did, under load, between the wake's publish and the kill).
        other, go_other = unique("o"), events.key_for("go-other")
        producer.send_task(it_app.fifo_gate.name, (other, 0, go_other), queue=queue)
        events.wait(ev="enter", res=other, k=0)
        events.client.rpush(go, 1)  # the holder ends: A releases, wakes the waiter, dies
        assert a.proc is not None
        wait_for(lambda: a.proc.poll() is not None, 30, "worker A killed right after its wake")
        events.client.rpush(go_other, 1)  # for the blocker's copy that B runs

        def stranded() -> bool:
            state = amqp_vhost.queues().get(wake, {})
            return state.get("consumers") == "0" and state.get("messages_ready") == "1"

        wait_for_queues(stranded, 20, "the wake stranded in Q.lease-wake, with no consumer")
        assert not _entered_k(events, n, 1), "the waiter ran before the wake was stranded"
        killed = time.monotonic()
        b = start_worker({**env, "CL_WAKE_QUEUE": "1" if consumes_wake else "0"}, queue=queue)
        assert waiter.get(timeout=60) == 1
        ran_after = time.monotonic() - killed
        # drained (ready and unacked): B has acked the back-stop copy, run or dropped
        wait_for_queues(lambda: drained(amqp_vhost, queue), 30, "the back-stop copy taken from Q")
    entered = _entered_k(events, n, 1)
    queues = amqp_vhost.queues()
    print(
        f"consumes_wake={consumes_wake}: waiter ran {len(entered)} time(s), via "
        f"{[e['via'] for e in entered]}, {ran_after:.1f}s after B was started; "
        f"{wake}: {queues.get(wake)}"
    )
    assert len(entered) == 1 and entered[0]["host"] == node(b), entered
    if not consumes_wake:
        assert entered[0]["via"] is None, "the waiter was woken: the control is broken"
        assert queues[wake]["messages_ready"] == "1", queues  # still stranded
        return
    assert entered[0]["via"] == wake, entered
    assert drained(amqp_vhost, wake), queues


def _entered_k(events: Any, n: str, k: int) -> list[dict[str, Any]]:
    return [e for e in events.where(ev="enter", res=n) if e["k"] == k]


# -- quorum queues: the delivery limit -----------------------------------------------------------
@pytest.mark.parametrize("handoff", [True, False], ids=["wait_list", "negative_control"])
def test_a_waiter_whose_copy_a_quorum_queues_delivery_limit_dropped_is_not_lost(
    amqp_vhost, it_app, start_worker, store_env, events, coord, queue, handoff
):
    """Q is a quorum queue with ``x-delivery-limit: 0``: a message returned once is dropped.
    Worker A runs a holder and holds a refused waiter's back-stop copy; A is SIGKILLed, and
    RabbitMQ drops both messages (the holder's task is lost, as the delivery limit says). The
    waiter is not: its place in the resource's wait list outlives
    its copy, and once the dead holder's lease has run out the new worker's pass over the wait
    lists sends it again; it runs once, recovering the lease. Negative control (hand-off off:
    the waiter's only trace is its copy): it is lost with it."""
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": "2",
        "CL_BACKOFF_CAP": "3",
        "CL_QUORUM_QUEUE": queue,
        "CL_DELIVERY_LIMIT": "0",
        "CL_HANDOFF": "1" if handoff else "0",
    }
    a = start_worker(env, queue=queue, pool="threads", concurrency=2)
    n, go = unique("qq"), events.key_for("go")
    producer = amqp_producer(it_app, amqp_vhost.url)
    from kombu import Exchange, Queue

    arguments = {"x-queue-type": "quorum", "x-delivery-limit": 0}
    producer.conf.task_queues = [
        Queue(queue, Exchange(queue, type="topic"), routing_key=queue, queue_arguments=arguments)
    ]
    try:
        holder = producer.send_task(it_app.rabbit_job.name, (n, 0, go), queue=queue)
        events.wait(ev="enter", res=n, k=0)
        waiter = producer.send_task(it_app.rabbit_job.name, (n, 1), queue=queue)
        events.wait(ev="retry", task=waiter.id)

        def held_by_a() -> bool:
            """A holds a copy of the waiter as a countdown (unacked) due in a second or more:
            the kill then lands before A runs it and publishes the next copy to Q (where the
            new worker would get it). The retry event is told before the copy is published,
            so neither it nor an empty Q proves A holds the copy."""
            inspect = producer.control.inspect(destination=[node(a)], timeout=2)
            scheduled = inspect.scheduled() or {}
            now = datetime.datetime.now(datetime.timezone.utc)
            return any(
                e["request"]["id"] == waiter.id
                and datetime.datetime.fromisoformat(e["eta"]) - now > datetime.timedelta(seconds=1)
                for es in scheduled.values()
                for e in es
            )

        wait_for(held_by_a, 20, "worker A to hold the waiter's back-stop copy")
        a.kill()  # (RabbitMQ drops both of A's unacked messages: returned once is too many)
        killed = time.monotonic()
        coord.set(go, 1)
        start_worker(env, queue=queue, pool="threads", concurrency=2)
        watch = 10.0
        deadline = time.monotonic() + watch
        while time.monotonic() < deadline and not waiter.ready():
            time.sleep(0.1)
    finally:
        producer.close()
    counts = [runs(coord, events, n, 0), runs(coord, events, n, 1)]
    print(
        f"handoff={handoff}: waiter {waiter.state} {time.monotonic() - killed:.1f}s after the "
        f"kill, holder {holder.state}; bodies ran {counts}"
    )
    assert holder.state == "PENDING" and counts[0] == 1  # dropped by RabbitMQ
    if not handoff:
        assert not waiter.ready() and counts[1] == 0, "the waiter ran: the control is broken"
        return
    outcome = waiter.get(timeout=1)
    assert waiter.state == "SUCCESS" and counts[1] == 1 and outcome["recovered"] is True
