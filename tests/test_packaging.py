"""Packaging: what each extra installs, and the hint a missing optional driver gives.

The missing-driver tests run a fresh interpreter in which the driver cannot be imported
(``sys.modules[name] = None`` makes ``import name`` fail), the way a user without the extra
sees it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the metadata is the same on 3.10

ROOT = Path(__file__).resolve().parents[1]


def _extra(name: str) -> dict[str, str]:
    """The requirements of one extra, keyed by project name (lowercase, extras kept)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for requirement in project["optional-dependencies"][name]:
        key = re.match(r"[A-Za-z0-9_.\-]+(\[[^\]]*\])?", requirement)
        assert key is not None, requirement
        out[key.group(0).lower()] = requirement
    return out


def _without(module: str, code: str) -> str:
    """Run ``code`` in a fresh interpreter where ``module`` cannot be imported."""
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n{code}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    return result.stdout + result.stderr


class TestExtras:
    def test_the_redis_extra_brings_what_a_redis_broker_needs(self):
        """celery-lease[redis] is the one install for Redis as store, broker and backend."""
        redis_extra = _extra("redis")
        assert "redis" in redis_extra
        assert "celery[redis]" in redis_extra, redis_extra

    def test_the_postgres_extra_brings_psycopg_3(self):
        assert "psycopg[binary]" in _extra("postgres")


class TestMissingDrivers:
    def test_a_missing_psycopg_gets_an_install_hint(self):
        """postgresql+psycopg:// without psycopg names the extra to install."""
        out = _without(
            "psycopg",
            "from celery_lease import LeaseConfigError\n"
            "from celery_lease.stores import store_from_url\n"
            "try:\n"
            "    store_from_url('postgresql+psycopg://app:secret@127.0.0.1:1/db')\n"
            "except LeaseConfigError as exc:\n"
            "    print('LeaseConfigError:', exc)\n",
        )
        assert "LeaseConfigError:" in out, out
        assert "pip install 'celery-lease[postgres]'" in out, out
        assert "secret" not in out

    def test_a_missing_redis_gets_an_install_hint(self):
        """The same kind of hint for redis:// without redis-py, and the same error
        (LeaseConfigError, which ``except LeaseError`` catches, also from a FenceGate)."""
        out = _without(
            "redis",
            "from celery_lease import FenceGate, LeaseConfigError\n"
            "from celery_lease.stores import store_from_url\n"
            "for make in (store_from_url, FenceGate):\n"
            "    try:\n"
            "        make('redis://:secret@127.0.0.1:1/0')\n"
            "    except LeaseConfigError as exc:\n"
            "        print('LeaseConfigError:', exc)\n",
        )
        assert out.count("LeaseConfigError:") == 2, out
        assert out.count("pip install 'celery-lease[redis]'") == 2, out
        assert "secret" not in out
