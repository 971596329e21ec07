"""Shared fixtures: real servers, stores over every backend, unique resource names.

Servers: when ``CELERY_LEASE_TEST_REDIS_URL`` / ``CELERY_LEASE_TEST_POSTGRES_URL`` /
``CELERY_LEASE_TEST_RABBITMQ_DIR`` are set (``.ci/run`` starts the servers and sets them), the
tests use those; otherwise the session starts its own on free loopback ports in temporary
directories and stops them at the end (RabbitMQ, heavier: one node for all the run's pytest-xdist
processes). A missing server binary skips the tests that need it, except under ``CI=true`` where
it fails them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from celery_lease.stores import MemoryLeaseStore, store_from_url
from celery_lease.stores.base import BaseLeaseStore

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
STORE_KINDS = ("memory", "redis", "redis_cluster", "sqlite", "postgres")
#: The same stores run with least privilege: Redis over TLS as an ACL user limited to the
#: store's key prefix, PostgreSQL as a role that owns nothing and may create nothing (see
#: tests/tooling/secure.py). The ``store`` fixture, so the contract suites, covers them too.
SECURE_KINDS = ("redis_secure", "postgres_role")
_counter = itertools.count()


# A sample of a user's own suite, run by tests/test_testing.py in its own pytest process.
collect_ignore = ["user_suite"]


def missing(what: str) -> None:
    """Skip locally, fail in CI: a test that needs a server must not silently pass in CI."""
    if IN_CI:
        pytest.fail(f"{what} is required when CI=true", pytrace=False)
    pytest.skip(what)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running redis-server: the CI one from the environment, or one started here."""
    url = os.environ.get("CELERY_LEASE_TEST_REDIS_URL")
    if url:
        yield SimpleNamespace(url=url)
        return
    from tests.tooling.servers import RedisServer

    try:
        server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=True)
    except FileNotFoundError as exc:
        missing(str(exc))
    with server:
        yield server


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running PostgreSQL: the CI one from the environment, or one started here."""
    url = os.environ.get("CELERY_LEASE_TEST_POSTGRES_URL")
    if url:
        yield SimpleNamespace(url=url)
        return
    from tests.tooling.servers import PostgresServer

    try:
        server = PostgresServer()
    except FileNotFoundError as exc:
        missing(str(exc))
    with server:
        yield server


#: Where a pytest-xdist run's processes find the directory of the RabbitMQ node they share.
SHARED_RABBITMQ = "celery_lease_rabbitmq"


@pytest.fixture(scope="session")
def rabbitmq_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """A running RabbitMQ node (tests/tooling/rabbitmq.py: ``.url``, ``.ctl()``, vhosts): the
    CI one from the environment, the one this run's pytest-xdist processes share (the first
    that needs it starts it, the run's main process stops it), or one started here."""
    from tests.tooling.rabbitmq import RabbitMQServer, shared_node

    directory = os.environ.get("CELERY_LEASE_TEST_RABBITMQ_DIR")
    if os.environ.get("CELERY_LEASE_TEST_AMQP_URL") and not directory:
        missing("CELERY_LEASE_TEST_AMQP_URL needs CELERY_LEASE_TEST_RABBITMQ_DIR (rabbitmqctl)")
    shared = getattr(request.config, "workerinput", {}).get(SHARED_RABBITMQ)
    try:
        if directory:
            yield RabbitMQServer.attach(directory)
            return
        if shared:
            server = shared_node(Path(shared))
        else:
            server = RabbitMQServer(tmp_path_factory.mktemp("rabbitmq")).start()
    except FileNotFoundError as exc:
        missing(str(exc))
    except (RuntimeError, TimeoutError) as exc:  # (installed, but it would not start)
        missing(f"RabbitMQ did not start: {exc}")
    yield server
    if not shared:
        server.close()


@pytest.fixture
def amqp_vhost(rabbitmq_server: Any) -> Iterator[Any]:
    """A fresh vhost on the session's RabbitMQ for one test (``.name``, ``.url``,
    ``.queues()``: name -> durable, messages, consumers), deleted with everything in it at
    the end: a test's queues, bindings and connections are its own."""
    name = unique("v")
    url = rabbitmq_server.add_vhost(name)
    try:
        yield SimpleNamespace(
            name=name,
            url=url,
            server=rabbitmq_server,
            queues=lambda: rabbitmq_server.list_queues(name),
        )
    finally:
        rabbitmq_server.delete_vhost(name)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_SharedRabbitMQ(), "celery-lease-shared-rabbitmq")


class _SharedRabbitMQ:
    """In the main process of a pytest-xdist run: a directory of its own for the RabbitMQ node
    the run's processes share (RabbitMQ is heavy: ~5 s of CPU and ~140 MB each), handed to
    each process, and the node stopped once they have all ended. (Not under pytest's basetemp:
    other runs on the machine may delete that one's parent while this run goes on.)"""

    def __init__(self) -> None:
        self.directory: Path | None = None

    def pytest_configure_node(self, node: Any) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="celery-lease-rabbitmq-"))
        node.workerinput[SHARED_RABBITMQ] = str(self.directory / "node")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.directory is None:
            return
        from tests.tooling.rabbitmq import stop_shared_node

        stop_shared_node(self.directory / "node")  # (if a process started it)
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A TLS-only redis-server (its own CA) whose default user needs the admin password."""
    from tests.tooling.secure import REDIS_ADMIN_PASSWORD
    from tests.tooling.servers import RedisServer

    try:
        server = RedisServer(
            tmp_path_factory.mktemp("redis-tls"),
            appendonly=True,
            tls=True,
            extra_args=("--requirepass", REDIS_ADMIN_PASSWORD),
        )
    except FileNotFoundError as exc:
        missing(str(exc))
    with server:
        yield server


@pytest.fixture(scope="session")
def postgres_role(postgres_server: Any) -> Iterator[Any]:
    """A least-privilege login role on the test PostgreSQL (dropped at the end)."""
    from tests.tooling.secure import PostgresRole

    role = PostgresRole(postgres_server.url)
    try:
        yield role
    finally:
        role.drop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A 3-master Redis Cluster on loopback, started here (the hash-tagged key layout's test)."""
    from tests.tooling.servers import RedisClusterServers

    try:
        servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    except FileNotFoundError as exc:
        missing(str(exc))
    with servers:
        yield servers


def xdist_index() -> int | None:
    """This pytest-xdist worker's number (``gw2`` -> 2), None when the suite runs in one
    process (``tests/run.sh`` runs it in several, see ``-n`` there)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


#: Redis databases the session server has (``--databases`` in tests/tooling/servers.py).
REDIS_DATABASES = 64


def own_redis_db(base: int) -> int:
    """A Redis database number for state that must not be shared between the suite's
    processes run at once: ``base`` in a single process, else one per xdist worker above
    the shared ones (a broker whose visibility timeout restores every unacked message in its
    database, a count of the clients in one database)."""
    index = xdist_index()
    if index is None:
        return base
    number = 16 + 2 * index + (0 if base == 0 else 1)
    if number >= REDIS_DATABASES:
        raise RuntimeError(f"too many test processes for {REDIS_DATABASES} Redis databases")
    return number


def unique(prefix: str = "t") -> str:
    """A name no other test uses: keeps tests independent on shared servers."""
    return f"{prefix}{os.getpid():x}{next(_counter):x}{uuid.uuid4().hex[:6]}"


@pytest.fixture
def names() -> str:
    """A unique resource-name prefix for one test, e.g. ``t1a2b3c/``."""
    return unique() + "/"


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Any, **options: Any) -> Any:
    """Build a store of ``kind`` isolated from other tests (own key prefix / tables / file)."""
    if kind == "memory":
        return MemoryLeaseStore(**options)
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        return store_from_url(server.url, key_prefix=f"{unique('cl')}:", **options)
    if kind == "redis_cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return store_from_url(cluster.url, cluster=True, key_prefix=f"{unique('cl')}:", **options)
    if kind == "redis_secure":
        from tests.tooling.secure import REDIS_ADMIN_PASSWORD, redis_acl_user

        server = request.getfixturevalue("redis_secure_server")
        prefix = f"{unique('cl')}:"
        secure = store_from_url(redis_acl_user(server, prefix), key_prefix=prefix, **options)
        secure.test_admin_url = server.url_for(password=REDIS_ADMIN_PASSWORD)  # type: ignore[attr-defined]
        return secure
    if kind == "sqlite":
        return store_from_url(f"sqlite:///{tmp_path}/leases.db", **options)
    if kind == "postgres":
        server = request.getfixturevalue("postgres_server")
        return store_from_url(server.url, table_prefix=f"{unique('cl')}_", **options)
    if kind == "postgres_role":
        role = request.getfixturevalue("postgres_role")
        table_prefix = f"{unique('cl')}_"
        # The owner (the admin) creates the tables and grants; the role's store only checks
        # that they are there (create_tables stays on: it creates nothing that exists).
        with store_from_url(role.admin_url, table_prefix=table_prefix) as owner:
            role.grant(owner)
        return store_from_url(role.url, table_prefix=table_prefix, **options)
    raise ValueError(kind)


def store_or_fallback(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """A fixture body: a store of ``kind``, where ``postgres_fallback`` is PostgreSQL with its
    one-statement forms (no functions) and ``postgres`` is checked to run its functions."""
    instance = make_store(kind.removesuffix("_fallback"), request, tmp_path)
    if kind == "postgres_fallback":
        instance.sql.use_functions(False)
        instance.ledger_sql.use_functions(False)
    elif kind == "postgres":
        assert instance.sql.acquire_raw is instance.sql.fast_raw[0]  # the functions
    try:
        yield instance
    finally:
        instance.close()


@contextlib.contextmanager
def redis_admin(store: Any) -> Iterator[Any]:
    """A client on a Redis store's server that may read any key (the ACL user of a secure
    store may not): for tests that look around the store's API."""
    import redis

    admin_url = getattr(store, "test_admin_url", None)
    if admin_url is None:
        yield store.client
        return
    with redis.Redis.from_url(admin_url) as admin:
        yield admin


@pytest.fixture(params=STORE_KINDS + SECURE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[BaseLeaseStore]:
    """Each store kind in turn, isolated from the other tests."""
    instance = make_store(request.param, request, tmp_path)
    try:
        yield instance
    finally:
        instance.close()


@pytest.fixture(params=("redis", "sqlite", "postgres"))
def real_store_kind(request: pytest.FixtureRequest) -> str:
    """The stores shared between processes (everything but memory)."""
    return str(request.param)
