"""The stores' connections: taken per call from a free list and given back (issue 8, item 3).

* :class:`FreeList` itself: last in, first out; at most ``max_idle`` kept; a discarded
  connection is closed and never handed out again; a forked child neither reuses nor closes the
  parent's connections.
* The Redis and PostgreSQL stores on real servers: a new thread per call (what Celery's gevent
  pool does with a greenlet per task) reuses one connection instead of opening one per thread;
  after a server-side disconnect of every idle connection the next call still succeeds; a forked
  child and its parent calling at the same time each get their own replies.

Each store-level test has a negative control that switches the protection off.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy.engine import make_url

from celery_lease import LeaseStoreError, Owner
from celery_lease.stores import _connections, store_from_url
from celery_lease.stores._connections import MAX_IDLE, FreeList
from celery_lease.stores.redis import RedisLeaseStore
from tests.conftest import make_store, unique
from tests.tooling.servers import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)

SERVER_KINDS = ("redis", "postgres")


class Conn:
    """A stand-in connection that records whether it was closed."""

    made = 0

    def __init__(self) -> None:
        Conn.made += 1
        self.closed = False

    def close(self) -> None:
        self.closed = True


def free_list(max_idle: int = MAX_IDLE) -> FreeList[Conn]:
    return FreeList(Conn, Conn.close, max_idle=max_idle)


class TestFreeList:
    def test_last_in_first_out(self):
        """The connection given back last is handed out first; an empty list opens one."""
        free = free_list()
        a, b = free.get(), free.get()
        assert a is not b
        free.put(a)
        free.put(b)
        assert free.get() is b
        assert free.get() is a
        assert free.idle() == 0

    def test_keeps_at_most_max_idle(self):
        """Given back beyond ``max_idle``, connections are closed; the kept ones stay open."""
        free = free_list(max_idle=4)
        conns = [free.get() for _ in range(10)]
        for conn in conns:
            free.put(conn)
        assert free.idle() == 4
        assert [c.closed for c in conns] == [False] * 4 + [True] * 6
        assert {id(free.get()) for _ in range(4)} == {id(c) for c in conns[:4]}

    def test_the_default_bound(self):
        """The default keeps ``MAX_IDLE`` (64) idle connections."""
        free = free_list()
        conns = [free.get() for _ in range(MAX_IDLE + 36)]
        for conn in conns:
            free.put(conn)
        assert free.idle() == MAX_IDLE == 64
        assert sum(c.closed for c in conns) == 36

    def test_discarded_connection_is_closed_and_never_handed_out(self):
        """A broken connection is closed instead of given back; the next call gets another."""
        free = free_list()
        broken = free.get()
        free.discard(broken)
        assert broken.closed
        assert free.get() is not broken
        assert free.idle() == 0

    def test_clear_closes_idle_connections(self):
        """clear() closes every idle connection (after a connection error)."""
        free = free_list()
        conns = [free.get() for _ in range(3)]
        for conn in conns:
            free.put(conn)
        free.clear()
        assert all(c.closed for c in conns)
        assert free.get() not in conns

    def test_many_threads_share_the_idle_connections(self):
        """A thread per call (a greenlet per task, under gevent) reuses the idle connection."""
        free = free_list()
        before = Conn.made
        for _ in range(50):
            thread = threading.Thread(target=lambda: free.put(free.get()))
            thread.start()
            thread.join()
        assert Conn.made - before == 1

    def test_negative_control_per_thread_opens_one_per_thread(self, monkeypatch):
        """PER_THREAD (the old cache) opens one connection per thread and keeps it."""
        monkeypatch.setattr(_connections, "PER_THREAD", True)
        free = free_list()
        before = Conn.made
        kept = []

        def call() -> None:
            conn = free.get()
            kept.append(conn)
            free.put(conn)

        for _ in range(50):
            thread = threading.Thread(target=call)
            thread.start()
            thread.join()
        assert Conn.made - before == 50
        assert not any(c.closed for c in kept)

    def test_forked_child_neither_reuses_nor_closes_the_parents(self):
        """In a forked child the parent's idle connections are forgotten, not used or closed."""
        free = free_list()
        parents = [free.get() for _ in range(3)]
        for conn in parents:
            free.put(conn)
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 0
            try:
                conn = free.get()
                code |= 1 if conn in parents else 0
                free.put(conn)
                free.close()
                code |= 2 if any(c.closed for c in parents) else 0
                code |= 4 if free.idle() != 0 else 0
            except BaseException:
                code |= 8
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert free.idle() == 3
        assert free.get() is parents[-1] and not parents[-1].closed


# -- the stores on real servers ------------------------------------------------------------------
@pytest.fixture(params=SERVER_KINDS)
def server_store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    if request.param == "postgres":
        # A database of its own: PostgreSQL counts the sessions opened per database, and the
        # suite's other processes open theirs in the shared one meanwhile.
        with own_database(request.getfixturevalue("postgres_server").url) as url:
            store = store_from_url(url)
            try:
                yield store
            finally:
                store.close()
        return
    store = make_store(request.param, request, tmp_path)
    try:
        yield store
    finally:
        store.close()


@contextlib.contextmanager
def own_database(server_url: str) -> Iterator[str]:
    """A new database on the PostgreSQL server (dropped afterwards): its URL."""
    url = make_url(server_url)
    name = unique("cl_db")
    with psycopg.connect(
        host=url.host, port=url.port, user=url.username, dbname=url.database, autocommit=True
    ) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def task_free_list(store: Any) -> FreeList[Any]:
    """The free list that serves a store's task calls."""
    return store._connections.free  # (both stores keep their connection layer there)


class Server:
    """What the store's server sees: connections opened so far, and closing them."""

    def __init__(self, store: Any, request: pytest.FixtureRequest) -> None:
        self.redis = isinstance(store, RedisLeaseStore)
        if self.redis:
            self.admin: Any = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
            # The server counts the connections of the whole suite (its other processes run
            # meanwhile): count the sockets this process connects to the store's server.
            self.handshakes = 0
            port = self.admin.connection_pool.connection_kwargs["port"]
            connect = redis.connection.Connection._connect

            def counted(conn: Any) -> Any:
                sock = connect(conn)
                if getattr(conn, "port", None) == port:
                    self.handshakes += 1
                return sock

            request.getfixturevalue("monkeypatch").setattr(
                redis.connection.Connection, "_connect", counted
            )
        else:
            url = make_url(request.getfixturevalue("postgres_server").url)
            self.admin = psycopg.connect(
                host=url.host,
                port=url.port,
                user=url.username,
                dbname=store._connections.engine.url.database,  # (its own, see server_store)
                autocommit=True,
            )

    def opened(self) -> int:
        """Connections established to the server so far (PostgreSQL: once reported, in the
        store's own database; Redis: by this process)."""
        if self.redis:
            return self.handshakes
        sql = "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        return int(self.admin.execute(sql).fetchone()[0])

    def disconnect(self, ids: list[int]) -> None:
        """Close these connections from the server side (as a restart would), and wait until
        they are gone."""
        if self.redis:
            for client_id in ids:
                self.admin.client_kill_filter(_id=client_id)
            return
        for pid in ids:
            self.admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        sql = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)"
        wait_for(lambda: self.admin.execute(sql, (ids,)).fetchone()[0] == 0, 10, "backends to end")

    def close(self) -> None:
        self.admin.close()


@pytest.fixture
def server(server_store: Any, request: pytest.FixtureRequest) -> Iterator[Server]:
    seen = Server(server_store, request)
    try:
        yield seen
    finally:
        seen.close()


def call_from_new_threads(store: Any, resource: str, n: int) -> None:
    """``n`` calls, each from a thread of its own that ends after it."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.get(resource)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    for _ in range(n):
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    assert not errors, errors[:3]


class TestStores:
    def test_a_thread_per_call_reuses_one_connection(self, server_store, server, names):
        """150 calls from 150 short-lived threads open at most 2 connections, not 150."""
        server_store.get(names + "x")  # opened once, before counting
        before = server.opened()
        call_from_new_threads(server_store, names + "x", 150)
        opened = server.opened() - before
        print(f"{server_store.url}: {opened} connections opened by 150 threads")
        assert opened <= 2
        assert task_free_list(server_store).idle() == 1

    def test_negative_control_per_thread_opens_one_per_thread(
        self, server_store, server, names, monkeypatch
    ):
        """With PER_THREAD (the old cache) every short-lived thread opens a connection."""
        monkeypatch.setattr(_connections, "PER_THREAD", True)
        server_store.get(names + "x")
        before = server.opened()
        call_from_new_threads(server_store, names + "x", 150)
        # (PostgreSQL counts a session once its backend has ended: poll for the last ones)
        wait_for(lambda: server.opened() - before >= 140, 10, "140 connections opened")
        print(f"{server_store.url} per-thread: {server.opened() - before} opened by 150 threads")

    def test_after_a_disconnect_the_next_call_succeeds(self, server_store, server, names):
        """Idle connections closed by the server: the next call retries on a fresh one."""
        server.disconnect(self._idle_connections(server_store, 3))
        assert server_store.get(names + "x") is None
        assert task_free_list(server_store).idle() == 1

    def test_negative_control_retry_on_another_dead_connection(
        self, server_store, server, names, monkeypatch
    ):
        """Without closing the idle ones after a disconnect, the retry takes another dead one."""
        server.disconnect(self._idle_connections(server_store, 3))
        monkeypatch.setattr(FreeList, "clear", lambda self: None)
        with pytest.raises(LeaseStoreError):
            server_store.get(names + "x")

    @staticmethod
    def _idle_connections(store: Any, n: int) -> list[int]:
        """Leave ``n`` open connections idle in the store's free list (as ``n`` concurrent
        calls would); returns their server-side ids."""
        free = task_free_list(store)
        free.clear()
        conns = [free.get() for _ in range(n)]
        ids = []
        for conn in conns:
            if isinstance(store, RedisLeaseStore):
                conn.send_command("CLIENT", "ID")
                ids.append(int(conn.read_response()))
            else:
                ids.append(conn.conn.dbapi_connection.info.backend_pid)
            free.put(conn)
        return ids


class TestSQLTranslateWrapper:
    """Connections.translate is where an SQL store's driver errors are translated; a wrapper or
    override of it (tracing every store error) wraps every store call, claims and releases
    included, each attempt with its first_attempt flag."""

    @pytest.fixture(params=("sqlite", "postgres"))
    def traced(self, request, tmp_path, monkeypatch):
        from celery_lease.stores.sql.connection import Connections

        calls: list[tuple[str, bool]] = []
        original = Connections.translate

        @contextlib.contextmanager
        def translate(self, what, first_attempt=True):
            calls.append((what, first_attempt))
            with original(self, what, first_attempt):
                yield

        monkeypatch.setattr(Connections, "translate", translate)
        store = make_store(request.param, request, tmp_path)
        try:
            yield store, calls
        finally:
            store.close()

    def test_claims_and_releases_go_through_it(self, traced, names):
        store, calls = traced
        store.get(names + "warm")
        calls.clear()
        store.release(store.acquire(names + "r", Owner.new("t"), 30))
        assert len(calls) == 2 and all(first for _, first in calls), calls

    def test_a_retry_after_a_disconnect_goes_through_it_again(self, traced, request, names):
        store, calls = traced
        if store._connections.dialect != "postgresql":
            pytest.skip("a server-side disconnect needs PostgreSQL")
        server = Server(store, request)
        try:
            server.disconnect(TestStores._idle_connections(store, 3))
            calls.clear()
            assert store.get(names + "x") is None
        finally:
            server.close()
        assert [first for _, first in calls] == [True, False]


class TestFork:
    @pytest.mark.parametrize("pid_check", [True, False], ids=["pid-check", "negative-control"])
    def test_forked_child_and_parent_each_get_their_own_replies(
        self, request, tmp_path, names, pid_check
    ):
        """Parent and forked child calling at once each read their own replies; with the pid
        check switched off they share the parent's connection and read each other's."""
        store = make_store("redis", request, tmp_path, socket_timeout=1.0)
        try:
            owners = {who: store.acquire(names + who, Owner.new(who), 60) for who in "pc"}
            assert store.get(names + "p").owner_label == "p"  # one idle connection now
            pid = os.fork()
            if pid == 0:
                if not pid_check:  # pretend the free list was made in this child
                    task_free_list(store)._pid = os.getpid()
                os._exit(0 if _agree(store, names + "c", "c") else 1)
            parent_ok = _agree(store, names + "p", "p")
            child_ok = _exit_code(pid, timeout=20) == 0
            store.close()  # a fresh connection for the clean-up
            for lease in owners.values():
                store.release(lease)
        finally:
            store.close()
        print(f"pid check {pid_check}: parent agreed {parent_ok}, child agreed {child_ok}")
        if pid_check:
            assert parent_ok and child_ok
        else:
            assert not (parent_ok and child_ok), "a connection shared across fork went unseen"


def _exit_code(pid: int, timeout: float) -> int | None:
    """Wait for our forked child; SIGKILL it (by its pid) if it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _agree(store: Any, resource: str, label: str, seconds: float = 1.0) -> bool:
    """Read ``resource`` for ``seconds``: True when every reply named its own owner."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            info = store.get(resource)
            if info is None or info.owner_label != label:
                return False
    except Exception:
        return False
    return True


class TestPostgresRawCursor:
    """The long claim and release statements go through a raw cursor kept per connection."""

    def test_claims_and_releases_on_one_connection_reuse_its_raw_cursor(self, request, tmp_path):
        store = make_store("postgres", request, tmp_path)
        try:
            for i in range(3):
                store.release(store.acquire(f"raw-{i}", Owner.new("t"), 30))
            (held,) = store._connections.free._idle
            raw = held.cursor.raw
            assert isinstance(raw, psycopg.RawCursor) and not raw.closed
            store.release(store.acquire("raw-again", Owner.new("t"), 30))
            assert store._connections.free._idle == [held] and held.cursor.raw is raw
        finally:
            store.close()
        assert raw.closed  # closed with its connection

    def test_fetch_runs_on_a_kept_raw_cursor_or_a_fresh_one(self, request, tmp_path):
        """The store's cursors keep one raw cursor; another cursor gets a new one per call."""
        from celery_lease.stores.sql import wait_statements

        statement = wait_statements.raw("SELECT %(a)s::int + %(b)s::int, %(a)s::int")
        store = make_store("postgres", request, tmp_path)
        try:
            held = store._connections.free.get()
            try:
                kept = held.cursor
                assert kept.raw is None  # made at its first use
                assert wait_statements.fetch(kept, statement, {"a": 2, "b": 3}) == (5, 2)
                first = kept.raw
                assert wait_statements.fetch(kept, statement, {"a": 1, "b": 1}) == (2, 1)
                assert kept.raw is first
                plain = held.conn.dbapi_connection.cursor()
                assert wait_statements.fetch(plain, statement, {"a": 4, "b": 0}) == (4, 4)
                assert not hasattr(plain, "raw")
            finally:
                store._connections.free.put(held)
        finally:
            store.close()

    def test_a_cursor_factory_the_user_configured_is_kept(self, request, tmp_path):
        """engine_options connect_args cursor_factory (ClientCursor: the usual setting behind
        PgBouncer's transaction pooling) gives the store's cursors, as before the kept raw
        cursor; the long statements still go through a raw cursor, a new one per call, and
        nothing is prepared on the server: not after psycopg's prepare_threshold (5 runs: seen
        failing at 6 claims), nor by an overlapped release (early wake)."""
        store = make_store(
            "postgres",
            request,
            tmp_path,
            engine_options={"connect_args": {"cursor_factory": psycopg.ClientCursor}},
        )
        try:
            for i in range(8):
                store.release(store.acquire(f"cf-{i}", Owner.new("t"), 30))
                lease = store.acquire(f"cf-{i}", Owner.new("t"), 30, identity="x", early_wake=True)
                store.release(lease, outcome="done", meanwhile=lambda: None)
            for _ in range(10):
                store.get("cf-0")
            (held,) = store._connections.free._idle
            assert type(held.cursor) is psycopg.ClientCursor
            held.cursor.execute("SELECT count(*) FROM pg_prepared_statements")
            assert held.cursor.fetchone() == (0,)  # client-side binding: nothing prepared
        finally:
            store.close()


class TestRedisEvalshaHead:
    """A script call packs its head (EVALSHA, sha, key count, keys) once and the arguments per
    call: the server must see exactly the command packed whole."""

    ECHO = "return {KEYS, ARGV}"

    @pytest.mark.parametrize(
        ("keys", "args"),
        [
            (["k:{a}1", "k:{a}2"], ["r", "0123abcd", "w@h:1:t", 30_000_000, "", 7, 1.5]),
            (["k:{a}1"], ["\u00e9\u00f8\u4e2d", b"raw\r\nbytes", "a\r\nb", -1, 0, "x" * 3000]),
            ([], ["only", "args"]),
            (["k:{a}1", "k:{a}2", "k:{a}3"], []),
            ([], []),
        ],
    )
    def test_the_server_sees_the_command_as_packed_whole(self, redis_server, keys, args):
        from hiredis import pack_command

        from celery_lease.stores.redis.connection import Connections, Script

        client = redis.Redis.from_url(redis_server.url)
        try:
            connections = Connections(client)
            assert connections.pack is not None  # the path under test (hiredis)
            script = Script(connections, self.ECHO)
            script.load()
            for _ in range(2):  # the second call reuses the kept head
                got_keys, got_args = script(keys=keys, args=args)
                assert [k.decode() for k in got_keys] == keys
                assert got_args == [a if isinstance(a, bytes) else str(a).encode() for a in args]
            # The bytes sent: what packing the whole command gives.
            sent = _record_sent(connections)
            script(keys=keys, args=args)
            assert sent == [pack_command(("EVALSHA", script.sha, len(keys), *keys, *args))]
        finally:
            client.close()

    def test_fixed_arguments_go_with_the_head(self, redis_server):
        """Arguments passed as fixed are sent after the keys, before the call's own, packed
        with the head and kept per value: the server sees the command as packed whole."""
        from hiredis import pack_command

        from celery_lease.stores.redis.connection import Connections, Script

        client = redis.Redis.from_url(redis_server.url)
        try:
            connections = Connections(client)
            script = Script(connections, self.ECHO)
            script.load()
            keys = ["k:{a}1", "k:{a}2"]
            sent = _record_sent(connections)
            for fixed in ((30_000_000, "", "\u00e9"), (30_000_000, "1", "\u00e9"), ("k:{a}2",)):
                for _ in range(2):  # the second call reuses the kept head
                    got_keys, got_args = script(keys=keys, args=["r", 7], fixed=fixed)
                    assert [k.decode() for k in got_keys] == keys
                    assert got_args == [str(a).encode() for a in (*fixed, "r", 7)]
                sent.clear()
                script(keys=keys, args=["r", 7], fixed=fixed)
                want = pack_command(("EVALSHA", script.sha, len(keys), *keys, *fixed, "r", 7))
                assert sent == [want]
            # One head per fixed values; a fixed argument equal to a key is not taken for one.
            assert len(connections._heads) == 3
        finally:
            client.close()

    def test_only_heads_of_a_few_keys_are_kept(self, redis_server):
        """A renewal batch's keys differ from call to call: a long key list is packed whole
        each time, never kept (the kept heads stay small and few)."""
        from celery_lease.stores.redis.connection import Connections, Script

        client = redis.Redis.from_url(redis_server.url)
        try:
            connections = Connections(client)
            script = Script(connections, self.ECHO)
            script.load()
            few = [f"k:{{a}}{i}" for i in range(9)]  # a claim's
            many = [f"k:{{a}}{i}" for i in range(99)]  # a renewal of 33 leases
            for keys in (few, many):
                got_keys, got_args = script(keys=keys, args=["x", 1])
                assert [k.decode() for k in got_keys] == keys and got_args == [b"x", b"1"]
            assert list(connections._heads) == [(script.sha, *few)]
        finally:
            client.close()


class TestRedisHeadedScripts:
    """The claims and releases send their fixed arguments first (a prelude puts them back in
    the script's order); a test's stand-in for a script is sent them in its own order."""

    def test_a_stand_in_script_gets_its_own_order(self, redis_server):
        store = RedisLeaseStore(url=redis_server.url, key_prefix=unique("headed"))
        calls: list[tuple[str, list[Any]]] = []

        class StandIn:
            def __init__(self, name, script):
                self.name, self.script = name, script

            def __call__(self, keys, args, **kwargs):
                calls.append((self.name, list(args)))
                return self.script(keys=keys, args=args, **kwargs)

        try:
            for attr in ("_acquire", "_release", "_release_outcome"):
                setattr(store, attr, StandIn(attr, getattr(store, attr)))
            owner = Owner.new("host:1:t")
            plain = store.acquire("headed-a", owner, 30)
            assert store.release(plain)
            ident = store.acquire("headed-b", owner, 30, identity="i-1", attempt=0)
            assert store.release(ident, outcome="done", result="7")
            assert [(name, args[:3]) for name, args in calls] == [
                ("_acquire", ["headed-a", owner.token, owner.label]),
                ("_release", ["headed-a", owner.token, plain.fence]),
                ("_acquire", ["headed-b", owner.token, owner.label]),
                ("_release_outcome", ["headed-b", owner.token, ident.fence]),
            ]
            assert calls[0][1][3] == 30_000_000 and calls[2][1][4] == "i-1"
            assert calls[3][1][3:6] == ["i-1", "done", "7"]
        finally:
            store.close()


def _record_sent(connections: Any) -> list[bytes]:
    """The bytes each command sent on ``connections``' one free connection, as sent."""
    sent: list[bytes] = []
    conn = connections.free.get()
    original = conn.send_packed_command
    conn.send_packed_command = lambda packed, **kw: (
        sent.append(b"".join(packed)),
        original(packed, **kw),
    )
    connections.free.put(conn)
    return sent
