"""The README's main command runs the example project end to end (SQLite, no servers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.harness import ROOT

pytestmark = pytest.mark.integration


def test_the_example_project_runs():
    """A real worker on the SQLite broker: exclusive runs per account, fences in order."""
    done = subprocess.run(
        [sys.executable, "-m", "example_project.run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no two sessions overlapped" in done.stdout
    assert done.stdout.strip().endswith("ok")
