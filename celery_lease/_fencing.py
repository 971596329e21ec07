"""Fencing at the side effect: a gate that only lets the newest owner's writes through.

A lease alone cannot give mutual exclusion: an owner paused past its ttl wakes up believing it
still holds the lease. The fence makes that safe only if the side effect checks it. A
:class:`FenceGate` keeps, per key, the highest fence it admitted, and admits a write only if its
fence is at least that high, atomically (a Redis script or one SQL statement).
"""

from __future__ import annotations

from typing import Any

from . import _events as events
from ._errors import LeaseConfigError, StaleFenceError
from ._interrupt import raise_if_interrupted
from ._lease import Lease
from ._names import show_value
from .stores import LeaseStore, store_from_url
from .stores.base import FenceGateStore

__all__ = ["FenceGate"]


class FenceGate:
    """Admits a fence for a key only if it is >= every fence admitted for that key before.

    Args:
        url: the same URLs as the lease stores (``redis://``, ``postgresql+psycopg://``,
            ``sqlite:///``, ``memory://``); the gate can live next to the side effect rather
            than next to the leases.
        store: or an existing lease store to share connections with (not closed by close()).
        **options: store options (``key_prefix``, ``table_prefix``, ...) for a URL.

    Example::

        gate = FenceGate("postgresql+psycopg://app@db/app")
        gate.admit(f"invoice:{invoice_id}", current_lease().fence)   # or StaleFenceError
        write_the_invoice(...)
    """

    def __init__(
        self, url: str | None = None, *, store: LeaseStore | None = None, **options: Any
    ) -> None:
        if (url is None) == (store is None):
            raise LeaseConfigError("FenceGate needs exactly one of url= or store=")
        backend = store if store is not None else store_from_url(url or "", **options)
        if not isinstance(backend, FenceGateStore):
            raise LeaseConfigError(f"{show_value(backend)} cannot serve as a fence gate")
        self._backend: FenceGateStore = backend
        self._owns = store is None
        self.url = backend.url

    def admit(self, key: str, fence: int | Lease) -> int:
        """Admit ``fence`` (or a lease's fence) for ``key``; atomically record it.

        Returns:
            The admitted fence.

        Raises:
            StaleFenceError: a newer fence was admitted for ``key`` before; nothing changed.
            LeaseConfigError: ``key`` is not a valid name or ``fence`` not an integer.
            LeaseStoreError: the gate's store failed; treat the write as not admitted.
        """
        raise_if_interrupted()  # (also with a store that makes no shielded call: memory)
        value = fence.fence if isinstance(fence, Lease) else fence
        if isinstance(value, bool) or not isinstance(value, int):
            raise LeaseConfigError(f"a fence is an integer, got {show_value(fence)}")
        admitted, highest = self._backend.gate_admit(key, value)
        if not admitted:
            events.count("celery_lease_stale_fence_rejections_total")
            raise StaleFenceError.rejected(key, value, highest)
        return value

    def highest(self, key: str) -> int | None:
        """The highest fence admitted for ``key`` so far, or None."""
        return self._backend.gate_highest(key)

    def close(self) -> None:
        if self._owns:
            self._backend.close()

    def __repr__(self) -> str:
        return f"<FenceGate {self.url}>"
