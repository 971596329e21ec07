"""A lease's store-clock times may come as microseconds and become datetimes when read."""

from __future__ import annotations

import threading
from datetime import timezone

from celery_lease import Lease, Owner, _lease
from celery_lease._codec import from_micros

ACQUIRED, EXPIRES = 1_764_000_000_123_456, 1_764_000_060_123_456


def lease(**times):
    return Lease(resource="r", owner=Owner.new("t"), fence=1, ttl=60.0, sent_monotonic=0.0, **times)


def test_microseconds_read_as_the_datetimes_they_stand_for():
    given = lease(acquired_at=ACQUIRED, expires_at=EXPIRES)
    as_dates = lease(acquired_at=from_micros(ACQUIRED), expires_at=from_micros(EXPIRES))
    assert given.acquired_at == as_dates.acquired_at == from_micros(ACQUIRED)
    assert given.expires_at == as_dates.expires_at == from_micros(EXPIRES)
    assert given.acquired_at.tzinfo is timezone.utc
    assert given.acquired_at is given.acquired_at  # converted once
    assert "expires_at=2025-11-24T16:01:00.123456+00:00" in repr(given)


def test_a_renewal_or_an_assignment_moves_the_expiry():
    given = lease(acquired_at=ACQUIRED, expires_at=EXPIRES)
    given.renewed(1.0, EXPIRES + 5_000_000, 60.0)
    assert given.expires_at == from_micros(EXPIRES + 5_000_000)
    given.renewed(2.0, from_micros(EXPIRES + 9_000_000), 60.0)
    assert given.expires_at == from_micros(EXPIRES + 9_000_000)
    given.expires_at = EXPIRES
    assert given.expires_at == from_micros(EXPIRES)


def test_a_first_read_racing_a_renewal_keeps_the_renewed_expiry(monkeypatch):
    """The first read converts the claim's microseconds; a renewal recorded by the renewer
    thread while it converts must win (966ec30 wrote the old expiry back unlocked). The
    renewal is forced into the conversion: it runs in another thread, and the read waits for
    it unless the read holds the lease's lock (then the renewal runs right after)."""
    given = lease(acquired_at=ACQUIRED, expires_at=EXPIRES)
    renewed = EXPIRES + 30_000_000
    renewers: list[threading.Thread] = []

    def converting(micros: int):
        if not renewers:
            held = given._lock.locked()
            renewer = threading.Thread(target=given.renewed, args=(1.0, renewed, 60.0))
            renewers.append(renewer)
            renewer.start()
            if not held:
                renewer.join()
        return from_micros(micros)

    monkeypatch.setattr(_lease, "from_micros", converting)
    first = given.expires_at
    renewers[0].join()
    assert first in (from_micros(EXPIRES), from_micros(renewed))  # either order is fine
    assert given.expires_at == from_micros(renewed)
