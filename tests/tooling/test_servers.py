"""The test tooling's servers: each test talks to the server it started, not to a neighbour's."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.conftest import missing
from tests.tooling.rabbitmq import stop_shared_node
from tests.tooling.servers import RedisServer

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]


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


def _rabbitmq(directory, **options):
    from tests.tooling.rabbitmq import RabbitMQServer

    try:
        return RabbitMQServer(directory, **options)
    except FileNotFoundError as exc:
        missing(str(exc))
        raise


def _processes_left(server) -> list[str]:
    """The node's recorded processes (rabbitmq-server script, Erlang VM, epmd) still alive."""
    from tests.tooling.rabbitmq import _alive

    return [name for name, (pid, started) in server.pids.items() if _alive(pid, started)]


@pytest.mark.rabbitmq
class TestRabbitMQ:
    """The private RabbitMQ node: loopback only, its own ports, cookie and epmd, stopped by PID."""

    def test_a_port_taken_before_the_node_binds_it_is_picked_again(self, tmp_path):
        """Another process takes the AMQP port picked for the node before it binds it: the
        node fails to start, the start notices and picks its ports again. Then the node, as
        started: its Erlang VM listens on 127.0.0.1 only, on its AMQP and distribution ports,
        its epmd on loopback only, none of them a default port; closing it leaves none of its
        processes behind."""
        from tests.tooling.rabbitmq import _connection_start, listening_sockets
        from tests.tooling.servers import DEFAULT_PORTS

        server = _rabbitmq(tmp_path / "node")
        with socket.socket() as neighbour:
            neighbour.bind(("127.0.0.1", 0))
            neighbour.listen()
            taken = neighbour.getsockname()[1]
            server.port = taken  # (the race: the port was free when it was picked)
            with server:
                assert server.port != taken
                start = _connection_start(server.port)
                assert start is not None and server.node.encode() in start
                beam, _ = server.pids["beam"]
                epmd, _ = server.pids["epmd"]
                assert listening_sockets(beam) == {
                    ("127.0.0.1", server.port),
                    ("127.0.0.1", server.dist_port),
                }
                assert {address for address, _ in listening_sockets(epmd)} <= {
                    "127.0.0.1",
                    "::1",
                }
                assert {port for _, port in listening_sockets(epmd)} == {server.epmd_port}
                ports = {server.port, server.dist_port, server.epmd_port}
                assert len(ports) == 3 and not ports & DEFAULT_PORTS
                recorded = dict(server.pids)
        server.pids = recorded
        assert _processes_left(server) == []

    def test_one_node_serves_every_test_process_and_only_its_cookie_reaches_it(self, tmp_path):
        """Two processes ask for the shared node of one directory: the first starts it and
        leaves it running, the second finds it (the same node, not a second one). rabbitmqctl
        reaches it with the node's private cookie and manages a vhost that a client then uses;
        with any other HOME (another cookie: the system's, the user's) it is refused. Stopped
        by the PIDs its directory records, nothing of it is left."""
        from tests.tooling.rabbitmq import RabbitMQServer

        _rabbitmq(tmp_path / "probe")  # (skips here when RabbitMQ is not installed)
        directory = tmp_path / "shared"
        ask = (
            "import sys; from pathlib import Path; from tests.tooling.rabbitmq import shared_node;"
            " print(shared_node(Path(sys.argv[1])).node)"
        )
        nodes = [
            subprocess.run(
                [sys.executable, "-c", ask, str(directory)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout.strip()
            for _ in range(2)
        ]
        server = RabbitMQServer.attach(directory)
        try:
            assert nodes == [server.node, server.node] and server.running()
            import kombu

            url = server.add_vhost("probe")
            with kombu.Connection(url) as connection:
                connection.default_channel.queue_declare("probe-queue", durable=True)
            assert server.list_queues("probe")["probe-queue"]["durable"] == "true"
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            refused = subprocess.run(
                [str(server.ctl_script), "list_vhosts"],
                env={**server.env(), "HOME": str(elsewhere)},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert refused.returncode != 0, refused.stdout
        finally:
            recorded = dict(server.pids)
            stop_shared_node(directory)
        server.pids = recorded
        assert _processes_left(server) == []
