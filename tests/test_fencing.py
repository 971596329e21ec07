"""Fenced side effects: SQL rows, Redis hashes and an HTTP tool gateway on loopback.

Each protection has a negative control: the same write without the fence check is accepted
even though it is stale.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
import redis
import sqlalchemy as sa
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from celery_lease import (
    FenceGate,
    InvalidFenceTokenError,
    LeaseConfigError,
    Owner,
    StaleFenceError,
)
from celery_lease.fencing import (
    FENCING_HEADER,
    FenceSigner,
    check_fencing_token,
    fenced_get,
    fenced_hset,
    fenced_set,
    fenced_update,
    fencing_headers,
    token_from_request,
)
from celery_lease.stores import MemoryLeaseStore, store_from_url
from tests.conftest import unique


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/app.db"
    else:
        url = request.getfixturevalue("postgres_server").url
    engine = sa.create_engine(url)
    yield engine
    engine.dispose()


def accounts_table(engine):
    metadata = sa.MetaData()
    table = sa.Table(
        unique("accounts_"),
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("balance", sa.Integer, nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=True),
    )
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert().values(id=1, balance=100, fence=None))
    return table


class TestSqlFencedUpdate:
    def test_newer_or_equal_fence_writes_and_older_is_refused(self, engine):
        """The row keeps the highest fence; a stale writer changes nothing."""
        table = accounts_table(engine)
        where = table.c.id == 1
        with engine.begin() as conn:
            assert fenced_update(conn, table, where, {"balance": 90}, 5) == 1
            assert fenced_update(conn, table, where, {"balance": 80}, 5) == 1
            with pytest.raises(StaleFenceError) as caught:
                fenced_update(conn, table, where, {"balance": 0}, 4)
            assert (caught.value.fence, caught.value.highest) == (4, 5)
            row = conn.execute(sa.select(table.c.balance, table.c.fence)).one()
        assert tuple(row) == (80, 5)

    def test_negative_control_a_plain_update_accepts_the_stale_write(self, engine):
        """Without the fence condition the stale owner's write lands."""
        table = accounts_table(engine)
        with engine.begin() as conn:
            fenced_update(conn, table, table.c.id == 1, {"balance": 90}, 5)
            conn.execute(sa.update(table).where(table.c.id == 1).values(balance=0, fence=4))
            assert conn.execute(sa.select(table.c.balance)).scalar() == 0

    def test_missing_row(self, engine):
        table = accounts_table(engine)
        with engine.begin() as conn, pytest.raises(LookupError):
            fenced_update(conn, table, table.c.id == 2, {"balance": 1}, 1)

    def test_a_table_without_the_fence_column_is_a_config_error(self, tmp_path):
        """A table (or model) without the column gets LeaseConfigError naming it and the fix,
        not a KeyError from SQLAlchemy, and nothing is written."""
        engine = sa.create_engine(f"sqlite:///{tmp_path}/app.db")
        metadata = sa.MetaData()
        table = sa.Table(
            "accounts",
            metadata,
            sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("n", sa.Integer),
        )
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert().values(id=1, n=1))
            for column in ("fence", "version"):
                with pytest.raises(LeaseConfigError, match=rf"'accounts' has no column '{column}'"):
                    fenced_update(conn, table, table.c.id == 1, {"n": 2}, 5, fence_column=column)
            assert conn.execute(sa.select(table.c.n)).scalar() == 1
        engine.dispose()

    def test_orm_model_in_a_session(self, engine):
        """ORM models and Sessions work the same way."""
        name = unique("orm_")

        class Base(DeclarativeBase):
            pass

        class Page(Base):
            __tablename__ = name
            id: Mapped[int] = mapped_column(primary_key=True)
            title: Mapped[str]
            fence: Mapped[int | None]

        Base.metadata.create_all(engine)
        with Session(engine) as session:
            session.add(Page(id=1, title="draft", fence=None))
            session.commit()
            lease = MemoryLeaseStore().acquire("page-1", Owner.new(), 30)
            fenced_update(session, Page, Page.id == 1, {"title": "published"}, lease)
            with pytest.raises(StaleFenceError):
                fenced_update(session, Page, Page.id == 1, {"title": "stale"}, lease.fence - 1)
            session.commit()
            assert session.get(Page, 1).title == "published"


def three_rows(engine):
    """Rows 1..3 of a fresh accounts table: fences None, 3 and 7."""
    table = accounts_table(engine)
    with engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": 2, "balance": 100, "fence": 3}, {"id": 3, "balance": 100, "fence": 7}],
        )
    return table


def rows(engine, table):
    with engine.connect() as conn:
        query = sa.select(table.c.id, table.c.balance, table.c.fence).order_by(table.c.id)
        return [tuple(row) for row in conn.execute(query)]


def plain_conditional_update(conn, table, where, values, fence):
    """The per-row condition alone: what fenced_update was (the protection switched off)."""
    column = table.c.fence
    statement = (
        sa.update(table)
        .where(where)
        .where(sa.or_(column.is_(None), column <= fence))
        .values({**values, "fence": fence})
    )
    return conn.execute(statement).rowcount


class TestSqlFencedUpdateAllOrNothing:
    """A stale writer whose condition matches several rows writes none of them."""

    def test_a_stale_multi_row_write_changes_no_row(self, engine):
        """One matched row carries a newer fence: StaleFenceError, and the older rows keep
        their values (not only the newer one)."""
        table = three_rows(engine)
        before = rows(engine, table)
        with engine.begin() as conn, pytest.raises(StaleFenceError) as caught:
            fenced_update(conn, table, table.c.id.in_([1, 2, 3]), {"balance": 0}, 5)
        assert (caught.value.fence, caught.value.highest) == (5, 7)
        assert rows(engine, table) == before

    def test_an_autocommit_connection_is_all_or_nothing_too(self, engine):
        """No surrounding transaction to roll back: the one statement decides alone."""
        table = three_rows(engine)
        before = rows(engine, table)
        autocommit = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        with autocommit as conn, pytest.raises(StaleFenceError):
            fenced_update(conn, table, table.c.id.in_([1, 2, 3]), {"balance": 0}, 5)
        assert rows(engine, table) == before

    def test_a_fence_newer_than_every_row_writes_them_all(self, engine):
        table = three_rows(engine)
        with engine.begin() as conn:
            assert fenced_update(conn, table, table.c.id.in_([1, 2, 3]), {"balance": 1}, 7) == 3
        assert rows(engine, table) == [(1, 1, 7), (2, 1, 7), (3, 1, 7)]

    def test_negative_control_the_per_row_condition_alone_writes_the_older_rows(self, engine):
        table = three_rows(engine)
        with engine.begin() as conn:
            assert (
                plain_conditional_update(conn, table, table.c.id.in_([1, 2, 3]), {"balance": 0}, 5)
                == 2
            )
        assert rows(engine, table) == [(1, 0, 5), (2, 0, 5), (3, 100, 7)]


def _concurrent_stale_write(engine, table, update):
    """A newer owner has updated row 2 (fence 3 -> 9) and not committed; the stale owner
    (fence 5, newer than every committed row) updates rows 1 and 2 meanwhile and waits for row
    2's lock; then the newer owner commits."""
    outcome = {}
    newer = engine.connect()
    newer_tx = newer.begin()
    newer.execute(sa.update(table).where(table.c.id == 2).values(balance=9, fence=9))
    pid = newer.execute(sa.text("select pg_backend_pid()")).scalar()

    def stale():
        try:
            with engine.begin() as conn:
                outcome["pid"] = conn.execute(sa.text("select pg_backend_pid()")).scalar()
                outcome["result"] = update(conn, table, table.c.id.in_([1, 2]), {"balance": 0}, 5)
        except StaleFenceError as exc:
            outcome["result"] = exc

    thread = threading.Thread(target=stale, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        with engine.connect() as watcher:  # until the stale writer waits for the newer's lock
            while True:
                blocked = watcher.execute(
                    sa.text(
                        "select count(*) from pg_stat_activity "
                        "where :pid = any(pg_blocking_pids(pid))"
                    ),
                    {"pid": pid},
                ).scalar()
                watcher.rollback()  # pg_stat_activity is a snapshot per transaction
                if blocked:
                    break
                assert time.monotonic() < deadline, "the stale writer never waited for the lock"
                time.sleep(0.01)
        newer_tx.commit()
    finally:
        newer.close()
    thread.join(30)
    assert not thread.is_alive()
    return outcome["result"]


class TestSqlFencedUpdateConcurrentWriter:
    """PostgreSQL READ COMMITTED: a row a newer owner commits while the stale statement runs."""

    @pytest.fixture
    def pg_engine(self, postgres_server):
        engine = sa.create_engine(postgres_server.url)
        yield engine
        engine.dispose()

    def test_a_newer_commit_during_the_statement_leaves_every_row_unwritten(self, pg_engine):
        """Refused as a whole: row 2 keeps the newer owner's write, row 1 its own."""
        table = three_rows(pg_engine)
        result = _concurrent_stale_write(pg_engine, table, fenced_update)
        assert isinstance(result, StaleFenceError) and result.highest == 9
        assert rows(pg_engine, table) == [(1, 100, None), (2, 9, 9), (3, 100, 7)]

    def test_negative_control_a_plain_update_partly_applies(self, pg_engine):
        """Without the lock-then-check, the stale write lands on row 1 only."""
        table = three_rows(pg_engine)
        assert _concurrent_stale_write(pg_engine, table, plain_conditional_update) == 1
        assert rows(pg_engine, table) == [(1, 0, 5), (2, 9, 9), (3, 100, 7)]


@pytest.fixture(params=["sqlite", "postgres"])
def lease_db(request, tmp_path):
    """A SQL lease store and an engine on its database (the side effect's tables live there)."""
    from celery_lease.stores import store_from_url

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/app.db"
    else:
        url = request.getfixturevalue("postgres_server").url
    store = store_from_url(url, table_prefix=f"{unique('cl')}_")
    engine = sa.create_engine(url)
    yield store, engine
    engine.dispose()
    store.close()


def _old_and_newer(store, resource):
    """An old owner's lease and the newer one granted after it (the old never released: it
    was force-released, as an administrator evicts a frozen holder)."""
    old = store.acquire(resource, Owner.new("old"), 30)
    store.force_release(resource)
    return old, store.acquire(resource, Owner.new("newer"), 30)


class TestSqlFencedUpdateWithTheLeaseStore:
    """``store=``: the row's own check, plus the lease store's grants in the same statement."""

    def test_an_old_owner_is_refused_before_the_newer_one_writes(self, lease_db):
        """The newer owner has not touched the row: the old owner's write is still refused,
        naming the newer fence, and changes nothing; the newer owner's write passes."""
        store, engine = lease_db
        table = accounts_table(engine)
        resource = unique("acct/")
        where = table.c.id == 1
        old = store.acquire(resource, Owner.new("old"), 30)
        with engine.begin() as conn:
            assert fenced_update(conn, table, where, {"balance": 90}, old, store=store) == 1
        store.force_release(resource)
        newer = store.acquire(resource, Owner.new("newer"), 30)
        with engine.begin() as conn, pytest.raises(StaleFenceError) as caught:
            fenced_update(conn, table, where, {"balance": 0}, old, store=store)
        assert (caught.value.fence, caught.value.highest) == (old.fence, newer.fence)
        assert rows(engine, table) == [(1, 90, old.fence)]
        with engine.begin() as conn:  # (a number with resource= works the same)
            fenced_update(conn, table, where, {"balance": 80}, newer.fence, store=store,
                          resource=resource)  # fmt: skip
        assert rows(engine, table) == [(1, 80, newer.fence)]

    def test_negative_control_without_the_store_the_old_write_lands(self, lease_db):
        """The same write without store=: the row knows only the old fence, so it takes it."""
        store, engine = lease_db
        table = accounts_table(engine)
        old, _ = _old_and_newer(store, unique("acct/"))
        with engine.begin() as conn:
            assert fenced_update(conn, table, table.c.id == 1, {"balance": 0}, old) == 1
        assert rows(engine, table) == [(1, 0, old.fence)]

    def test_an_orm_session_is_checked_too(self, lease_db):
        """On a Session the store's check holds the same way."""
        store, engine = lease_db
        table = accounts_table(engine)
        old, _ = _old_and_newer(store, unique("acct/"))
        with Session(engine) as session, pytest.raises(StaleFenceError):
            fenced_update(session, table, table.c.id == 1, {"balance": 0}, old, store=store)
        assert rows(engine, table) == [(1, 100, None)]

    def test_what_store_and_resource_must_be(self, lease_db, tmp_path):
        """Each misuse is a LeaseConfigError naming the fix, and writes nothing."""
        from celery_lease.stores import store_from_url

        store, engine = lease_db
        table = accounts_table(engine)
        lease = store.acquire(unique("acct/"), Owner.new(), 30)
        elsewhere = store_from_url(f"sqlite:///{tmp_path}/elsewhere.db")
        where = table.c.id == 1
        cases = [
            ({"store": MemoryLeaseStore()}, "FenceGate"),
            ({"store": elsewhere}, "not in this connection's database"),
            ({"store": store, "resource": "other/1"}, "not the lease's resource"),
        ]
        try:
            with engine.begin() as conn:
                for options, message in cases:
                    with pytest.raises(LeaseConfigError, match=message):
                        fenced_update(conn, table, where, {"balance": 0}, lease, **options)
                with pytest.raises(LeaseConfigError, match="resource="):
                    fenced_update(conn, table, where, {"balance": 0}, lease.fence, store=store)
        finally:
            elsewhere.close()
        assert rows(engine, table) == [(1, 100, None)]


@pytest.fixture(params=["redis", "redis_cluster"])
def redis_lease_store(request, tmp_path):
    from tests.conftest import make_store

    store = make_store(request.param, request, tmp_path)
    yield store
    store.close()


class TestRedisFencedWritesWithTheLeaseStore:
    """``store=``: the hash's own check, plus the lease store's grants in the same script."""

    def test_an_old_owner_is_refused_before_the_newer_one_writes(self, redis_lease_store):
        """Also on a cluster, with the key carrying the resource's hash tag."""
        store = redis_lease_store
        resource = unique("doc/")
        key = f"app:{store.hash_tag(resource)}:{unique('doc')}"
        old = store.acquire(resource, Owner.new("old"), 30)
        assert fenced_set(store.client, key, "v1", old, store=store) == old.fence
        store.force_release(resource)
        newer = store.acquire(resource, Owner.new("newer"), 30)
        with pytest.raises(StaleFenceError) as caught:
            fenced_set(store.client, key, "stale", old, store=store)
        assert (caught.value.fence, caught.value.highest) == (old.fence, newer.fence)
        with pytest.raises(StaleFenceError):
            fenced_hset(store.client, key, {"x": "1"}, old.fence, store=store, resource=resource)
        assert fenced_get(store.client, key) == (b"v1", old.fence)
        assert fenced_set(store.client, key, "v2", newer, store=store) == newer.fence
        assert fenced_get(store.client, key) == (b"v2", newer.fence)

    def test_negative_control_without_the_store_the_old_write_lands(self, redis_lease_store):
        store = redis_lease_store
        resource = unique("doc/")
        key = f"app:{store.hash_tag(resource)}:{unique('doc')}"
        old, _ = _old_and_newer(store, resource)
        assert fenced_set(store.client, key, "stale", old) == old.fence
        assert fenced_get(store.client, key) == (b"stale", old.fence)

    def test_what_store_and_key_must_be(self, redis_lease_store, tmp_path):
        """Another kind of store, or on a cluster a key outside the resource's slot: a
        LeaseConfigError naming the fix, and nothing written."""
        from celery_lease.stores import store_from_url

        store = redis_lease_store
        resource = unique("doc/")
        lease = store.acquire(resource, Owner.new(), 30)
        key = f"app:{store.hash_tag(resource)}:{unique('doc')}"
        with (
            store_from_url(f"sqlite:///{tmp_path}/x.db") as sql_store,
            pytest.raises(LeaseConfigError, match="RedisLeaseStore"),
        ):
            fenced_set(store.client, key, "v", lease, store=sql_store)
        with pytest.raises(LeaseConfigError, match="resource="):
            fenced_set(store.client, key, "v", lease.fence, store=store)
        if store.cluster:
            other = next(
                f"app:{n}" for n in range(1000)
                if store.client.keyslot(f"app:{n}") != store.client.keyslot(key)
            )  # fmt: skip
            with pytest.raises(LeaseConfigError, match=r"hash_tag"):
                fenced_set(store.client, other, "v", lease, store=store)
        assert fenced_get(store.client, key) == (None, None)


class TestRedisFencedWritesOnAnotherDatabase:
    """``store=`` with a data client elsewhere than the lease store: refused, since the script
    would read a fences hash that is not there and let the stale write through."""

    @staticmethod
    def _client(store, db=None, host=None):
        options = store.client.connection_pool.connection_kwargs
        return redis.Redis(
            host=host or options["host"],
            port=options["port"],
            db=options["db"] if db is None else db,
        )

    def test_a_client_on_another_database_is_refused(self, redis_server):
        """The reviewer's case: leases in db 0, the data in db 1; nothing is written."""
        store = store_from_url(
            redis_server.url.rsplit("/", 1)[0] + "/0", key_prefix=unique("cl") + ":"
        )
        try:
            resource = unique("acct/")
            old, newer = _old_and_newer(store, resource)
            data = self._client(store, db=1)
            key = unique("dash:")
            with pytest.raises(LeaseConfigError) as caught:
                fenced_set(data, key, "stale", old, store=store)
            message = str(caught.value)
            assert "db 1" in message and "db 0" in message and "store.client" in message
            assert data.exists(key) == 0
            with pytest.raises(LeaseConfigError, match="db 1"):
                fenced_hset(data, key, {"x": "1"}, newer, store=store)
        finally:
            store.close()

    def test_control_a_client_on_the_same_database_is_checked(self, redis_server):
        """Another client on the store's server and database (also named "localhost" where
        the store says 127.0.0.1): the stale write is refused by the grant check, the newer
        owner's lands."""
        store = store_from_url(redis_server.url, key_prefix=unique("cl") + ":")
        try:
            resource = unique("acct/")
            old, newer = _old_and_newer(store, resource)
            for client in (self._client(store), self._client(store, host="localhost")):
                key = unique("dash:")
                with pytest.raises(StaleFenceError) as caught:
                    fenced_set(client, key, "stale", old, store=store)
                assert caught.value.highest == newer.fence
                assert fenced_set(client, key, "v", newer, store=store) == newer.fence
        finally:
            store.close()

    def test_negative_control_without_the_check_the_stale_write_lands(self, redis_server):
        """What the refusal prevents: the script on db 1 finds no fences hash, so it takes the
        old owner's write (the same script, called without the location check)."""
        from celery_lease import _fence_redis

        store = store_from_url(redis_server.url, key_prefix=unique("cl") + ":")
        try:
            old, _ = _old_and_newer(store, unique("acct/"))
            data = self._client(store, db=1)
            key = unique("dash:")
            script = data.register_script(_fence_redis._SET_SCRIPT)
            fences = store._fences_key(old.resource)
            assert (
                script(keys=[key, fences], args=[old.fence, "fence", old.resource, "value", "x"])[0]
                == 1
            )
            assert fenced_get(data, key) == (b"x", old.fence)
        finally:
            store.close()

    def test_a_single_server_client_with_a_cluster_store_is_refused(self, request, tmp_path):
        """A client of one server given a Redis Cluster's store: refused, naming the cluster."""
        from tests.conftest import make_store

        store = make_store("redis_cluster", request, tmp_path)
        try:
            resource = unique("doc/")
            lease = store.acquire(resource, Owner.new(), 30)
            single = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
            with pytest.raises(LeaseConfigError, match="Redis Cluster"):
                fenced_set(single, f"app:{store.hash_tag(resource)}:x", "v", lease, store=store)
        finally:
            store.close()


class TestRedisFencedWrites:
    def test_fenced_set_and_hset(self, redis_server):
        """Writes carry the fence; an older fence is refused and the value stays."""
        client = redis.Redis.from_url(redis_server.url)
        key = unique("doc:")
        assert fenced_set(client, key, "v1", 7) == 7
        with pytest.raises(StaleFenceError) as caught:
            fenced_set(client, key, "stale", 6)
        assert caught.value.highest == 7
        assert fenced_get(client, key) == (b"v1", 7)
        fenced_hset(client, key, {"owner": "w2", "value": "v2"}, 8)
        assert client.hgetall(key) == {b"value": b"v2", b"owner": b"w2", b"fence": b"8"}

    def test_negative_control_a_plain_hset_accepts_the_stale_write(self, redis_server):
        client = redis.Redis.from_url(redis_server.url)
        key = unique("doc:")
        fenced_set(client, key, "v1", 7)
        client.hset(key, mapping={"value": "stale", "fence": 6})
        assert fenced_get(client, key) == (b"stale", 6)


SECRET = "k" * 32


class TestHttpTokens:
    def test_unsigned_token_round_trip_and_stale_refusal(self):
        store = MemoryLeaseStore()
        gate = FenceGate(store=store)
        lease = store.acquire("acct-1", Owner.new(), 30)
        headers = fencing_headers(lease)
        assert check_fencing_token(headers, gate) == lease.fence
        with pytest.raises(StaleFenceError):
            check_fencing_token({FENCING_HEADER: f"acct-1;{lease.fence - 1}"}, gate)

    def test_a_forged_higher_fence_and_a_tampered_token_are_refused(self):
        """With a signer, inventing a fence or editing a signed one does not pass."""
        signer = FenceSigner({"k1": SECRET}, active="k1")
        gate = FenceGate("memory://")
        good = signer.sign("acct-1", 5)
        assert check_fencing_token({FENCING_HEADER: good}, gate, signer=signer) == 5
        forged_unsigned = {FENCING_HEADER: "acct-1;999"}
        with pytest.raises(InvalidFenceTokenError):
            check_fencing_token(forged_unsigned, gate, signer=signer)
        other_key = FenceSigner({"k1": "x" * 32}, active="k1").sign("acct-1", 999)
        with pytest.raises(InvalidFenceTokenError, match="signature"):
            check_fencing_token({FENCING_HEADER: other_key}, gate, signer=signer)
        parts = good.split(".")
        parts[3] = "999"
        with pytest.raises(InvalidFenceTokenError, match="signature"):
            check_fencing_token({FENCING_HEADER: ".".join(parts)}, gate, signer=signer)
        assert gate.highest("acct-1") == 5  # nothing forged got in

    def test_negative_control_without_a_signer_a_forged_fence_locks_out_the_owner(self):
        """Unsigned tokens trust the caller: a forged high fence blocks the real owner."""
        gate = FenceGate("memory://")
        check_fencing_token({FENCING_HEADER: "acct-1;999"}, gate)
        with pytest.raises(StaleFenceError):
            check_fencing_token({FENCING_HEADER: "acct-1;5"}, gate)

    def test_key_rotation_expiry_and_resource_binding(self):
        old = FenceSigner({"k1": SECRET}, active="k1")
        rotated = FenceSigner({"k1": SECRET, "k2": "z" * 32}, active="k2")
        only_new = FenceSigner({"k2": "z" * 32}, active="k2")
        token = old.sign("acct-1", 3)
        assert rotated.verify(token) == ("acct-1", 3)
        with pytest.raises(InvalidFenceTokenError, match="unknown key"):
            only_new.verify(token)
        with pytest.raises(InvalidFenceTokenError, match="expired"):
            old.verify(old.sign("acct-1", 3, expires_in=-1))
        gate = FenceGate("memory://")
        with pytest.raises(InvalidFenceTokenError, match="another resource"):
            check_fencing_token(old.sign("acct-2", 9), gate, signer=old, resource="acct-1")

    def test_header_extraction_from_wsgi_asgi_and_mappings(self):
        assert token_from_request({"HTTP_FENCING_TOKEN": "a;1"}) == "a;1"
        scope = {"type": "http", "headers": [(b"fencing-token", b"a;2")]}
        assert token_from_request(scope) == "a;2"
        assert token_from_request({"fencing-token": "a;3"}) == "a;3"
        with pytest.raises(InvalidFenceTokenError, match="no Fencing-Token"):
            check_fencing_token({}, FenceGate("memory://"))


class TestTokenParsingNeverCrashes:
    """Whatever a caller sends, the parser answers a fence or InvalidFenceTokenError (a 403),
    never TypeError/ValueError (a 500)."""

    SIGNER = FenceSigner({"k1": SECRET}, active="k1")

    @staticmethod
    def _outcome(token, **kwargs):
        try:
            return check_fencing_token(token, FenceGate("memory://"), **kwargs)
        except InvalidFenceTokenError:
            return "refused"

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.text())
    @example("\u00b2")
    @example("acct-1;\u00b2")
    @example("acct-1;\u0663")  # ARABIC-INDIC DIGIT THREE: isdigit() and int() accept it
    @example("acct-1;" + "9" * 5000)  # past int()'s digit limit
    @example("acct-1;" + "9" * 30)  # past any store's 64-bit fence
    @example(f"acct-1;{2**53}")  # past the fences Redis compares exactly
    @example(";5")  # no resource
    @example("acct 1;5")  # not a resource name
    @example("acct-1;-5")
    @example("acct-1;")
    def test_unsigned_tokens(self, token):
        """An unsigned token is admitted only as ``<resource>;<ascii digits>``."""
        outcome = self._outcome({FENCING_HEADER: token})
        if outcome != "refused":
            raw = token.rpartition(";")[2]
            assert raw.isascii() and raw.isdigit() and outcome == int(raw) < 2**53

    @settings(max_examples=300, deadline=None, database=None)
    @given(part=st.integers(0, 5), text=st.text())
    @example(part=5, text="\u00e9" * 43)  # a non-ASCII MAC
    @example(part=3, text="\u00b2")
    @example(part=4, text="9" * 5000)
    @example(part=2, text="")  # an empty resource
    @example(part=2, text="YWNjdCAx")  # base64 of "acct 1": not a resource name
    @example(part=2, text="_w")  # base64 of b"\xff": not UTF-8
    @example(part=1, text="")
    def test_signed_tokens_with_one_part_replaced(self, part, text):
        """A signed token with any one part replaced is refused, never crashes the parser."""
        parts = self.SIGNER.sign("acct-1", 5).split(".")
        parts[part] = text
        token = ".".join(parts)
        outcome = self._outcome(token, signer=self.SIGNER)
        assert outcome in ("refused", 5)
        with pytest.raises(InvalidFenceTokenError) if outcome == "refused" else _no_error():
            self.SIGNER.verify(token)

    @settings(max_examples=200, deadline=None, database=None)
    @given(st.text())
    @example("")
    @example("v1.k1.YWNjdC0x.5.0." + "\u00e9" * 43)
    @example("v1." + "x" * 100_000)
    def test_signed_tokens_from_arbitrary_text(self, token):
        """Arbitrary text given to a signer is refused, never crashes it."""
        assert self._outcome(token, signer=self.SIGNER) == "refused"
        with pytest.raises(InvalidFenceTokenError):
            self.SIGNER.verify(token)

    def test_a_token_for_a_well_formed_resource_still_passes(self):
        """The stricter parser keeps admitting what fencing_headers and sign() produce."""
        assert self._outcome({FENCING_HEADER: "browser/acct-42:x_y.z;12"}) == 12
        token = self.SIGNER.sign("browser/acct-42", 2**53 - 1, expires_in=60)
        assert self._outcome(token, signer=self.SIGNER) == 2**53 - 1


class _no_error:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_a_wsgi_tool_gateway_rejects_a_stale_owner_over_http():
    """A real WSGI gateway on loopback: the newest owner's call passes, the stale one gets 409,
    a forged one 403."""
    signer = FenceSigner({"k1": SECRET}, active="k1")
    gate = FenceGate("memory://")
    actions = []

    def gateway(environ, start_response):
        try:
            fence = check_fencing_token(environ, gate, signer=signer, resource="browser-1")
        except StaleFenceError as exc:
            start_response("409 Conflict", [("Content-Type", "text/plain")])
            return [str(exc).encode()]
        except InvalidFenceTokenError as exc:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [str(exc).encode()]
        actions.append(fence)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"fence": fence}).encode()]

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    server = make_server("127.0.0.1", 0, gateway, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = MemoryLeaseStore()
        old = store.acquire("browser-1", Owner.new("old"), 30)
        store.force_release("browser-1")
        new = store.acquire("browser-1", Owner.new("new"), 30)

        def call(headers):
            request = urllib.request.Request(
                f"http://127.0.0.1:{server.server_port}/click", headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert call(fencing_headers(new, signer=signer)) == 200
        assert call(fencing_headers(old, signer=signer)) == 409
        assert call({FENCING_HEADER: f"browser-1;{new.fence + 100}"}) == 403
        assert actions == [new.fence]
    finally:
        server.shutdown()
        server.server_close()


def test_a_stdlib_http_server_gateway_reads_its_headers_object():
    """``check_fencing_token(self.headers, ...)`` in a ``http.server`` handler: its
    ``HTTPMessage`` (no Mapping, case-insensitive ``get``) is read, whatever case the client
    wrote the header in; the newest owner passes, the stale one gets 409, no header 403."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    gate = FenceGate("memory://")
    actions, refusals = [], []

    class Gateway(BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                fence = check_fencing_token(self.headers, gate, resource="browser-1")
            except StaleFenceError:
                status = 409
            except InvalidFenceTokenError as exc:
                refusals.append(str(exc))
                status = 403
            else:
                actions.append(fence)
                status = 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = MemoryLeaseStore()
        old = store.acquire("browser-1", Owner.new("old"), 30)
        store.force_release("browser-1")
        new = store.acquire("browser-1", Owner.new("new"), 30)

        def call(headers):
            request = urllib.request.Request(
                f"http://127.0.0.1:{server.server_port}/act", data=b"", headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert call(fencing_headers(new)) == 200
        assert call({"fencing-token": f"browser-1;{new.fence}"}) == 200  # any case
        assert call(fencing_headers(old)) == 409
        assert call({}) == 403  # the control: a request without the header
        assert actions == [new.fence, new.fence]
        assert refusals == ["the request carries no Fencing-Token header"]
    finally:
        server.shutdown()
        server.server_close()


def test_token_from_request_reads_any_headers_object_with_get():
    """An ``email.message.Message`` (what ``http.server`` hands a handler) is read through
    its case-insensitive ``get``; one without the header gives None."""
    from email.message import Message

    headers = Message()
    headers["FENCING-TOKEN"] = "acct-1;7"
    assert token_from_request(headers) == "acct-1;7"
    assert token_from_request(Message()) is None


_BOUND = 2**53 - 1  # the largest fence every store compares exactly


@pytest.fixture(params=["memory", "redis", "sqlite", "postgres"])
def any_store(request, tmp_path):
    from tests.conftest import make_store

    store = make_store(request.param, request, tmp_path)
    yield store
    store.close()


class TestFenceBound:
    """Fences above 2**53 - 1 are refused alike by every store and helper: Redis compares them
    as Lua doubles, where an older fence can compare equal to a newer one."""

    def test_negative_control_lua_cannot_tell_two_fences_apart_above_2_53(self, redis_server):
        """What the bound guards against: Redis's Lua sees 2**60 + 100 > 2**60 + 1 as false."""
        client = redis.Redis.from_url(redis_server.url)
        compare = "return tonumber(ARGV[1]) > tonumber(ARGV[2]) and 1 or 0"
        assert client.eval(compare, 0, 2**60 + 100, 2**60 + 1) == 0
        assert client.eval(compare, 0, _BOUND, _BOUND - 1) == 1  # exact up to the bound

    def test_every_gate_refuses_a_fence_past_the_bound(self, any_store):
        """FenceGate.admit and the store's own gate_admit name the fence and the bound; at the
        bound an older fence is still refused, as below it."""
        gate = FenceGate(store=any_store)
        key = unique("k-")
        for big in (_BOUND + 1, 2**60 + 100, 2**63 - 1):
            with pytest.raises(LeaseConfigError, match=rf"fence {big} is above {_BOUND}"):
                gate.admit(key, big)
            with pytest.raises(LeaseConfigError, match=str(big)):
                any_store.gate_admit(key, big)
        assert gate.highest(key) is None  # nothing was admitted
        assert gate.admit(key, _BOUND) == _BOUND
        with pytest.raises(StaleFenceError) as caught:
            gate.admit(key, _BOUND - 1)
        assert caught.value.highest == _BOUND
        assert gate.highest(key) == _BOUND

    def test_force_release_refuses_a_fence_past_the_bound(self, any_store):
        resource = unique("r/")
        any_store.acquire(resource, Owner.new(), 30)
        with pytest.raises(LeaseConfigError, match=str(_BOUND)):
            any_store.force_release(resource, fence=_BOUND + 1)
        assert any_store.get(resource) is not None

    def test_fenced_set_refuses_a_fence_past_the_bound(self, redis_server):
        """The reviewer's sequence (2**60 + 100, then 2**60 + 1) writes nothing at all."""
        client = redis.Redis.from_url(redis_server.url)
        key = unique("doc:")
        for big in (2**60 + 100, 2**60 + 1):
            with pytest.raises(LeaseConfigError, match=rf"fence {big} is above"):
                fenced_set(client, key, "v", big)
        assert fenced_get(client, key) == (None, None)
        assert fenced_set(client, key, "v", _BOUND) == _BOUND
        with pytest.raises(StaleFenceError):
            fenced_set(client, key, "older", _BOUND - 1)
        assert fenced_get(client, key) == (b"v", _BOUND)

    def test_check_fencing_token_has_the_same_bound(self, any_store):
        """A token past the bound is an invalid token (403), signed or not; one at it passes."""
        gate = FenceGate(store=any_store)
        signer = FenceSigner({"k1": SECRET}, active="k1")
        key = unique("k-")
        with pytest.raises(InvalidFenceTokenError, match=str(_BOUND)):
            check_fencing_token(f"{key};{_BOUND + 1}", gate)
        with pytest.raises(LeaseConfigError, match=str(_BOUND)):
            signer.sign(key, _BOUND + 1)
        assert check_fencing_token(f"{key};{_BOUND}", gate) == _BOUND
        with pytest.raises(StaleFenceError):
            check_fencing_token(signer.sign(key, _BOUND - 1), gate, signer=signer)

    def test_granted_fences_stay_far_below_the_bound(self, any_store):
        """A Redis fence is about the server clock in microseconds (2**53 us is the year 2255);
        SQL and memory count from 1."""
        lease = any_store.acquire(unique("r/"), Owner.new(), 30)
        assert 0 < lease.fence < _BOUND // 4
