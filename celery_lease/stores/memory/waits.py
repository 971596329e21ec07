"""The memory store's wait lists: joining, holding, waking, and ``wake_due`` (invariants 12-16)."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from ..._codec import from_micros
from ..._names import validate_resource
from ..base import DEFAULT_WAKE_DUE_LIMIT, POLL, POLL_HOLD, POLL_PLACES, DueWake, Waiter, rearm_fits
from .core import MemoryStoreCore

__all__ = ["MemoryWaits"]


def _wake(waiter: list[Any], now: int, grace: int) -> None:
    """Mark ``waiter`` woken for ``grace`` us from ``now`` (a polling one: POLL_HOLD graces; its
    place is kept as long); the free resource is held for it until then (against the claims
    listed behind it). Once that passes unclaimed the waiter keeps its place and is not woken
    again until a refused claim of its own re-arms it (``_join``)."""
    until = now + grace * (POLL_HOLD if waiter[4] == POLL else 1)
    waiter[3] = until
    waiter[2] = max(waiter[2], until)
    waiter[6] = False


def _older(waiter: list[Any], attempt: int | None) -> bool:
    """Whether a claim of ``attempt`` is a copy of an older attempt than the one ``waiter``
    was listed by (its identity retried since): it neither re-arms, replaces the wake of,
    nor claims as that waiter. A place or a claim that names no attempt (a worker of an
    earlier version) is never older."""
    return attempt is not None and waiter[5] is not None and attempt < waiter[5]


def _held(
    waits: list[list[Any]], identity: str | None, now: int, attempt: int | None = None
) -> list[Any] | None:
    """The waiter the free resource is held for against a claim by ``identity``: the one
    whose wake is in flight (woken less than the grace ago: one wake at a time, even with a
    re-armed waiter ahead of it), else the first never woken (or re-armed), unless
    ``identity`` is that waiter or listed before it (None then, or when nobody waits); a copy
    of an older attempt than the one listed is not that waiter."""
    held = next((w for w in waits if w[3] > now), None)
    if held is None:
        held = next((w for w in waits if w[3] == 0), None)
    for waiter in waits:
        if waiter[0] == identity and not _older(waiter, attempt):
            return None
        if waiter is held:
            return held
    return None


def _bytes(payload: str) -> int:
    """A wake payload's bytes (UTF-8) as the bound counts them: none for a polling place."""
    return 0 if payload == POLL else len(payload.encode())


def _payload_bytes(waits: builtins.list[builtins.list[Any]]) -> int:
    """The bytes (UTF-8) of the wake payloads in a wait list (bounded by wait_bytes_cap)."""
    return sum(_bytes(w[4]) for w in waits)


class MemoryWaits(MemoryStoreCore):
    """The wait lists of the memory store."""

    def _wait_list(self, resource: str, now: int) -> builtins.list[builtins.list[Any]]:
        listed = self._waits.get(resource, ())
        # A woken waiter that did not claim within its grace (its message waits behind a
        # backlog, or its worker is paused): nothing is held for woken heads for 10 graces.
        missed = max((w[3] for w in listed if 0 < w[3] <= now), default=0)
        if missed:
            hold = 10 * round(self.handoff_grace * 1e6)
            self._slow[resource] = max(self._slow.get(resource, 0), missed + hold)
        waits = [w for w in listed if w[2] > now]
        if waits:
            self._waits[resource] = waits
        else:  # (the window after a missed wake ends with the list: invariant 13)
            self._waits.pop(resource, None)
            self._slow.pop(resource, None)
        return waits

    def _join(
        self,
        resource: str,
        identity: str | None,
        payload: str,
        wait_ttl: float,
        now: int,
        attempt: int | None,
        since: int | None = None,
    ) -> int:
        """The claimant's place in the list (0: not listed), joining or re-arming it;
        ``identity``: the place's name."""
        if not payload or identity is None:
            return 0
        waits = self._waits.setdefault(resource, [])
        until = now + round(wait_ttl * 1e6)
        for place, waiter in enumerate(waits, 1):
            if waiter[0] == identity:
                if _older(waiter, attempt):
                    # a copy of an attempt its identity moved past (a back-stop copy sent
                    # before a retry): the newer attempt keeps its wake and its state
                    return place
                # Refused again (a woken copy too late or beaten to it, or a back-stop copy):
                # it keeps its place and is re-armed, so the next release wakes it again. Its
                # new payload replaces the old one within the bytes bound (rearm_fits; else the
                # old, valid one is kept).
                waiter[2] = max(waiter[2], until)
                waiter[3] = 0
                waiter[6] = False
                old, new = _bytes(waiter[4]), _bytes(payload)
                after = _payload_bytes(waits) - old + new
                if rearm_fits(old, new, after, len(waits), self.wait_bytes_cap):
                    waiter[4] = payload
                    waiter[5] = attempt
                return place
        if payload != POLL and (
            sum(w[4] != POLL for w in waits) >= self.wait_cap
            or _payload_bytes(waits) + len(payload.encode()) > self.wait_bytes_cap
        ):
            payload = POLL  # no room for its message: a polling place
        if len(waits) >= POLL_PLACES * self.wait_cap:
            return 0
        # behind every place not listed later than it (its publish time, at most since_skew
        # ahead of now: a publisher's clock a little fast keeps its order; else now)
        at = min(now + self._since_skew_us, since) if since is not None else now
        place = len(waits)
        while place and waits[place - 1][1] > at:
            place -= 1
        waits.insert(place, [identity, at, until, 0, payload, attempt, False])
        return place + 1

    def _polling(self, resource: str, position: int) -> bool:
        """Whether the place at ``position`` (1-based; 0: none) is a polling one."""
        waits = self._waits.get(resource, ())
        return 0 < position <= len(waits) and waits[position - 1][4] == POLL

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        names, limit = self._wake_due_args(resources, limit)
        out: builtins.list[DueWake] = []
        with self._lock:
            now = self._now_us()
            if names is None:
                # By when the last place lapses, as the other stores' indexes order them; only a
                # list with a live place on a resource with no live lease counts against the
                # limit (a held one's release wakes its next waiter).
                lapses = ((max((w[2] for w in ws), default=0), r) for r, ws in self._waits.items())
                names = [
                    r
                    for _, r in sorted(
                        (lapse, r) for lapse, r in lapses if lapse > now and not self._live(r, now)
                    )[:limit]
                ]
            for resource in names:
                if self._live(resource, now):
                    continue  # held: its holder's release wakes the next waiter
                waits = self._wait_list(resource, now)
                if any(w[3] > now for w in waits):
                    continue  # a wake in flight: its grace decides
                for waiter in waits:
                    if waiter[3] != 0 and not waiter[6]:  # missed its grace: once more
                        waiter[6] = True
                        out.append(DueWake(resource, waiter[4], True))
                woke = next((w for w in waits if w[3] == 0), None)
                if woke is not None:
                    _wake(woke, now, round(self.handoff_grace * 1e6))
                    out.append(DueWake(resource, woke[4], False))
        return out

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        resource = validate_resource(resource)
        with self._lock:
            now = self._now_us()
            return [
                Waiter(place, w[0], from_micros(w[1]), from_micros(w[2]), w[3] > now)
                for place, w in enumerate(self._wait_list(resource, now), 1)
            ]
