"""Fixtures for tests with real ``celery worker`` processes and a real Redis broker."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import own_redis_db, unique
from tests.integration.harness import Events, Worker

pytestmark = pytest.mark.integration


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture(scope="session")
def it_app(redis_server: Any) -> Any:
    """The integration app module, pointed at the session Redis as broker and backend."""
    # (a broker of each test process's own: a worker with a short visibility timeout restores
    # every old unacked message in its database, other tests' running tasks included)
    os.environ["CL_BROKER"] = _db(redis_server.url, own_redis_db(0))
    os.environ["CL_BACKEND"] = _db(redis_server.url, 2)
    os.environ["CL_COORD"] = _db(redis_server.url, 3)
    module = importlib.import_module("tests.integration.worker_app")
    module.app.conf.broker_url = os.environ["CL_BROKER"]
    module.app.conf.result_backend = os.environ["CL_BACKEND"]
    # (the peers' lock stores too: another test module may have imported the app before
    # CL_COORD was set, leaving their URLs empty)
    if isinstance(module.app.conf.get("ONCE"), dict):
        module.app.conf.ONCE["settings"]["url"] = os.environ["CL_COORD"]
        module.app.conf.singleton_backend_url = os.environ["CL_COORD"]
    return module


@pytest.fixture
def coord(redis_server: Any) -> redis.Redis:
    return redis.Redis.from_url(_db(redis_server.url, 3))


@pytest.fixture
def events(coord: redis.Redis) -> Events:
    return Events(coord, f"events-{unique()}")


@pytest.fixture
def store_env(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], dict[str, str]]:
    """Environment variables that point workers at a fresh store of the given kind."""

    def make(kind: str) -> dict[str, str]:
        prefix = unique("it")
        if kind == "redis":
            server = request.getfixturevalue("redis_server")
            return {"CL_STORE": _db(server.url, 1), "CL_PREFIX": f"{prefix}:"}
        if kind == "postgres":
            server = request.getfixturevalue("postgres_server")
            return {"CL_STORE": server.url, "CL_TABLE_PREFIX": f"{prefix}_"}
        if kind == "sqlite":
            return {"CL_STORE": f"sqlite:///{tmp_path}/leases.db", "CL_TABLE_PREFIX": "it_"}
        if kind == "redis_secure":  # TLS, as an ACL user held to the prefix
            from tests.tooling.secure import redis_acl_user

            server = request.getfixturevalue("redis_secure_server")
            return {"CL_STORE": redis_acl_user(server, f"{prefix}:"), "CL_PREFIX": f"{prefix}:"}
        raise ValueError(kind)

    return make


@pytest.fixture
def start_worker(it_app: Any, events: Events, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start real worker processes; all are stopped (by PID) when the test ends.

    ``wait=False`` only spawns the process: start several, then ``wait_ready()`` each.
    """
    started: list[Worker] = []

    def start(env: dict[str, str], *, queue: str, wait: bool = True, **options: Any) -> Worker:
        full_env = {
            "CL_BROKER": os.environ["CL_BROKER"],
            "CL_BACKEND": os.environ["CL_BACKEND"],
            "CL_COORD": os.environ["CL_COORD"],
            "CL_EVENTS": events.key,
            **env,
        }
        if not started and full_env["CL_BROKER"].startswith("redis://"):
            # No worker of this test runs yet and the earlier tests' have stopped: a restore
            # mutex left now is a dead worker's, and would hold up every redelivery.
            redis.Redis.from_url(full_env["CL_BROKER"]).delete("unacked_mutex")
        name = options.pop("name", None) or unique("w")
        worker = Worker(full_env, name=name, queue=queue, logdir=tmp_path, **options)
        started.append(worker)
        return worker.start() if wait else worker.spawn()

    yield start
    for worker in started:  # all shut down together, then waited for
        worker.request_stop()
    for worker in started:
        worker.wait_stopped()


@pytest.fixture
def queue() -> str:
    return unique("q")


@pytest.fixture
def make_sink(it_app: Any) -> Iterator[Callable[[dict[str, str]], Any]]:
    """Create the side-effect sink of a test's workers (``CL_SINK``/``CL_SINK_NAME``); it is
    dropped when the test ends (list this fixture before ``start_worker``: it is then torn down
    after the workers stopped)."""
    made: list[Any] = []

    def make(env: dict[str, str]) -> Any:
        sink = it_app.eo.Sink(env.get("CL_SINK", ""), env["CL_SINK_NAME"])
        sink.create()
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.drop()
