"""What bench_scale found at scale (docs/performance.md, "At scale"), on the real stores.

* ``renew_many`` renews any number of leases: ``RENEW_BATCH`` per round trip, one after
  another. PostgreSQL takes at most 65,535 parameters per statement (5 per lease): 20k leases
  in one call failed; a Redis script blocks the server while it runs: one script per batch,
  counted at the script call.
* ``list(expired_only=True)`` reads the expiry index from its start to the clock (O(expired)),
  shown by the plan: an index range on the expiry index, no sequential scan, no sort.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import pytest

from celery_lease import Lease, Owner
from celery_lease._codec import from_micros
from celery_lease.stores import _bounds
from celery_lease.stores import base as store_base
from tests.conftest import make_store, unique

LONG = 600.0


@pytest.fixture
def pg_store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    instance = make_store("postgres", request, tmp_path)
    yield instance
    with instance.engine.begin() as conn:
        instance.metadata.drop_all(conn)
    instance.close()


@pytest.fixture
def sqlite_store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    instance = make_store("sqlite", request, tmp_path)
    yield instance
    instance.close()


def fill(store: Any, prefix: str, count: int, owner: Owner, expires_in_us: int) -> list[Lease]:
    """``count`` leases held by ``owner`` (fence 1), written straight into the lease table:
    what ``count`` claims leave there, in one statement instead of ``count`` round trips."""
    store.release(store.acquire(f"{prefix}setup", owner, 10.0))  # tables exist, clock read
    with store.engine.begin() as conn:
        now_us = conn.exec_driver_sql(f"SELECT {store.sql.now}").scalar()
        rows = [
            {"r": f"{prefix}{i:06d}", "t": owner.token, "l": owner.label, "a": now_us}
            for i in range(count)
        ]
        values = (
            "%(r)s, %(t)s, %(l)s, 1, %(a)s, %(a)s"
            if store.dialect == "postgresql"
            else (":r, :t, :l, 1, :a, :a")
        )
        conn.exec_driver_sql(
            f"INSERT INTO {store.sql.table} "
            "(resource, owner_token, owner_label, fence, acquired_us, expires_us) "
            f"VALUES ({values} + {int(expires_in_us)})",
            rows,
        )
    return [
        Lease(
            resource=row["r"],
            owner=owner,
            fence=1,
            acquired_at=from_micros(now_us),
            expires_at=from_micros(now_us + expires_in_us),
            ttl=LONG,
            sent_monotonic=time.monotonic(),
            store=store,
        )
        for row in rows
    ]


class TestRenewBatches:
    def test_postgres_renews_20k_leases_in_one_call(self, pg_store):
        """Before: one statement with 100,000 parameters, refused (every lease lost)."""
        owner = Owner.new("scale")
        leases = fill(pg_store, unique("b") + "/", 20_000, owner, 60_000_000)
        before = max(lease.expires_at for lease in leases)
        results = pg_store.renew_many(leases, LONG)
        assert results == [None] * len(leases)
        assert min(lease.expires_at for lease in leases) > before
        with pg_store.engine.connect() as conn:
            renewed = conn.exec_driver_sql(
                f"SELECT count(*) FROM {pg_store.sql.table} "
                f"WHERE owner_token = %(t)s AND expires_us > {pg_store.sql.now} + 300000000",
                {"t": owner.token},
            ).scalar()
        assert renewed == len(leases)

    def test_redis_sends_one_script_per_batch(self, request, tmp_path, monkeypatch):
        """Counted at the script call the store makes (before: one script for all)."""
        store = make_store("redis", request, tmp_path)
        try:
            owner = Owner.new("scale")
            prefix = unique("b") + "/"
            count = 2 * _bounds.RENEW_BATCH + 1
            leases = [store.acquire(f"{prefix}{i}", owner, 60.0) for i in range(count)]
            sizes: list[int] = []
            script = store._renew

            def counting(**kwargs: Any) -> Any:
                sizes.append(len(kwargs["args"]) // 4)
                return script(**kwargs)

            monkeypatch.setattr(store, "_renew", counting)
            assert store.renew_many(leases, LONG) == [None] * count
            assert len(sizes) == math.ceil(count / _bounds.RENEW_BATCH) == 3
            assert max(sizes) == _bounds.RENEW_BATCH and sum(sizes) == count
            sizes.clear()
            assert store.renew_many(leases[:5], LONG) == [None] * 5
            assert sizes == [5]  # the common few: one round trip
        finally:
            store.close()

    def test_results_stay_aligned_across_batches(self, store, names, monkeypatch):
        """Every store, with a batch of 3: losses in the first and last batches are reported
        at their own place, the others renewed."""
        monkeypatch.setattr(store_base, "RENEW_BATCH", 3)
        owner = Owner.new("scale")
        leases = [store.acquire(f"{names}{i}", owner, 5.0) for i in range(8)]
        for gone in (leases[1], leases[7]):
            store.release(gone)
        before = [lease.expires_at for lease in leases]
        results = store.renew_many(leases, LONG)
        assert [r is not None for r in results] == [i in (1, 7) for i in range(8)]
        assert all(results[i].reason == "released" for i in (1, 7))
        for i, lease in enumerate(leases):
            if i not in (1, 7):
                assert lease.expires_at > before[i]


def literal(value: Any) -> str:
    return str(value) if isinstance(value, int) else "'" + str(value).replace("'", "''") + "'"


def pg_plan(store: Any, statement: str, params: dict[str, Any]) -> str:
    """The generic plan of ``statement``: what a prepared statement runs, as psycopg's are
    after a few executions of the same text (a one-shot plan folds the parameters in)."""
    names: list[str] = []

    def slot(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", slot, statement)
    args = ", ".join(literal(params[name]) for name in names)
    with store.engine.connect() as conn:
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE listing AS {text}")
        rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE listing({args})").fetchall()
        conn.exec_driver_sql("DEALLOCATE listing")
    return "\n".join(row[0] for row in rows)


def list_params(prefix: str = "") -> dict[str, Any]:
    return {"prefix": prefix, "plen": len(prefix), "after_e": -(2**62), "after_r": "", "n": 101}


def expiry_index(store: Any) -> str:
    """The lease table's expiry index, checked to be on (expires_us, resource): the order
    list() pages in."""
    (index,) = (
        i
        for t in store.metadata.tables.values()
        for i in t.indexes
        if i.name.endswith("leases_expiry")
    )
    assert [c.name for c in index.columns] == ["expires_us", "resource"]
    return str(index.name)


class TestExpiredListing:
    def test_postgres_reads_the_expiry_index_not_every_live_lease(self, pg_store):
        """20k live leases and 50 expired, analysed: the generic plan (a prepared statement's)
        reads the expiry index up to the clock, no sequential scan, no sort (before: every live
        lease read through the index, or scanned and sorted, then dropped by a join filter on
        the clock)."""
        prefix = unique("x") + "/"
        owner = Owner.new("scale")
        fill(pg_store, prefix + "live/", 20_000, owner, 3_600_000_000)
        fill(pg_store, prefix + "gone/", 50, owner, -1_000_000)
        table = pg_store.sql.table
        with pg_store.engine.begin() as conn:
            conn.exec_driver_sql(f"ANALYZE {table}")
        plan = pg_plan(pg_store, pg_store.sql.list_expired, list_params())
        index = expiry_index(pg_store)
        scan = plan[plan.index(f"Index Scan using {index}") :]
        # The clock bounds the index range: no live lease is read (the plan before read them
        # all through the index and dropped them by a join filter, or scanned and sorted).
        assert re.search(r"Index Cond: \(.*expires_us <= ", scan.splitlines()[1]), plan
        assert "Join Filter" not in plan and "Seq Scan" not in plan and "Sort" not in plan, plan
        page = pg_store.list(expired_only=True, limit=100)
        assert len(page.leases) == 50 and page.cursor is None
        assert all(info.resource.startswith(prefix + "gone/") for info in page.leases)

    def test_sqlite_reads_the_expiry_index_up_to_the_clock(self, sqlite_store):
        prefix = unique("x") + "/"
        owner = Owner.new("scale")
        fill(sqlite_store, prefix + "live/", 2_000, owner, 3_600_000_000)
        fill(sqlite_store, prefix + "gone/", 5, owner, -1_000_000)
        statement = sqlite_store.sql.list_expired
        with sqlite_store.engine.connect() as conn:
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", list_params())
            plan = "\n".join(str(row[-1]) for row in rows)
        index = expiry_index(sqlite_store)
        assert f"USING INDEX {index} (expires_us>? AND expires_us<?)" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
        page = sqlite_store.list(expired_only=True, limit=100)
        assert sorted(info.resource for info in page.leases) == [
            f"{prefix}gone/{i:06d}" for i in range(5)
        ]
