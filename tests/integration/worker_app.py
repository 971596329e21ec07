"""The Celery app that the integration tests run in real ``celery worker`` processes.

Configured entirely from the environment (``CL_*`` variables set by the test harness), so each
test can point its workers at its own store, queue and coordination keys. Task bodies report to
the test through a coordination Redis (``CL_COORD``): an append-only event list (a single list
gives a total order of enter/exit events across processes), readiness flags and go signals.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import sys
import threading
import time
from typing import Any

import redis
from celery import Celery, bootsteps, signals

import celery_lease
from celery_lease import (
    FenceGate,
    LeaseInterrupt,
    LeaseLostError,
    Owner,
    StaleFenceError,
    current_lease,
    lease_task,
)
from celery_lease._wakes import WOKEN_HEADER as WOKEN

env = os.environ
app = Celery("lease_it", broker=env.get("CL_BROKER", "memory://"))
app.conf.update(
    result_backend=env.get("CL_BACKEND", env.get("CL_BROKER", "cache+memory://")),
    lease_store_url=env.get("CL_STORE", "memory://"),
    lease_ttl=float(env.get("CL_TTL", "1.0")),
    lease_key_prefix=env.get("CL_PREFIX", "celery_lease:"),
    lease_table_prefix=env.get("CL_TABLE_PREFIX", "celery_lease_"),
    lease_busy_backoff_base=float(env.get("CL_BACKOFF_BASE", "0.05")),
    lease_busy_backoff_cap=float(env.get("CL_BACKOFF_CAP", "0.3")),
    lease_lost_retry_delay=float(env.get("CL_LOST_DELAY", "0.2")),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=env.get("CL_QUEUE", "celery"),
    result_expires=600,
    # A pool child that is not up in 4 s (Celery's default) is SIGKILLed and replaced: on a
    # loaded 2-core box twenty children replaced at once took longer, and the failpoint matrix
    # counted those kills as its own.
    worker_proc_alive_timeout=30.0,
)
if env.get("CL_TRACK_STARTED"):
    app.conf.task_track_started = True
if env.get("CL_ACKS_LATE") == "0":  # Celery's default: the message is acked as its run starts
    app.conf.task_acks_late = False
if env.get("CL_DEDUP") == "0":  # no identity records: a copy of a finished task runs again
    app.conf.lease_dedup = False
if env.get("CL_QUORUM_QUEUE"):
    # The test's queue as a quorum queue (x-delivery-limit CL_DELIVERY_LIMIT when set), bound
    # to an exchange of type CL_QUORUM_EXCHANGE: topic (default) as Celery's docs set quorum
    # queues up for its native delayed delivery, or direct (the queue then gets a wake queue).
    from kombu import Exchange, Queue

    _quorum_args: dict[str, Any] = {"x-queue-type": "quorum"}
    if env.get("CL_DELIVERY_LIMIT"):
        _quorum_args["x-delivery-limit"] = int(env["CL_DELIVERY_LIMIT"])
    _name = env["CL_QUORUM_QUEUE"]
    app.conf.task_queues = [
        Queue(
            _name,
            Exchange(_name, type=env.get("CL_QUORUM_EXCHANGE", "topic")),
            routing_key=_name,
            queue_arguments=_quorum_args,
        )
    ]
    # Celery then declares 28 delay queues for its native delayed delivery, quorum ones by
    # default: deleting the test's vhost took 17 s with those, so here they are classic.
    app.conf.broker_native_delayed_delivery_queue_type = "classic"
if env.get("CL_CANCEL_WAKE") == "off":
    # Negative control of test_rabbitmq_faults.py: cancel_consumer(Q) leaves Q's wake queue
    # consumed (as when the wake queue was not cancelled with its task queue).
    from kombu.messaging import Consumer as _KombuConsumer

    _cancel_by_queue = _KombuConsumer.cancel_by_queue

    def _keep_wake_queues(self: Any, queue: str) -> None:
        if not queue.endswith(".lease-wake"):
            _cancel_by_queue(self, queue)

    _KombuConsumer.cancel_by_queue = _keep_wake_queues  # type: ignore[method-assign]
if env.get("CL_ETA_QOS") == "off":
    # Negative control of test_rabbitmq_faults.py: the worker does not raise its prefetch for
    # each countdown message it holds (Celery does, on RabbitMQ's classic queues), so held
    # back-stop copies fill the prefetch as they do on quorum queues' static prefetch.
    from kombu.common import QoS

    QoS.increment_eventually = lambda self, n=1: self.value  # type: ignore[method-assign]
    QoS.decrement_eventually = lambda self, n=1: self.value  # type: ignore[method-assign]
if env.get("CL_REJECT_ON_WORKER_LOST") == "0":  # Celery's default: a killed child's step fails
    app.conf.task_reject_on_worker_lost = False
if env.get("CL_NO_BACKEND"):  # no result backend (Celery's DisabledBackend)
    app.conf.result_backend = None
if env.get("CL_WAKE_QUEUE"):  # unset: the library's default (on)
    app.conf.lease_handoff_wake_queue = env["CL_WAKE_QUEUE"] == "1"
if env.get("CL_EARLY_WAKE"):  # unset: the library's default (on)
    app.conf.lease_handoff_early_wake = env["CL_EARLY_WAKE"] == "1"
if env.get("CL_HANDOFF"):  # unset: the library's default (on)
    app.conf.lease_handoff = env["CL_HANDOFF"] == "1"
if env.get("CL_WAIT_CAP") or env.get("CL_HANDOFF_GRACE"):
    # The wait list cap and the hand-off grace are store constants, not settings: set the
    # defaults every store this worker makes starts with.
    from celery_lease.stores import base as _store_base

    _store_base.DEFAULT_WAIT_CAP = int(env.get("CL_WAIT_CAP") or _store_base.DEFAULT_WAIT_CAP)
    _store_base.DEFAULT_HANDOFF_GRACE = float(
        env.get("CL_HANDOFF_GRACE") or _store_base.DEFAULT_HANDOFF_GRACE
    )
if env.get("CL_SINCE_SKEW"):  # the negative control of the tolerance for publish times ahead
    from celery_lease.stores import base as _store_base

    _store_base.SINCE_SKEW = float(env["CL_SINCE_SKEW"])
if env.get("CL_HANDOFF_MAX_PAYLOAD"):
    app.conf.lease_handoff_max_payload = int(env["CL_HANDOFF_MAX_PAYLOAD"])
if env.get("CL_POLLING") == "0":  # the negative control of the polling places
    from celery_lease import _attempt

    _attempt.POLLING_PLACES = False
if env.get("CL_PASS_THE_TURN") == "0":  # the negative control of the turn checks and passes
    from celery_lease import _wakes

    _wakes.PASS_THE_TURN = False
if env.get("CL_EXIT_TURNS") == "0":  # negative control: a process exits without its turn checks
    from celery_lease import _wakes

    _wakes.EXIT_TURNS = False
if env.get("CL_POLL_TURN_GRACES"):  # negative control: a polling turn checked too early
    from celery_lease import _wakes

    _wakes.POLL_TURN_GRACES = int(env["CL_POLL_TURN_GRACES"])
if env.get("CL_PASS_IN_PARENT") == "0":  # negative control: prefork passes in pool process 0
    from celery_lease import _passes

    _passes.PASS_IN_PARENT = False
if env.get("CL_HAND_OVER") == "0":  # negative control: a pool process waits for its checks
    from celery_lease import _passes

    _passes.HAND_OVER_TURNS = False
if env.get("CL_STORE_DOWN_MAX_WAIT"):
    app.conf.lease_store_down_max_wait = float(env["CL_STORE_DOWN_MAX_WAIT"])
#: How long a worker holds the Redis transport's ``unacked_mutex`` (kombu: 300 s). A worker
#: SIGKILLed while restoring unacked messages leaves the key behind; with kombu's default no
#: other worker of the broker database restores anything for five minutes.
UNACKED_MUTEX_EXPIRE = 5
app.conf.broker_transport_options = {"unacked_mutex_expire": UNACKED_MUTEX_EXPIRE}
if env.get("CL_VISIBILITY"):
    # A short visibility timeout makes the Redis transport redeliver a message whose worker
    # has not acked it within that time (a long task, or a worker that died), checked every
    # second rather than every 100 s.
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "visibility_timeout": float(env["CL_VISIBILITY"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }

if env.get("CL_QUEUE_ORDER"):  # the Redis transport's order of serving the consumed queues
    app.conf.broker_transport_options = {
        **(app.conf.broker_transport_options or {}),
        "queue_order_strategy": env["CL_QUEUE_ORDER"],
    }

if env.get("CL_CONNECTIONS") == "per-thread":
    # The connection tests' negative control: each thread (greenlet, under gevent) keeps one
    # store connection for its lifetime, as the stores did before their free lists.
    from celery_lease.stores import _connections

    _connections.PER_THREAD = True

if env.get("CL_PLAIN_METRICS_PORT"):
    # What exposing the lease counters looked like before --lease-metrics-port: the default
    # registry served from the worker's main process (tests/integration/test_metrics_prefork.py
    # uses it as the negative control).

    @signals.worker_init.connect
    def _plain_metrics(**_: Any) -> None:
        import prometheus_client

        prometheus_client.start_http_server(int(env["CL_PLAIN_METRICS_PORT"]), "127.0.0.1")


if env.get("CL_INTERRUPT_AS_EXCEPTION"):
    # The negative control of test_interrupt_delivery.py: LeaseInterrupt as it was, an
    # Exception (a LeaseLostError), which an ordinary ``except Exception:`` swallows.
    import celery_lease._interrupt as _interrupt_module

    class _ExceptionInterrupt(LeaseLostError):
        pass

    _ExceptionInterrupt.__name__ = _ExceptionInterrupt.__qualname__ = "LeaseInterrupt"
    _interrupt_module.LeaseInterrupt = _ExceptionInterrupt  # type: ignore[misc]

#: What a body catches to see its lease interrupt (LeaseInterrupt is no LeaseLostError).
LOST = (LeaseLostError, LeaseInterrupt)


# Prompt exits, for the suite's time (in this test app only; the library is untouched). A warm
# shutdown is complete when these signals are sent, and what the processes would do after it
# changes nothing a test looks at, yet costs about two seconds of wall time per worker:
# - a prefork pool child, after its worker_process_shutdown receivers (celery_lease's releases
#   the leases still held) ran, tells the parent it died and sleeps one second so the parent can
#   SIGTERM it (billiard's Worker._do_exit), then os._exit()s; during a shutdown nobody reads
#   that message, so the child always sleeps out the second;
# - the main process, after worker_shutdown, joins its threads, runs the atexit handlers
#   (celery_lease's release_all_held, logging's flush) and then tears the interpreter down,
#   which took 1-2 s on the loaded test machine and does nothing observable.
# Both exit here with the same status, after the same receivers and handlers.


def _under_gevent() -> bool:
    monkey = getattr(sys.modules.get("gevent"), "monkey", None)
    return bool(monkey is not None and monkey.is_anything_patched())


@signals.worker_init.connect
def _broker_pool_per_greenlet(sender: Any = None, **_: Any) -> None:
    """Under gevent, a connection in the broker's pool for each greenlet that may ack at once.

    Celery 5.7 acks a finished task from its own greenlet (``Consumer.call_soon_ack``), and
    the Redis transport's pool of a channel holds ``max_connections`` (10 by default) and
    raises ``MaxConnectionsError`` past that instead of waiting: in a burst on ``-c 50``, acks
    failed ("Couldn't ack"), their messages stayed unacked until the visibility timeout, and
    once the error hit the consumer itself ("Connection to broker lost") a message fetched
    around the reconnection was stranded: the 1 task in 500 that never ran.
    """
    if sender is None or not _under_gevent() or env.get("CL_BROKER_POOL") == "default":
        return  # (CL_BROKER_POOL=default: the negative control of test_connections.py)
    options = dict(app.conf.broker_transport_options or {})
    options.setdefault("max_connections", int(sender.concurrency) + 10)
    app.conf.broker_transport_options = options


class _PromptWarmShutdown(bootsteps.StartStopStep):  # type: ignore[misc]
    """On an AMQP broker, a worker notices a SIGTERM within a quarter of a second, not ten.

    The worker's event loop polls its sockets for as long as its next timer allows, at most
    10 s (the hub's timer has ``max_interval=10``), and Celery's warm-shutdown handler only
    sets a flag that the loop reads between polls. On Redis the transport's own polling wakes
    the loop often; an idle py-amqp connection does not, so every idle worker took 10 s to
    begin its warm shutdown (measured with a plain Celery app too: Celery's, not ours). A
    no-op timer every 0.25 s bounds each poll.
    """

    def start(self, c: Any) -> None:
        self.tref = c.timer.call_repeatedly(0.25, _nothing)

    def stop(self, c: Any) -> None:
        tref = getattr(self, "tref", None)
        if tref is not None:
            tref.cancel()


def _nothing() -> None:
    return None


if env.get("CL_BROKER", "").startswith(("amqp", "pyamqp")):
    app.steps["consumer"].add(_PromptWarmShutdown)


@signals.worker_process_shutdown.connect
def _pool_child_exits_now(exitcode: Any = None, **_: Any) -> None:
    if isinstance(exitcode, int):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exitcode)


@signals.worker_shutdown.connect
def _worker_exits_now(sender: Any = None, **_: Any) -> None:
    code = getattr(sender, "exitcode", None)
    code = 0 if code is None else code
    if not isinstance(code, int) or threading.current_thread() is not threading.main_thread():
        return  # the ordinary way out
    if _under_gevent():
        return
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter runs first
    atexit._run_exitfuncs()  # then these (the last logging.shutdown flushes the log file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forget_interrupt() -> None:
    """Switch the interrupt layer off for the rest of this body (test bodies only).

    A body that swallows its LeaseInterrupt gets it again from its next ``lease.check()``,
    store call or fenced write. Bodies that play an owner which never learned of the loss
    (stuck in a call an interrupt cannot break), to show the fence alone refusing its stale
    write, call this after swallowing it: such an owner would see nothing either.
    """
    from celery_lease import _interrupt

    interrupter = getattr(_interrupt._local, "interrupter", None)
    if interrupter is not None:
        interrupter.disarm()


_coord: redis.Redis | None = None
_coord_pid: int | None = None
_gate: FenceGate | None = None


def coord() -> redis.Redis:
    """This process's client of the coordination Redis (remade after fork)."""
    global _coord, _coord_pid  # noqa: PLW0603
    if _coord is None or _coord_pid != os.getpid():
        _coord = redis.Redis.from_url(env["CL_COORD"], socket_timeout=10)
        _coord_pid = os.getpid()
    return _coord


def gate() -> FenceGate:
    global _gate  # noqa: PLW0603
    if _gate is None:
        _gate = FenceGate(
            env.get("CL_GATE", env.get("CL_STORE", "memory://")),
            **_prefix_options(env.get("CL_GATE", env.get("CL_STORE", ""))),
        )
    return _gate


def _prefix_options(url: str) -> dict[str, Any]:
    # CL_GATE_PREFIX: a gate on the same server under a prefix of its own, so not sharing the
    # lease store (it knows only the fences it admitted), the negative control of a gate that
    # does share it.
    if url.startswith("redis"):
        return {"key_prefix": env.get("CL_GATE_PREFIX", env.get("CL_PREFIX", "celery_lease:"))}
    if url.startswith(("postgresql", "sqlite")):
        prefix = env.get("CL_GATE_PREFIX", env.get("CL_TABLE_PREFIX", "celery_lease_"))
        return {"table_prefix": prefix}
    return {}


def report(kind: str, **fields: Any) -> None:
    fields.update(ev=kind, pid=os.getpid(), t=time.time())
    coord().rpush(env["CL_EVENTS"], json.dumps(fields, default=str))


def _lost_reason(lease: Any) -> str | None:
    """Why the lease was lost (an interrupt itself carries no reason; the lease records it)."""
    lost = lease.lost
    return None if lost is None else lost.reason


def _report_outcome(kind: str, task_id: Any, name: Any, exc: Any) -> None:
    """Report how an execution ended (retry, failure) with its exception's class and reason.

    Called from Celery signals, after the body: the lease interrupter is disarmed by then, so
    unlike a report from inside the body this one cannot be cut short by a late interrupt.
    """
    if "CL_EVENTS" not in env or "CL_COORD" not in env:
        return
    try:
        report(
            kind,
            task=task_id,
            name=name,
            exc=type(exc).__name__,
            reason=getattr(exc, "reason", None),
            fence=getattr(exc, "fence", None),
            position=getattr(exc, "position", None),
            message=str(exc),
        )
    except Exception:  # test reporting must never break the worker
        return


@signals.task_retry.connect
def _on_retry(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
    exc = getattr(reason, "exc", None) or reason
    _report_outcome("retry", getattr(request, "id", None), getattr(sender, "name", None), exc)


@signals.task_failure.connect
def _on_failure(sender: Any = None, task_id: Any = None, exception: Any = None, **_: Any) -> None:
    _report_outcome("failure", task_id, getattr(sender, "name", None), exception)


def wait_pushed(go: str, timeout: float = 60.0, block: float = 1.0) -> None:
    """Block until the test pushes to the coordination list ``go`` (one push each); a
    TimeoutError naming it after ``timeout`` s. (``block``: one BLPOP's wait, below the
    client's socket timeout.)"""
    deadline = time.monotonic() + timeout
    while not coord().blpop([go], timeout=block):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody pushed {go}")


def wait_for_key(key: str, timeout: float = 60.0, poll: float = 0.002) -> None:
    """Busy-poll a coordination key without touching the lease (a paused owner's view)."""
    deadline = time.monotonic() + timeout
    client = coord()
    while not client.exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(key)
        time.sleep(poll)


@lease_task(app=app, resource="res-{n}", bind=True)
def exclusive(self: Any, n: int, hold: float = 0.05) -> int:
    """Reports enter/exit with its fence around a short hold of resource res-<n>."""
    lease = current_lease()
    assert self.request.lease is lease
    report("enter", res=n, fence=lease.fence, task=self.request.id)
    completed = False
    try:
        time.sleep(hold)
        completed = True
    finally:
        # Also when the body is interrupted (lease lost under load): it has stopped acting
        # before the lease is released, so the exit is still ordered before the next enter.
        report("exit", res=n, fence=lease.fence, task=self.request.id, completed=completed)
    return lease.fence


@lease_task(app=app, resource="gate-{n}", bind=True)
def gated_hold(self: Any, n: int, go: str) -> int:
    """Holds resource gate-<n> until the test sets the coordination key ``go`` (60 s at most);
    returns its fence. Copies sent with the same task id and arguments wait for the same key."""
    wait_for_key(go, timeout=60.0, poll=0.05)
    return current_lease().fence


@lease_task(app=app, resource="paused-{trial}", bind=True)
def paused_writer(
    self: Any, trial: int, role: str, use_gate: bool = True, self_fence: bool = True
) -> int:
    """Checks its lease, tells the test it is about to write, waits for "go", then writes.

    The test SIGSTOPs this process between the check and the write (the classic paused owner).
    With ``use_gate`` the write goes through a FenceGate; without it (the negative control) the
    body also ignores the loss signal, as an owner paused mid-write would. ``self_fence=False``
    ignores the loss signal but keeps the gate (as a body stuck in a call that an interrupt
    cannot break would): then the gate alone must refuse the stale write.
    """
    lease = current_lease()
    key = f"paused-{trial}"
    report(
        "start",
        trial=trial,
        role=role,
        fence=lease.fence,
        task=self.request.id,
        previous_fence=lease.previous_fence,
    )
    lease.check()
    if role == "first" and not coord().exists(f"{env['CL_EVENTS']}:done:{trial}"):
        report("ready", trial=trial, role=role, fence=lease.fence, task=self.request.id)
        try:  # (the test pauses this process once it sees "ready": maybe before set() returned)
            coord().set(f"{env['CL_EVENTS']}:ready:{trial}", os.getpid())
            wait_for_key(f"{env['CL_EVENTS']}:go:{trial}")
        except LOST:
            if use_gate and self_fence:
                report("self_fenced", trial=trial, role=role, fence=lease.fence)
                raise
            report("ignored_loss", trial=trial, role=role, fence=lease.fence)
            forget_interrupt()  # else the gate's admit raises it again: the gate must decide
            wait_for_key(f"{env['CL_EVENTS']}:go:{trial}")
    if use_gate:
        try:
            gate().admit(key, lease.fence)
        except StaleFenceError:
            report("rejected", trial=trial, role=role, fence=lease.fence)
            raise
    report("write", trial=trial, role=role, fence=lease.fence)
    coord().set(f"{env['CL_EVENTS']}:done:{trial}", 1)
    return lease.fence


class FarGate:
    """A FenceGate in another store than the leases' (``CL_FAR_GATE``: another Redis database,
    or PostgreSQL; its key prefix or table prefix ``CL_FAR_PREFIX``), made at the first admit
    in each process: the test process imports this module too and connects nowhere for it.
    It is a gate of the user's own kind (it has ``admit(key, fence)``), as ``gates=`` takes."""

    def __init__(self) -> None:
        self._gate: FenceGate | None = None
        self._pid: int | None = None

    @property
    def url(self) -> str:  # (how the library names this gate: its class and URL)
        return env.get("CL_FAR_GATE", "")

    def gate(self) -> FenceGate:
        if self._gate is None or self._pid != os.getpid():
            url, prefix = env["CL_FAR_GATE"], env["CL_FAR_PREFIX"]
            option = "key_prefix" if url.startswith("redis") else "table_prefix"
            self._gate, self._pid = FenceGate(url, **{option: prefix}), os.getpid()
        return self._gate

    def admit(self, key: str, fence: int) -> int:
        return self.gate().admit(key, fence)


far_gate = FarGate()


def _far_write(task: Any, account: str, role: str) -> int:
    """A step of an agent on one account: an older owner (``role="first"``, its first run
    only) is frozen by the test right before its write and never learns of its loss; a newer
    owner (``"second"``) sits in a long model call before its own write. Each writes through
    the far gate (``account-<account>``), as the README's pattern does, right before the write.
    """
    lease = current_lease()
    events_key = env["CL_EVENTS"]
    report(
        "start",
        account=account,
        role=role,
        fence=lease.fence,
        task=task.request.id,
        previous_fence=lease.previous_fence,
    )
    if role == "first" and coord().set(f"{events_key}:paused:{account}", 1, nx=True):
        # An owner stuck where no interrupt reaches it (a call in C, a frozen VM): it never
        # learns that its lease ran out, so only the gate can refuse its write.
        forget_interrupt()
        report("ready", account=account, role=role, fence=lease.fence, task=task.request.id)
        coord().set(f"{events_key}:ready:{account}", os.getpid())
        wait_for_key(f"{events_key}:go:{account}")  # the test SIGSTOPs this process here
    elif role == "second":
        report("model_call", account=account, fence=lease.fence, task=task.request.id)
        wait_for_key(f"{events_key}:model_done:{account}", timeout=60.0, poll=0.05)
    try:
        far_gate.admit(f"account-{account}", lease.fence)
    except StaleFenceError as exc:
        report("rejected", account=account, role=role, fence=lease.fence, highest=exc.highest)
        raise
    report("write", account=account, role=role, fence=lease.fence, task=task.request.id)
    return lease.fence


@lease_task(
    app=app,
    resource="browser/account-{account}",
    bind=True,
    gates=[(far_gate, "account-{account}")],
)
def far_writer(self: Any, account: str, role: str) -> int:
    """Admits its fence at the far gate right after its claim (gates=), then _far_write."""
    return _far_write(self, account, role)


@lease_task(app=app, resource="browser/account-{account}", bind=True)
def far_writer_ungated(self: Any, account: str, role: str) -> int:
    """The same step without gates= (the negative control): the far gate learns a fence only
    from a write."""
    return _far_write(self, account, role)


@lease_task(app=app, resource="browser/account-{account}", bind=True)
def account_touch(self: Any, account: str) -> int:
    """Claims the account's resource and returns its fence: shows that nobody holds it."""
    report("touch", account=account, fence=current_lease().fence, task=self.request.id)
    return current_lease().fence


@lease_task(app=app, resource="late-{trial}", bind=True)
def late_writer(self: Any, trial: int, role: str) -> int:
    """The README's pattern: admit the lease at the gate right before the side effect.

    ``first``: tells the test it is about to admit and waits for "go" (the test SIGSTOPs it
    there, past its ttl) and goes on even when it learns of the loss (a call an interrupt cannot
    break), so that only the gate can refuse its write. ``second`` (the newer owner, which takes
    the expired lease over): reports its claim and waits for "second-go" before its admit, as a
    holder still in its slow model call, so that it has not written when the old one resumes.
    A re-run of ``first`` (the retry after a refusal) writes at once.
    """
    lease = current_lease()
    key = f"late-{trial}"
    events = env["CL_EVENTS"]
    report(
        "start",
        trial=trial,
        role=role,
        fence=lease.fence,
        task=self.request.id,
        previous_fence=lease.previous_fence,
    )
    if role == "first" and coord().set(f"{events}:paused:{trial}", 1, nx=True):
        report("ready", trial=trial, role=role, fence=lease.fence, task=self.request.id)
        # The test pauses this process once it sees "ready" (maybe before set() returned) and
        # resumes it after a newer owner claimed; the loss its renewal thread then finds can
        # be raised anywhere up to forget_interrupt(), which also covers a loss found only after
        # "go" (else the gate's admit would raise it first, and the gate must decide).
        ignored = False
        while True:
            try:
                coord().set(f"{events}:ready:{trial}", os.getpid())
                wait_for_key(f"{events}:go:{trial}")
                forget_interrupt()
                break
            except LOST:
                if not ignored:
                    report("ignored_loss", trial=trial, role=role, fence=lease.fence)
                    ignored = True
    elif role == "second":
        report("claimed", trial=trial, role=role, fence=lease.fence, task=self.request.id)
        wait_for_key(f"{events}:second-go:{trial}")
    report("admitting", trial=trial, role=role, fence=lease.fence)
    try:
        gate().admit(key, lease)
    except StaleFenceError:
        report("rejected", trial=trial, role=role, fence=lease.fence)
        raise
    report("write", trial=trial, role=role, fence=lease.fence)
    return lease.fence


@lease_task(app=app, resource="slow-{n}", bind=True)
def slow_call(self: Any, n: int, seconds: float, ignore_loss: bool = False) -> dict[str, Any]:
    """Blocks like a slow model call, longer than the ttl; reports how it ended.

    With ``ignore_loss`` (a negative control) the body swallows the loss interrupt and keeps
    going to the end, as a body that was never interrupted would.
    """
    lease = current_lease()
    report(
        "start",
        res=n,
        fence=lease.fence,
        task=self.request.id,
        attempt=int(self.request.get("celery_lease_lost_retries") or 0),
    )
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        try:
            time.sleep(left)
        except LOST as exc:
            report(
                "interrupted",
                res=n,
                fence=lease.fence,
                reason=getattr(exc, "reason", None) or _lost_reason(lease),
            )
            if not ignore_loss:
                raise
            forget_interrupt()
    report("done", res=n, fence=lease.fence)
    return {"fence": lease.fence, "expires_at": lease.expires_at.isoformat()}


@lease_task(app=app, resource="crash-{n}", bind=True)
def crash_once(self: Any, n: int) -> dict[str, Any]:
    """First run: waits to be SIGKILLed by the test. Later runs: complete."""
    lease = current_lease()
    attempt = coord().incr(f"{env['CL_EVENTS']}:attempts:{n}")
    report("start", res=n, fence=lease.fence, attempt=attempt, recovered=lease.recovered)
    if attempt == 1:
        coord().set(f"{env['CL_EVENTS']}:ready:{n}", os.getpid())
        time.sleep(60)
    report("done", res=n, fence=lease.fence, attempt=attempt)
    return {
        "fence": lease.fence,
        "recovered": lease.recovered,
        "previous_fence": lease.previous_fence,
    }


@lease_task(app=app, resource="busy-{n}", bind=True, max_retries=0)
def no_retries(self: Any, n: int) -> int:
    """max_retries=0: busy waits must not use up the user's retry budget."""
    return current_lease().fence


@lease_task(app=app, resource="uretry-{n}", bind=True, max_retries=2)
def user_retry(self: Any, n: int, leak: bool = False) -> int:
    """Calls ``self.retry()`` on its first run: the retry must find the resource free.

    ``leak`` (a negative control) swaps the lease's owner token before retrying, so the release
    in the task's finally no longer matches and the lease stays behind until its ttl runs out:
    the lock-left-behind-on-retry bug of celery-once (PR #37).
    """
    lease = current_lease()
    report(
        "start",
        res=n,
        fence=lease.fence,
        task=self.request.id,
        retries=self.request.retries,
        previous_fence=lease.previous_fence,
    )
    if self.request.retries == 0:
        if leak:
            lease.owner = Owner.new("leaked")
        raise self.retry(countdown=0.1)
    return lease.fence


@lease_task(app=app, resource="onbusy-{n}", bind=True, on_busy="fail")
def busy_fails(self: Any, n: int) -> int:
    """on_busy="fail": a busy resource fails the task at once."""
    report("enter", res=n, task=self.request.id)
    return current_lease().fence


@lease_task(app=app, resource="onbusy-{n}", bind=True, on_busy="skip")
def busy_skips(self: Any, n: int) -> int:
    """on_busy="skip": a busy resource ends the execution FAILURE (skipped) without running."""
    report("enter", res=n, task=self.request.id)
    return current_lease().fence


@lease_task(app=app, resource="hog-{n}", bind=True, lost_max_retries=0)
def gil_hog(self: Any, n: int, seconds: float, check: bool = True, gated: bool = True) -> int:
    """Holds the GIL in one C call for about ``seconds`` (heartbeat starvation), then commits.

    The call is a backtracking regular expression: the interpreter cannot switch threads or run
    a signal handler inside it, so the renewal thread is starved and an interrupt cannot land.
    Then the body calls ``lease.check()`` and commits through the fence gate. ``check=False``
    plays a body that never stops by itself (it swallows the loss interrupt, as code stuck in a
    call an interrupt cannot break would), leaving the gate as the only protection;
    ``gated=False`` also drops the gate (the negative control).
    """
    lease = current_lease()
    report("start", res=n, fence=lease.fence, task=self.request.id)
    # the time at 18 "a"s doubles with every extra one; the least of five runs, as one that
    # was preempted (a loaded box) would make the hog too short to outlive its lease
    base = 1.0
    for _ in range(5):
        began = time.perf_counter()
        re.fullmatch(r"(a+)+b", "a" * 18)
        base = min(base, max(time.perf_counter() - began, 1e-6))
    size = min(34, 18 + max(0, math.ceil(math.log2(seconds / base))))
    re.fullmatch(r"(a+)+b", "a" * size)

    def commit() -> None:
        if check:
            lease.check()
        if gated:
            gate().admit(f"hog-{n}", lease.fence)
        report("write", res=n, fence=lease.fence)

    if check:
        commit()
    else:
        while True:  # swallow the loss interrupt wherever it lands
            try:
                commit()
                break
            except StaleFenceError:
                report("refused", res=n, fence=lease.fence)
                raise
            except LOST:
                forget_interrupt()  # else the gate's admit raises it again: the gate decides
                continue
    return lease.fence


@lease_task(app=app, resource="settings-{n}", bind=True)
def lease_settings_seen(self: Any, n: int) -> dict[str, Any]:
    """What the running execution got: its lease's ttl and store, and the resolved cap."""
    lease = current_lease()
    assert lease.store is not None
    return {
        "ttl": lease.ttl,
        "store": lease.store.url,
        "max_runtime": self.lease_settings.max_runtime,
        "fence": lease.fence,
    }


@lease_task(app=app, resource="threads-{n}", bind=True)
def count_renewers(self: Any, n: int, hold: float) -> int:
    """Holds a lease while others run; reports the renewal threads in this process."""
    report("enter", res=n)
    deadline = time.monotonic() + hold
    counts = []
    while time.monotonic() < deadline:
        counts.append(sum(1 for t in threading.enumerate() if t.name == "celery-lease-renewer"))
        time.sleep(0.05)
    report("renewers", res=n, max=max(counts), min=min(counts))
    return max(counts)


@lease_task(app=app, resource="capped-{n}", bind=True, max_runtime=2.0, lost_max_retries=0)
def capped(self: Any, n: int) -> int:
    """Renews forever (never returns on its own): the runtime cap must stop it."""
    lease = current_lease()
    report("start", res=n, fence=lease.fence, task=self.request.id)
    try:
        while True:
            time.sleep(0.05)
    except LOST as exc:
        report(
            "interrupted",
            res=n,
            fence=lease.fence,
            reason=getattr(exc, "reason", None) or _lost_reason(lease),
        )
        raise


@lease_task(app=app, resource="gated-{n}", bind=True)
def gated_write(self: Any, n: int) -> int:
    """Writes through the process's shared FenceGate (no workaround): one admit per run."""
    lease = current_lease()
    attempt = coord().incr(f"{env['CL_EVENTS']}:attempts:gated-{n}")
    report("admitting", res=n, fence=lease.fence, attempt=attempt, task=self.request.id)
    gate().admit(f"gated-{n}", lease.fence)
    report("write", res=n, fence=lease.fence, attempt=attempt)
    return lease.fence


def _running_duplicate_body(task: Any, n: int) -> dict[str, Any]:
    """First run: waits to be SIGKILLed by the test. Later runs: complete."""
    lease = current_lease()
    attempt = coord().incr(f"{env['CL_EVENTS']}:attempts:rundup-{n}")
    report("start", res=n, fence=lease.fence, attempt=attempt, task=task.request.id)
    if attempt == 1:
        coord().set(f"{env['CL_EVENTS']}:ready:{n}", os.getpid())
        time.sleep(60)
    report("done", res=n, fence=lease.fence, attempt=attempt)
    return {"fence": lease.fence, "attempt": attempt, "recovered": lease.recovered}


@lease_task(app=app, resource="rundup-{n}", bind=True, ttl=1.0, on_busy="skip")
def running_duplicate_skip(self: Any, n: int) -> dict[str, Any]:
    """on_busy="skip": a busy *duplicate* of it must still be re-armed."""
    return _running_duplicate_body(self, n)


@lease_task(app=app, resource="rundup-{n}", bind=True, ttl=1.0, on_busy="fail")
def running_duplicate_fail(self: Any, n: int) -> dict[str, Any]:
    """on_busy="fail": a busy *duplicate* of it must still be re-armed."""
    return _running_duplicate_body(self, n)


if env.get("CL_DUPLICATE_REARM") == "off":
    # Negative control: a busy duplicate of the running execution is handled like other
    # contention (on_busy and the busy budget apply), as before the fix.
    from celery_lease import _waiting

    _lease_busy = _waiting.lease_busy

    def _busy_without_duplicates(task: Any, setup: Any, busy: Any, *a: Any) -> Any:
        busy.duplicate = False
        return _lease_busy(task, setup, busy, *a)

    _waiting.lease_busy = _busy_without_duplicates  # type: ignore[assignment]


if env.get("CL_EARLY_RETRY") == "off":
    # Negative control of test_handoff_early_wake.py: an early-woken copy refused before the
    # release landed is not sent again shortly; it waits with the back-off like other copies.
    from celery_lease import _waiting as _early_waiting

    _early_waiting.EARLY_RETRY_DELAYS = ()


if env.get("CL_POLL_ROUTE") == "own":
    # Negative control of test_handoff_line.py: a polling waiter's copies go through its task
    # queue (behind its backlog), not through the wake queue.
    from celery_lease import _waiting as _poll_waiting

    _poll_waiting.POLL_VIA_WAKE_QUEUE = False


if env.get("CL_EARLY_RETRY_ROUTE") == "own":
    # Negative control of test_handoff_early_wake.py: a refused early copy is sent again on
    # its task queue, behind that queue's backlog, instead of through the wake queue.
    from celery_lease import _waiting as _early_route_waiting

    _early_route_waiting.EARLY_RETRY_VIA_WAKE_QUEUE = False


if env.get("CL_FAILED_COPY") == "run":
    # Negative control of test_handoff_outcomes.py: no copy is taken for one of a failed
    # execution, so the other copy of a failed waiter runs its body again.
    from celery_lease import _copies

    _copies.copy_of_failed = lambda lease, request: False  # type: ignore[assignment]


if env.get("CL_REFUSED_COPY") == "retry":
    # Negative control of test_handoff_failed_copies.py: a hand-off copy refused again ends
    # with Retry (Celery stores RETRY), as a message's first refusal does.
    from celery_lease import _execution

    _requeue = _execution.requeue

    def _requeue_storing(
        task: Any, exc: Any, delay: float, updates: Any, store: bool = True, **kw: Any
    ) -> Any:
        return _requeue(task, exc, delay, updates, **kw)

    _execution.requeue = _requeue_storing  # type: ignore[assignment]


if env.get("CL_FINISHED_READ") == "off":
    # Negative control of test_handoff_failed_copies.py: no copy reads its task's state in
    # the result backend before running.
    from celery_lease import _copies as _copies_unread

    _copies_unread.task_state = lambda task, request, woken=False: None  # type: ignore[assignment]


if env.get("CL_LISTED_ON_LOSS") == "off":
    # Negative control of test_handoff_lost_reply.py: a claim sent with a place to wake whose
    # reply was lost is taken as never listed (its copy does not count as a waiter's).
    from celery_lease import _outcomes

    _store_down = _outcomes.store_down

    def _never_listed(task: Any, setup: Any, exc: Any, resource: Any, listed=False, gate=None):
        return _store_down(task, setup, exc, resource, gate=gate)

    _outcomes.store_down = _never_listed  # type: ignore[assignment]


if env.get("CL_LISTED_AT") == "now":
    # Negative control of test_handoff_gave_up.py: a re-armed place counts as listed now,
    # not from its first listing (the stamp before review 1).
    from celery_lease import _clock
    from celery_lease import _message as _listed_module

    def _listed_now(request: Any) -> float:
        down = _listed_module.read_header(request, _listed_module.STORE_DOWN_HEADER)
        now = _clock.wall()
        return now if down is None else min(now, float(down))

    _listed_module.listed_at = _listed_now


if env.get("CL_GAVE_UP_READ") == "off":
    # Negative control of test_handoff_gave_up.py: a woken copy never reads its task's state
    # in the result backend, also when its back-stop sibling may have given up.
    from celery_lease import _copies as _copies_trusting

    _copies_trusting.sibling_may_have_given_up = lambda task, request, settings, lease=None: False  # type: ignore[assignment]


if env.get("CL_GIVE_UP_ONCE") == "off":
    # Negative control of test_handoff_gave_up.py: copies refused at their last wait together
    # each give up (no give-up mark is taken in the store).
    from celery_lease import _copies as _copies_each

    _copies_each.give_up_once = lambda task, store, busy: None  # type: ignore[assignment]


if env.get("CL_WAIT_ATTEMPT") == "off":
    # Negative control of test_handoff_retried_waiter.py: the stores are not told the
    # attempt of a claim, so a copy of an older attempt re-arms a newer attempt's place.
    from celery_lease.stores import base as _base_for_attempt

    _base_for_attempt.BaseLeaseStore._attempt_args = staticmethod(lambda attempt: None)  # type: ignore[method-assign]
    # (and the one-pass check of the common case, which does not call _attempt_args)
    _claim_checks = _base_for_attempt.BaseLeaseStore._claim_checks

    def _claim_checks_without_attempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (*_claim_checks(self, *args, **kwargs)[:4], None)

    _base_for_attempt.BaseLeaseStore._claim_checks = _claim_checks_without_attempt  # type: ignore[method-assign]


if env.get("CL_BACKSTOP") == "off":
    # Negative control of test_handoff_outcomes.py (there is no setting for it): a listed
    # waiter's re-queued copy comes 10 minutes later, so only a wake would run it in time.
    from celery_lease._setup import TaskSetup

    TaskSetup.backstop_delay = lambda self, waits: 600.0  # type: ignore[method-assign]


@lease_task(app=app, resource="conn-{n}")
def touch(n: int, hold: float = 0.0) -> int:
    """Claims conn-<n>, holds it ``hold`` s and releases it: store calls and nothing else."""
    if hold:
        time.sleep(hold)
    return current_lease().fence


@lease_task(app=app, resource="conn-{n}")
def touch_together(n: int, go: str, timeout: float = 60.0) -> int:
    """Claims conn-<n>, reports ``waiting`` and blocks until the test pushes to list ``go``
    (once per task): tasks let go by one push end, and ack, at the same moment."""
    report("waiting", res=n)
    wait_pushed(go, timeout, block=2)
    return current_lease().fence


def _fifo_body(task: Any, n: int, k: int, hold: float) -> int:
    # via: the wake queue a woken copy came from (None: its own queue)
    via = getattr(task.request, "lease_wake_queue", None)
    report("enter", res=n, k=k, task=task.request.id, via=via, host=task.request.hostname)
    time.sleep(hold)
    report("exit", res=n, k=k, task=task.request.id)
    return k


@lease_task(app=app, resource="fifo-{n}", bind=True)
def fifo_hold(self: Any, n: int, k: int, hold: float) -> int:
    """Holds fifo-<n> for ``hold`` s; waits for it with the hand-off (identity on)."""
    return _fifo_body(self, n, k, hold)


class _RefusesWokenCopies(celery_lease.LeaseTask):
    """Its ``before_start`` raises for a woken copy of k=1: Celery fails that copy before its
    body, so it never claims (as a check in a user's own ``before_start`` might)."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        if (self.request.get(WOKEN) or (self.request.headers or {}).get(WOKEN)) and args[1] == 1:
            raise RuntimeError("refused by before_start")


@lease_task(app=app, resource="fifo-{n}", bind=True, base=_RefusesWokenCopies)
def fifo_hold_refusing(self: Any, n: int, k: int, hold: float) -> int:
    """fifo_hold whose woken copies of k=1 fail in before_start, never claiming."""
    return _fifo_body(self, n, k, hold)


@lease_task(app=app, resource="fifo-{n}", bind=True)
def fifo_blob(self: Any, n: int, k: int, blob: str) -> int:
    """fifo_hold with a big argument (its wake message may be over the bound) and a short hold."""
    return _fifo_body(self, n, k, 0.1)


@lease_task(app=app, resource="fifo-{n}", bind=True, order="publish")
def fifo_ordered(self: Any, n: int, k: int, hold: float) -> int:
    """fifo_hold whose waiters run in the order they were published (order="publish")."""
    return _fifo_body(self, n, k, hold)


@lease_task(app=app, resource="fifo-{n}", bind=True, identity=False)
def fifo_hold_backoff(self: Any, n: int, k: int, hold: float) -> int:
    """The same without an identity: waits with the back-off alone (the negative control)."""
    return _fifo_body(self, n, k, hold)


@lease_task(app=app, resource="fifo-{n}", bind=True, max_retries=2)
def fifo_retry_once(self: Any, n: int, k: int, countdown: float) -> int:
    """Waits for fifo-<n> with the hand-off; its attempt 0 calls ``self.retry(countdown)``
    (``enter`` says whether this copy was woken)."""
    woken = self.request.get(WOKEN) or (self.request.headers or {}).get(WOKEN)
    report("enter", res=n, k=k, task=self.request.id, retries=self.request.retries, woken=woken)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return k


@lease_task(app=app, resource="fifo-{n}", bind=True)
def fifo_fail(self: Any, n: int, k: int, hold: float) -> int:
    """Waits for fifo-<n> with the hand-off, holds it ``hold`` s and fails with a ValueError
    naming how many times its body ran (``enter`` says whether this copy was woken)."""
    runs = coord().incr(f"{env['CL_EVENTS']}:runs:{n}:{k}")
    woken = self.request.get(WOKEN) or (self.request.headers or {}).get(WOKEN)
    report("enter", res=n, k=k, task=self.request.id, run=runs, woken=woken is not None)
    time.sleep(hold)
    raise ValueError(f"body run {runs}")


@lease_task(app=app, resource="fifo-{n}", identity="job-{n}-{key}", bind=True)
def shared_maybe(self: Any, n: str, key: str, tag: str, hold: float, fail: bool) -> str:
    """An identity shared by every task id with the same (n, key): holds fifo-<n> ``hold`` s,
    then fails (ValueError naming how many times the body of ``tag`` ran) or returns."""
    runs = coord().incr(f"{env['CL_EVENTS']}:runs:{n}:{tag}")
    woken = self.request.get(WOKEN) or (self.request.headers or {}).get(WOKEN)
    report("enter", res=n, tag=tag, task=self.request.id, run=runs, woken=woken is not None)
    time.sleep(hold)
    if fail:
        raise ValueError(f"{tag} body run {runs}")
    return f"{tag} ok"


@lease_task(app=app, resource="fifo-{n}", bind=True, acks_late=False, reject_on_worker_lost=False)
def exit_once(self: Any, n: str, tag: str) -> str:
    """Celery's defaults (acks early, no reject on worker lost): run 1 ends with SystemExit."""
    runs = coord().incr(f"{env['CL_EVENTS']}:runs:{n}:{tag}")
    report("enter", res=n, tag=tag, task=self.request.id, run=runs)
    if runs == 1:
        raise SystemExit(3)
    return f"run {runs}"


@lease_task(app=app, resource="fifo-{n}", bind=True, busy_max_waits=2)
def fifo_few_waits(self: Any, n: int, k: int, hold: float) -> int:
    """fifo_hold that gives up after 2 busy waits (LeaseBusyError)."""
    return _fifo_body(self, n, k, hold)


@lease_task(app=app, resource="fifo-{n}", bind=True)
def fifo_gate(self: Any, n: str, k: int, go: str, timeout: float = 120.0) -> int:
    """Holds fifo-<n> until the test pushes to the coordination list ``go``."""
    report("enter", res=n, k=k, task=self.request.id)
    wait_pushed(go, timeout)
    report("exit", res=n, k=k, task=self.request.id)
    return k


@app.task
def note_callback(*args: Any, label: str) -> None:
    """A link or link_error callback: reports that it ran."""
    report("callback", label=label)


@signals.task_postrun.connect
def _on_postrun(
    sender: Any = None, task_id: Any = None, state: Any = None, retval: Any = None, **_: Any
) -> None:
    """How each copy of fifo_fail ended (RETRY: re-queued; IGNORED: dropped unrun); and a
    busy re-queue of a copy that already waited, which ends IGNORED (no task_retry signal)
    with the busy error as the Ignore's cause: reported as "requeued" (with a store error:
    "store_requeued", a waiter's copy sent again while the store is unreachable)."""
    if getattr(sender, "name", "").endswith((".fifo_fail", ".shared_maybe", ".exit_once")):
        report("postrun", task=task_id, state=state)
    cause = getattr(retval, "__cause__", None)
    if state == "IGNORED" and type(cause).__name__ == "LeaseStoreError":
        _report_outcome("store_requeued", task_id, getattr(sender, "name", None), cause)
    if state == "IGNORED" and type(cause).__name__ == "LeaseBusyError":
        _report_outcome("requeued", task_id, getattr(sender, "name", None), cause)


# The exactly-once scenarios' tasks register on this app too (imported last: they use it).
@lease_task(app=app, resource="retrying-{n}", bind=True)
def retrying_body(self: Any, n: str, calls: int) -> int:
    """A retry loop around a flaky call, as bodies are written: ``except Exception`` retries.

    Reports every call and every exception it swallows; runs out after ``calls`` calls.
    """
    lease = current_lease()
    for call in range(calls):
        try:
            report("calling", res=n, call=call, fence=lease.fence, task=self.request.id)
            time.sleep(0.05)  # the flaky call
        except Exception as exc:
            report("swallowed", res=n, exc=type(exc).__name__, fence=lease.fence)
    report("ran_out", res=n, fence=lease.fence)
    return lease.fence


from tests.integration import eo_tasks as eo  # noqa: E402, F401

if env.get("CL_REPORT_STARTS"):

    @signals.task_prerun.connect
    def _report_start(task_id: Any = None, task: Any = None, **_: Any) -> None:
        """Every copy a worker starts, refused or not: where it came from (the raw delivery
        route, before a woken copy takes its waiter's route) and which worker took it."""
        request = task.request
        delivery = request.delivery_info or {}
        report(
            "start",
            task=task_id,
            host=request.hostname,
            ex=delivery.get("exchange"),
            rk=delivery.get("routing_key"),
            retries=request.retries,
            redelivered=bool(delivery.get("redelivered")),
        )


@lease_task(app=app, resource="fifo-{n}", bind=True)
def route_probe(self: Any, n: int, k: int, hold: float, retry_to: Any = None) -> int:
    """A waiter that, when it runs woken through a wake queue for the first time, retries itself
    with ``retry_to`` as its retry options (``{"queue": ...}`` or ``{"exchange": ...,
    "routing_key": ...}``); it reports its delivery route as it sees it."""
    request = self.request
    delivery = request.delivery_info or {}
    via = getattr(request, "lease_wake_queue", None)
    report(
        "enter",
        res=n,
        k=k,
        task=request.id,
        via=via,
        host=request.hostname,
        ex=delivery.get("exchange"),
        rk=delivery.get("routing_key"),
        retries=request.retries,
    )
    if retry_to and via and not request.retries:
        report("exit", res=n, k=k, task=request.id)
        raise self.retry(countdown=0.3, **retry_to)
    time.sleep(hold)
    report("exit", res=n, k=k, task=request.id)
    return k


@app.task
def plain_step(n: int, k: int, hold: float, go: str = "") -> int:
    """A plain task (no lease): one message of a backlog, reported when it starts; it takes
    ``hold`` s, or with ``go`` until the test pushes to that coordination list (up to 120 s)."""
    report("enter", res=n, k=k, plain=True)
    if go:
        wait_pushed(go, 120)
    else:
        time.sleep(hold)
    return k


# -- unique= (tests/integration/test_unique.py) ----------------------------------------------
def _unique_body(task: Any, n: str, go: str, fail: bool = False) -> str:
    """Reports enter, waits for the test's ``go`` (when given), reports exit."""
    report("enter", res=n, task=task.request.id, retries=task.request.retries)
    if go:
        wait_pushed(go)
    report("exit", res=n, task=task.request.id)
    if fail:
        raise ValueError("the body failed")
    return n


_UNIQUE_TTL = float(env.get("CL_UNIQUE_TTL", "60"))


@lease_task(app=app, resource="uq-{n}", bind=True, unique="until_executed", unique_ttl=_UNIQUE_TTL)
def uq_executed(self: Any, n: str, go: str = "", fail: bool = False) -> str:
    """unique="until_executed": the key is held from publish to the end of the execution."""
    return _unique_body(self, n, go, fail)


@lease_task(app=app, resource="uq-{n}", bind=True, unique="until_executing", unique_ttl=_UNIQUE_TTL)
def uq_executing(self: Any, n: str, go: str = "", fail: bool = False) -> str:
    """unique="until_executing": the key is held until the body starts."""
    return _unique_body(self, n, go, fail)


@lease_task(
    app=app,
    resource="uq-{n}",
    bind=True,
    unique="until_and_while_executing",
    unique_ttl=_UNIQUE_TTL,
)
def uq_and_while(self: Any, n: str, go: str = "", fail: bool = False) -> str:
    """unique="until_and_while_executing": the key is held until a worker starts it."""
    return _unique_body(self, n, go, fail)


@lease_task(app=app, resource="uq-{n}", bind=True, unique="until_expired", unique_ttl=_UNIQUE_TTL)
def uq_expired(self: Any, n: str, go: str = "", fail: bool = False) -> str:
    """unique="until_expired": the key is held for its ttl, whatever the execution does."""
    return _unique_body(self, n, go, fail)


@lease_task(
    app=app,
    resource="uq-{n}",
    bind=True,
    unique="until_executed",
    unique_ttl=_UNIQUE_TTL,
    max_retries=1,
)
def uq_retrying(self: Any, n: str, countdown: float) -> str:
    """until_executed that retries once after ``countdown``: the key is kept across it."""
    report("enter", res=n, task=self.request.id, retries=self.request.retries)
    if not self.request.retries:
        raise self.retry(countdown=countdown)
    return n


@lease_task(app=app, resource="uq-{n}", bind=True, on_busy="fail")
def uq_fail_busy(self: Any, n: str, go: str = "") -> str:
    """on_busy="fail" (its refusal is an expected outcome: quiet)."""
    return _unique_body(self, n, go)


if env.get("CL_UNIQUE_REVOKE") == "0":  # the negative control of a revoked copy's lock
    from celery_lease import _unique

    _unique.RELEASE_ON_REVOKE = False


@lease_task(app=app, resource="rabbit-{n}", bind=True)
def rabbit_job(self: Any, n: str, k: int, go: str = "", timeout: float = 60.0) -> dict[str, Any]:
    """Holds rabbit-<n> until the coordination key ``go`` exists (at once without one), then
    returns; counts the runs of its body per (n, k) (``enter`` carries the run number, the
    fence, whether it recovered a dead owner's lease and whether RabbitMQ redelivered the
    message). Every copy of one task waits for the same key."""
    lease = current_lease()
    runs = coord().incr(f"{env['CL_EVENTS']}:runs:{n}:{k}")
    delivery = self.request.delivery_info or {}
    report(
        "enter",
        res=n,
        k=k,
        run=runs,
        task=self.request.id,
        fence=lease.fence,
        recovered=lease.recovered,
        previous_fence=lease.previous_fence,
        redelivered=bool(delivery.get("redelivered")),
        host=self.request.hostname,
    )
    coord().set(f"{env['CL_EVENTS']}:ready:{n}:{k}", os.getpid())
    if go:
        wait_for_key(go, timeout=timeout, poll=0.05)
    report("exit", res=n, k=k, run=runs, task=self.request.id, fence=lease.fence)
    return {"k": k, "run": runs, "fence": lease.fence, "recovered": lease.recovered}


# -- the peers' README examples and their ports (tests/integration/test_peer_ports.py) --------
# Each README task as it is, with a ``go`` signal from the test in place of its sleep(), next
# to its port as docs/migrating.md maps it (one line per option). The peers lock in the
# coordination Redis.
try:
    from celery_once import QueueOnce
    from celery_singleton import Singleton
except ImportError:  # (the bench extra): the ports alone
    QueueOnce = Singleton = None

_PEER_LOCK_TTL = 60  # the peers' lock timeout: a run that crashed frees its keys within it


def _readme_sleep(name: str, go: str, value: Any) -> Any:
    """The README's ``sleep(...)``: reports enter, waits for the test's ``go``, reports exit."""
    from celery import current_task

    task_id = current_task.request.id if current_task else None
    report("enter", res=name, task=task_id)
    wait_pushed(go)
    report("exit", res=name, task=task_id)
    return value


if QueueOnce is not None:
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": env.get("CL_COORD", ""), "default_timeout": _PEER_LOCK_TTL},
    }
    app.conf.singleton_backend_url = env.get("CL_COORD", "")
    app.conf.singleton_key_prefix = "cl_it_singleton:"
    app.conf.singleton_lock_expiry = _PEER_LOCK_TTL

    @app.task(base=QueueOnce)
    def once_slow_task(go: str) -> str:
        return _readme_sleep("once_slow_task", go, "Done!")

    @app.task(base=QueueOnce, once={"graceful": True})
    def once_slow_task_graceful(go: str) -> str:
        return _readme_sleep("once_slow_task_graceful", go, "Done!")

    @app.task(base=QueueOnce)
    def once_slow_add_default(a: int, b: int, go: str) -> int:
        return _readme_sleep("once_slow_add_default", go, a + b)  # type: ignore[no-any-return]

    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def once_slow_add(a: int, b: int, go: str) -> int:
        return _readme_sleep("once_slow_add", go, a + b)  # type: ignore[no-any-return]

    @app.task(base=QueueOnce, once={"keys": []})
    def once_slow_add_any(a: int, b: int, go: str) -> int:
        return _readme_sleep("once_slow_add_any", go, a + b)  # type: ignore[no-any-return]

    @app.task(base=QueueOnce, once={"unlock_before_run": True})
    def once_unlock_before_run(go: str) -> str:
        return _readme_sleep("once_unlock_before_run", go, "Done!")

    @app.task(base=Singleton)
    def singleton_do_stuff(*args: Any, **kwargs: Any) -> str:
        return _readme_sleep("singleton_do_stuff", kwargs["go"], "I just woke up")

    @app.task(base=Singleton, unique_on=["username"])
    def singleton_do_something(username: str, otherarg: Any = None, go: str = "") -> None:
        _readme_sleep("singleton_do_something", go, None)

    @app.task(base=Singleton, raise_on_duplicate=True)
    def singleton_raising(username: str, go: str = "") -> None:
        _readme_sleep("singleton_raising", go, None)

    @app.task(base=Singleton, lock_expiry=2)
    def singleton_expiring(go: str) -> None:
        _readme_sleep("singleton_expiring", go, None)


@lease_task(app=app, resource="slow_task", unique="until_executed")
def port_once_slow_task(go: str) -> str:
    return _readme_sleep("port_once_slow_task", go, "Done!")


@lease_task(app=app, resource="slow_task/graceful", unique="until_executed", on_conflict="skip")
def port_once_slow_task_graceful(go: str) -> str:
    return _readme_sleep("port_once_slow_task_graceful", go, "Done!")


@lease_task(app=app, resource="add/{a}-{b}", unique="until_executed", unique_key="{a}:{b}")
def port_once_slow_add_default(a: int, b: int, go: str) -> int:
    return _readme_sleep("port_once_slow_add_default", go, a + b)  # type: ignore[no-any-return]


@lease_task(app=app, resource="slow_add/{a}-{b}", unique="until_executed", unique_key="{a}")
def port_once_slow_add(a: int, b: int, go: str) -> int:
    return _readme_sleep("port_once_slow_add", go, a + b)  # type: ignore[no-any-return]


@lease_task(app=app, resource="slow_add", unique="until_executed")  # keys=[]: one key
def port_once_slow_add_any(a: int, b: int, go: str) -> int:
    return _readme_sleep("port_once_slow_add_any", go, a + b)  # type: ignore[no-any-return]


@lease_task(app=app, resource="slow_task/unlocked", unique="until_executing")
def port_once_unlock_before_run(go: str) -> str:
    return _readme_sleep("port_once_unlock_before_run", go, "Done!")


@lease_task(
    app=app,
    resource=celery_lease.key_of,
    unique="until_executed",
    on_conflict="return_existing",
)
def port_singleton_do_stuff(*args: Any, **kwargs: Any) -> str:
    return _readme_sleep("port_singleton_do_stuff", kwargs["go"], "I just woke up")


@lease_task(
    app=app,
    resource="user/{username}",
    unique="until_executed",
    unique_key="{username}",
    on_conflict="return_existing",
)
def port_singleton_do_something(username: str, otherarg: Any = None, go: str = "") -> None:
    _readme_sleep("port_singleton_do_something", go, None)


@lease_task(app=app, resource="user/{username}", unique="until_executed", on_conflict="raise")
def port_singleton_raising(username: str, go: str = "") -> None:
    _readme_sleep("port_singleton_raising", go, None)


@lease_task(
    app=app,
    resource="expiring",
    unique="until_executed",
    unique_ttl=2,
    on_conflict="return_existing",
)
def port_singleton_expiring(go: str) -> None:
    _readme_sleep("port_singleton_expiring", go, None)
