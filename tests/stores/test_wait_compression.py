"""PostgreSQL: a long wait list is stored with lz4, not the default pglz.

Each refused claim and each release on a resource with waiters rewrites the whole ``waits``
value; past about 2 kB PostgreSQL compresses it, and pglz took about half of those statements'
server time (190 waiters of 400 bytes: 5.3 ms a claim with pglz, 2.7 ms with lz4,
``benchmarks/bench_wait_list.py``). The store sets the column's compression when it creates the
lease table; it never alters a table made earlier (the ALTER's ACCESS EXCLUSIVE lock would wait
behind any open reader of the table, and every claim behind it), and a server that refuses the
method keeps its default.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_lease import LeaseBusyError, Owner
from celery_lease.stores import store_from_url
from celery_lease.stores.sql import schema
from tests.conftest import unique
from tests.tooling.servers import wait_for

pytestmark = pytest.mark.postgres

LONG = 30.0
PAYLOAD = 400  # bytes per waiter: 32 of them make a list well past the 2 kB TOAST threshold
DEADLINE = 20.0  # seconds a store creation may take before it counts as blocked


def column_compression(store: Any) -> str:
    """The ``waits`` column's compression setting ('' = the server's default)."""
    with store.engine.connect() as conn:
        return str(
            conn.execute(
                sa.text(
                    "SELECT attcompression::text FROM pg_attribute "
                    "WHERE attrelid = to_regclass(:t) AND attname = 'waits'"
                ),
                {"t": store.leases_table.name},
            ).scalar()
        )


def stored_with(store: Any, resource: str) -> str | None:
    """How the resource's list value is stored: 'lz4', 'pglz', or None (not compressed)."""
    with store.engine.connect() as conn:
        return conn.execute(
            sa.text(f"SELECT pg_column_compression(waits) FROM {store.leases_table.name} "
                    "WHERE resource = :r"),
            {"r": resource},
        ).scalar()  # fmt: skip


def fill(store: Any, resource: str, waiters: int = 32) -> None:
    """Hold ``resource`` and list ``waiters`` refused claims with long payloads."""
    store.acquire(resource, Owner.new("holder"), LONG, identity="holder")
    for n in range(waiters):
        payload = f"{n:04d}" + "x" * (PAYLOAD - 4)
        with pytest.raises(LeaseBusyError):
            store.acquire(resource, Owner.new(f"w{n}"), LONG, identity=f"w{n}", wait=payload)


def reader(url: str, table: str) -> Any:
    """A connection whose open transaction has read ``table`` (a report, a pg_dump)."""
    conn = connect(url)
    conn.execute(f"SELECT count(*) FROM {table}")
    return conn


def connect(url: str, **kwargs: Any) -> Any:
    parts = make_url(url)
    return psycopg.connect(
        host=parts.host, port=parts.port, user=parts.username, dbname=parts.database, **kwargs
    )


def lock_waits(url: str, text: str) -> bool:
    """Whether a session running a statement containing ``text`` waits for a lock."""
    with connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND strpos(query, %s) > 0 AND pid <> pg_backend_pid()",
            (text,),
        ).fetchone()
        return bool(row and row[0])


def in_thread(work: Any) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("postgres_server").url)


class TestWaitListCompression:
    def test_a_new_store_stores_a_long_list_with_lz4(self, url):
        """The column is set to lz4 at creation, and a 13 kB list is stored with it."""
        with store_from_url(url, table_prefix=f"{unique('cz')}_") as store:
            assert column_compression(store) == "l"
            fill(store, "r")
            assert stored_with(store, "r") == "lz4"

    def test_negative_control_the_default_stores_it_with_pglz(self, url, monkeypatch):
        """With the step asking for the method PostgreSQL uses anyway, the same list is stored
        with pglz: the check above can see the difference."""
        monkeypatch.setattr(schema, "WAITS_COMPRESSION", "pglz")
        with store_from_url(url, table_prefix=f"{unique('cz')}_") as store:
            fill(store, "r")
            assert stored_with(store, "r") == "pglz"

    def test_a_server_that_refuses_the_method_keeps_its_default(self, url, monkeypatch):
        """A method the server cannot use (here one PostgreSQL 15 does not know; a server built
        without lz4, or before 14, refuses the same step) leaves the column as it is, and the
        store is made and queues waiters as before."""
        monkeypatch.setattr(schema, "WAITS_COMPRESSION", "zstd")
        with store_from_url(url, table_prefix=f"{unique('cz')}_") as store:
            assert column_compression(store) == ""
            fill(store, "r", waiters=3)
            assert [w.position for w in store.waiters("r")] == [1, 2, 3]


class TestTablesMadeBefore:
    def test_a_store_on_an_earlier_table_leaves_it_and_waits_for_no_reader(self, url):
        """A lease table made by an earlier version (default compression), read by another
        session's open transaction: a store made on it waits for no lock (no DDL on the table;
        before, an ALTER waited out the statement timeout, every claim behind it), and the
        column is left as it was."""
        prefix = f"{unique('cz')}_"
        with store_from_url(url, table_prefix=prefix) as old:
            held = old.acquire("r", Owner.new("a"), LONG)
            table = old.leases_table.name
            with old.engine.begin() as conn:
                conn.execute(sa.text(f"ALTER TABLE {table} ALTER COLUMN waits "
                                     "SET COMPRESSION default"))  # fmt: skip
        report = reader(url, table)
        made: list[Any] = []
        waited = []
        try:
            thread = in_thread(lambda: made.append(store_from_url(url, table_prefix=prefix)))
            while thread.is_alive():  # (a statement waiting for a lock shows for its whole wait)
                if lock_waits(url, table):
                    waited.append(True)
                thread.join(0.05)
            assert made and not waited, "the store's creation waited for the reader"
        finally:
            report.close()
            thread.join(DEADLINE)
        with made[0] as store:
            assert column_compression(store) == ""
            assert store.get("r").fence == held.fence

    def test_negative_control_the_alter_waits_for_the_reader(self, url):
        """The same ALTER run by hand waits for the reader's transaction: the check above would
        see a store that ran it (what a review saw: 5-25 s, every claim stalled behind it)."""
        with store_from_url(url, table_prefix=f"{unique('cz')}_") as store:
            table = store.leases_table.name
            report = reader(url, table)
            done = threading.Event()

            def alter() -> None:
                with store.engine.begin() as conn:
                    conn.execute(sa.text(f"ALTER TABLE {table} ALTER COLUMN waits "
                                         "SET COMPRESSION pglz"))  # fmt: skip
                done.set()

            thread = in_thread(alter)
            try:
                waiting = wait_for(
                    lambda: lock_waits(url, "SET COMPRESSION pglz"),
                    DEADLINE,
                    "the lock wait",
                )
                assert waiting and not done.is_set(), "the ALTER did not wait for the reader"
            finally:
                report.close()
            assert done.wait(DEADLINE)
            thread.join(DEADLINE)
