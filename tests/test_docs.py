"""The docs site builds with no warning, and every Python block in the docs is valid Python."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "lease_task" in api  # the reference is generated from the docstrings
    assert "paused_renewals" in api


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if p.parent == ROOT / "docs" and p.name not in nav]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_parse(page: Path) -> None:
    for number, block in enumerate(BLOCK.findall(page.read_text()), 1):
        try:
            ast.parse(block)
        except SyntaxError as exc:
            pytest.fail(f"{page.name} python block {number}, line {exc.lineno}: {exc.msg}")
