"""Test helpers for your own suite: leased tasks without servers.

Opt in from a ``conftest.py``:

```python title="conftest.py"
pytest_plugins = ["celery_lease.testing"]
```

and take the ``lease_store`` fixture in a test: while the test runs, every lease task in the
process claims in that one in-memory store, whatever ``lease_store_url`` says (also when the
setting is missing). It works with ``task_always_eager`` and with the worker of
``celery.contrib.pytest`` / ``celery.contrib.testing.worker.start_worker`` (which runs in a
thread of the test process). Outside pytest, ``using_store(TestLeaseStore())`` does the same.

The store has the whole store API (``get``, ``list``, ``identity_get``, ``force_release``...),
and behaves as a real store does: its ``release()`` frees the resource and wakes nobody. To
release a lease the test holds and hand the resource to the task waiting for it, as production
code outside a task does, call ``celery_lease.release_lease(holder)`` (and
``celery_lease.force_release(resource)`` to evict with the hand-off). A few moves a test needs:

* ``lease_store.expire(resource)`` makes the current lease look expired, as after the holder
  crashed: the next claim is a takeover with ``previous_fence`` and the checkpoints left behind;
* ``paused_renewals()`` makes every renewal fail, so a running lease runs out at its ttl (minus
  the self-fence margin) as if the worker froze: the body is interrupted and the task retried
  (an eager run raises ``LeaseLostError``);
* ``send_twice(task, args, kwargs)`` delivers the same message twice (one task id), as a broker
  redelivery does;
* ``assert_no_stale_write_accepted(writes)`` and ``lease_store.assert_no_stale_write_accepted()``
  fail the test if a side effect accepted a write with an older fence after a newer one.

A frozen clock in your test (freezegun) does not stop, expire or extend a lease: the package
times leases with the real ``time.monotonic`` and ``time.time``, kept where freezegun does not
patch them, while your task bodies see the frozen clock like the rest of your code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._app_stores import override_store
from ._errors import LeaseLostError, LeaseStoreError
from ._lease import Lease, LeaseInfo
from ._names import validate_resource, validate_ttl
from ._settings import forget_resolved_settings
from .stores.memory import MemoryLeaseStore

__all__ = [
    "GateDecision",
    "TestLeaseStore",
    "assert_no_stale_write_accepted",
    "forget_resolved_settings",
    "paused_renewals",
    "send_twice",
    "using_store",
]


@dataclass(frozen=True)
class GateDecision:
    """One fence-gate decision: the write for ``key`` with ``fence`` was admitted or refused."""

    key: str
    fence: int
    admitted: bool
    highest: int


class TestLeaseStore(MemoryLeaseStore):
    """The in-memory store of ``celery_lease.testing``, shared by a test and its tasks.

    Args:
        **options: as ``MemoryLeaseStore`` (``clock``, ``max_ttl``, ``retention``).
    """

    __test__ = False  # not a test class, whatever pytest's name rule says

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.url = "memory://testing"
        self._given = frozenset(options)  # options given here win over the app's
        self._paused = 0
        self._pause_lock = threading.Lock()
        self.gate_log: list[GateDecision] = []

    def adopt_app_options(self, options: Mapping[str, Any]) -> None:
        """Take the options every store takes (``max_ttl``, ``retention``) from an app's settings.

        A lease task calls this with its app's ``lease_store_options`` (and ``lease_retention``)
        before it claims, so a ttl the app's real store accepts is accepted here too. Options
        given to the constructor are kept; backend options (``key_prefix``,
        ``statement_timeout``, ...) mean nothing to an in-memory store and are ignored.
        """
        for name, limit in (("max_ttl", 365 * 86400.0), ("retention", 3650 * 86400.0)):
            if name in options and name not in self._given:
                setattr(self, name, validate_ttl(options[name], limit, name=name))

    def expire(self, resource: str) -> LeaseInfo | None:
        """Make the current lease on ``resource`` look expired, as after its holder crashed.

        The fence, the identity record and the checkpoints stay: the next claim takes over
        and sees ``previous_fence`` and ``checkpoints``. A holder still running finds its
        lease lost at its next renewal. Returns the lease as it was, or None if none was live.
        """
        resource = validate_resource(resource)
        with self._lock:
            now = self._now_us()
            record = self._leases.get(resource)
            if record is None or record.expires_us <= now:
                return None
            info = record.info(resource, now)
            record.expires_us = now
            return info

    @contextlib.contextmanager
    def paused_renewals(self) -> Iterator[None]:
        """Fail every renewal in this store while the block runs (see ``paused_renewals()``)."""
        with self._pause_lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._pause_lock:
                self._paused -= 1

    def renew_many(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        if self._paused:
            raise LeaseStoreError("renewals are paused by celery_lease.testing.paused_renewals()")
        return super().renew_many(leases, ttl)

    def _gate_decided(self, key: str, fence: int, admitted: bool, highest: int) -> None:
        # Under the store lock, with the decision: logged after it, another thread's admit
        # could be logged first and the log would show an order the gate never saw.
        self.gate_log.append(GateDecision(key, int(fence), admitted, highest))

    def assert_no_stale_write_accepted(self) -> None:
        """Fail if a fence gate of this store admitted an older fence after a newer one."""
        with self._lock:
            admitted = [(d.key, d.fence) for d in self.gate_log if d.admitted]
        assert_no_stale_write_accepted(admitted)


def assert_no_stale_write_accepted(writes: Iterable[tuple[str, int] | int]) -> None:
    """Fail if a side effect accepted a write with an older fence after a newer one.

    Args:
        writes: the writes a side effect accepted, in the order it accepted them, as
            ``(key, fence)`` pairs (one order per key) or bare fences (one key).

    Raises:
        AssertionError: naming the key, the stale fence and the newer one accepted before.
    """
    newest: dict[str, int] = {}
    for number, write in enumerate(writes):
        key, fence = ("", write) if isinstance(write, int) else write
        before = newest.get(key)
        if before is not None and fence < before:
            where = f" for {key!r}" if key else ""
            raise AssertionError(
                f"write #{number} was accepted{where} with fence {fence} after fence {before}: "
                "a stale holder's write got through"
            )
        newest[key] = fence if before is None else max(before, fence)


@contextlib.contextmanager
def using_store(store: TestLeaseStore | None = None) -> Iterator[TestLeaseStore]:
    """Make every lease task in this process claim in ``store`` (a new one if omitted)."""
    store = TestLeaseStore() if store is None else store
    with override_store(store):
        yield store


@contextlib.contextmanager
def paused_renewals(store: TestLeaseStore | None = None) -> Iterator[None]:
    """While the block runs, renewals fail: a running lease runs out as if its worker froze.

    The holder self-fences at its ttl minus the margin (its own monotonic clock), its body is
    interrupted and the task goes to RETRY, exactly as on a real worker (an eager run raises
    ``LeaseLostError`` at once instead). Use a short ttl in such a test (the lease runs out in
    real time). ``store`` defaults to the
    store in place (the ``lease_store`` fixture or ``using_store()``).
    """
    if store is None:
        from ._app_stores import overridden_store

        current = overridden_store()
        if not isinstance(current, TestLeaseStore):
            raise RuntimeError(
                "paused_renewals() needs the lease_store fixture or using_store() in effect, "
                "or a TestLeaseStore passed in"
            )
        store = current
    with store.paused_renewals():
        yield


def send_twice(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> tuple[Any, Any]:
    """Deliver the same message twice (one task id), as a broker redelivery does.

    With ``task_always_eager`` both copies run one after the other in this thread; with a
    worker they may overlap. Returns both ``AsyncResult``/``EagerResult`` objects; the copy
    that did not run the body ends with the recorded result of the one that did. A body that
    raises leaves its identity ``failed``, not done: then both copies run it (the second as
    ``recovered``).
    """
    from uuid import uuid4

    options.setdefault("task_id", str(uuid4()))
    first = task.apply_async(args, kwargs, **options)
    second = task.apply_async(args, kwargs, **options)
    return first, second


try:
    import pytest
except ImportError:  # pragma: no cover - the plugin part needs pytest
    pass
else:

    @pytest.fixture(autouse=True)
    def _lease_settings_per_test() -> Iterator[None]:
        """Each test's lease tasks resolve ``app.conf`` afresh (not what an earlier test did)."""
        forget_resolved_settings()
        yield
        forget_resolved_settings()

    @pytest.fixture
    def lease_store() -> Iterator[TestLeaseStore]:
        """An in-memory lease store that every lease task uses while the test runs."""
        with using_store() as store:
            yield store
