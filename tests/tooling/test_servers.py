"""The test tooling's servers: each test talks to the server it started, not to a neighbour's."""

from __future__ import annotations

import pytest
import redis

from tests.conftest import missing
from tests.tooling.servers import RedisServer

pytestmark = pytest.mark.redis


def _server(tmp_path, name: str, **options) -> RedisServer:
    try:
        return RedisServer(tmp_path / name, **options)
    except FileNotFoundError as exc:
        missing(str(exc))
        raise


def test_a_port_taken_before_the_server_binds_it_is_picked_again(tmp_path):
    """Test processes run at once: another one's server can take the free port picked for
    this one before it binds it. The start must notice (this server exited, another answers)
    and pick again, so its URL reaches its own process. Failed before: start() returned with
    the other server answering on the port (a Redis Cluster was then built from a neighbour's
    nodes and failed)."""
    neighbour = _server(tmp_path, "neighbour").start()
    try:
        mine = _server(tmp_path, "mine")
        mine.port = neighbour.port  # (the race: the port was free when it was picked)
        mine.start()
        try:
            assert mine.port != neighbour.port
            info = redis.Redis.from_url(mine.url).info("server")
            assert mine.proc is not None and info["process_id"] == mine.proc.pid
        finally:
            mine.close()
    finally:
        neighbour.close()


def test_a_given_port_that_is_taken_fails_the_start(tmp_path):
    """A port the caller chose is not changed behind its back: the start fails instead."""
    neighbour = _server(tmp_path, "neighbour").start()
    try:
        mine = _server(tmp_path, "mine", port=neighbour.port)
        with pytest.raises(RuntimeError):
            mine.start()
        mine.close()
    finally:
        neighbour.close()


def test_a_password_protected_server_is_recognised_as_its_own(tmp_path):
    """The readiness check logs in when the server wants a password."""
    server = _server(tmp_path, "pw", extra_args=("--requirepass", "s3cret")).start()
    try:
        client = redis.Redis.from_url(server.url_for(password="s3cret"))
        assert client.info("server")["process_id"] == server.proc.pid  # type: ignore[union-attr]
    finally:
        server.close()


@pytest.mark.postgres
def test_a_postgresql_port_taken_before_it_binds_is_picked_again(tmp_path):
    """The same race for the PostgreSQL the tooling starts. Failed before: pg_ctl failed."""
    from tests.tooling.servers import PostgresServer

    neighbour = _server(tmp_path, "neighbour").start()
    try:
        try:
            server = PostgresServer()
        except FileNotFoundError as exc:
            missing(str(exc))
        server.port = neighbour.port
        with server:
            assert server.port != neighbour.port
            import psycopg

            with psycopg.connect(server.dsn) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        neighbour.close()
