"""What bench_scale found at scale (docs/performance.md, "At scale"), on the real stores.

* ``renew_many`` renews any number of leases: ``RENEW_BATCH`` per round trip, one after
  another. PostgreSQL takes at most 65,535 parameters per statement (5 per lease): 20k leases
  in one call failed; a Redis script blocks the server while it runs: one script per batch,
  counted at the script call.
"""

from __future__ import annotations

import math
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
