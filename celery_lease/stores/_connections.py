"""Idle connections of a store, shared by every thread and greenlet of the process.

A store takes a connection for each call and gives it back when the call ends. Caching one per
thread looks the same under the prefork, solo and threads pools, but under gevent a
``threading.local`` is per greenlet, and Celery's gevent pool runs every task in a new greenlet:
each task opened a connection of its own (redis-py's pool ran out after 100 tasks; PostgreSQL
paid a new session per task). With a :class:`FreeList` the connections open at any moment are at
most the calls in flight at the busiest moment so far, of which at most ``max_idle`` stay open
once idle.

* Last in, first out: the connection used most recently is warm (its socket buffers, the
  server's per-connection state) and the ones at the bottom may be closed as surplus.
* Forks: a connection opened by the parent is never used by a forked child (two processes on
  one socket interleave their replies) and never closed by it either (that would close the
  parent's session on the server): the child forgets them and opens its own.
* A connection that failed, or whose call was interrupted mid-command, may have a reply pending:
  it is discarded, never given back.

Setting :data:`PER_THREAD` brings the old cache back (one connection per thread or greenlet,
kept for its lifetime): the tests' negative control, not a configuration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .._pid import getpid

__all__ = ["MAX_IDLE", "PER_THREAD", "FreeList", "Once"]

C = TypeVar("C")

#: Idle connections a free list keeps open; a connection given back beyond that is closed.
MAX_IDLE = 64

#: The negative control of the connection tests: one connection per thread (per greenlet under
#: gevent), never given back, as before free lists. Read at every call.
PER_THREAD = False


class FreeList(Generic[C]):
    """A stack of idle connections: :meth:`get` one per call, then :meth:`put` or :meth:`discard`.

    Safe to use from any number of threads or greenlets: ``list.append`` and ``list.pop`` are
    atomic, and no call blocks (an empty list opens a new connection), so a free list never
    makes a call wait behind another.

    Args:
        connect: opens a new connection (may raise the driver's errors).
        close: closes a connection for good; it must not raise.
        max_idle: idle connections kept open.
    """

    __slots__ = ("_close", "_connect", "_idle", "_local", "_pid", "max_idle")

    def __init__(
        self,
        connect: Callable[[], C],
        close: Callable[[C], None],
        *,
        max_idle: int = MAX_IDLE,
    ) -> None:
        self._connect = connect
        self._close = close
        self.max_idle = max_idle
        self._idle: list[C] = []
        self._pid = getpid()
        self._local = threading.local()  # only with PER_THREAD

    def get(self) -> C:
        """An idle connection (the most recently used), or a new one."""
        if PER_THREAD:
            return self._thread_connection()
        if self._pid != getpid():
            self._forget()
        try:
            return self._idle.pop()
        except IndexError:
            return self._connect()

    def put(self, conn: C) -> None:
        """Give back a connection whose call ended cleanly (no reply pending)."""
        if PER_THREAD:
            return  # it stays this thread's
        if self._pid != getpid():
            return  # the parent's, taken before a fork: never reused by the child
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            self._close(conn)

    def discard(self, conn: C) -> None:
        """Close a connection that failed or was interrupted mid-call instead of giving it back."""
        if PER_THREAD and getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        if self._pid == getpid():
            self._close(conn)

    def clear(self) -> None:
        """Close every idle connection: a connection error suggests they are all dead (the
        server restarted), and a call retried on one of them would fail again."""
        if PER_THREAD:
            self._local = threading.local()
            return
        if self._pid != getpid():
            self._forget()
            return
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return
            self._close(conn)

    close = clear

    def idle(self) -> int:
        """How many idle connections are kept (for tests and metrics)."""
        return 0 if self._pid != getpid() else len(self._idle)

    def _forget(self) -> None:
        """In a forked child: drop the parent's connections without closing them."""
        self._idle = []
        self._local = threading.local()
        self._pid = getpid()

    def _thread_connection(self) -> C:
        conn: C | None = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != getpid():
            conn = self._connect()
            self._local.conn, self._local.pid = conn, getpid()
        return conn


class Once:
    """A callable that runs ``fn`` on its first call only: a release's ``meanwhile``, which a
    store may reach twice (a call tried again on a fresh connection, or in another form)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
