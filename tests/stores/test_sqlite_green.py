"""The SQLite store under gevent: a call that meets a locked database waits without blocking
the hub.

SQLite's own busy wait sleeps in C. Under gevent every greenlet shares one OS thread, so while a
store call slept there, no other greenlet of the process ran: not one that held the write lock
and had switched away inside its transaction, so the lock was never given back and the call
failed after the whole busy timeout (30 s), the renewer's calls too, and every lease the process
held expired while its bodies were frozen (seen as two bodies of one resource inside at once in
the exclusion test on a gevent worker). Now a SQLite connection made under gevent has no C-level
busy wait: a locked database is asked again after a sleep that switches to the hub, until the
same deadline.

Each case runs in a fresh interpreter with gevent's monkey-patching (it cannot be undone in the
test process). The busy deadline is lowered to 3 s so the negative control fails fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("gevent")

ROOT = Path(__file__).resolve().parents[2]

CASE = """
import json
import sys

from gevent import monkey

monkey.patch_all()

import sqlite3

import gevent

from celery_lease import LeaseStoreError, Owner
from celery_lease.stores import SQLLeaseStore
from celery_lease.stores.sql import connection

path, mode = sys.argv[1], sys.argv[2]
connection.SQLITE_BUSY_TIMEOUT = 3.0
if mode == "off":  # the negative control: SQLite's own busy wait, as before
    connection.COOPERATIVE_BUSY_WAIT = False
store = SQLLeaseStore(url=f"sqlite:///{path}")
store.release(store.acquire("warm-up", Owner.fresh("t"), 5))
order = []


def holder():
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    order.append("holding")
    gevent.sleep(0.3)  # switches to the hub while it holds the write lock
    db.execute("COMMIT")
    order.append("committed")


def claimer(what, call):
    while "holding" not in order:
        gevent.sleep(0.005)
    try:
        call()
        order.append(what)
    except LeaseStoreError as exc:
        order.append(f"{what} failed: {exc}")


gevent.joinall(
    [
        gevent.spawn(holder),
        gevent.spawn(claimer, "claimed", lambda: store.acquire("r", Owner.fresh("t"), 10)),
    ],
    timeout=30,
)
print(json.dumps(order))
"""


def run_case(tmp_path: Path, mode: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CASE), str(tmp_path / "leases.db"), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_locked_database_lets_the_holder_greenlet_commit(tmp_path):
    order = run_case(tmp_path, "on")
    assert order == ["holding", "committed", "claimed"], order


def test_negative_control_sqlites_own_busy_wait_blocks_the_holder(tmp_path):
    """Without the cooperative wait the claim sleeps in C, the holder never runs again before
    the deadline, and the claim fails with the database locked."""
    order = run_case(tmp_path, "off")
    assert order[0] == "holding", order
    failed = [entry for entry in order if "failed" in entry]
    assert failed and "database is locked" in failed[0], order
    assert order.index(failed[0]) < order.index("committed"), order
