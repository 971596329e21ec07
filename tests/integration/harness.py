"""Real ``celery worker`` processes for the integration tests.

A :class:`Worker` is one ``celery -A tests.integration.worker_app worker`` process started with
its own environment (store, queue, coordination keys). It is stopped by PID: SIGTERM (warm
shutdown), then SIGKILL for it and its pool children if it does not exit in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from tests.tooling.servers import wait_for

ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    """PIDs of the direct children of ``pid`` (the prefork pool processes)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


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
    ) -> None:
        self.name = name
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.logfile = logdir / f"{name}.log"
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.integration.worker_app",
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

    def start(self, timeout: float = 60.0) -> Worker:
        with open(self.logfile.with_suffix(".err"), "wb") as stderr:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=stderr
            )
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

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        children = children_of(self.proc.pid)
        for pid in [self.proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a paused child cannot shut down
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        for pid in children:  # children of a worker killed hard
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc = None


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
