"""Building a lease store from a URL, and masking passwords in URLs."""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any

from .._errors import LeaseConfigError
from .._settings import did_you_mean

if TYPE_CHECKING:
    from .base import LeaseStore

__all__ = ["SUPPORTED_SCHEMES", "mask_url", "store_from_url"]

SUPPORTED_SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "postgresql+psycopg://",
    "sqlite:///",
    "sqlite://",
    "memory://",
)
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:@/]*):(?P<pw>[^@/]*)@")
_QUERY_PW = re.compile(r"(?i)([?&]password=)[^&]*")


def mask_url(url: object) -> str:
    """Return the URL with any password replaced by ``***`` (safe to log or show)."""
    text = str(url)
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text, count=1)
    return _QUERY_PW.sub(r"\1***", text)


def store_from_url(url: str, **options: Any) -> LeaseStore:
    """Create the lease store a URL names.

    ``redis://``, ``rediss://`` and ``unix://`` give a :class:`RedisLeaseStore`;
    ``postgresql+psycopg://`` and ``sqlite:///path`` (or ``sqlite://`` in memory) give a
    :class:`SQLLeaseStore`; ``memory://`` a :class:`MemoryLeaseStore` (tests only).
    Keyword options go to the store's constructor.

    Raises:
        LeaseConfigError: the URL is empty, malformed or of an unsupported kind (named, with
            its password masked), or an option is not one the store takes.
    """
    if not isinstance(url, str) or not url.strip():
        raise LeaseConfigError(
            f"lease store URL {mask_url(url)!r} is empty; set lease_store_url to one of "
            "redis://host:6379/0, postgresql+psycopg://user@host/db or sqlite:///lease.db"
        )
    url = url.strip()
    lowered = url.lower()
    if lowered.startswith(("redis://", "rediss://", "unix://")):
        from .redis import RedisLeaseStore

        return RedisLeaseStore(url=url, **_checked(RedisLeaseStore, options))
    if lowered.startswith(("postgresql+psycopg://", "sqlite://")):
        from .sql import SQLLeaseStore

        return SQLLeaseStore(url=url, **_checked(SQLLeaseStore, options))
    if lowered.startswith("memory://"):
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
