"""A lease's store-clock times may come as microseconds and become datetimes when read."""

from __future__ import annotations

from datetime import timezone

from celery_lease import Lease, Owner
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
