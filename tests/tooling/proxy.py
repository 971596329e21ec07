"""A loopback TCP proxy that injects network faults between a client and a store.

``tc netem`` and toxiproxy are not available here, so the tests put this proxy between a client
(a Celery worker, a store) and a real server and break the path on demand::

    with TcpProxy(redis_port) as proxy:
        store = RedisLeaseStore(url=proxy.url_for(redis_url), socket_timeout=0.5)
        proxy.blackhole()      # a partition: nothing moves either way, nothing is closed
        proxy.heal()           # traffic flows again
        proxy.set_latency(0.2) # every chunk waits 0.2 s in each direction (RTT + 0.4 s)
        proxy.reset_all()      # every connection is closed abruptly (RST), like a dead peer
        proxy.lose_replies(1)  # the next reply is dropped and its connection reset

One background thread runs a ``selectors`` loop over the listener and every connection pair; the
control methods hand their work to that thread and wait until it is done, so when
``blackhole()`` returns no further byte is forwarded, and when ``reset_all()`` returns every
connection is gone. ``stop()`` closes every socket and joins the thread.

Faults:

* ``blackhole()`` stalls: the proxy stops reading and writing, so bytes wait in the kernel
  buffers as they would in a partition that TCP retransmits across. After ``heal()`` they are
  delivered late (a request the client gave up on may still reach the server: exactly the
  "outcome unknown" case a store must survive). New connections are accepted and held; their
  upstream connection is made at heal time.
* ``blackhole(drop=True)`` reads and discards instead; connections that lost bytes have a
  corrupt stream, so ``heal()`` resets them and only untouched ones carry on.
* ``set_latency(seconds)`` delays each forwarded chunk by ``seconds`` one way, keeping order.
* ``reset_all()`` closes both sides of every connection with ``SO_LINGER 0`` (a TCP RST).
* ``lose_replies(n)``: the next ``n`` chunks the server sends are dropped and their connection
  reset, so the request did reach the server and run there but the client never hears back
  (the "lost reply" a store's own retry must survive). ``replies_lost`` counts them.

Only loopback targets are accepted: the tests never send traffic off the machine.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["TcpProxy"]

_CHUNK = 65536
_MAX_PENDING = 4 * 1024 * 1024  # stop reading a side while this much waits to go the other way


class _Side:
    """One socket of a connection pair, with the chunks waiting to be written *to* it."""

    __slots__ = ("eof", "outbox", "outbox_bytes", "sock")

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock
        self.eof = False
        self.outbox: collections.deque[tuple[float, bytes]] = collections.deque()
        self.outbox_bytes = 0


class _Pair:
    """A client connection and its upstream connection."""

    __slots__ = ("client", "damaged", "upstream")

    def __init__(self, client: socket.socket) -> None:
        self.client = _Side(client)
        self.upstream = _Side(None)
        self.damaged = False  # bytes were dropped: the stream can never be trusted again

    def sides(self) -> tuple[tuple[_Side, _Side], tuple[_Side, _Side]]:
        """(source, destination) for both directions."""
        return ((self.client, self.upstream), (self.upstream, self.client))


class TcpProxy:
    """Forward 127.0.0.1:<free port> to 127.0.0.1:``target_port``, with injectable faults.

    Args:
        target_port: the server's port.
        target_host: the server's address; must be a loopback address.
        connect_timeout: seconds to wait for the upstream connection of a new client.
    """

    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", *, connect_timeout: float = 2.0
    ) -> None:
        if not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError(f"TcpProxy only forwards to loopback addresses, not {target_host!r}")
        self.target = (target_host, int(target_port))
        self.connect_timeout = connect_timeout
        self.port = 0
        self.accepted = 0  #: connections accepted since start
        self._pairs: list[_Pair] = []
        self._blackholed = False
        self._drop = False
        self._latency = 0.0
        self._lose_replies = 0
        self.replies_lost = 0  #: server replies dropped by lose_replies()
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._stopping = False
        self.error: BaseException | None = None  #: what killed the loop, if anything did

    # -- public API -----------------------------------------------------------------------
    def start(self) -> TcpProxy:
        if self._thread is not None:
            raise RuntimeError("TcpProxy already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._loop, name=f"TcpProxy:{self.port}->{self.target[1]}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close every socket and join the loop thread (idempotent)."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            self._call(self._request_stop)
            thread.join(10)
        if thread.is_alive():  # pragma: no cover - would be a bug in the loop
            raise RuntimeError("TcpProxy thread did not stop")
        self._thread = None
        self._close_everything()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by this proxy's (user, password kept)."""
        parts = urlsplit(url)
        userinfo, _, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}@" if userinfo else ""
        return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{self.port}"))

    def blackhole(self, *, drop: bool = False) -> None:
        """Stop all traffic both ways on existing and new connections without closing them."""

        def apply() -> None:
            self._blackholed = True
            self._drop = drop

        self._call(apply)

    def heal(self) -> None:
        """Let traffic flow again (stalled bytes go out now; dropped-into streams are reset)."""

        def apply() -> None:
            self._blackholed = False
            self._drop = False
            for pair in list(self._pairs):
                if pair.damaged:
                    self._close_pair(pair, reset=True)
                elif pair.upstream.sock is None:
                    self._connect_upstream(pair)
            for pair in list(self._pairs):  # a side that hung up during the blackhole
                self._maybe_finish(pair)

        self._call(apply)

    def reset_all(self) -> None:
        """Close both sides of every connection abruptly (RST); new connections work."""

        def apply() -> None:
            for pair in list(self._pairs):
                self._close_pair(pair, reset=True)

        self._call(apply)

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk forwarded from now on by ``seconds`` in each direction."""
        if seconds < 0:
            raise ValueError("latency must be >= 0")

        def apply() -> None:
            self._latency = float(seconds)

        self._call(apply)

    def lose_replies(self, count: int = 1) -> None:
        """Drop the next ``count`` chunks sent by the server and reset their connections."""
        if count < 0:
            raise ValueError("count must be >= 0")

        def apply() -> None:
            self._lose_replies = int(count)

        self._call(apply)

    @property
    def connections(self) -> int:
        """How many client connections are open through the proxy right now."""
        return int(self._call(lambda: len(self._pairs)))

    @property
    def blackholed(self) -> bool:
        return self._blackholed

    # -- control plumbing -----------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread (or here when the loop is not running) and wait."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            if self.error is not None:
                raise RuntimeError("TcpProxy loop died") from self.error
            return fn()
        done = threading.Event()
        box: list[Any] = []
        self._calls.put((fn, box, done))
        self._wake()
        if not done.wait(10):
            raise RuntimeError("TcpProxy loop did not answer within 10 s")
        if box and isinstance(box[0], BaseException):
            raise box[0]
        return box[0] if box else None

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is not None:
            with contextlib.suppress(OSError):  # full (already woken) or closed
                wake.send(b"x")

    def _request_stop(self) -> None:
        self._stopping = True

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._run_calls()
                if self._stopping:
                    break
                timeout = self._register()
                assert self._selector is not None
                for key, events in self._selector.select(timeout):
                    self._dispatch(key.data, key.fileobj, events)  # type: ignore[arg-type]
                self._run_calls()
        except BaseException as exc:  # pragma: no cover - reported through self.error
            self.error = exc
        finally:
            self._stopping = True
            self._close_everything()
            self._run_calls()  # release any waiter

    def _run_calls(self) -> None:
        while True:
            try:
                fn, box, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                box.append(fn())
            except Exception as exc:
                box.append(exc)
            finally:
                done.set()

    def _register(self) -> float | None:
        """Set every socket's interest for this turn; return the select timeout."""
        selector = self._selector
        assert selector is not None and self._listener is not None and self._wake_r is not None
        wanted: dict[socket.socket, tuple[int, Any]] = {
            self._wake_r: (selectors.EVENT_READ, "wake"),
            self._listener: (selectors.EVENT_READ, "listen"),
        }
        now = time.monotonic()
        timeout: float | None = None
        flowing = not self._blackholed
        for pair in self._pairs:
            for src, dst in pair.sides():
                if src.sock is None:
                    continue
                events = 0
                can_read = not src.eof and (
                    (flowing and dst.outbox_bytes < _MAX_PENDING)
                    or (self._blackholed and self._drop)
                )
                if can_read:
                    events |= selectors.EVENT_READ
                if flowing and src.outbox:
                    due = src.outbox[0][0]
                    if due <= now:
                        events |= selectors.EVENT_WRITE
                    else:
                        timeout = due - now if timeout is None else min(timeout, due - now)
                if events:
                    wanted[src.sock] = (events, pair)
        registered = selector.get_map()
        for fileobj in [key.fileobj for key in registered.values()]:
            if fileobj not in wanted:
                selector.unregister(fileobj)
        for sock, (events, data) in wanted.items():
            key = registered.get(sock)
            if key is None:
                selector.register(sock, events, data)
            elif key.events != events or key.data is not data:
                selector.modify(sock, events, data)
        return timeout

    def _dispatch(self, data: Any, sock: socket.socket, events: int) -> None:
        if data == "wake":
            with contextlib.suppress(OSError):
                while sock.recv(4096):
                    pass
            return
        if data == "listen":
            self._accept()
            return
        pair: _Pair = data
        if pair not in self._pairs:  # closed earlier in this turn
            return
        side = pair.client if sock is pair.client.sock else pair.upstream
        other = pair.upstream if side is pair.client else pair.client
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(side)
            if events & selectors.EVENT_READ:
                self._read(pair, side, other)
        except OSError:
            self._close_pair(pair, reset=True)
            return
        self._maybe_finish(pair)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.accepted += 1
            pair = _Pair(client)
            self._pairs.append(pair)
            if not self._blackholed:
                self._connect_upstream(pair)

    def _connect_upstream(self, pair: _Pair) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=self.connect_timeout)
        except OSError:  # the server is down: the client sees its connection reset
            self._close_pair(pair, reset=True)
            return
        upstream.setblocking(False)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair.upstream.sock = upstream

    def _read(self, pair: _Pair, side: _Side, other: _Side) -> None:
        assert side.sock is not None
        try:
            chunk = side.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if not chunk:
            side.eof = True
            return
        if self._blackholed:  # drop mode: the bytes are lost and the stream is broken
            pair.damaged = True
            return
        if side is pair.upstream and self._lose_replies > 0:  # a reply lost on its way back
            self._lose_replies -= 1
            self.replies_lost += 1
            self._close_pair(pair, reset=True)
            return
        other.outbox.append((time.monotonic() + self._latency, chunk))
        other.outbox_bytes += len(chunk)
        if self._latency == 0:
            self._flush(other)

    @staticmethod
    def _flush(side: _Side) -> None:
        """Write the due chunks waiting for ``side`` (as much as the socket takes)."""
        if side.sock is None:
            return
        now = time.monotonic()
        while side.outbox and side.outbox[0][0] <= now:
            due, chunk = side.outbox[0]
            try:
                sent = side.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                return
            side.outbox_bytes -= sent
            if sent < len(chunk):
                side.outbox[0] = (due, chunk[sent:])
                return
            side.outbox.popleft()

    def _maybe_finish(self, pair: _Pair) -> None:
        """Close a pair once one side hung up and what it sent has been delivered."""
        if self._blackholed:
            return
        for src, dst in pair.sides():
            if src.eof and not dst.outbox:
                self._close_pair(pair, reset=False)
                return

    def _close_pair(self, pair: _Pair, *, reset: bool) -> None:
        with contextlib.suppress(ValueError):
            self._pairs.remove(pair)
        for side in (pair.client, pair.upstream):
            sock, side.sock = side.sock, None
            side.outbox.clear()
            side.outbox_bytes = 0
            if sock is None:
                continue
            if self._selector is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(sock)
            if reset:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.close()

    def _close_everything(self) -> None:
        for pair in list(self._pairs):
            self._close_pair(pair, reset=True)
        if self._selector is not None:
            with contextlib.suppress(Exception):
                self._selector.close()
            self._selector = None
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._listener = self._wake_r = self._wake_w = None
