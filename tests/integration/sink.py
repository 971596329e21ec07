"""The side-effect sink of the exactly-once tasks, and their history records.

* ``CL_SINK``: where side effects land. Empty: lists and hashes in the coordination Redis under
  ``CL_SINK_NAME``; a ``postgresql+psycopg://`` URL: tables named ``<CL_SINK_NAME>_*`` there.
* ``CL_HISTORY``: a directory for :mod:`tests.tooling.history` events (one JSONL file per
  process). Bodies record ``acquire`` (at the store's claim time), ``effect`` (at the sink, after
  the side effect took place) and ``write`` (a counter write accepted or rejected).

The side effect is counted at the sink itself, never only in the ledger: the sink keeps every
application (a log plus a per-key count), so a doubled effect is visible even if the ledger
recorded it once.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import sqlalchemy as sa

from celery_lease import Lease, LeaseInterrupt, LeaseLostError, StaleFenceError, shielded
from celery_lease.fencing import fenced_hset, fenced_update
from tests.integration.worker_app import coord, forget_interrupt
from tests.tooling import history

__all__ = ["Sink", "hist", "record_acquire"]

env = os.environ


# -- history ------------------------------------------------------------------------------------
def hist(**event: Any) -> None:
    """Append one event to this process's history file, when the test asked for a history."""
    directory = env.get("CL_HISTORY")
    if directory:
        history.record(directory, **event)


def record_acquire(lease: Lease) -> None:
    """Record an acquisition at its linearisation point: the store's claim time.

    The body starts after the claim returned; a pause in between (SIGSTOP) would otherwise log
    an older fence after a newer owner's. The store clock (Redis ``TIME``, PostgreSQL
    ``clock_timestamp()``) is this host's wall clock, mapped here onto the monotonic clock every
    other event carries.
    """
    claimed_ns = int(lease.acquired_at.timestamp() * 1e9)
    mono_ns = time.monotonic_ns() - (time.time_ns() - claimed_ns)
    hist(op="acquire", resource=lease.resource, fence=lease.fence, mono_ns=mono_ns)


# -- the sink ------------------------------------------------------------------------------------
class Sink:
    """Where the side effects of these tasks land (Redis or PostgreSQL), countable by the test.

    * ``append(idem, payload)``: one application of effect ``idem``, atomically added to a log
      and a per-key count; ``first(idem)`` is what the first application wrote.
    * a counter (one row / one hash) for read-modify-write increments, with an ``applied``
      record per increment written in the same atomic step as the value.
    """

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self._engine: sa.Engine | None = None
        self._pid = os.getpid()
        meta = sa.MetaData()
        self.log_table = sa.Table(
            f"{name}_log",
            meta,
            sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
            sa.Column("idem", sa.String(200), nullable=False, index=True),
            sa.Column("payload", sa.Text, nullable=False),
        )
        self.counter_table = sa.Table(
            f"{name}_counter",
            meta,
            sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("value", sa.BigInteger, nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=True),
        )
        self.applied_table = sa.Table(  # no unique key: a doubled increment stays visible
            f"{name}_applied",
            meta,
            sa.Column("i", sa.Integer, nullable=False, index=True),
            sa.Column("value", sa.BigInteger, nullable=False),
            sa.Column("fence", sa.BigInteger, nullable=False),
        )
        self.metadata = meta

    @property
    def sql(self) -> bool:
        return bool(self.url)

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None or self._pid != os.getpid():
            self._engine = sa.create_engine(self.url, pool_size=2, max_overflow=4)
            self._pid = os.getpid()
        return self._engine

    def key(self, suffix: str) -> str:
        return f"{self.name}:{suffix}"

    # -- setup (test process) ------------------------------------------------------------------
    def create(self) -> None:
        if self.sql:
            self.metadata.create_all(self.engine)
            with self.engine.begin() as conn:
                conn.execute(sa.insert(self.counter_table).values(id=1, value=0, fence=None))
        else:
            coord().hset(self.key("counter"), mapping={"value": 0})

    def drop(self) -> None:
        if self.sql:
            self.metadata.drop_all(self.engine)
            self.engine.dispose()
        else:
            coord().delete(*(self.key(s) for s in ("log", "count", "first", "counter")))

    # -- appended effects ---------------------------------------------------------------------
    def append(self, idem: str, payload: dict[str, Any]) -> dict[str, Any]:
        text = json.dumps(payload, sort_keys=True)
        if self.sql:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(self.log_table).values(idem=idem, payload=text))
        else:
            pipe = coord().pipeline(transaction=True)
            pipe.rpush(self.key("log"), json.dumps({"idem": idem, **payload}, sort_keys=True))
            pipe.hincrby(self.key("count"), idem, 1)
            pipe.hsetnx(self.key("first"), idem, text)
            pipe.execute()
        return payload

    def first(self, idem: str) -> dict[str, Any] | None:
        if self.sql:
            with self.engine.connect() as conn:
                text = conn.execute(
                    sa.select(self.log_table.c.payload)
                    .where(self.log_table.c.idem == idem)
                    .order_by(self.log_table.c.id)
                    .limit(1)
                ).scalar()
        else:
            text = coord().hget(self.key("first"), idem)
        return None if text is None else json.loads(text)

    def firsts(self) -> dict[str, dict[str, Any]]:
        """``first(idem)`` of every key, in one read."""
        if self.sql:
            log = self.log_table
            out: dict[str, dict[str, Any]] = {}
            with self.engine.connect() as conn:
                for idem, text in conn.execute(
                    sa.select(log.c.idem, log.c.payload).order_by(log.c.id)
                ):
                    out.setdefault(idem, json.loads(text))
            return out
        raw = coord().hgetall(self.key("first"))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def counts(self) -> dict[str, int]:
        if self.sql:
            log = self.log_table
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(log.c.idem, sa.func.count()).group_by(log.c.idem))
                return {idem: int(n) for idem, n in rows}
        raw = coord().hgetall(self.key("count"))
        return {k.decode(): int(v) for k, v in raw.items()}

    def total(self) -> int:
        if self.sql:
            with self.engine.connect() as conn:
                count = conn.execute(sa.select(sa.func.count()).select_from(self.log_table))
                return int(count.scalar() or 0)
        return int(coord().llen(self.key("log")))

    # -- the counter ----------------------------------------------------------------------------
    def increment(self, i: int, lease: Lease, *, fenced: bool, window: float) -> dict[str, Any]:
        """Read-modify-write the counter, as increment ``i`` of ``lease``; returns the receipt.

        Fenced: stamp the fence first (a fenced write of nothing), then read, then write value
        and applied record with a fenced write. Stamping before the read is what makes a
        read-modify-write safe: once a newer owner has stamped, an older owner's write is
        refused, so nobody can write a value computed from a read that a newer owner's write
        has made stale, nor overwrite a value a newer owner has read. Unfenced (the negative
        control): a plain read and a plain write.

        ``window`` seconds pass between the read and the write (where a pause does harm). A
        lease interrupt that lands there is ignored, as a body stuck in a call that cannot be
        interrupted would: only the fence can stop the stale write then.
        """
        if self.sql:
            return self._increment_sql(i, lease, fenced=fenced, window=window)
        client = coord()
        key = self.key("counter")
        if fenced:
            self._stamp(lambda: fenced_hset(client, key, {}, lease), i, lease)
        value = int(client.hget(key, "value") or 0)
        _ignore_interrupt(window)
        new = {"value": value + 1, f"applied:{i}": json.dumps([value + 1, lease.fence])}
        # The write and its history record form one step: an interrupt is held back until both
        # are done (it lands right after, as it could right after the write anyway), so the
        # history never misses a write that took place.
        with shielded():
            try:
                if fenced:
                    fenced_hset(client, key, new, lease)
                else:
                    client.hset(key, mapping={**new, "fence": lease.fence})
            except StaleFenceError:
                hist(op="write", key="counter", fence=lease.fence, result="rejected", i=i)
                raise
            return self._accepted(i, value + 1, lease)

    def _increment_sql(
        self, i: int, lease: Lease, *, fenced: bool, window: float
    ) -> dict[str, Any]:
        table = self.counter_table
        row = table.c.id == 1
        # Every driver call runs shielded from the lease interrupt (only the window does not): an
        # interrupt landing inside psycopg leaves the connection mid-command, the rollback then
        # fails with "another command is already in progress", which replaces the interrupt, and
        # the task ends FAILURE instead of RETRY. Seen here in the connect (SQLAlchemy's first
        # queries on a new connection) and inside fenced_update, which now shields itself
        # (test_fenced_interrupt.py); our own statements need it as much.
        conn: sa.Connection | None = None
        try:
            with shielded():
                conn = self.engine.connect()
                conn.begin()
                if fenced:  # the stamp (and the row lock)
                    self._stamp(lambda: fenced_update(conn, table, row, {}, lease), i, lease)
                value = int(conn.execute(sa.select(table.c.value).where(row)).scalar_one())
            _ignore_interrupt(window)
            with shielded():  # the write, its commit and its history record: one step
                try:
                    if fenced:
                        fenced_update(conn, table, row, {"value": value + 1}, lease)
                    else:
                        conn.execute(
                            sa.update(table).where(row).values(value=value + 1, fence=lease.fence)
                        )
                    conn.execute(
                        sa.insert(self.applied_table).values(
                            i=i, value=value + 1, fence=lease.fence
                        )
                    )
                    conn.commit()
                except StaleFenceError:
                    hist(op="write", key="counter", fence=lease.fence, result="rejected", i=i)
                    raise
                return self._accepted(i, value + 1, lease)
        finally:
            if conn is not None:
                with shielded():
                    conn.close()  # rolls back what was not committed

    @staticmethod
    def _stamp(write: Any, i: int, lease: Lease) -> None:
        """The stamp: a fenced write of nothing, refused once a newer owner has stamped."""
        try:
            write()
        except StaleFenceError:
            hist(op="write", key="counter", fence=lease.fence, result="rejected", i=i, at="stamp")
            raise

    def _accepted(self, i: int, value: int, lease: Lease) -> dict[str, Any]:
        # The write's own sequence number is the value it wrote: accepted increments write
        # 1, 2, 3, ... in the order the counter accepted them.
        hist(op="write", key="counter", fence=lease.fence, result="ok", seq=value, i=i)
        hist(op="effect", idem=f"inc-{i}", result="ok", fence=lease.fence)
        return {"value": value, "fence": lease.fence}

    def fence_then_applied(self, i: int, lease: Lease) -> list[dict[str, Any]]:
        """Reconcile increment ``i`` for ``lease``: stamp the fence, then read ``applied(i)``.

        An earlier owner of the counter may be frozen with its write still to come (or, on
        PostgreSQL, written and not yet committed: its transaction holds the row). Read first,
        the answer could be "not applied" while that write lands right after, and the new
        owner's REDO applies the increment a second time (seen: counter 101 after 100
        increments). Once the stamp is in, that write is refused; on PostgreSQL the stamp also
        waits for the open transaction to end, so the read sees what it committed.
        """
        if self.sql:
            table = self.counter_table
            with shielded(), self.engine.connect() as conn:
                conn.begin()
                self._stamp(
                    lambda: fenced_update(conn, table, table.c.id == 1, {}, lease), i, lease
                )
                conn.commit()
        else:
            client, key = coord(), self.key("counter")
            self._stamp(lambda: fenced_hset(client, key, {}, lease), i, lease)
        return self.applied(i)

    def applied(self, i: int) -> list[dict[str, Any]]:
        """Every application of increment ``i`` found at the counter: ``[{value, fence}]``."""
        if self.sql:
            t = self.applied_table
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(t.c.value, t.c.fence).where(t.c.i == i))
                return [{"value": int(v), "fence": int(f)} for v, f in rows]
        raw = coord().hget(self.key("counter"), f"applied:{i}")
        if raw is None:
            return []
        value, fence = json.loads(raw)
        return [{"value": value, "fence": fence}]

    def counter(self) -> tuple[int, dict[int, int]]:
        """The counter's value and, per increment, how many applications it records."""
        if self.sql:
            t = self.applied_table
            with self.engine.connect() as conn:
                value = conn.execute(sa.select(self.counter_table.c.value)).scalar_one()
                rows = conn.execute(sa.select(t.c.i, sa.func.count()).group_by(t.c.i))
                return int(value), {int(i): int(n) for i, n in rows}
        raw = coord().hgetall(self.key("counter"))
        fields = {k.decode(): v for k, v in raw.items()}
        applied = {int(k.split(":", 1)[1]): 1 for k in fields if k.startswith("applied:")}
        return int(fields.get("value", 0)), applied


def _ignore_interrupt(seconds: float) -> None:
    """Sleep ``seconds``, swallowing a lease interrupt (a stuck, uninterruptible call)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            time.sleep(left)
        except (LeaseLostError, LeaseInterrupt):
            hist(op="interrupt_ignored")
            forget_interrupt()  # else the fenced write raises it again: the fence must decide
