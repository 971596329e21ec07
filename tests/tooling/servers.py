"""Real Redis and PostgreSQL servers for the tests, on 127.0.0.1, in temporary directories
(RabbitMQ: tests/tooling/rabbitmq.py).

Each server is started by the tooling, on a free non-default port, and stopped by PID by
whoever started it. Usable as a library by ``.ci/run`` too::

    python -m tests.tooling.servers start /tmp/dir   # prints export lines, leaves them running
    python -m tests.tooling.servers stop /tmp/dir
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["PostgresServer", "RedisServer", "free_port", "make_tls_files", "wait_for"]

PG_BIN = Path(os.environ.get("CELERY_LEASE_PG_BIN", "/usr/lib/postgresql/15/bin"))


#: Ports a system server listens on by default: PostgreSQL, Redis; RabbitMQ's AMQP (and TLS),
#: epmd, Erlang distribution, management, and the range its rabbitmqctl calls listen in.
DEFAULT_PORTS = frozenset({5432, 6379, 5671, 5672, 4369, 25672, 15672, *range(35672, 35683)})


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (not a server's default port)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in DEFAULT_PORTS:
            return port


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02, min_polls: int = 1):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes, and at least
    ``min_polls`` polls were made: a slow predicate (``rabbitmqctl`` starts an Erlang VM per
    call: 13-32 s a call on a box at load 15) still gets that many looks."""
    deadline = time.monotonic() + timeout
    polls = 0
    while True:
        value = predicate()
        polls += 1
        if value:
            return value
        if time.monotonic() > deadline and polls >= min_polls:
            raise TimeoutError(f"timed out after {timeout}s ({polls} looks) waiting for {what}")
        time.sleep(interval)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop_pid(pid: int, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Stop a process we started, by PID, escalating to SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: poll for its exit
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)
            continue
        if done:
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _stop_popen(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10.0
) -> None:
    """Stop a child we started and reap it through its Popen (no zombie, no warning)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (IP SAN), made with openssl.

    Returns the paths ``ca``, ``cert`` and ``key`` (PEM, EC P-256, valid for 2 days). The CA's
    key is deleted once the server certificate is signed: nothing else can ever be signed by it.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl is not installed (apt-get install openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, csr = directory / "server.crt", directory / "server.key", directory / "server.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _run_checked(
        [
            openssl,
            "req",
            "-x509",
            *ec,
            "-keyout",
            str(ca_key),
            "-out",
            str(ca),
            "-subj",
            "/CN=celery_lease test CA",
            "-days",
            "2",
        ]
    )
    _run_checked(
        [
            openssl,
            "req",
            *ec,
            "-keyout",
            str(key),
            "-out",
            str(csr),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ]
    )
    _run_checked(
        [
            openssl,
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-copy_extensions",
            "copy",
            "-out",
            str(cert),
            "-days",
            "2",
        ]
    )
    ca_key.unlink()
    csr.unlink()
    return {"ca": ca, "cert": cert, "key": key}


class RedisServer:
    """A redis-server on 127.0.0.1:<free port> with its data in a temporary directory.

    Args:
        appendonly: AOF persistence; ``appendfsync`` sets its fsync policy.
        maxmemory_policy: the eviction policy (noeviction unless a test wants otherwise).
        tls: serve TLS only (no plaintext port), with a CA and certificate for 127.0.0.1 made
            in the server's directory; ``url`` is then ``rediss://`` and trusts that CA only.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        maxmemory_policy: str = "noeviction",
        maxmemory: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: bool = False,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self._tmp = None if directory else tempfile.mkdtemp(prefix="celery-lease-redis-")
        self.dir = Path(directory or self._tmp or "")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        # A port picked here may be taken by another process (another test process picking at
        # the same moment) before the server binds it: the first start then picks again.
        self._pick_port: Callable[[], int] | None = None if port else free_port
        self._log_from = 0  # (where this start's lines begin in redis.log)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.maxmemory_policy = maxmemory_policy
        self.maxmemory = maxmemory
        self.extra_args = extra_args
        self.tls = make_tls_files(self.dir / "tls") if tls else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.url_for()

    def url_for(self, user: str | None = None, password: str | None = None) -> str:
        """The server's URL (as ``user:password`` when given); over TLS, trusting only its CA."""
        auth = f"{user}:{password}@" if user else (f":{password}@" if password else "")
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return (
            f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_cert_reqs=required"
            f"&ssl_ca_certs={self.tls['ca']}&ssl_check_hostname=true"
        )

    def start(self) -> RedisServer:
        for attempt in range(5):
            log = self.dir / "redis.log"
            self._log_from = log.stat().st_size if log.exists() else 0
            self.proc = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                wait_for(self._ready, 20, f"redis-server on port {self.port}")
            except _PortTaken:
                _stop_popen(self.proc, signal.SIGKILL)
                self.proc = None
                if self._pick_port is None or attempt == 4:
                    raise
                self.port = self._pick_port()
                continue
            self._pick_port = None  # (a restart keeps the port)
            return self
        raise AssertionError("unreachable")

    def _args(self) -> list[str]:
        args = [
            self.binary or "redis-server",
            "--bind",
            "127.0.0.1",
            *self._port_args(),
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--maxmemory-policy",
            self.maxmemory_policy,
            "--protected-mode",
            "yes",
            "--databases",
            "64",  # (tests/conftest.py REDIS_DATABASES: test processes run at once)
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        return [*args, *self.extra_args]

    def _port_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port",
            "0",  # no plaintext listener at all
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls["cert"]),
            "--tls-key-file",
            str(self.tls["key"]),
            "--tls-ca-cert-file",
            str(self.tls["ca"]),
            "--tls-auth-clients",
            "no",  # clients prove who they are with an ACL password, not a certificate
        ]

    def _ready(self) -> bool:
        """Whether this server answers on its port: its own process, not another one that
        holds the port (then ``_PortTaken``; a server that exited: ``RuntimeError``)."""
        if self.proc is not None and self.proc.poll() is not None:
            with open(self.dir / "redis.log", "rb") as file:
                file.seek(self._log_from)
                log = file.read().decode(errors="replace")[-2000:]
            if "Address already in use" in log:
                raise _PortTaken(self.port)
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
        try:
            with contextlib.ExitStack() as stack:
                sock = stack.enter_context(
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
                )
                if self.tls is not None:
                    context = ssl.create_default_context(cafile=str(self.tls["ca"]))
                    sock = stack.enter_context(
                        context.wrap_socket(sock, server_hostname="127.0.0.1")
                    )
                password = _option(self.extra_args, "--requirepass")
                if password is not None:
                    sock.sendall(f"AUTH {password}\r\n".encode())
                    if not _read_reply(sock).startswith(b"+OK"):
                        return False
                # (persistence: INFO answers while the dataset loads, other commands do not)
                sock.sendall(b"INFO server persistence\r\n")
                reply = _read_reply(sock)
                # and a command that is refused (-LOADING) until the dataset is in memory
                sock.sendall(b"PING\r\n")
                pong = _read_reply(sock)
        except OSError:
            return False
        found = re.search(rb"process_id:(\d+)", reply)
        if found is None or b"loading:0" not in reply or not pong.startswith(b"+PONG"):
            return False  # (loading, or not a complete reply yet)
        if self.proc is not None and int(found.group(1)) != self.proc.pid:
            raise _PortTaken(self.port)
        return True

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed beyond what AOF already wrote)."""
        if self.proc is not None:
            _stop_popen(self.proc, signal.SIGKILL)
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            _stop_popen(self.proc)
            self.proc = None

    def restart(self, *, kill: bool = True) -> None:
        self.kill() if kill else self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PortTaken(RuntimeError):
    """Another process answers on the port a server was started on."""


def _option(args: tuple[str, ...], name: str) -> str | None:
    """The value after ``name`` in a server's extra arguments, if it is there."""
    for flag, value in itertools.pairwise(args):
        if flag == name:
            return value
    return None


def _read_reply(sock: socket.socket) -> bytes:
    """One RESP reply: a status or error line, or a bulk string read to its end."""
    data = sock.recv(65536)
    if data.startswith(b"$"):
        head, _, body = data.partition(b"\r\n")
        size = int(head[1:])
        while size >= 0 and len(body) < size + 2:
            more = sock.recv(65536)
            if not more:
                break
            body += more
        return body
    return data


class PostgresServer:
    """A PostgreSQL 15 cluster made by initdb in a temporary directory, on 127.0.0.1.

    The directory must be reachable by the ``postgres`` user: leave ``directory`` unset to get a
    fresh one under the system temporary directory (pytest's own tmp dirs are root-only).

    The server runs as the ``postgres`` user when the tests run as root (PostgreSQL refuses to
    run as root). Connect with ``url`` (user postgres, trust authentication on loopback).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, port: int | None = None):
        if not (PG_BIN / "initdb").exists():
            raise FileNotFoundError(f"PostgreSQL binaries not found in {PG_BIN}")
        self._tmp = None if directory else tempfile.mkdtemp(prefix="celery-lease-pg-")
        self.dir = Path(directory or self._tmp or "")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = self.dir / "data"
        self.port = port or free_port()
        self._pick_port = port is None  # (see RedisServer: picked again if taken at start)
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chmod(self.dir, 0o755)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _cmd(self, *args: str) -> list[str]:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        return ["runuser", "-u", "postgres", "--", *cmd] if self._as_postgres else cmd

    def init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        _run_checked(
            self._cmd(
                "initdb",
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale",
                "C",
            )
        )

    def start(self) -> PostgresServer:
        self.init()
        for attempt in range(5):
            try:
                self._start()
            except RuntimeError:
                log = self.dir / "postgres.log"
                tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
                # (what log_min_messages=fatal keeps of a port another process holds)
                taken = "could not create any TCP/IP sockets" in tail
                if not (taken and self._pick_port) or attempt == 4:
                    raise
                log.unlink()
                self.port = free_port()
                continue
            self._pick_port = False  # (a restart keeps the port)
            return self
        raise AssertionError("unreachable")

    def _start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.dir} -c max_connections=300 "
            "-c shared_buffers=64MB -c fsync=on -c synchronous_commit=on "
            "-c log_min_messages=fatal"
        )
        _run_checked(
            self._cmd(
                "pg_ctl",
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.dir / "postgres.log"),
                "-w",
                "-t",
                "60",
                "start",
            )
        )
        wait_for(lambda: _port_open(self.port), 30, f"PostgreSQL on port {self.port}")

    @property
    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self, mode: str = "fast") -> None:
        if self.pid is None:
            return
        subprocess.run(
            self._cmd("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"),
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def restart(self, mode: str = "immediate") -> None:
        self.stop(mode)
        self.start()

    def close(self) -> None:
        self.stop("immediate")
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535 and not _port_open(port + 10000):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisClusterServers:
    """A Redis Cluster of ``masters`` nodes (no replicas) on 127.0.0.1, in a temporary directory.

    Each node is a :class:`RedisServer` with cluster mode on (AOF on); ``redis-cli --cluster
    create`` assigns the 16384 slots. ``url`` is the first node's (a cluster client discovers the
    rest).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, masters: int = 3):
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            raise FileNotFoundError("redis-cli is not installed (apt-get install redis-tools)")
        self._tmp = None if directory else tempfile.mkdtemp(prefix="celery-lease-cluster-")
        self.dir = Path(directory or self._tmp or "")
        self.nodes = [
            RedisServer(
                self.dir / f"node{i}",
                port=free_cluster_port(),
                appendonly=True,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(self.dir / f"node{i}" / "nodes.conf"),
                    "--cluster-node-timeout",
                    "5000",
                ),
            )
            for i in range(masters)
        ]
        for node in self.nodes:
            node._pick_port = free_cluster_port  # (its bus port must be free too)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        _run_checked(
            [
                self.cli or "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ]
        )
        wait_for(self._ok, 30, "the Redis cluster to be ok on every node")
        return self

    def _ok(self) -> bool:
        for node in self.nodes:
            done = subprocess.run(
                [self.cli or "redis-cli", "-p", str(node.port), "cluster", "info"],
                check=False,
                capture_output=True,
                text=True,
            )
            if "cluster_state:ok" not in done.stdout:
                return False
        return True

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_checked(cmd: list[str]) -> None:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")


def _main(argv: list[str]) -> int:
    """``start DIR`` launches Redis, PostgreSQL and RabbitMQ (tests/tooling/rabbitmq.py) and
    prints ``export`` lines; ``stop DIR`` stops them."""
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python -m tests.tooling.servers start|stop DIR", file=sys.stderr)
        return 2
    action, directory = argv
    base = Path(directory)
    from tests.tooling.rabbitmq import RabbitMQServer, stop_shared_node

    if action == "start":
        base.mkdir(parents=True, exist_ok=True)
        redis_server = RedisServer(base / "redis", appendonly=True).start()
        assert redis_server.proc is not None
        (base / "redis.pid").write_text(str(redis_server.proc.pid))
        pg = PostgresServer(base / "pg").start()
        rabbitmq = RabbitMQServer(base / "rabbitmq").start()
        print(f"export CELERY_LEASE_TEST_REDIS_URL={redis_server.url}")
        print(f"export CELERY_LEASE_TEST_POSTGRES_URL={pg.url}")
        print(f"export CELERY_LEASE_TEST_AMQP_URL={rabbitmq.url}")
        print(f"export CELERY_LEASE_TEST_RABBITMQ_DIR={rabbitmq.dir}")  # (for rabbitmqctl)
        # keep redis and rabbitmq running after we exit: detach from the Popen objects
        redis_server.proc = None
        rabbitmq.detach()
        return 0
    pid_file = base / "redis.pid"
    if pid_file.exists():
        _stop_pid(int(pid_file.read_text()))
        pid_file.unlink()
    if (base / "pg").exists():
        PostgresServer(base / "pg").stop("fast")
    stop_shared_node(base / "rabbitmq")  # (by the PIDs its node.json records)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
