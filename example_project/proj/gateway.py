"""The outside world the demo's tasks act on: a payments gateway and a tool gateway, in SQLite.

Both enforce what a real side effect must enforce for leases to be safe: a write carrying an
older fence than the newest one seen for that resource is refused (``StaleFenceError``), and a
charge with an idempotency key that was charged before returns the first receipt instead of
charging again. Every decision is recorded, so the demo counts evidence instead of trusting logs.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from celery_lease import StaleFenceError

#: The fence check, on unless DEMO_GATEWAY_FENCE_CHECK=off: the demo's negative control
#: (tests/integration/test_example_project.py), which must then count stale writes accepted.
FENCE_CHECK = os.environ.get("DEMO_GATEWAY_FENCE_CHECK", "on") != "off"

SCHEMA = """
CREATE TABLE IF NOT EXISTS fences (resource TEXT PRIMARY KEY, fence INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS writes (
    id INTEGER PRIMARY KEY AUTOINCREMENT, resource TEXT, fence INTEGER, what TEXT,
    pid INTEGER, accepted INTEGER, at REAL);
CREATE TABLE IF NOT EXISTS charges (
    idempotency_key TEXT PRIMARY KEY, invoice INTEGER, fence INTEGER, receipt TEXT);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, kind TEXT, job TEXT, pid INTEGER,
    fence INTEGER, detail TEXT);
"""


class Gateway:
    """One SQLite file; safe to use from several processes and threads (one connection per call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with closing(self._connect()) as db:
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def _admit(self, db: sqlite3.Connection, resource: str, fence: int, what: str) -> None:
        """Inside a write transaction: refuse an older fence, else remember the newest."""
        row = db.execute("SELECT fence FROM fences WHERE resource = ?", (resource,)).fetchone()
        accepted = row is None or fence >= row[0] or not FENCE_CHECK
        db.execute(
            "INSERT INTO writes (resource, fence, what, pid, accepted, at) VALUES (?,?,?,?,?,?)",
            (resource, fence, what, os.getpid(), int(accepted), time.time()),
        )
        if not accepted:
            db.execute("COMMIT")
            raise StaleFenceError.rejected(resource, fence, row[0])
        db.execute("INSERT OR REPLACE INTO fences VALUES (?, ?)", (resource, fence))

    def write(self, resource: str, fence: int, what: str) -> None:
        """A fenced action on a tool (a browser click, a deploy step)."""
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            self._admit(db, resource, fence, what)
            db.execute("COMMIT")
        finally:
            db.close()

    def charge(self, invoice: int, fence: int, idempotency_key: str) -> dict[str, Any]:
        """Charge an invoice once per idempotency key, only for the newest fence."""
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            self._admit(db, f"invoice:{invoice}", fence, "charge")
            row = db.execute(
                "SELECT receipt FROM charges WHERE idempotency_key = ?", (idempotency_key,)
            ).fetchone()
            if row is None:
                receipt = {"charge": f"ch_{invoice}_{fence}", "invoice": invoice}
                db.execute(
                    "INSERT INTO charges VALUES (?, ?, ?, ?)",
                    (idempotency_key, invoice, fence, json.dumps(receipt)),
                )
            else:
                receipt = json.loads(row[0])
            db.execute("COMMIT")
            return receipt
        finally:
            db.close()

    def find_charge(self, idempotency_key: str) -> dict[str, Any] | None:
        """What reconciliation asks: did this charge happen? (its receipt, or None)"""
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT receipt FROM charges WHERE idempotency_key = ?", (idempotency_key,)
            ).fetchone()
        return None if row is None else json.loads(row[0])

    def event(self, kind: str, job: str, fence: int | None = None, detail: Any = None) -> None:
        """The demo's own log: what each task did, in which process, under which fence."""
        db = self._connect()
        try:
            db.execute(
                "INSERT INTO events (at, kind, job, pid, fence, detail) VALUES (?,?,?,?,?,?)",
                (time.time(), kind, job, os.getpid(), fence, json.dumps(detail)),
            )
        finally:
            db.close()

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with closing(self._connect()) as db:
            return db.execute(sql, params).fetchall()
