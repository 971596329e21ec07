"""Running ``celery -A tests.cli_app lease ...`` on a real store: in-process, or as a subprocess.

Most CLI tests run the ``lease`` command group in this process (``lease_here``: a fresh app per
call, configured as ``tests/cli_app.py`` would be from the same environment), which saves a
Python start and the imports of Celery and SQLAlchemy per call (~1.3 s of CPU). A few tests
keep ``run_lease``, the real ``python -m celery -A tests.cli_app lease`` entry point, to prove
that Celery finds the command and that exit status and stderr reach the shell.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_lease import _app_stores
from celery_lease.cli import lease
from celery_lease.stores import store_from_url
from tests.cli_config import make_app
from tests.conftest import unique

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Target:
    """A store for one test: its URL and prefix as the CLI app sees them, and a client."""

    url: str
    prefix: str
    store: Any
    extra_env: dict[str, str]

    def env(self) -> dict[str, str]:
        """The environment that points tests.cli_app at this store."""
        return {"CLI_STORE": self.url, "CLI_PREFIX": self.prefix, **self.extra_env}

    def run(self, *args: str, stdin: str = "", env: dict[str, str] | None = None) -> Any:
        """Run ``celery -A tests.cli_app lease <args>`` in-process; returns a ``Done``."""
        return lease_here(*args, stdin=stdin, env={**self.env(), **(env or {})})

    def run_subprocess(self, *args: str, stdin: str = "") -> Any:
        """Run ``python -m celery -A tests.cli_app lease <args>``; returns the CompletedProcess."""
        return run_lease(*args, stdin=stdin, env=self.env())

    def json(self, *args: str) -> Any:
        """Run a command with ``--json``; assert it succeeded and return the parsed output."""
        done = self.run(*args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@dataclass
class Done:
    """What an in-process command left: named like ``subprocess.CompletedProcess``."""

    returncode: int
    stdout: str
    stderr: str


class _StderrNow(logging.Handler):
    """Writes records to whatever ``sys.stderr`` is when they are emitted (as Python's
    last-resort handler does in the subprocess, where nothing configures logging)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


def lease_here(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> Done:
    """Run the ``lease`` group in this process as ``run_lease`` would run it in a subprocess.

    The app is made afresh from ``env`` (on top of ``os.environ``, like the subprocess's) and its
    stores are closed afterwards, so each call starts from nothing, like a new process. Output,
    stderr (log records of WARNING and up included, as the subprocess would print them) and the
    exit status are returned; an exception other than an exit is raised, where the subprocess
    would have printed a traceback and exited 1.
    """
    app = make_app({**os.environ, **(env or {})})
    handler = _StderrNow(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        result = CliRunner().invoke(
            lease,
            list(args),
            input=stdin,
            obj=CLIContext(app=app, no_color=False, workdir=None),
            prog_name="celery lease",
        )
    finally:
        root.removeHandler(handler)
        for store in _app_stores._stores.pop(app, {}).values():
            store.close()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Done(result.exit_code, result.stdout, result.stderr)


def run_lease(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> Any:
    """Run ``python -m celery -A tests.cli_app lease <args>``; returns the CompletedProcess."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.cli_app", "lease", *args],
        cwd=ROOT,
        env=full_env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line_error(done: Any) -> str:
    """The single ``Error: ...`` line a failed command printed (asserts it is the only one)."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: "), done.stderr
    return str(lines[0])


def make_target(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    prefix = unique("cli")
    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        store = store_from_url(url, key_prefix=f"{prefix}:")
    elif kind == "sqlite":
        url = f"sqlite:///{tmp_path}/leases.db"
        store = store_from_url(url, table_prefix=f"{prefix}_")
    elif kind == "postgres":
        url = request.getfixturevalue("postgres_server").url
        store = store_from_url(url, table_prefix=f"{prefix}_")
    else:
        raise ValueError(kind)
    return Target(url, prefix, store, {"CLI_MARKS": str(tmp_path / "marks")})
