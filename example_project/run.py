"""The demo: two real workers, and each failure celery_lease exists for injected in turn.

    python -m example_project.run [--store URL] [--broker URL] [--only TEXT] [--keep-world PATH]

By default everything is embedded (SQLite store, kombu's SQLAlchemy transport on SQLite, no
servers). Each scenario is checked against what the outside world recorded (example_project/proj/
gateway.py), not against logs; every figure in the evidence column is counted from those tables
in this run; the exit status is non-zero if any invariant failed. ``--keep-world`` copies the
tables out for a test to count again; DEMO_GATEWAY_FENCE_CHECK=off switches the gateway's
fence check off (a negative control: stale writes then get through and are counted).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

TTL = 3.0  # lease_ttl in example_project/proj/celery.py


class Interrupted(BaseException):
    """A signal asked the run to stop: stop this run's workers, remove its temp dir, exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: While a worker is being started, a stop signal waits here: raised in the middle of Popen it
#: would lose the PID of a worker already forked. (Blocking the signals instead would leave
#: them blocked in the worker, which inherits the signal mask.)
_held: dict[str, int | None] = {"holding": 0, "signum": None}


def _interrupt(signum: int, _frame: object) -> None:
    for stop in STOP_SIGNALS:  # once: a second signal must not cut the clean-up short
        signal.signal(stop, signal.SIG_IGN)
    # Kept as well as raised: a raise that lands in a finalizer ("Exception ignored in ...") or
    # in library code that catches everything is lost, and the run would go on to the end and
    # exit 0; every wait checks this again.
    _held["signum"] = signum
    if not _held["holding"]:
        raise Interrupted(signum)


def _raise_if_stopped() -> None:
    if _held["signum"] is not None:
        raise Interrupted(_held["signum"])


class Demo:
    """The workers this run started (and only those), the gateway, the scenario rows."""

    def __init__(self, data: Path) -> None:
        from example_project.proj.tasks import gateway

        self.data = data
        self.world = gateway()
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.rows: list[tuple[str, str, str, str]] = []
        self.failures: list[str] = []
        self._names = iter(f"w{n}" for n in range(1, 100))

    # -- workers -----------------------------------------------------------------------------
    def start_worker(self) -> str:
        name = next(self._names)
        self.declare_queues(name)
        log = (self.data / f"{name}.log").open("wb")
        _held["holding"] = 1
        try:
            self.workers[name] = self._popen(name, log)
        finally:
            log.close()  # the worker has its own copy
            _held["holding"] = 0
        _raise_if_stopped()
        return name

    def declare_queues(self, name: str) -> None:
        """Create the queues worker ``name`` consumes in the broker, before it starts.

        kombu's SQLAlchemy transport creates a queue's row on first use by a SELECT and then an
        INSERT, guarded only inside one process: a worker declaring its queue at start while
        this process sends the first message to it (or the other worker declares the shared
        queue) could lose that race to "UNIQUE constraint failed: kombu_queue.name", which
        killed the worker. Declared here first, one process at a time, every later use finds
        the row (and the broker's tables exist before any worker opens them).
        """
        from example_project.proj.celery import app

        with app.connection_for_write() as connection:
            channel = connection.default_channel
            for queue in (app.conf.task_default_queue, self.queue(name)):
                channel.queue_declare(queue=queue, durable=True, auto_delete=False)

    def _popen(self, name: str, log: Any) -> subprocess.Popen[bytes]:
        from example_project.proj.celery import app

        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "--quiet",
                "-A",
                "example_project.proj",
                "worker",
                "-n",
                f"{name}@%h",
                "-Q",  # the shared queue, and one of its own (see worker_paused)
                f"{app.conf.task_default_queue},{self.queue(name)}",
                "-P",
                "threads",
                "-c",
                "4",
                "-l",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def queue(self, name: str) -> str:
        from example_project.proj.celery import app

        return f"{app.conf.task_default_queue}-{name}"

    def worker_of(self, pid: int) -> str:
        for name, process in self.workers.items():
            if process.pid == pid:
                return name
        raise AssertionError(f"pid {pid} is not one of this demo's workers")

    def stop_all(self, timeout: float = 30.0) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for name, process in self.workers.items():
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"worker {name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr)
                process.kill()
                process.wait()

    # -- waiting -----------------------------------------------------------------------------
    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            _raise_if_stopped()
            value = check()
            if value:
                return value
            dead = [n for n, p in self.workers.items() if p.poll() not in (None, -9)]
            if dead:
                raise SystemExit(f"worker {dead[0]} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not happen in {timeout:.0f} s")
            time.sleep(0.05)

    def result(self, job: Any, timeout: float = 120.0) -> Any:
        self.wait_for(f"the result of {job.id}", job.ready, timeout)
        return job.get(propagate=True)

    def event(self, kind: str, job: str) -> tuple[Any, ...] | None:
        rows = self.world.query(
            "SELECT pid, fence, detail FROM events WHERE kind = ? AND job = ? ORDER BY id",
            kind,
            job,
        )
        return rows[0] if rows else None

    def count(self, sql: str, *params: Any) -> int:
        return int(self.world.query(sql, *params)[0][0])

    def expect(self, ok: bool, invariant: str) -> None:
        if not ok:
            self.failures.append(invariant)


def progress(step: int, total: int, text: str) -> None:
    print(f"[{step}/{total}] {text}", flush=True)


# -- the scenarios -----------------------------------------------------------------------------
def worker_crash(demo: Demo) -> None:
    from example_project.proj.tasks import send_invoice

    job = send_invoice.apply_async((17, 30.0))  # the bank takes its time to confirm
    pid, fence, _ = demo.wait_for(
        "the charge of invoice 17", lambda: demo.event("charged", "invoice-17")
    )
    victim = demo.worker_of(pid)
    os.kill(pid, signal.SIGKILL)  # after the gateway charged, before the ledger says done
    demo.workers[victim].wait()
    demo.start_worker()
    if redelivers_at_once():
        # RabbitMQ gives an unacked message back as soon as its consumer's connection closes
        # (task_acks_late): the crashed worker's own message comes again, nothing is re-sent.
        again = "redelivered by RabbitMQ"
        receipt = demo.result(job)
    else:
        # The embedded broker drops a crashed worker's message; Redis with acks_late delivers
        # it again after its visibility timeout (an hour by default). Do what they would: the
        # same message again.
        again = "re-sent by the demo"
        receipt = demo.result(send_invoice.apply_async((17, 30.0), task_id=job.id))
    charges = demo.count("SELECT count(*) FROM charges WHERE invoice = 17")
    reconciled = demo.count("SELECT count(*) FROM events WHERE kind = 'reconciled'")
    finished = demo.event("finished", "invoice-17")
    demo.expect(charges == 1, f"invoice 17 charged once (charged {charges} times)")
    demo.expect(reconciled == 1, "the new owner reconciled the unfinished charge")
    demo.expect(finished is not None and finished[1] > fence, "the new owner has a greater fence")
    demo.rows.append(
        (
            f"worker crash: SIGKILL {victim} after the charge, before it was recorded",
            f"lease expired after its ttl; new owner took over with fence {finished[1]}",
            "effect ledger + reconciliation (asked the gateway by idempotency key)",
            f"charges for invoice 17: {charges}; reconciliations: {reconciled}; "
            f"receipt {receipt['charge']} (the message {again})",
        )
    )


def redelivers_at_once() -> bool:
    """Whether the broker delivers a crashed worker's unacked message again by itself, at once
    (AMQP: when the worker's connection closes)."""
    from example_project.proj.celery import app

    return str(app.conf.broker_url).startswith(("amqp", "pyamqp"))


def worker_paused(demo: Demo) -> None:
    from example_project.proj.tasks import browse

    first = browse.apply_async((7, "session-A", 8))
    pid, fence, _ = demo.wait_for("session A's first page", lambda: demo.event("page", "session-A"))
    victim = demo.worker_of(pid)
    pause_holding_no_sqlite_lock(pid)  # a long GC pause, a frozen VM, a laptop lid
    try:
        # To the other worker's own queue: a frozen worker blocked in BRPOP would still be
        # handed a message from the shared queue by a Redis broker.
        other = next(n for n, p in demo.workers.items() if p.poll() is None and n != victim)
        second = browse.apply_async((7, "session-B", 3), queue=demo.queue(other))
        second_fence = demo.result(second, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    demo.result(first)  # A stopped acting, was retried, and finished later
    refused = demo.count(
        "SELECT count(*) FROM writes WHERE resource LIKE '%browser/account-7' AND accepted = 0"
    )
    stale = stale_writes_accepted(demo, "%browser/account-7")
    a_fences = sorted(
        {r[0] for r in demo.world.query("SELECT fence FROM events WHERE job = 'session-A'")}
    )
    demo.expect(second_fence > fence, "the paused worker's lease was taken over")
    demo.expect(len(a_fences) >= 2, "the paused session stopped and ran again under a new fence")
    demo.expect(stale == 0, f"the gateway accepted {stale} stale writes for account 7")
    demo.expect(
        refused + stale >= 1, "the paused session's late click reached the gateway after waking"
    )
    demo.rows.append(
        (
            f"worker paused past its ttl: SIGSTOP {victim} mid-session, SIGCONT later",
            f"lease expired; session B drove account 7 with fence {second_fence}; the paused "
            f"session stopped on waking and ran again later (its fences {a_fences})",
            "self-fencing on the worker's monotonic clock; the fence checked by the tool gateway",
            f"stale writes refused by the gateway: {refused}; stale writes accepted: {stale}",
        )
    )


#: The embedded SQLite files a frozen worker could keep locked: the broker, the results, the
#: leases, and the gateway's own tables (the world the tasks act on).
SQLITE_FILES = ("broker.db", "results.db", "leases.db", "world.db")


def pause_holding_no_sqlite_lock(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` at a moment it holds no lock on the embedded SQLite files.

    A threads-pool worker frozen in the middle of a broker poll, a renewal or a gateway write
    would keep the file locked, and nothing else could send a message, claim or act until it
    woke: a demo artefact of the single-file embedded default, not what the scenario shows
    (the other worker's first gateway write would wait out SQLite's 30 s and fail with
    "database is locked"). So pause, try to lock each file, and if one is held, let the
    worker go on a moment and pause again.
    """
    files = [Path(os.environ["EXAMPLE_DATA"], n) for n in SQLITE_FILES]
    deadline = time.monotonic() + timeout
    while True:
        os.kill(pid, signal.SIGSTOP)
        locked = [f for f in files if f.exists() and _locked(f)]
        if not locked:
            return
        os.kill(pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {pid} kept {locked[0].name} locked for {timeout:.0f} s")
        time.sleep(0.05)


def _locked(path: Path) -> bool:
    with closing(sqlite3.connect(path, timeout=0.2, isolation_level=None)) as db:
        try:
            db.execute("BEGIN EXCLUSIVE")  # refused while another connection reads or writes
        except sqlite3.OperationalError:
            return True
        db.execute("ROLLBACK")
        return False


def slow_model(demo: Demo) -> None:
    from example_project.proj.tasks import research

    calls = [0.5, 2.5 * TTL, 1.0]
    started = time.monotonic()
    result = demo.result(research.apply_async(("job-1", calls)))
    took = time.monotonic() - started
    fences = {r[0] for r in demo.world.query("SELECT fence FROM events WHERE job = 'job-1'")}
    claims = demo.count("SELECT count(*) FROM events WHERE kind = 'claimed' AND job = 'job-1'")
    takeovers = demo.count(
        "SELECT count(*) FROM events WHERE kind = 'claimed' AND job = 'job-1' AND detail != 'null'"
    )
    demo.expect(len(fences) == 1, f"the slow job kept its one lease (fences {sorted(fences)})")
    demo.expect(claims == 1 and takeovers == 0, f"{claims} claims, {takeovers} takeovers")
    demo.expect(result["steps"] == len(calls), "every model call finished")
    demo.rows.append(
        (
            f"slow model response: one call of {calls[1]:.1f} s on a {TTL:.0f} s ttl",
            "renewed in the background; never expired, never taken over",
            "renewal with a hard runtime cap; checkpoints between steps",
            f"{took:.1f} s under fence {min(fences)}; claims: {claims}; takeovers: {takeovers}",
        )
    )


def duplicate_delivery(demo: Demo) -> None:
    from example_project.proj.tasks import send_invoice

    task_id = str(uuid.uuid4())
    first = send_invoice.apply_async((18, 0.5), task_id=task_id)
    second = send_invoice.apply_async((18, 0.5), task_id=task_id)  # the broker delivers twice
    resent = send_invoice.apply_async((18,))  # a caller resends: new task id
    sent = [first, second, resent]
    demo.result(first)
    demo.result(second)
    third = demo.result(resent)
    ran = demo.count("SELECT count(*) FROM events WHERE kind = 'charged' AND job = 'invoice-18'")
    charges = demo.count("SELECT count(*) FROM charges WHERE invoice = 18")
    demo.expect(ran == 1 and charges == 1, f"invoice 18 ran once ({ran} runs, {charges} charges)")
    demo.rows.append(
        (
            "duplicate delivery: one message twice, then resent with a new task id",
            "the copies found the identity running or done; none ran the body again",
            "unique task identity (invoice:{invoice_id}) checked in the claim",
            f"deliveries: {len(sent)}; bodies run: {ran}; charges: {charges}; "
            f"the resent copy got {third['charge']}",
        )
    )


def hot_resource(demo: Demo) -> None:
    from example_project.proj.tasks import deploy

    started = time.monotonic()
    jobs = [deploy.delay(release) for release in range(1, 9)]
    fences = [demo.result(job) for job in jobs]
    took = time.monotonic() - started
    spans = demo.world.query(
        "SELECT fence, min(at), max(at) FROM events WHERE kind = 'deploy' GROUP BY fence "
        "ORDER BY min(at)"
    )
    overlaps = sum(1 for a, b in itertools.pairwise(spans) if b[1] < a[2])
    in_order = [s[0] for s in spans] == sorted(s[0] for s in spans)
    demo.expect(overlaps == 0, f"no two deploys at once ({overlaps} overlaps)")
    demo.expect(in_order and len(set(fences)) == len(fences), "deploy fences increase")
    demo.rows.append(
        (
            "hot resource: 8 releases to deploy/production at once",
            "one holder at a time; the others waited without holding a worker slot",
            "fence per release, checked by the deploy gateway",
            f"overlaps: {overlaps}; fences in run order: {_fences([s[0] for s in spans])}; "
            f"{took:.1f} s for {8 * 0.25:.1f} s of work",
        )
    )


def _fences(fences: list[int]) -> str:
    if max(fences) < 10_000:
        return str(fences)
    increasing = all(a < b for a, b in itertools.pairwise(fences))
    return f"{len(fences)} {'increasing' if increasing else 'NOT increasing'} (Redis: time-floored)"


SCENARIOS = [
    ("worker crash (SIGKILL) in the middle of a charge", worker_crash),
    ("worker paused (SIGSTOP) past its ttl", worker_paused),
    ("slow model call longer than the ttl", slow_model),
    ("duplicate delivery of an invoice", duplicate_delivery),
    ("burst on one hot resource", hot_resource),
]


def selected(only: str | None) -> list[tuple[str, Callable[[Demo], None]]]:
    """The scenarios whose title contains ``only``, ignoring case (all of them for None)."""
    if only is None:
        return list(SCENARIOS)
    return [(t, f) for t, f in SCENARIOS if only.casefold() in t.casefold()]


def stale_writes_accepted(demo: Demo, resource_like: str) -> int:
    """Writes the gateway accepted with a lower fence than one it had accepted before."""
    return demo.count(
        "SELECT count(*) FROM writes w WHERE w.accepted = 1 AND w.resource LIKE ? AND w.fence < "
        "(SELECT max(p.fence) FROM writes p WHERE p.resource = w.resource AND p.accepted = 1 "
        "AND p.id < w.id)",
        resource_like,
    )


def world_invariants(demo: Demo) -> None:
    """Over everything the gateway saw: no stale write accepted, every invoice charged once."""
    newest: dict[str, int] = {}
    for resource, fence in demo.world.query(
        "SELECT resource, fence FROM writes WHERE accepted = 1 ORDER BY id"
    ):
        demo.expect(
            fence >= newest.get(resource, 0),
            f"{resource}: fence {fence} accepted after fence {newest.get(resource)}",
        )
        newest[resource] = max(fence, newest.get(resource, 0))
    for invoice, charges in demo.world.query(
        "SELECT invoice, count(*) FROM charges GROUP BY invoice"
    ):
        demo.expect(charges == 1, f"invoice {invoice} charged {charges} times")


def table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("failure injected", "what the lease did", "what made it safe", "evidence (this run)")
    lines = []
    for number, row in enumerate(rows, 1):
        lines.append(f"{number}. {row[0]}")
        for title, text in zip(header[1:], row[1:], strict=True):
            lines.append(f"   {title + ':':<22} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help="lease store URL (default: SQLite in a temp dir)")
    parser.add_argument(
        "--broker",
        help="broker URL: redis://..., amqp://... (RabbitMQ) (default: SQLite in a temp dir)",
    )
    parser.add_argument(
        "--only",
        metavar="TEXT",
        help="run only the scenarios whose title contains TEXT (case ignored)",
    )
    parser.add_argument(
        "--keep-world", metavar="PATH", help="copy the gateway's SQLite tables to PATH at the end"
    )
    options = parser.parse_args(argv)
    scenarios = selected(options.only)
    if not scenarios:  # an empty run would print "all invariants held" about nothing
        titles = "\n  ".join(t for t, _ in SCENARIOS)
        parser.error(f"--only {options.only!r} matches no scenario; the scenarios:\n  {titles}")
    for stop in STOP_SIGNALS:  # Python's default for SIGTERM/SIGHUP exits with no clean-up
        signal.signal(stop, _interrupt)
    try:
        return run(options, scenarios)
    except Interrupted as stopped:
        name = signal.Signals(stopped.signum).name
        print(
            f"stopped by {name}: this run's workers were stopped, its temp dir removed",
            file=sys.stderr,
        )
        return 128 + stopped.signum


def run(options: argparse.Namespace, scenarios: list[tuple[str, Callable[[Demo], None]]]) -> int:
    with tempfile.TemporaryDirectory(prefix="celery-lease-demo-") as tmp:
        os.environ["EXAMPLE_DATA"] = tmp
        if options.store or options.broker:
            os.environ["DEMO_RUN"] = uuid.uuid4().hex[:8]
        if options.store:
            os.environ["DEMO_STORE_URL"] = options.store
        if options.broker:
            os.environ["DEMO_BROKER_URL"] = options.broker
        from example_project.proj.celery import app

        print(
            f"celery_lease demo: 2 workers, broker {app.conf.broker_url.split(':')[0]}, "
            f"lease store {app.conf.lease_store_url.split(':')[0]}, ttl {TTL:.0f} s",
            flush=True,
        )
        demo = Demo(Path(tmp))
        started = time.monotonic()
        try:
            demo.start_worker()
            demo.start_worker()
            for step, (title, scenario) in enumerate(scenarios, 1):
                progress(step, len(scenarios), f"{title} ...")
                began = time.monotonic()
                scenario(demo)
                print(f"      done in {time.monotonic() - began:.1f} s", flush=True)
            world_invariants(demo)
            _raise_if_stopped()
        except Interrupted:
            demo.stop_all(timeout=10)  # a warm shutdown waits for a running task
            raise
        except BaseException:
            demo.stop_all()
            for name in demo.workers:
                tail = (Path(tmp) / f"{name}.log").read_text(errors="replace")[-2000:]
                print(f"--- {name} log (last lines) ---\n{tail}", file=sys.stderr)
            raise
        demo.stop_all()
        if options.keep_world:  # for tests that count the evidence again on their own
            with (
                closing(sqlite3.connect(demo.world.path)) as src,
                closing(sqlite3.connect(options.keep_world)) as dst,
            ):
                src.backup(dst)
        print()
        print(table(demo.rows))
        print()
        took = time.monotonic() - started
        if demo.failures:
            for failure in demo.failures:
                print(f"INVARIANT FAILED: {failure}")
            return 1
        print(f"all invariants held ({took:.0f} s).")
        if app.conf.broker_url.startswith("sqla+sqlite"):  # not a sqla+postgresql broker
            print(
                "The embedded broker is for development and single hosts: it does not redeliver\n"
                "a crashed worker's message (scenario 1 re-sent it); use Redis or RabbitMQ with\n"
                "task_acks_late in production (run.py --broker redis://...)."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
