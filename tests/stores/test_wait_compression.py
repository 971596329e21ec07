"""PostgreSQL: a long wait list is stored with lz4, not the default pglz.

Each refused claim and each release on a resource with waiters rewrites the whole ``waits``
value; past about 2 kB PostgreSQL compresses it, and pglz took about half of those statements'
server time (190 waiters of 400 bytes: 5.3 ms a claim with pglz, 2.7 ms with lz4,
``benchmarks/bench_wait_list.py``). The store sets the column's compression when it creates or
upgrades its tables, where the server can; where it cannot, the store works as before.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import sqlalchemy as sa

from celery_lease import LeaseBusyError, Owner
from celery_lease.stores import store_from_url
from celery_lease.stores.sql import schema
from tests.conftest import unique

pytestmark = pytest.mark.postgres

LONG = 30.0
PAYLOAD = 400  # bytes per waiter: 32 of them make a list well past the 2 kB TOAST threshold


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
        """With the step switched off (the method PostgreSQL uses anyway), the same list is
        stored with pglz: the check above can see the difference."""
        monkeypatch.setattr(schema, "WAITS_COMPRESSION", "pglz")
        with store_from_url(url, table_prefix=f"{unique('cz')}_") as store:
            fill(store, "r")
            assert stored_with(store, "r") == "pglz"

    def test_a_table_made_before_gets_it_when_its_owner_starts_a_store(self, url):
        """A lease table made by an earlier version (default compression) is set to lz4 by the
        next store its owner makes on it; leases and fences are kept."""
        prefix = f"{unique('cz')}_"
        with store_from_url(url, table_prefix=prefix) as old:
            held = old.acquire("r", Owner.new("a"), LONG)
            with old.engine.begin() as conn:
                conn.execute(
                    sa.text(f"ALTER TABLE {old.leases_table.name} ALTER COLUMN waits "
                            "SET COMPRESSION default")
                )  # fmt: skip
            assert column_compression(old) == ""
        with store_from_url(url, table_prefix=prefix) as store:
            assert column_compression(store) == "l"
            assert store.get("r").fence == held.fence

    def test_a_server_that_refuses_the_method_keeps_its_default(self, url, monkeypatch, caplog):
        """A method the server cannot use (here one PostgreSQL 15 does not know; a server built
        without lz4 answers the same way) leaves the column as it is, says so at INFO, and the
        store is made and queues waiters as before."""
        monkeypatch.setattr(schema, "WAITS_COMPRESSION", "zstd")
        caplog.set_level(logging.INFO, logger=schema.__name__)
        with store_from_url(url, table_prefix=f"{unique('cz')}_") as store:
            assert column_compression(store) == ""
            fill(store, "r", waiters=3)
            assert [w.position for w in store.waiters("r")] == [1, 2, 3]
        assert "keep PostgreSQL's default compression" in caplog.text
        assert "zstd" in caplog.text
