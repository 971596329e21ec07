"""The memory store's fence gates (``celery_lease.FenceGate`` support) and once-marks."""

from __future__ import annotations

from ..._names import validate_fence, validate_resource
from .core import MemoryStoreCore

__all__ = ["MemoryGates"]


class MemoryGates(MemoryStoreCore):
    """Fence gates and ``mark_once`` of the memory store."""

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted and >= the newest fence
        granted for ``key`` as a resource (FenceGate support)."""
        validate_resource(key)
        fence = validate_fence(fence)
        with self._lock:
            # Under the lock that claims and force-releases take: a grant is either before
            # this decision (and counts) or after it.
            admitted, granted = self._gates.get(key), self._fences.get(key)
            highest = max((f for f in (admitted, granted) if f is not None), default=None)
            if highest is not None and highest > fence:
                self._gate_decided(key, fence, False, highest)
                return False, highest
            self._gates[key] = int(fence)
            self._gate_decided(key, fence, True, int(fence))
            return True, int(fence)

    def _gate_decided(self, key: str, fence: int, admitted: bool, highest: int) -> None:
        """Called under the store lock with each gate decision, in the order they were made."""

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Record ``key`` for ``ttl`` seconds unless a live record of another ``token`` has it:
        whether this caller holds it now."""
        validate_resource(key)
        with self._lock:
            now = self._now_us()
            for name in [k for k, (_, until) in self._marks.items() if until <= now]:
                del self._marks[name]
            held = self._marks.get(key)
            if held is None:
                self._marks[key] = (token, now + max(1, round(ttl * 1e6)))
                return True
            return held[0] == token

    def gate_highest(self, key: str) -> int | None:
        with self._lock:
            return self._gates.get(validate_resource(key))
