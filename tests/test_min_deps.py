"""The oldest dependency versions pyproject.toml allows still work.

``sqlalchemy>=2.0`` is declared, and SQLAlchemy 2.1 needs Python 3.11: on Python 3.10 every
user runs the SQL store on 2.0.x. The test installs ``sqlalchemy==2.0.*`` once into a cache
directory (``CELERY_LEASE_TEST_MIN_DEPS``, which .ci/run points into its work directory, else
one under the system temp directory) and runs ``tests/tooling/sql_smoke.py`` in a subprocess
with it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[1]
MINIMUM = "sqlalchemy==2.0.*"


def _installed_minimum() -> Path:
    """A directory holding SQLAlchemy 2.0.x (installed with pip --target on first use)."""
    base = os.environ.get("CELERY_LEASE_TEST_MIN_DEPS") or tempfile.gettempdir()
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    target = Path(base) / f"celery-lease-sqlalchemy-2.0-{tag}"
    if (target / "sqlalchemy").is_dir():
        return target
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--target", str(partial), MINIMUM],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        missing(f"could not install {MINIMUM}: {result.stderr.strip()[-300:]}")
    with contextlib.suppress(OSError):  # atomic: a concurrent run that won keeps its copy
        partial.rename(target)
    return target


class TestMinimumSQLAlchemy:
    def test_the_sqlite_store_works_on_sqlalchemy_2_0(self):
        """Claim, renew, release, checkpoint, ledger and FenceGate on SQLAlchemy 2.0.x."""
        path = _installed_minimum()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), str(ROOT)]))
        result = subprocess.run(
            [sys.executable, "-m", "tests.tooling.sql_smoke"],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False,
        )  # fmt: skip
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-2000:]
        assert "ok sqlalchemy 2.0." in out, out


class TestPostgresFillfactor:
    def test_the_leases_table_keeps_fillfactor_70(self, postgres_server):
        """The DDL step gives the leases table the fillfactor the table option used to."""
        sa = pytest.importorskip("sqlalchemy")
        from celery_lease.stores.sql import SQLLeaseStore

        prefix = f"ff{uuid.uuid4().hex[:8]}_"
        store = SQLLeaseStore(url=postgres_server.url, table_prefix=prefix)
        try:
            with store.engine.connect() as conn:
                options = conn.execute(
                    sa.text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                    {"name": f"{prefix}leases"},
                ).scalar()
        finally:
            store.close()
        assert options == ["fillfactor=70"], options
