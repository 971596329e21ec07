"""Running ``python -m celery -A tests.cli_app lease ...`` as a subprocess against a real store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_lease.stores import store_from_url
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
        """Run ``celery -A tests.cli_app lease <args>``; returns the CompletedProcess."""
        return run_lease(*args, stdin=stdin, env={**self.env(), **(env or {})})

    def json(self, *args: str) -> Any:
        """Run a command with ``--json``; assert it succeeded and return the parsed output."""
        done = self.run(*args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def run_lease(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> Any:
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
