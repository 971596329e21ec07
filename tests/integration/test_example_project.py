"""The README's main command runs the demo end to end (SQLite store and broker, no servers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.harness import ROOT

pytestmark = pytest.mark.integration


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_demo_injects_every_failure_and_every_invariant_holds():
    """Two real workers; crash, pause, slow call, duplicate and burst; evidence from the run."""
    done = _run("example_project.run")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for line in ("worker crash", "paused past its ttl", "slow model", "duplicate", "hot resource"):
        assert line in done.stdout
    assert "charges for invoice 17: 1; reconciliations: 1" in done.stdout
    assert "stale writes accepted: 0" in done.stdout
    assert "bodies run: 1; charges: 1" in done.stdout
    assert "overlaps: 0" in done.stdout
    assert "all invariants held" in done.stdout


def _db(url: str, number: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{number}"


@pytest.mark.redis
def test_the_demo_on_redis_store_and_broker(redis_server):
    """The same scenarios with --store/--broker on a real redis-server (the broker hands a
    message to a frozen worker blocked in BRPOP: the demo routes around it)."""
    done = _run(
        "example_project.run",
        "--store",
        _db(redis_server.url, 7),
        "--broker",
        _db(redis_server.url, 8),
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all invariants held" in done.stdout
    assert "lease store redis" in done.stdout


@pytest.mark.postgres
def test_the_demo_on_a_postgresql_store(postgres_server):
    done = _run("example_project.run", "--store", postgres_server.url)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all invariants held" in done.stdout
    assert "lease store postgresql" in done.stdout


def test_the_store_walkthrough_runs():
    done = _run("example_project.store_demo")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "took over with fence 2" in done.stdout
