"""Real ``celery worker`` processes for the integration tests.

A :class:`Worker` is one ``celery -A tests.integration.worker_app worker`` process started with
its own environment (store, queue, coordination keys). It is stopped by PID: SIGTERM (warm
shutdown), then SIGKILL for it and its pool children if it does not exit in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from celery_lease.stores import LeaseStore, store_from_url
from tests.tooling.servers import wait_for

ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    """PIDs of the direct children of ``pid`` (the prefork pool processes).

    Each thread of the process lists the children it forked (a pool child that replaces a dead
    one is forked by the pool's supervisor thread, not the main thread).
    """
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


class Worker:
    """One real celery worker process."""

    def __init__(
        self,
        env: dict[str, str],
        *,
        name: str,
        queue: str,
        pool: str = "prefork",
        concurrency: int = 2,
        logdir: Path,
        extra_args: tuple[str, ...] = (),
        app: str = "tests.integration.worker_app",
    ) -> None:
        self.name = name
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.logfile = logdir / f"{name}.log"
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            queue,
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
            f"--logfile={self.logfile}",
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._children: dict[int, str | None] = {}  # pool children at shutdown: start times

    def start(self, timeout: float = 60.0) -> Worker:
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> Worker:
        """Start the process without waiting for it (start several, then wait_ready each)."""
        with open(self.logfile.with_suffix(".err"), "wb") as stderr:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=stderr
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> Worker:
        wait_for(self._ready, timeout, f"worker {self.name} to be ready")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited early:\n{self.log()[-4000:]}")
        return " ready." in self.log()

    def log(self) -> str:
        parts = []
        for path in (self.logfile, self.logfile.with_suffix(".err")):
            with contextlib.suppress(OSError):
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is this worker or one of its pool children (safe to signal)."""
        return self.proc is not None and pid in (self.proc.pid, *children_of(self.proc.pid))

    def kill(self) -> list[int]:
        """SIGKILL the worker and its pool children at once (a machine loss); returns the PIDs.

        Nothing is acked or requeued by the worker: its unacked messages stay with the broker.
        """
        assert self.proc is not None
        pids = [self.proc.pid, *children_of(self.proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        return pids

    def stop(self, timeout: float = 15.0) -> None:
        self.request_stop()
        self.wait_stopped(timeout)

    def request_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM) without waiting: stop several workers at once."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._children = {pid: _start_time(pid) for pid in children_of(self.proc.pid)}
        for pid in [self.proc.pid, *self._children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a paused child cannot shut down
        self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = 15.0) -> None:
        """Wait for the shutdown asked by request_stop(); SIGKILL what is left after timeout."""
        if self.proc is None:
            return
        children = self._children
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        for pid, started in children.items():  # children of a worker killed hard
            if started is not None and _start_time(pid) == started:  # the same process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc = None


def _start_time(pid: int) -> str | None:
    """The process's start time (tells a process from a later one that reuses its pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class Events:
    """The coordination list the task bodies append to (see worker_app.report)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key

    def all(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange(self.key, 0, -1)]

    def where(self, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.all() if all(e.get(k) == v for k, v in match.items())]

    def wait(self, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: (self.where(**match) or [None])[0], timeout, f"event {match}")

    def key_for(self, suffix: str) -> str:
        return f"{self.key}:{suffix}"


def check_exclusion(events: list[dict[str, Any]]) -> dict[Any, list[int]]:
    """Check enter/exit alternate per resource and fences strictly increase.

    Returns the fences per resource; raises AssertionError describing the first violation.
    """
    state: dict[Any, dict[str, Any]] = {}
    fences: dict[Any, list[int]] = {}
    for event in events:
        if event["ev"] not in ("enter", "exit"):
            continue
        res = event["res"]
        current = state.get(res)
        if event["ev"] == "enter":
            assert current is None, f"overlap on {res}: {event} entered while {current} inside"
            seen = fences.setdefault(res, [])
            assert not seen or event["fence"] > seen[-1], (
                f"fence did not increase on {res}: {event['fence']} after {seen[-1]}"
            )
            seen.append(event["fence"])
            state[res] = event
        else:
            assert current is not None and current["fence"] == event["fence"], (
                f"exit without matching enter on {res}: {event}"
            )
            state[res] = None
    return fences


def wait_results(results: list[Any], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    return [r.get(timeout=max(0.1, deadline - time.monotonic())) for r in results]


# -- processes ----------------------------------------------------------------------------------
def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (``T`` when stopped), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def sigstop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel reports it stopped (all its threads)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: process_state(pid) in ("T", "t", None), timeout, f"pid {pid} to stop")


def sqlite_write_locked(path: str) -> bool:
    """Whether some process holds the SQLite database's write lock right now."""
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return True
        raise
    else:
        conn.execute("ROLLBACK")
        return False
    finally:
        conn.close()


def sigstop_outside_store(pid: int, sqlite_path: str | None, timeout: float = 10.0) -> int:
    """SIGSTOP ``pid`` at a moment it holds no SQLite write lock; returns the attempts taken.

    A process stopped inside a SQLite write transaction (a renewal in flight) would block every
    other process's claim until it is continued, which is not the scenario under test (and
    cannot happen with Redis or PostgreSQL, whose statements commit on the server alone).
    """
    deadline = time.monotonic() + timeout
    attempts = 0
    while True:
        attempts += 1
        sigstop(pid)
        if sqlite_path is None or not sqlite_write_locked(sqlite_path):
            return attempts
        os.kill(pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} kept holding the SQLite write lock")
        time.sleep(0.005)  # let it finish its transaction (about a millisecond)


# -- stores and histories -----------------------------------------------------------------------
def worker_store(env: dict[str, str]) -> LeaseStore:
    """A store in the test process that sees what the workers of ``env`` see (same prefixes)."""
    url = env["CL_STORE"]
    if url.startswith("redis"):
        return store_from_url(url, key_prefix=env["CL_PREFIX"], socket_timeout=5.0)
    return store_from_url(url, table_prefix=env["CL_TABLE_PREFIX"])


def check_fenced_writes(events: list[dict[str, Any]], key: str = "trial") -> dict[Any, list[int]]:
    """Check that the accepted writes to each key carry non-decreasing fences, in log order.

    The log is one Redis list, so its order is the real-time order of the reports; a write is
    reported only after the side effect accepted it. Returns the fences per key; raises
    AssertionError naming the first stale write.
    """
    fences: dict[Any, list[int]] = {}
    for event in events:
        if event["ev"] != "write":
            continue
        seen = fences.setdefault(event[key], [])
        assert not seen or event["fence"] >= max(seen), (
            f"stale write accepted on {key}={event[key]}: fence {event['fence']} after "
            f"fence {max(seen)} was written ({event})"
        )
        seen.append(event["fence"])
    return fences


# -- the broker -----------------------------------------------------------------------------------
def queue_busy(broker: redis.Redis, queue: str) -> int:
    """Messages of ``queue`` still in the Redis broker: waiting, or delivered and not acked.

    The Redis transport keeps delivered, unacked messages (running, or held for their ETA by a
    worker) in its global ``unacked`` hash with their routing key.
    """
    waiting = int(broker.llen(queue))
    unacked = 0
    for raw in broker.hvals("unacked"):
        try:
            _, _, routing_key = json.loads(raw)
        except (ValueError, TypeError):
            continue
        unacked += routing_key == queue
    return waiting + unacked


def wait_queue_idle(broker: redis.Redis, queue: str, timeout: float, settle: float = 1.5) -> None:
    """Wait until ``queue`` has had no waiting or unacked message for ``settle`` seconds.

    (A message moves from the list to the unacked hash in two steps; the settle time covers
    that gap and a redelivery sweep.)
    """
    deadline = time.monotonic() + timeout
    idle_since: float | None = None
    while True:
        now = time.monotonic()
        if queue_busy(broker, queue):
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= settle:
            return
        if now > deadline:
            raise TimeoutError(f"queue {queue} still busy after {timeout}s")
        time.sleep(0.1)


# -- results ------------------------------------------------------------------------------------
def backend_meta(app: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The Redis result backend's record of each task id (one MGET per 500 ids)."""
    backend = app.backend
    out: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        raw = backend.client.mget([backend.get_key_for_task(i) for i in chunk])
        for task_id, value in zip(chunk, raw, strict=True):
            out[task_id] = backend.decode_result(value) if value else {"status": "PENDING"}
    return out


def wait_success(
    app: Any,
    ids: list[str],
    timeout: float,
    tick: Callable[[], None] | None = None,
    explain: Callable[[list[str]], str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Wait until every task id is SUCCESS (a FAILURE fails at once); ``tick`` runs between
    polls (a nemesis, say). Returns the records. On a timeout, ``explain(pending ids)`` (see
    :func:`explain_stuck`) is added to the error."""
    deadline = time.monotonic() + timeout
    next_poll = 0.0
    while True:
        now = time.monotonic()
        if now >= next_poll:
            metas = backend_meta(app, ids)
            pending = [i for i, m in metas.items() if m["status"] != "SUCCESS"]
            if not pending:
                return metas
            failed = [metas[i] for i in pending if metas[i]["status"] == "FAILURE"]
            assert not failed, f"{len(failed)} tasks failed, e.g. {failed[:2]}"
            if now > deadline:
                why = "" if explain is None else "\n" + explain(pending)
                raise TimeoutError(f"{len(pending)} tasks not SUCCESS, e.g. {pending[:5]}{why}")
            next_poll = now + 0.25
        if tick is not None:
            tick()
        time.sleep(0.01)


#: What a worker logs when an ack failed or its broker connection dropped: the message stays
#: unacked until the visibility timeout (an hour by default) or the worker's shutdown.
BROKER_TROUBLE = (
    "] Couldn't ack '",
    "] Couldn't reject '",
    "] consumer: Connection to broker lost",
)


def broker_trouble(worker: Worker) -> list[str]:
    """The worker's log records of failed acks and lost broker connections."""
    return [
        line
        for line in worker.log().splitlines()
        if line.startswith("[") and any(t in line for t in BROKER_TROUBLE)
    ]


def task_digest(workers: list[Worker], task_id: str, width: int = 190) -> list[str]:
    """Every worker's log records naming ``task_id``, shortened and packed into lines of about
    ``width`` characters: what CI's short tail can show of one task's story. A record keeps
    its time (seconds), worker and process, and its message with the task's name and id cut
    down; another task's refusal naming this one as the holder becomes ``held fN``."""
    subject = re.compile(r"[Tt]ask [\w.]+\[([0-9a-f-]+)\]")
    record = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:(\d\d:\d\d,\d{3}): \w+/([\w-]+)\] (.*)")
    entries: list[tuple[str, str]] = []
    for worker in workers:
        for line in worker.log().splitlines():
            m = record.match(line) if task_id in line else None
            if m is None:
                continue
            when, proc, text = m.groups()
            who = subject.search(text)
            if who is None or who.group(1) != task_id:
                fence = re.search(r"fence=(\d+)", text)
                text = f"held f{fence.group(1)}" if fence else "named"
            else:
                text = re.sub(r'holder="[^"]*"', "holder=..", subject.sub("T", text, 1))
            proc = proc.replace("ForkPoolWorker-", "P").replace("MainProcess", "M")
            entries.append((when, f"{worker.name[-4:]}/{proc} {text[:100]}"))
    entries.sort()
    packed: list[str] = []
    previous = ""
    for when, entry in entries:  # (one "held" entry per holding, the first)
        what = entry.split(" ", 1)[1]
        if not (what.startswith("held ") and what == previous):
            packed.append(f"{when} {entry}")
        previous = what
    lines, line = [], f"{task_id[:8]}:"
    for entry in packed:
        if len(line) + len(entry) + 3 > width:
            lines.append(line)
            line = ""
        line += (" | " if line else "") + entry
    return [*lines, line] if line else lines


def explain_stuck(
    app: Any,
    ids: list[str],
    *,
    workers: list[Worker],
    store: LeaseStore | None = None,
    resources: dict[str, str] | None = None,
    limit: int = 3,
    tail: int = 40,
) -> str:
    """Why tasks did not finish: for each of the first ``limit`` ids, its result state, the
    worker log lines naming it, where its message is in the Redis broker (waiting in a queue
    list, delivered and unacked, or in neither: lost), and, given the ``store`` and the task's
    resource, the lease and identity records there. Then the broker-side trouble each worker
    logged and the tail of its log."""
    broker = redis.Redis.from_url(app.conf.broker_url)
    try:
        queued: list[tuple[str, bytes]] = []
        for key in broker.scan_iter(count=1000):
            if broker.type(key) == b"list":
                queued += [(key.decode(errors="replace"), raw) for raw in broker.lrange(key, 0, -1)]
        unacked = broker.hgetall("unacked")
    finally:
        broker.close()
    logs = {w.name: w.log() for w in workers}  # the log file, then stderr
    metas = backend_meta(app, ids[:limit])
    out = [f"{len(ids)} tasks not finished; the first {min(limit, len(ids))}:"]
    for task_id in ids[:limit]:
        tag = task_id.encode()
        where = [f"waiting in list {key!r}" for key, raw in queued if tag in raw]
        where += [f"unacked (tag {t.decode()})" for t, raw in unacked.items() if tag in raw]
        out.append(f"- {task_id}: state {metas[task_id]['status']}; broker: {where or 'absent'}")
        resource = (resources or {}).get(task_id)
        if store is not None and resource is not None:
            out.append(
                f"    store: lease {store.get(resource)}; "
                f"identity {store.identity_get(resource, task_id)}"
            )
        for name, text in logs.items():
            lines = [line for line in text.splitlines() if task_id in line]
            out.append(f"    {name} log: {len(lines)} lines")
            out += [f"      {line}" for line in lines]
    trouble = (*BROKER_TROUBLE, "Restoring", "CRITICAL", "ERROR")
    for name, text in logs.items():
        lines = text.splitlines()
        counts = {t: sum(t in line for line in lines) for t in trouble}
        own = [line for line in lines if line.startswith("[")]  # (log records, not stderr)
        out.append(f"{name} log: {counts}; its last {tail} records:")
        out += [f"  {line}" for line in own[-tail:]] if tail else []  # (own[-0:] is all)
    return "\n".join(out)


def prepare_store(env: dict[str, str]) -> None:
    """Create the store's tables from the test process before workers start.

    Several workers starting at once on a fresh PostgreSQL table prefix race to create the
    tables, and ``SQLLeaseStore.create_tables`` gives up after three immediate attempts: the
    worker then dies at start (a library bug, reproduced by test_concurrent_start.py). Tests
    about something else create the tables first.
    """
    worker_store(env).close()
