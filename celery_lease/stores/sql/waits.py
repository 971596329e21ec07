"""The wait list of the SQL store (invariants 12-14, ``stores/protocol.py``), kept in the lease row.

A resource's FIFO wait list lives in three columns of its lease row: ``waits``, the places oldest
first, each ``[identity, since_us, expires_us, woken_until_us, payload]`` (JSONB on PostgreSQL,
JSON text on SQLite); ``wait_slow_us``, until when nothing is held for a woken head because a
wake missed its grace lately; and ``waits_expire_us``, when the last place lapses (indexed, so
the sweep finds lists nobody came back to). All three are NULL when nobody waits, which is
all the common claim and release look at.

In the lease row the list is changed under the same row lock as the lease: on PostgreSQL every
decision is made on the newest committed row (the claim's ``ON CONFLICT`` and a ``FOR UPDATE``
read, see :mod:`.wait_statements`), so a claim, a join and a release racing each other are
serialised by the row, in one statement each. On SQLite the decisions below run in Python inside
the claim's or release's ``BEGIN IMMEDIATE`` transaction; the PostgreSQL statements make the
same decisions in SQL (the contract suite runs both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..base import POLL, POLL_HOLD, POLL_PLACES, rearm_fits

if TYPE_CHECKING:
    from .statements import Statements

__all__ = [
    "Settled",
    "Waits",
    "decide",
    "due",
    "load",
    "release_sqlite",
    "release_wake",
    "settle",
    "stored",
]

#: A wait list entry: [identity, since_us, expires_us, woken_until_us, payload, attempt, again];
#: the attempt (the retries of the claim that listed it, null when it named none) is absent from
#: places written by an earlier version; ``again`` (1: its missed wake was sent once more, see
#: :func:`due`) only follows a missed wake, and every rewrite of the place that wakes or re-arms
#: it drops it (the PostgreSQL statements build such a place with six items).
Place = list[Any]


def older(entry: Place, attempt: int | None) -> bool:
    """Whether a claim of ``attempt`` is a copy of an older attempt than the one ``entry`` was
    listed by (its identity retried since): it neither re-arms, replaces the wake of, nor
    claims as that waiter. A place or a claim without an attempt is never older."""
    return attempt is not None and len(entry) > 5 and entry[5] is not None and attempt < entry[5]


def load(raw: Any) -> list[Place]:
    """The places in a ``waits`` column as the driver returns it (None, JSON text or a list)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return list(json.loads(raw))
    return list(raw)


@dataclass(slots=True)
class Waits:
    """A lease row's wait list with lapsed places dropped, as of ``now``."""

    places: list[Place]
    slow: int

    @classmethod
    def read(cls, raw: Any, slow: Any, now: int, hold: int) -> Waits:
        """Drop lapsed places; a woken waiter that did not claim within its grace holds
        nothing for woken heads for ``hold`` us after its grace ended."""
        places = load(raw)
        floor = int(slow or 0)
        missed = max((int(p[3]) for p in places if 0 < int(p[3]) <= now), default=0)
        if missed:
            floor = max(floor, missed + hold)
        live = [p for p in places if int(p[2]) > now]
        # (the pause after a missed wake ends with the list: a fresh list holds again)
        return cls(live, floor if live else 0)

    def position(self, identity: str | None) -> int:
        """1-based place of ``identity``, 0 when it does not wait."""
        for place, entry in enumerate(self.places, 1):
            if entry[0] == identity:
                return place
        return 0

    def held(self, identity: str | None, now: int, attempt: int | None = None) -> Place | None:
        """The waiter the free resource is held for against a claim by ``identity``: the
        one whose wake is in flight (woken less than the grace ago: one wake at a time, even
        with a re-armed waiter ahead of it), else the first never woken (or re-armed), unless
        ``identity`` is that waiter or listed before it (None then); a copy of an older
        ``attempt`` than the one listed is not that waiter."""
        held = next((e for e in self.places if int(e[3]) > now), None)
        if held is None:
            held = next((e for e in self.places if int(e[3]) == 0), None)
        for entry in self.places:
            if entry[0] == identity and not older(entry, attempt):
                return None
            if entry is held:
                return held
        return None

    def join(
        self,
        identity: str,
        payload: str,
        until: int,
        now: int,
        cap: int,
        bytes_cap: int,
        attempt: int | None = None,
        since: int | None = None,
        skew: int = 0,
    ) -> int:
        """Put ``identity`` at the back, or keep and refresh its place; its place (0: the list
        is full: ``cap`` places, or its payloads would pass ``bytes_cap`` bytes).

        A waiter refused again (a woken copy too late or beaten to it, or a back-stop copy)
        is re-armed: the next release wakes it again. Its new payload replaces the old one
        within the bytes bound (``rearm_fits``: ``bytes_cap``, plus REARM_GROWTH per waiter for
        a payload that grew that much at most; else the old one is kept). A copy of an older
        ``attempt`` than the one listed changes nothing (the newer keeps its wake)."""
        place = self.position(identity)
        if place:
            entry = self.places[place - 1]
            if older(entry, attempt):
                return place
            entry[2] = max(int(entry[2]), until)
            entry[3] = 0
            del entry[6:]  # (re-armed: a later missed wake may be sent again)
            old, new = _bytes(entry[4]), _bytes(payload)
            after = self.payload_bytes() - old + new
            if rearm_fits(old, new, after, len(self.places), bytes_cap):
                entry[4] = payload
                entry[5:] = [attempt]
            return place
        if payload != POLL and (
            sum(str(e[4]) != POLL for e in self.places) >= cap
            or self.payload_bytes() + len(payload.encode()) > bytes_cap
        ):
            payload = POLL  # no room for its message: a polling place
        if len(self.places) >= POLL_PLACES * cap:
            return 0
        # behind every place not listed later than it (its publish time, at most ``skew`` us
        # ahead of now: a publisher's clock a little fast keeps its order; else now)
        at = min(now + skew, since) if since is not None else now
        place = len(self.places)
        while place and int(self.places[place - 1][1]) > at:
            place -= 1
        self.places.insert(place, [identity, at, until, 0, payload, attempt])
        return place + 1

    def polling(self, position: int) -> bool:
        """Whether the place at ``position`` (1-based; 0: none) is a polling one."""
        return 0 < position <= len(self.places) and str(self.places[position - 1][4]) == POLL

    def payload_bytes(self) -> int:
        """The bytes (UTF-8) of the listed wake payloads (none for a polling place)."""
        return sum(_bytes(e[4]) for e in self.places)


def _bytes(payload: Any) -> int:
    """A wake payload's bytes (UTF-8) as the bound counts them: none for a polling place."""
    text = str(payload)
    return 0 if text == POLL else len(text.encode())


def wake(entry: Place, now: int, grace_us: int) -> None:
    """Mark a waiter woken for the grace from ``now`` (a polling one: POLL_HOLD graces; its
    place kept at least as long)."""
    until = now + grace_us * (POLL_HOLD if str(entry[4]) == POLL else 1)
    entry[3] = until
    entry[2] = max(int(entry[2]), until)
    del entry[6:]


def stored(waits: Waits) -> dict[str, Any]:
    """The columns to write for ``waits`` (all NULL for an empty list)."""
    if not waits.places:
        return {"waits": None, "slow": None, "wexp": None}
    return {
        # (not ASCII-escaped: a non-ASCII character keeps its UTF-8 size, which the bytes bound
        # counts, instead of taking 6 bytes as \u00e9)
        "waits": json.dumps(waits.places, separators=(",", ":"), ensure_ascii=False),
        "slow": waits.slow or None,
        "wexp": max(int(p[2]) for p in waits.places),
    }


@dataclass(slots=True)
class Settled:
    """What a claim the plain upsert did not take does (see :func:`decide`)."""

    verdict: str  # "busy" (held by another), "mine" (this claim retried), "held", "claim"
    waits: Waits
    write: bool = False  # the list changed: write it back
    position: int = 0
    polling: bool = False  # its place is a polling one
    wake: str | None = None  # the held waiter's payload, woken by this claim
    head: Place | None = field(default=None)  # the waiter held for ("held")


def decide(
    holder: tuple[Any, Any, Any],
    raw: Any,
    slow: Any,
    *,
    token: str,
    identity: str | None,
    payload: str | None,
    duplicate: bool,
    wait_ttl_us: int,
    cap: int,
    bytes_cap: int,
    grace_us: int,
    attempt: int | None = None,
    since: int | None = None,
    skew: int = 0,
) -> Settled:
    """Settle a claim against its lease row: ``holder`` is (owner_token, expires_us, now);
    ``identity``: the name of the claim's place."""
    owner, expires, now = holder
    waits = Waits.read(raw, slow, now, 10 * grace_us)
    live = owner is not None and expires > now
    head = None if live or waits.slow > now else waits.held(identity, now, attempt)
    if live and owner != token:
        verdict = "busy"
    elif live:
        verdict = "mine"
    elif head is not None:
        verdict = "held"
    else:
        settled = Settled("claim", waits, write=True, head=head)
        place = waits.position(identity)
        if place and not older(waits.places[place - 1], attempt):
            del waits.places[place - 1]
        return settled
    settled = Settled(verdict, waits, head=head)
    if verdict == "mine":
        return settled
    if payload is not None and identity is not None and not (verdict == "busy" and duplicate):
        settled.position = waits.join(
            identity, payload, now + wait_ttl_us, now, cap, bytes_cap, attempt, since, skew
        )
        settled.polling = waits.polling(settled.position)
        # Refused unlisted, the list is as it was (lapsed places and a missed wake are read
        # again from it): no rewrite, which at a full list is the cost of the refusal.
        settled.write = settled.position != 0
    if verdict == "held" and head is not None and head[3] == 0:  # nobody woke it: wake it now
        wake(head, now, grace_us)
        settled.wake = head[4]
        settled.write = True
    return settled


def release_wake(raw: Any, slow: Any, now: int, grace_us: int) -> tuple[Waits, str | None]:
    """After a release: wake the first waiter never woken, unless a wake sent less than the
    grace ago is unclaimed (one wake in flight at a time). The list and the payload to send."""
    waits = Waits.read(raw, slow, now, 10 * grace_us)
    if any(int(p[3]) > now for p in waits.places):
        return waits, None
    for entry in waits.places:
        if int(entry[3]) == 0:
            wake(entry, now, grace_us)
            return waits, str(entry[4])
    return waits, None


def due(raw: Any, slow: Any, now: int, grace_us: int) -> tuple[Waits, list[tuple[str, bool]]]:
    """What ``wake_due`` does with a free resource's list (invariant 16): nothing while a wake
    is in flight; else each missed wake not sent again yet is sent once more (marked), and the
    first waiter never woken is woken. The list and the payloads to send, each with whether it
    is a missed wake sent again."""
    waits = Waits.read(raw, slow, now, 10 * grace_us)
    if any(int(p[3]) > now for p in waits.places):
        return waits, []
    out: list[tuple[str, bool]] = []
    for entry in waits.places:
        if int(entry[3]) != 0 and not (len(entry) > 6 and entry[6]):
            entry[5:] = [entry[5] if len(entry) > 5 else None, 1]
            out.append((str(entry[4]), True))
    for entry in waits.places:
        if int(entry[3]) == 0:
            wake(entry, now, grace_us)
            out.append((str(entry[4]), False))
            break
    return waits, out


# -- SQLite: the decisions run inside the caller's BEGIN IMMEDIATE ---------------------------
def settle(
    cursor: Any, sql: Statements, params: dict[str, Any], holder: Any, *, duplicate: bool
) -> tuple[Any, dict[str, Any]]:
    """Settle a claim the plain upsert refused, from its lease row (``sql.holder``): the new
    lease row (fence, acquired, expires, prev_label, prev_fence) and ``{}`` when it claims,
    else None and the ClaimRow fields of the refusal."""
    _, fence, acquired, expires, label, _, token, now, prev_label, prev_fence, raw, slow = holder
    settled = decide(
        (token, expires, now),
        raw,
        slow,
        token=params["t"],
        identity=params.get("pn"),
        payload=params.get("w"),
        duplicate=duplicate,
        wait_ttl_us=params["wttl"],
        cap=params["cap"],
        bytes_cap=params["wbytes"],
        grace_us=params["grace"],
        attempt=params.get("a"),
        since=params.get("since"),
        skew=params["skew"],
    )
    if settled.verdict == "claim":
        cursor.execute(sql.take, {**params, "now": now, **stored(settled.waits)})
        return cursor.fetchone(), {}
    if settled.write:
        cursor.execute(sql.waits_write, {"r": params["r"], **stored(settled.waits)})
    refused: dict[str, Any] = {
        "holder_token": token,
        "holder_label": label,
        "holder_fence": fence,
        "holder_acquired": acquired,
        "holder_expires": expires,
        "now": now,
        "holder_prev_label": prev_label,
        "holder_prev_fence": prev_fence,
        "position": settled.position,
        "polling": settled.polling,
        "wake": settled.wake,
    }
    if settled.verdict == "held" and settled.head is not None:
        refused["hold"], refused["hold_until"] = settled.head[0], settled.head[3]
    return None, refused


def release_sqlite(cursor: Any, sql: Statements, params: dict[str, Any]) -> tuple[int, str | None]:
    """Release (``sql.release_wake``) and wake the next waiter: (rows released, its payload)."""
    cursor.execute(sql.release_wake, params)
    row = cursor.fetchone()
    if row is None:
        return 0, None
    raw, slow, now = row
    if raw is None:
        return 1, None
    waits, payload = release_wake(raw, slow, now, params["grace"])
    cursor.execute(sql.waits_write, {"r": params["r"], **stored(waits)})
    return 1, payload
