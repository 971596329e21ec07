"""The Redis store's connection layer: clients, connections, scripts, and driver errors.

Everything that touches redis-py lives here: the client a URL names, the free lists of
connections each command takes (:class:`Connections`), the Lua scripts sent by SHA
(:class:`Script`), and :class:`Translate`, the one place where a driver exception becomes a
:class:`LeaseStoreError`.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import LeaseConfigError, LeaseStoreError
from ..._interrupt import shielded
from ..._names import mask_url
from .._connections import FreeList, Once
from ..base import connection_refused

try:
    import redis
    import redis.cluster
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "RedisLeaseStore needs the redis package: pip install 'celery-lease[redis]'"
    ) from exc

try:  # hiredis packs a command in C; redis-py's own packer walks the arguments in Python
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - depends on the install
    _pack_command = None  # type: ignore[assignment]

__all__ = [
    "DRIVER_ERRORS",
    "Connections",
    "Script",
    "Translate",
    "connect",
    "describe",
    "redis",
]

# A new connection sends nothing before its first command. Otherwise redis-py (8.x) opens each
# one with HELLO, CLIENT MAINT_NOTIFICATIONS and two CLIENT SETINFO: four round trips that a
# reconnect, or the renewer's first call, cannot spare on a slow link (at a round trip of a
# quarter of the ttl they took the whole renewal window). RESP2 needs no HELLO and has no
# maintenance notifications; the scripts' replies read the same in both protocols.
_LEAN_CONNECT: dict[str, Any] = {"protocol": 2}
_LEAN_CONNECT.update(
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)

# redis-py's cluster client raises RedisClusterException (not a RedisError) for, e.g., slots
# no node serves.
DRIVER_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)

# The client pool's limit for a client the store creates: far above what the free lists keep.
_MAX_CONNECTIONS = 10_000
# Most EVALSHA heads a Connections keeps packed (scripts x shards x the fixed arguments' values,
# small renewal batches), and the most keys a kept head has: a large renewal batch's keys
# differ from call to call and are packed whole, never kept.
_MAX_HEADS = 1024
_HEAD_KEYS = 12  # a claim has 9


class Translate(shielded):
    """Context manager turning redis errors into LeaseStoreError (cheaper than a generator).

    A :class:`shielded` itself (its ``__enter__``): a lease interrupt waits until the call
    returns; one object and one call less per store call than holding one.
    """

    __slots__ = ("subject", "url", "what")

    def __init__(self, url: str, what: str, subject: object) -> None:
        self.url, self.what, self.subject = url, what, subject

    def __exit__(self, exc_type: object = None, exc: object = None, tb: object = None) -> None:
        shielded.__exit__(self)
        if exc is not None and isinstance(exc, DRIVER_ERRORS):
            what = self.what % self.subject if self.subject is not None else self.what
            if connection_refused(exc):
                raise LeaseStoreError(
                    f"Redis lease store {self.url} refused the connection during {what} "
                    f"({type(exc).__name__}: {exc}): nothing was sent; the server is down or "
                    "not listening at that address",
                    True,
                ) from exc
            raise LeaseStoreError(
                f"Redis lease store {self.url} failed during {what}: "
                f"{type(exc).__name__}: {exc}; the outcome is unknown"
            ) from exc


class Script:
    """A Lua script of one store: EVALSHA, loading it once when the server lacks it.

    Sent on a connection of the store's free list (see :class:`Connections`) rather than
    through redis-py's client layer, which cost more CPU per call than the round trip itself.
    """

    __slots__ = ("connections", "sha", "source")

    def __init__(self, connections: Connections, source: str) -> None:
        self.connections = connections
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    def __call__(
        self,
        keys: Sequence[str],
        args: Sequence[Any],
        via: Connections | None = None,
        meanwhile: Callable[[], None] | None = None,
        fixed: tuple[Any, ...] = (),
    ) -> Any:
        """Run the script; ``meanwhile`` (called once) runs while its reply is awaited.

        ``fixed``: the script's first arguments, sent before ``args``: values that are the same
        call after call (a store's settings), packed once with the keys (see
        :meth:`Connections.evalsha`).
        """
        connections = self.connections if via is None else via
        once = Once(meanwhile) if meanwhile is not None else None
        try:
            return connections.evalsha(self.sha, keys, args, once, fixed)
        except redis.exceptions.NoScriptError:
            # The server lost its script cache (a restart). SCRIPT LOAD + EVALSHA, not EVAL:
            # the least-privilege ACL grants evalsha and script|load only.
            self.load(connections)
            return connections.evalsha(self.sha, keys, args, once, fixed)
        finally:
            if once is not None:
                once()  # (the call failed before it was sent: run it all the same)

    def load(self, via: Connections | None = None) -> None:
        """Make sure the server has the script (one round trip)."""
        self.sha = (self.connections if via is None else via).load_script(self.source)


class Connections:
    """Connections of the client's pool, taken from a free list for each command.

    Each command takes the most recently used idle connection (or opens one) and gives it back
    when its reply is read, so a process holds no more connections than it has commands in flight
    at its busiest (at most ``MAX_IDLE`` of them idle), under every pool, gevent included (see
    :mod:`._connections`). A connection that fails or is interrupted mid-command is disconnected,
    never reused with a reply pending; a connection error also closes the idle ones (the server
    likely restarted) and is tried once more on a fresh connection (every store operation is
    safe to repeat). For clients without a plain connection pool (Redis Cluster, sentinels),
    commands go through the client, which takes a connection from its pool per command.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        pool = getattr(client, "connection_pool", None)
        self.pool = pool if isinstance(pool, redis.ConnectionPool) else None
        self.free: FreeList[Any] = FreeList(self._open, self._close)
        # hiredis encodes text as UTF-8: use it only when the client would do the same.
        kwargs = self.pool.connection_kwargs if self.pool is not None else {}
        encoding = str(kwargs.get("encoding", "utf-8")).lower().replace("_", "-")
        self.pack = _pack_command if encoding in ("utf-8", "utf8") else None
        #: (sha, keys) -> "EVALSHA sha numkeys keys..." packed, without the count line.
        self._heads: dict[tuple[Any, ...], tuple[int, bytes]] = {}

    def evalsha(
        self,
        sha: str,
        keys: Sequence[str],
        args: Sequence[Any],
        meanwhile: Callable[[], None] | None = None,
        fixed: tuple[Any, ...] = (),
    ) -> Any:
        """``EVALSHA sha len(keys) *keys *fixed *args``.

        With hiredis, the command's head (up to the keys and the ``fixed`` arguments: the same
        few per script, shard and store settings) is packed once and kept, and only ``args``
        are packed per call: hiredis formats each argument's length with sprintf (about 1.6k
        instructions per argument, callgrind), and a claim's 21 arguments cost more to pack
        than the rest of the call. The bytes sent are the same as packing the whole command.

        ``meanwhile`` runs once the command is sent, before its reply is read (before the
        command, through a client without a plain connection pool); a connection tried again
        does not run it again when it is a :class:`Once`.
        """
        pack = self.pack
        if self.pool is None or pack is None or len(keys) > _HEAD_KEYS:
            return self._call(("EVALSHA", sha, len(keys), *keys, *fixed, *args), None, meanwhile)
        # (fixed as one item: a key and a fixed argument are never mistaken for each other)
        cache_key = (sha, *keys, fixed) if fixed else (sha, *keys)
        head = self._heads.get(cache_key)
        if head is None:
            head_command: tuple[Any, ...] = ("EVALSHA", sha, len(keys), *keys, *fixed)
            packed = pack(head_command)
            head = (len(head_command), packed[packed.index(b"\r\n") + 2 :])
            if len(self._heads) < _MAX_HEADS:
                self._heads[cache_key] = head
        return self._call(tuple(args), head, meanwhile)

    def execute(self, *command: Any) -> Any:
        return self._call(command, None)

    def _call(
        self,
        command: tuple[Any, ...],
        head: tuple[int, bytes] | None,
        meanwhile: Callable[[], None] | None = None,
    ) -> Any:
        """Send ``command`` and read its reply; with ``head`` (see :meth:`evalsha`), ``command``
        is what follows the packed head; ``meanwhile`` runs between the two."""
        if self.pool is None:
            if meanwhile is not None:
                meanwhile()
            return self.client.execute_command(*command)
        first: redis.exceptions.ConnectionError | None = None
        free = self.free
        for attempt in (1, 2):
            try:
                conn = free.get()
            except redis.exceptions.ConnectionError:
                if first is None or connection_refused(first):
                    raise
                # Refused now, but the first attempt may have reached the server: its error
                # (the outcome is unknown) is the one to report, not "refused".
                raise first from None
            try:
                if head is not None:
                    assert self.pack is not None
                    tail = self.pack(command)  # "*n\r\n" then the arguments
                    packed = b"*%d\r\n%b%b" % (
                        head[0] + len(command),
                        head[1],
                        tail[tail.index(b"\r\n") + 2 :],
                    )
                    conn.send_packed_command((packed,), check_health=False)
                elif self.pack is not None:
                    conn.send_packed_command((self.pack(command),), check_health=False)
                else:
                    conn.send_command(*command)
                if meanwhile is not None:
                    meanwhile()
                reply = conn.read_response()
            except redis.exceptions.ResponseError:
                free.put(conn)  # a reply was read: the connection is in a clean state
                raise
            except redis.exceptions.ConnectionError as exc:
                free.discard(conn)
                free.clear()
                if attempt == 2:
                    if (
                        first is not None
                        and connection_refused(exc)
                        and not connection_refused(first)
                    ):
                        raise first from None  # (as above)
                    raise
                first = exc
                continue
            except BaseException:
                free.discard(conn)
                raise
            free.put(conn)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def load_script(self, source: str) -> str:
        """Load a script (on every primary of a cluster); returns its SHA1."""
        if self.pool is None:
            sha = self.client.script_load(source)  # the client routes it to every primary
        else:
            sha = self.execute("SCRIPT", "LOAD", source)
        return sha.decode() if isinstance(sha, bytes) else str(sha)

    def _open(self) -> Any:
        assert self.pool is not None
        return self.pool.get_connection()

    def _close(self, conn: Any) -> None:
        assert self.pool is not None
        conn.disconnect()
        self.pool.release(conn)

    def close(self) -> None:
        if self.pool is not None:
            self.free.close()


def connect(url: str, *, cluster: bool, socket_timeout: float, password: str | None) -> Any:
    """A client for ``url`` (a ``redis.Redis``, or a ``RedisCluster`` with ``cluster=True``).

    Raises:
        LeaseConfigError: the URL does not parse (its password masked).
        LeaseStoreError: a cluster's nodes could not be reached for the slot map.
    """
    client: Any
    auth = {} if password is None else {"password": password}
    try:
        if cluster:
            client = redis.cluster.RedisCluster.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                **auth,
            )
        else:
            client = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                # One immediate reconnect covers a connection the server dropped; more
                # retries would stall renewal past the self-fence deadline.
                retry=Retry(NoBackoff(), 1),
                # The store's free lists bound its connections (idle and in flight);
                # the pool's own limit (100 by default) would only make a burst fail.
                max_connections=_MAX_CONNECTIONS,
                **_LEAN_CONNECT,
                **auth,
            )
    except ValueError as exc:
        # redis-py's message may quote a piece of a password that holds an unencoded
        # '/', '?' or '#' (as the "port"): show it only for a URL without a password.
        detail = str(exc) if mask_url(url) == url else "the URL does not parse"
        raise LeaseConfigError(
            f"bad Redis URL {mask_url(url)}: {detail}; expected redis://host:port/db, "
            "rediss://... or unix:///path/to/socket (percent-encode '/', '?', '#', '%' "
            "in a password: urllib.parse.quote(password, safe=''))"
        ) from None
    except DRIVER_ERRORS as exc:  # a cluster client asks its nodes for the slot map
        raise LeaseStoreError(
            f"could not reach the Redis cluster at {mask_url(url)}: {type(exc).__name__}: {exc}",
            connection_refused(exc),  # (nothing was sent: only the slot map was asked)
        ) from exc
    return client


def describe(client: Any) -> str:
    """Where a client given to the store connects, for messages (no password)."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_default_node()  # type: ignore[no-untyped-call]
        return f"redis://{node.host}:{node.port}/0 (cluster)"
    kwargs = client.connection_pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
    return f"redis://{where}/{kwargs.get('db', 0)}"
