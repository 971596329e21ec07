"""Building a lease store from a URL: the one place that knows which URL scheme names which store.

(Masking passwords in URLs is a name rule like the others, in :mod:`celery_lease._names`;
``mask_url`` and ``check_credentials`` are re-exported here for the code that imported them.)
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Literal

from .._errors import LeaseConfigError
from .._names import check_credentials, did_you_mean, mask_url

if TYPE_CHECKING:
    from .base import LeaseStore

__all__ = [
    "SUPPORTED_SCHEMES",
    "StoreKind",
    "check_credentials",
    "mask_url",
    "store_from_url",
    "store_kind",
]

SUPPORTED_SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "postgresql+psycopg://",
    "sqlite:///",
    "sqlite://",
    "memory://",
)
_REDIS = ("redis://", "rediss://", "unix://")
_POSTGRESQL = "postgresql+psycopg://"
_SQLITE = "sqlite://"  # sqlite:///path, or sqlite:// in memory

#: Which store a URL names (see :func:`store_kind`).
StoreKind = Literal["redis", "postgresql", "sqlite", "memory"]


def store_kind(url: str) -> StoreKind | None:
    """Which store :func:`store_from_url` makes for ``url``, or None for a URL it refuses."""
    lowered = url.strip().lower()
    if lowered.startswith(_REDIS):
        return "redis"
    if lowered.startswith(_POSTGRESQL):
        return "postgresql"
    if lowered.startswith(_SQLITE):
        return "sqlite"
    if lowered.startswith("memory://"):
        return "memory"
    return None


def store_from_url(url: str, **options: Any) -> LeaseStore:
    """Create the lease store a URL names.

    ``redis://``, ``rediss://`` and ``unix://`` give a :class:`RedisLeaseStore`;
    ``postgresql+psycopg://`` and ``sqlite:///path`` (or ``sqlite://`` in memory) give a
    :class:`SQLLeaseStore`; ``memory://`` a :class:`MemoryLeaseStore` (tests only).
    Keyword options go to the store's constructor.

    Raises:
        LeaseConfigError: the URL is empty, malformed or of an unsupported kind (named, with
            its password masked), its driver is not installed (naming the extra to install),
            or an option is not one the store takes.
    """
    if not isinstance(url, str) or not url.strip():
        raise LeaseConfigError(
            f"lease store URL {mask_url(url)!r} is empty; set lease_store_url to one of "
            "redis://host:6379/0, postgresql+psycopg://user@host/db or sqlite:///lease.db"
        )
    url = url.strip()
    lowered = url.lower()
    kind = store_kind(url)
    if kind == "redis":
        try:
            from .redis import RedisLeaseStore
        except ImportError as exc:  # redis-py is an optional extra; the message names it
            raise LeaseConfigError(f"{exc} (lease store URL {mask_url(url)!r})") from exc

        return RedisLeaseStore(url=url, **_checked(RedisLeaseStore, options))
    if kind in ("postgresql", "sqlite"):
        from .sql import SQLLeaseStore  # which checks the URL's credentials first

        return SQLLeaseStore(url=url, **_checked(SQLLeaseStore, options))
    if kind == "memory":
        from .memory import MemoryLeaseStore

        return MemoryLeaseStore(**_checked(MemoryLeaseStore, options))
    hint = ""
    if lowered.startswith(("postgresql://", "postgres://", "postgresql+psycopg2://")):
        hint = " (PostgreSQL needs the psycopg 3 driver: write postgresql+psycopg://...)"
    raise LeaseConfigError(
        f"unsupported lease store URL {mask_url(url)!r}{hint}; use redis://, rediss://, "
        "unix://, postgresql+psycopg://, sqlite:///path or sqlite:// (in memory)"
    )


def _checked(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The options, after refusing any the store's constructor does not take (a typo in
    ``lease_store_options`` would otherwise surface as a bare TypeError at the first claim)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return options
    takes = [
        name
        for name, p in params.items()
        if name != "url"
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for name in options:
        if name not in takes:
            raise LeaseConfigError(
                f"{cls.__name__} has no option {name!r}{did_you_mean(name, takes)} (from "
                "lease_store_options or a store_from_url keyword); its options are "
                f"{', '.join(sorted(takes))}"
            )
    return options
