"""Stopping a task body whose lease is lost, per worker pool.

* The body runs in a process's main thread (prefork child, solo pool): a ``SIGUSR1`` sent to the
  main thread runs our handler there, which raises :class:`LeaseInterrupt`; it interrupts a
  blocking sleep or socket wait too. The handler is installed once per process (re-installed if
  something replaced it) and passes any ``SIGUSR1`` that is not ours (billiard's soft time
  limit, Celery's "cry" handler) to the handler it replaced.
* The body runs in another thread (threads pool): an asynchronous exception
  (``PyThreadState_SetAsyncExc``), raised at the thread's next bytecode. It cannot break a
  blocking C call, so long waits should call ``lease.check()``.
* gevent: the body greenlet's hub runs a callback (``run_callback_threadsafe``, so the renewer
  may be a greenlet or a real thread) that throws :class:`LeaseInterrupt` into the body only
  if it is still armed and not inside a shielded store call: so ``disarm()`` absorbs an
  interrupt that was sent but not yet delivered, and it never lands in the release.

Disarming waits for an interrupt that is already on its way, so it can never land in the code
that runs after the body (release, result storage).

:class:`LeaseInterrupt` is a ``BaseException`` (as ``asyncio.CancelledError`` is since Python
3.8), so the ordinary ``except Exception:`` of a retry loop does not swallow it. A body that
swallows it anyway (a bare ``except:``) gets it again from its next ``lease.check()``, store call
or fenced write (:func:`raise_if_interrupted`): it is sent once, but never forgotten while the
body runs.

Store calls made by the body (``lease.guard()``, effects, checkpoints, a FenceGate) run inside
:func:`shielded`: an interrupt that arrives meanwhile is held back and raised when the call
returns, so it never leaves a driver connection in the middle of a command.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
import ctypes
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

__all__ = ["Interrupter", "LeaseInterrupt", "raise_if_interrupted", "shielded"]

_SIGNAL = getattr(signal, "SIGUSR1", None)
_local = threading.local()  # .interrupter: the armed Interrupter of this thread's body
_main: Interrupter | None = None  # the armed Interrupter of the main thread (signal mode)
_replaced: Any = None  # the SIGUSR1 handler our dispatcher stands in front of


def _dispatch(signum: int, frame: FrameType | None) -> None:
    interrupter = _main
    if interrupter is not None and interrupter._pending:
        interrupter._on_signal(signum, frame)
        return
    if callable(_replaced):
        _replaced(signum, frame)


def _install_dispatcher() -> None:
    """Put our SIGUSR1 dispatcher in place (main thread only; cheap when it already is)."""
    global _replaced  # noqa: PLW0603 - one handler per process
    current = _signal.getsignal(_SIGNAL)  # the raw handler, without signal's enum wrapping
    if current is not _dispatch:
        _replaced = current
        signal.signal(_SIGNAL, _dispatch)  # type: ignore[arg-type]


class LeaseInterrupt(BaseException):  # named like KeyboardInterrupt: no "Error", on purpose
    """Raised inside a task body to stop it because its lease was lost.

    A ``BaseException``, not an ``Exception`` (like ``asyncio.CancelledError`` and
    ``KeyboardInterrupt``): a retry loop's ``except Exception:`` around a flaky call must not
    swallow it and go on acting without the lease. Catch it only to clean up, then re-raise;
    if it is swallowed, the body's next ``lease.check()``, store call or fenced write raises it
    again. The task turns it into the recorded :class:`LeaseLostError` (resource, fence,
    holder, reason) and a retry; the lease's ``lost`` names the cause.
    """

    def __init__(self, message: str = "the lease was lost", *details: Any) -> None:
        super().__init__(message, *details)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def eventlet_patched() -> bool:
    """Whether eventlet monkey-patched this process (the eventlet pool, which we refuse).

    Under eventlet every green thread runs in the main thread, so neither a signal nor an
    asynchronous exception would reach the right task body.
    """
    patcher = sys.modules.get("eventlet.patcher")
    is_patched = getattr(patcher, "is_monkey_patched", None)
    return bool(is_patched is not None and is_patched("thread"))


def gevent_patched() -> bool:
    """Whether gevent monkey-patched threading here (greenlets share one OS thread)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))


def _gevent_current() -> tuple[Any, Any] | None:
    """(the current greenlet, its thread's hub) when gevent patched threading, else None."""
    gevent = sys.modules.get("gevent")
    if gevent is None or not gevent_patched():
        return None
    return gevent.getcurrent(), gevent.get_hub()


class Interrupter:
    """Interrupts the body running in the thread (or greenlet) that created it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._fire = False
        self._pending = False
        self._shield = 0
        self._deferred = False
        self._delivered = False  # sent (or raised after a shield) since arm(): never forgotten
        self._thread = threading.current_thread()
        green = _gevent_current()
        self._greenlet: Any = None if green is None else green[0]
        self._hub: Any = None if green is None else green[1]
        if green is not None:
            self.mode = "gevent"
        elif _SIGNAL is not None and self._thread is threading.main_thread():
            self.mode = "signal"
        else:
            self.mode = "async-exception"

    def arm(self) -> None:
        """Allow interrupts from now on (call in the body's thread, before the body)."""
        global _main  # noqa: PLW0603
        if self.mode == "signal":
            _install_dispatcher()
            _main = self
        with self._lock:
            self._armed = True
            self._fire = False
            self._deferred = False
            self._delivered = False
        _local.interrupter = self

    def disarm(self) -> None:
        """Forbid interrupts and absorb one already sent (call in the body's thread).

        An interrupt sent just before can still land while this runs; it is absorbed here, and
        the caller learns of the loss from ``lease.lost``.
        """
        if getattr(_local, "interrupter", None) is self:
            _local.interrupter = None
        while True:
            try:
                self._fire = False
                with self._lock:
                    self._armed = False
                    self._fire = False
                    self._deferred = False
                    self._delivered = False
                if self.mode == "signal":
                    # A signal already sent is handled at the next bytecode boundary of this
                    # thread; let it arrive while this (now disarmed) interrupter is current.
                    for _ in range(1000):
                        if not self._pending:
                            break
                        time.sleep(0)
                    self._release_main()
                elif self.mode == "async-exception":
                    _set_async_exc(self._thread.ident, None)  # drop one not yet raised
                return
            except LeaseInterrupt:
                continue

    def interrupt(self) -> bool:
        """Interrupt the body once, if armed (from any thread). Returns whether it was sent."""
        with self._lock:
            if not self._armed or self._fire or self._deferred:
                return False
            if self._shield:
                self._deferred = True  # raised by the body's thread when the store call ends
                return True
            self._fire = True
            self._delivered = True
            if self.mode == "signal":
                self._pending = True
                signal.pthread_kill(self._thread.ident or 0, _SIGNAL)  # type: ignore[arg-type]
            elif self.mode == "gevent":
                # Not greenlet.kill(): a kill already scheduled cannot be taken back, so it
                # landed after disarm(), inside the release. _deliver checks first.
                self._hub.loop.run_callback_threadsafe(self._deliver)
            else:
                _set_async_exc(self._thread.ident, LeaseInterrupt)
            return True

    def _deliver(self) -> None:
        """gevent: throw the interrupt into the body greenlet if it still wants it (in the hub).

        Runs in the hub, between greenlets, so the body is not inside a critical section of
        this object; no lock is taken (the hub must never block on one).
        """
        if not (self._armed and self._fire):
            return  # disarmed meanwhile (the body ended) or taken back by a re-raise
        if self._shield:
            self._fire = False
            self._deferred = True  # inside a store call: raised when it returns
            return
        if self._greenlet is not None and not self._greenlet.dead:
            self._greenlet.throw(LeaseInterrupt)

    def _release_main(self) -> None:
        global _main  # noqa: PLW0603
        if _main is self:
            _main = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No lock here: the handler runs in the body's thread, which may hold it.
        if self._pending:
            self._pending = False
            if self._fire:
                self._fire = False
                if self._shield:  # inside a store call: raise when it returns
                    self._deferred = True
                    return
                raise LeaseInterrupt("the lease was lost")

    # -- shielding store calls (called in the body's thread) -----------------------------------
    def _enter_shield(self) -> None:
        with self._lock:
            self._shield += 1
            if self._fire and self.mode == "async-exception":
                # Sent but perhaps not raised yet: take it back and raise it after the call.
                _set_async_exc(self._thread.ident, None)
                self._fire = False
                self._deferred = True

    def _exit_shield(self) -> None:
        with self._lock:
            self._shield -= 1
            raise_now = self._deferred and self._shield == 0 and self._armed
            if raise_now:
                self._deferred = False
                self._fire = True  # counts as delivered: no second interrupt
                self._delivered = True
        if raise_now:
            raise LeaseInterrupt("the lease was lost")

    def _raise_again(self) -> None:
        """Raise the interrupt once more if the body swallowed it (in the body's thread).

        Not while it is still on its way out: a ``finally`` or ``except`` clause that cleans up
        (closes a connection, rolls back) while the interrupt propagates must be able to make
        its store calls, or the cleanup is skipped (a transaction left open holds its locks).
        """
        if _propagating():
            return
        with self._lock:
            if not (self._armed and self._delivered):
                return
            # One still on its way (an async exception not raised yet, a signal not handled
            # yet) is taken back: this raise stands for it.
            if self._fire and self.mode == "async-exception":
                _set_async_exc(self._thread.ident, None)
            self._fire = False
        raise LeaseInterrupt(
            "the lease was lost (raised again: the body went on after the first interrupt)"
        )


def _propagating() -> bool:
    """Whether a LeaseInterrupt is being handled here (in an except or finally clause), also
    as the context of another exception raised while handling it."""
    exc: BaseException | None = sys.exc_info()[1]
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, LeaseInterrupt):
            return True
        exc = exc.__context__
        seen += 1
    return False


def raise_if_interrupted() -> None:
    """Raise :class:`LeaseInterrupt` if this thread's body was interrupted and went on.

    Called by ``lease.check()``, by every store call the body makes (:class:`shielded`) and by
    the fenced helpers, so a body that swallowed the interrupt stops at its next contact with
    the lease or a side effect. Cheap when nothing was interrupted.
    """
    interrupter: Interrupter | None = getattr(_local, "interrupter", None)
    if interrupter is not None and interrupter._delivered:
        interrupter._raise_again()


class shielded:
    """Hold back a lease interrupt of this thread's body until the enclosed store call ends."""

    __slots__ = ("interrupter",)

    def __enter__(self) -> None:
        interrupter: Interrupter | None = getattr(_local, "interrupter", None)
        self.interrupter = interrupter
        if interrupter is not None:
            if interrupter._delivered:  # swallowed by the body: no store call without a lease
                interrupter._raise_again()
            interrupter._enter_shield()

    def __exit__(self, exc_type: object = None, exc: object = None, tb: object = None) -> None:
        if self.interrupter is not None:
            self.interrupter._exit_shield()


def _set_async_exc(thread_id: int | None, exc: type[BaseException] | None) -> None:
    if thread_id is None:
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )
