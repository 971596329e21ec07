"""A private RabbitMQ node for the tests: Debian's ``rabbitmq-server``, on 127.0.0.1 only.

Nothing is shared with a system RabbitMQ or with another test's node: the node has a name of
its own, its own AMQP port, Erlang distribution port and ``epmd`` (started here on a port of its
own, never the system's 4369), its own Erlang cookie in a private HOME, its own config file,
data, logs and an empty plugin list, all in one directory. Every process it runs is started
here and stopped by PID (with its start time, so a reused PID is never signalled).

A node is described by ``node.json`` in its directory, so a process that did not start it
(``.ci/run``'s test run, another pytest-xdist process) can use it and stop it::

    server = RabbitMQServer(directory).start()       # ~5 s
    RabbitMQServer.attach(directory).ctl("list_queues")
    RabbitMQServer.attach(directory).stop()

Only the standard library here: ``.ci/run`` starts the servers with the system's python3.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import string
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.tooling.servers import free_port, wait_for

__all__ = [
    "RABBITMQ_BIN",
    "RabbitMQServer",
    "listening_sockets",
    "shared_node",
    "stop_shared_node",
]

#: Debian's RabbitMQ scripts. (``/usr/sbin/rabbitmq-server`` and ``rabbitmqctl`` are wrappers
#: that switch to the ``rabbitmq`` user and its HOME, so to the system node's cookie.)
RABBITMQ_BIN = Path(os.environ.get("CELERY_LEASE_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
STATE = "node.json"
#: An AMQP 0-9-1 client's first bytes; the server answers with a Connection.Start frame.
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


class _Popen(subprocess.Popen[bytes]):
    """A child process that :meth:`RabbitMQServer.detach` may leave running on purpose."""

    detached = False

    def __del__(self, *args: object, **kwargs: object) -> None:
        if not self.detached:  # (else Popen warns that it still runs, and keeps it to reap)
            super().__del__(*args, **kwargs)  # type: ignore[misc]


class RabbitMQServer:
    """One RabbitMQ node on 127.0.0.1:<free port>, its data in ``directory`` (a temporary one
    when unset, removed by :meth:`close`).

    Args:
        config: extra ``rabbitmq.conf`` lines (``"consumer_timeout = 5000"``), for a test that
            needs a node configured otherwise than the session's.

    ``url`` is the default vhost's; :meth:`add_vhost` makes a fresh one (the guest user may
    use it) and :meth:`url_for` names it. ``guest`` may log in from loopback only, as by default.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        config: tuple[str, ...] = (),
    ) -> None:
        self.server_script = RABBITMQ_BIN / "rabbitmq-server"
        self.ctl_script = RABBITMQ_BIN / "rabbitmqctl"
        self.epmd = shutil.which("epmd")
        if not self.server_script.exists() or not self.ctl_script.exists() or not self.epmd:
            raise FileNotFoundError(
                f"rabbitmq-server is not installed in {RABBITMQ_BIN} (apt-get install "
                "rabbitmq-server, or bash tests/tooling/ensure_rabbitmq.sh)"
            )
        self._tmp = None if directory else tempfile.mkdtemp(prefix="celery-lease-rabbitmq-")
        self.dir = Path(directory or self._tmp or "")
        self.dir.mkdir(parents=True, exist_ok=True)
        # (ports picked here may be taken by another process before the node binds them: the
        # first start then picks them all again, unless the caller chose the AMQP port)
        self._pick_ports = port is None
        self._logs_from: dict[Path, int] = {}  # (where this start's lines begin in each log)
        self.port, self.dist_port, self.epmd_port = port or 0, 0, 0
        self._new_ports()
        # (a name of its own: also names its data and log files)
        self.node = f"cl{uuid.uuid4().hex[:10]}@localhost"
        self.config = config
        self.proc: _Popen | None = None  # the rabbitmq-server script
        self.epmd_proc: _Popen | None = None
        #: what stop() signals: name -> (pid, start time); kept in node.json for attach()
        self.pids: dict[str, tuple[int, str]] = {}

    # -- where ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.url_for("/")

    def url_for(self, vhost: str) -> str:
        """The AMQP URL of ``vhost`` on this node, as the guest user."""
        path = "/" if vhost == "/" else vhost
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{path}"

    @property
    def home(self) -> Path:
        """The private HOME of the node and of its rabbitmqctl calls: the Erlang cookie."""
        return self.dir / "home"

    def env(self) -> dict[str, str]:
        """The environment of the node and of rabbitmqctl for it: nothing read from /etc, nor
        from RabbitMQ or Erlang settings in this process's environment."""
        loopback = "-kernel inet_dist_use_interface {127,0,0,1}"
        inherited = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("RABBITMQ_", "ERL_")) and name != "HOME"
        }
        return {
            **inherited,
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_CONFIG_FILES": str(self.dir / "conf.d" / "*.conf"),  # (none there)
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),  # (none)
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),  # (empty)
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),  # []
            "RABBITMQ_MOTD_FILE": str(self.dir / "motd"),  # (none)
            # the node's distribution listener, and each rabbitmqctl's (an OS-picked port, not
            # the CLI's default range 35672-35682 that every rabbitmqctl on the host uses)
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": loopback,
            "RABBITMQ_CTL_ERL_ARGS": loopback,
            "RABBITMQ_CTL_DIST_PORT_MIN": "0",
            "RABBITMQ_CTL_DIST_PORT_MAX": "0",
        }

    def _new_ports(self) -> None:
        ports: set[int] = set() if self._pick_ports else {self.port}
        while len(ports) < 3:
            ports.add(free_port())
        picked = sorted(ports - {self.port})
        if self._pick_ports:
            self.port = picked.pop()
        self.dist_port, self.epmd_port = picked[:2]

    # -- start ----------------------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> RabbitMQServer:
        """Start epmd and the node; return once the node answers AMQP on its port as itself."""
        self._write_files()
        for attempt in range(5):
            try:
                self._start_epmd()
                self._start_node(timeout)
            except _PortTaken:
                self.stop()
                if not self._pick_ports or attempt == 4:
                    raise
                self._new_ports()
                continue
            except BaseException:
                self.stop()
                raise
            self._pick_ports = False  # (a restart keeps the ports)
            self._write_state()
            return self
        raise AssertionError("unreachable")

    def _write_files(self) -> None:
        self.home.mkdir(mode=0o700, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():  # (Erlang wants it readable by its owner only)
            alphabet = string.ascii_uppercase
            cookie.write_text("".join(secrets.choice(alphabet) for _ in range(32)))
            cookie.chmod(0o400)
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")

    def _write_config(self) -> None:
        lines = [
            f"listeners.tcp.1 = 127.0.0.1:{self.port}",
            # (what the AMQP handshake reports: how _ready() knows its own node on the port)
            f"cluster_name = {self.node}",
            "loopback_users.guest = true",
            "log.console = false",
            "log.file.level = info",
            *self.config,
        ]
        (self.dir / "rabbitmq.conf").write_text("\n".join(lines) + "\n")

    def _start_epmd(self) -> None:
        with open(self.dir / "epmd.log", "ab") as log:
            self.epmd_proc = _Popen(
                [self.epmd or "epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # (a Ctrl-C in the terminal is the test run's to handle)
            )
        self.pids["epmd"] = (self.epmd_proc.pid, _start_time(self.epmd_proc.pid) or "")
        wait_for(self._epmd_ready, 10, f"epmd on port {self.epmd_port}")

    def _epmd_ready(self) -> bool:
        assert self.epmd_proc is not None
        if self.epmd_proc.poll() is not None:
            if _port_answers(self.epmd_port):
                raise _PortTaken(self.epmd_port)
            log = (self.dir / "epmd.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"epmd exited with {self.epmd_proc.returncode}: {log}")
        return self.epmd_port in {port for _, port in listening_sockets(self.epmd_proc.pid)}

    def _start_node(self, timeout: float) -> None:
        self._write_config()
        startup = self.dir / "startup.log"
        self._logs_from = {
            path: path.stat().st_size if path.exists() else 0
            for path in (startup, self.dir / "log" / f"{self.node}.log")
        }
        with open(startup, "ab") as log:
            self.proc = _Popen(
                [str(self.server_script)],
                cwd=self.dir,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.pids["script"] = (self.proc.pid, _start_time(self.proc.pid) or "")
        wait_for(self._ready, timeout, f"RabbitMQ node {self.node} on port {self.port}")
        beam = self._beam_pid()
        if beam is not None:
            self.pids["beam"] = beam

    def _ready(self) -> bool:
        """Whether the node answers AMQP on its port (its own node: the handshake names it);
        a node that exited raises (``_PortTaken`` when one of its ports was in use)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            log = self._log_tail()
            # (the AMQP listener's bind failed; the distribution listener's)
            taken = ("eaddrinuse", "dist_port_already_used")
            if any(what in log for what in taken) or _port_answers(self.port):
                raise _PortTaken(self.port)
            raise RuntimeError(f"rabbitmq-server exited with {self.proc.returncode}: {log}")
        start = _connection_start(self.port)
        if start is None:
            return False
        if self.node.encode() not in start:
            raise _PortTaken(self.port)  # another server answers on the port picked
        return True

    def _log_tail(self) -> str:
        """What this start wrote to the script's output and to the node's log."""
        text = ""
        for path, offset in self._logs_from.items():
            with contextlib.suppress(OSError), open(path, "rb") as file:
                file.seek(offset)
                text += file.read().decode(errors="replace")
        return text[-4000:]

    def _beam_pid(self) -> tuple[int, str] | None:
        """The Erlang VM's PID (the script's child), from the node's PID file."""
        pid_file = self.dir / "mnesia" / f"{self.node}.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        started = _start_time(pid)
        return None if started is None else (pid, started)

    # -- use ------------------------------------------------------------------------------------
    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl`` against this node (its cookie, epmd and name); its stdout."""
        done = subprocess.run(
            [str(self.ctl_script), "--quiet", *args],
            env=self.env(),
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout)[-2000:]}"
            )
        return done.stdout

    def add_vhost(self, name: str) -> str:
        """Create the vhost ``name`` (guest may configure, write and read everything in it);
        returns its URL. (Two rabbitmqctl calls, about a second.)"""
        self.ctl("add_vhost", name)
        self.ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        return self.url_for(name)

    def delete_vhost(self, name: str) -> None:
        """Delete the vhost ``name`` with its queues, exchanges and bindings."""
        self.ctl("delete_vhost", name)

    #: the columns list_queues reports, in order
    QUEUE_COLUMNS = ("durable", "messages", "consumers", "type", "messages_ready")

    def list_queues(self, vhost: str = "/") -> dict[str, dict[str, str]]:
        """The queues of ``vhost``: name -> its ``durable``, ``messages`` (ready and unacked),
        ``consumers``, ``type`` (classic, quorum) and ``messages_ready``."""
        columns = self.QUEUE_COLUMNS
        out = self.ctl("list_queues", "-p", vhost, "--no-table-headers", "name", *columns)
        queues = {}
        for line in out.splitlines():
            fields = line.split("\t")
            if len(fields) == len(columns) + 1:
                queues[fields[0]] = dict(zip(columns, fields[1:], strict=True))
        return queues

    # -- stop -----------------------------------------------------------------------------------
    def running(self) -> bool:
        """Whether the node's Erlang VM (or its script, before the VM is known) still runs."""
        for name in ("beam", "script"):
            if name in self.pids:
                return _alive(*self.pids[name])
        return False

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node, then its epmd: SIGTERM, SIGKILL after ``timeout``. Only the processes
        started here (recorded PIDs whose start time still matches) are signalled."""
        # The script passes SIGTERM on to the VM and waits for it (a clean shutdown, ~2 s).
        self._stop("script", self.proc, timeout)
        self._stop("beam", None, timeout)  # (gone with the script, unless that was killed)
        self.proc = None
        self._stop("epmd", self.epmd_proc, 10)
        self.epmd_proc = None

    def _stop(self, name: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
        recorded = self.pids.pop(name, None)
        if proc is not None:  # our child: stop and reap it
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            return
        if recorded is None or not _alive(*recorded):
            return
        pid, started = recorded
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not _alive(pid, started), timeout, f"{name} {pid} to exit", 0.05)
            return
        if _alive(pid, started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not _alive(pid, started), 10, f"{name} {pid} to die", 0.05)

    def close(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> RabbitMQServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shared with other processes -----------------------------------------------------------
    def _write_state(self) -> None:
        state = {
            "node": self.node,
            "port": self.port,
            "dist_port": self.dist_port,
            "epmd_port": self.epmd_port,
            "pids": self.pids,
        }
        temporary = self.dir / f".{STATE}.tmp"
        temporary.write_text(json.dumps(state))
        temporary.replace(self.dir / STATE)

    @classmethod
    def attach(cls, directory: str | os.PathLike[str]) -> RabbitMQServer:
        """The node another process started in ``directory`` (its ``node.json``): to use it,
        and to stop it by the PIDs recorded there."""
        state = json.loads((Path(directory) / STATE).read_text())
        server = cls(directory, port=int(state["port"]))
        server.node = state["node"]
        server.dist_port, server.epmd_port = int(state["dist_port"]), int(state["epmd_port"])
        server.pids = {name: (int(p), str(t)) for name, (p, t) in state["pids"].items()}
        server._pick_ports = False
        return server

    def detach(self) -> None:
        """Let the node outlive this process (whoever attaches to its directory stops it)."""
        for proc in (self.proc, self.epmd_proc):
            if proc is not None:
                proc.detached = True
        self.proc = self.epmd_proc = None


def shared_node(directory: Path) -> RabbitMQServer:
    """The one node of ``directory`` for several processes (a test run's pytest-xdist
    processes): the first caller starts it and leaves it running, the others attach to it.
    Whoever owns ``directory`` stops it with :func:`stop_shared_node` once they all ended.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file is closed)
        if (directory / STATE).exists():
            server = RabbitMQServer.attach(directory)
            if server.running():
                return server
            server.stop()  # (a node that died: its epmd may still run)
        server = RabbitMQServer(directory).start()
        server.detach()
        return server


def stop_shared_node(directory: Path) -> None:
    """Stop the node :func:`shared_node` started in ``directory``, if it did."""
    if (directory / STATE).exists():
        RabbitMQServer.attach(directory).stop()


class _PortTaken(RuntimeError):
    """Another process holds a port the node or its epmd was to listen on."""


def _connection_start(port: int) -> bytes | None:
    """The server's Connection.Start frame on 127.0.0.1:``port``, or None while nothing
    answers AMQP there. (The connection is closed right after: the server logs that.)"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(PROTOCOL_HEADER)
            data = b""
            while len(data) < 7 or len(data) < 8 + struct.unpack(">I", data[3:7])[0]:
                more = sock.recv(65536)
                if not more:
                    return None
                data += more
    except OSError:
        return None
    return data if data[:1] == b"\x01" else None  # (a METHOD frame)


def _port_answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _start_time(pid: int) -> str | None:
    """The process's start time (tells a process from a later one that reuses its PID)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # (a zombie has exited)


def _alive(pid: int, started: str) -> bool:
    return _start_time(pid) == started


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """The TCP sockets ``pid`` listens on, as (address, port), read from /proc."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in _lines(Path(f"/proc/{pid}/net/{table}")):
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            found.add((_address(address, family), int(port, 16)))
    return found


def _lines(path: Path) -> Iterator[str]:
    with contextlib.suppress(OSError):
        yield from path.read_text().splitlines()[1:]


def _address(hex_address: str, family: int) -> str:
    """/proc/net/tcp's address (32-bit words in host order) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)
