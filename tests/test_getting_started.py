"""docs/getting-started.md as a reader follows it, in a scratch directory: its files written
from the page's titled blocks, its step 3 run against a real worker (the page's command, its
SQLite broker, results and lease store), its step 5 test run twice in a row.

tests/test_docs.py runs the page's blocks once; these run what the page tells a reader to do
in a shell, where files (broker.db, effects.db) outlive one run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tooling import docblocks

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started.md"


def _commands(prefix: str) -> list[str]:
    """The page's shell lines that start with ``prefix``, in order."""
    lines = PAGE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip().startswith(prefix)]


def _argv(command: str) -> list[str]:
    """A page's command as this interpreter runs it (``celery`` / ``python`` -> sys.executable)."""
    words = shlex.split(command)
    if words[0] == "celery":
        return [sys.executable, "-m", "celery", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    raise AssertionError(f"not a command this test runs: {command}")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The page's titled files (proj.py, conftest.py, test_proj.py) in a scratch directory."""
    page = docblocks.parse(PAGE)
    titled = [b for b in page.blocks if b.title]
    assert {b.title for b in titled} >= {"proj.py", "conftest.py", "test_proj.py"}
    for block in titled:
        assert block.title is not None
        (tmp_path / block.title).write_text(block.code)
    return tmp_path


def _env(project: Path) -> dict[str, str]:
    # The checkout's celery_lease, whatever an installed copy points at.
    path = os.pathsep.join([str(project), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture
def worker(project: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The page's step-3 worker, started from the project directory, stopped by its PID."""
    (command,) = _commands("celery -A proj worker")
    log = project / "worker.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [*_argv(command), "--concurrency", "1"],  # (one pool process: a faster start)
            cwd=project,
            env=_env(project),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text():
            assert process.poll() is None, f"the worker exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no ready line:\n{log.read_text()[-4000:]}"
            time.sleep(0.1)
        yield process, log
    finally:
        process.terminate()  # (a warm shutdown; its pool process goes with it)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_step_3_runs_against_the_page_s_worker(project, worker):
    """The page's ``.delay(42).get()`` twice against its worker (SQLite broker and store):
    each prints its fence, the second above the first; the worker starts without the
    visibility warning, which concerns Redis and SQS brokers only."""
    process, log = worker
    (command,) = _commands('python -c "from proj import refresh_dashboard')
    fences = []
    for _ in range(2):
        done = subprocess.run(
            _argv(command),
            cwd=project,
            env=_env(project),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr + log.read_text()[-4000:]
        fences.append(int(done.stdout.strip()))
    assert fences == [1, 2]
    text = log.read_text()
    assert "visibility_timeout" not in text
    assert re.search(r"celery_lease store \S+ ready \(ttl 60s for its lease task", text), text
    assert process.poll() is None  # still running


def test_step_5_passes_run_after_run(project):
    """The page's test, run twice in the same directory: effects.db (made when proj.py is
    imported) outlives the first run, and must not refuse the second run's fences, which start
    at 1 again in the test's in-memory store."""
    for run in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_proj.py"],
            cwd=project,
            env=_env(project),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"run {run + 1}:\n{done.stdout[-4000:]}{done.stderr}"
        assert "1 passed" in done.stdout
