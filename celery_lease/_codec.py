"""How values cross the store boundary: JSON text for receipts, results and checkpoints, and
store-clock microseconds as datetimes.

Used by the stores (reading records) and by the ledger and the task (writing them), so it sits
below both and imports nothing of the package but the errors.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from kombu.utils.json import dumps, loads

from ._errors import LeaseConfigError

__all__ = ["decode", "encode", "from_micros"]


def encode(value: Any) -> str:
    """JSON text for a receipt, result or checkpoint (kombu's JSON: dates, UUIDs, decimals)."""
    try:
        return str(dumps(value))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise LeaseConfigError(
            f"{type(value).__name__} value is not JSON-serialisable for the ledger: {exc}; "
            "record ids and plain data, not live objects"
        ) from None


def decode(text: str | None) -> Any:
    """The value :func:`encode` wrote (None stays None)."""
    return None if text is None else loads(text)  # type: ignore[no-untyped-call]


def from_micros(micros: int) -> datetime:
    """Convert store-clock microseconds since the epoch to an aware UTC datetime.

    (A float of seconds carries these values to well under half a microsecond, so the result
    is exact; it is about four times faster than building it from integer parts.)
    """
    return datetime.fromtimestamp(int(micros) / 1e6, tz=timezone.utc)
