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
import time

from gevent import monkey

monkey.patch_all()

import sqlite3

import gevent

from celery_lease import LeaseStoreError, Owner
from celery_lease.stores import SQLLeaseStore
from celery_lease.stores.sql import connection

path, mode, what = sys.argv[1], sys.argv[2], sys.argv[3]
connection.SQLITE_BUSY_TIMEOUT = 3.0
if mode == "off":  # the negative control: SQLite's own busy wait, as before
    connection.COOPERATIVE_BUSY_WAIT = False
store = SQLLeaseStore(url=f"sqlite:///{path}")
store.release(store.acquire("warm-up", Owner.fresh("t"), 5))
order = []
ticks = []


def holder():
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    order.append("holding")
    gevent.sleep(0.3)  # switches to the hub while it holds the write lock
    db.execute("COMMIT")
    order.append("committed")


def ticker():  # the hub's heartbeat: a gap is a time no greenlet could run
    while not ("done" in order and "committed" in order):
        ticks.append(time.monotonic())
        gevent.sleep(0.02)
    ticks.append(time.monotonic())


def claimer(call):
    while "holding" not in order:
        gevent.sleep(0.005)
    try:
        call()
        order.append(what)
    except LeaseStoreError as exc:
        order.append(f"{what} failed: {exc}")
    order.append("done")


calls = {
    "claimed": lambda: store.acquire("r", Owner.fresh("t"), 10),
    "created": lambda: SQLLeaseStore(url=f"sqlite:///{path}", table_prefix="other_"),
}
gevent.joinall(
    [gevent.spawn(holder), gevent.spawn(ticker), gevent.spawn(claimer, calls[what])],
    timeout=30,
)
gap = max(b - a for a, b in zip(ticks, ticks[1:]))
print(json.dumps({"order": [e for e in order if e != "done"], "gap": gap}))
"""


def run_case(tmp_path: Path, mode: str, what: str) -> tuple[list[str], float]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CASE), str(tmp_path / "leases.db"), mode, what],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    return seen["order"], seen["gap"]


@pytest.mark.parametrize("what", ["claimed", "created"])
def test_a_locked_database_lets_the_holder_greenlet_commit(tmp_path, what):
    """A claim, or a store creating its tables, waits while the other greenlets run: the
    holder commits, the call succeeds, and the hub never stops for the busy timeout (3 s)."""
    order, gap = run_case(tmp_path, "on", what)
    assert order == ["holding", "committed", what], order
    assert gap < 1.5, f"no greenlet ran for {gap:.2f} s"


@pytest.mark.parametrize("what", ["claimed", "created"])
def test_negative_control_sqlites_own_busy_wait_blocks_the_holder(tmp_path, what):
    """Without the cooperative wait the call sleeps in C for the whole busy timeout, with every
    greenlet of the process: a claim fails with the database locked before the holder can
    commit; the table creation, which retries, is frozen as long."""
    order, gap = run_case(tmp_path, "off", what)
    assert order[0] == "holding", order
    assert gap >= 2.5, f"the hub stopped for {gap:.2f} s only"
    if what == "claimed":
        failed = [entry for entry in order if "failed" in entry]
        assert failed and "database is locked" in failed[0], order
        assert order.index(failed[0]) < order.index("committed"), order
