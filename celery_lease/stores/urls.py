"""Building a lease store from a URL, and masking passwords in URLs."""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from .._errors import LeaseConfigError
from .._settings import did_you_mean

if TYPE_CHECKING:
    from .base import LeaseStore

__all__ = ["SUPPORTED_SCHEMES", "check_credentials", "mask_url", "store_from_url"]

SUPPORTED_SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "postgresql+psycopg://",
    "sqlite:///",
    "sqlite://",
    "memory://",
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# A query parameter's value runs to the next "&name=" (a raw '&' inside a password must not
# leak its tail). Names may be percent-encoded: drivers decode them (pass%77ord is password).
_QUERY_FIRST = re.compile(r"(\?)([A-Za-z0-9_.%\-]+)=")
_QUERY_KEY = re.compile(r"(&)([A-Za-z0-9_.%\-]+)=")
# Any parameter whose decoded name says secret: password, ssl_password, sslpassword, passwd...
_SECRET_KEY = re.compile(r"pass|pwd|secret|token", re.IGNORECASE)


def _mask_query(text: str) -> str:
    start = text.find("?")
    if start < 0:
        return text
    first = _QUERY_FIRST.match(text, start)
    keys = [first] if first else []
    keys += _QUERY_KEY.finditer(text, first.end() if first else start)
    if not keys:
        return text
    out = [text[: keys[0].start()]]
    for number, key in enumerate(keys):
        end = keys[number + 1].start() if number + 1 < len(keys) else len(text)
        out.append(key.group(0))
        secret = _SECRET_KEY.search(unquote(key.group(2)))
        out.append("***" if secret else text[key.end() : end])
    return "".join(out)


def _password_span(text: str) -> tuple[int, int] | None:
    """Where the userinfo password of a URL is, by the widest reading any driver makes.

    redis-py (``urllib.parse``) reads the password up to the *last* ``@`` of the host part,
    SQLAlchemy up to the *first* ``@``; a password holding an unencoded ``/``, ``?`` or ``#``
    moves where ``urllib`` thinks the host part ends. So: from the first ``:`` after ``//``
    (the user name before it holds no ``/?#``) to the last ``@`` of the URL. This may mask
    more than the password (an ``@`` in a query), never less.
    """
    lead = len(text) - len(text.lstrip())  # store_from_url strips; so must the mask
    scheme = _SCHEME.match(text, lead)
    if scheme is None or scheme.group(0).lower().startswith("sqlite"):
        return None  # no URL, or a file path (which may hold ':' and '@'), not a password
    start = scheme.end()
    at = text.rfind("@", start)
    colon = text.find(":", start, at) if at >= 0 else -1
    if colon < 0:  # a ':' anywhere before the last '@' may start a password: mask it
        return None
    return colon + 1, at


def mask_url(url: object) -> str:
    """Return the URL with any password replaced by ``***`` (safe to log or show)."""
    text = str(url)
    span = _password_span(text)
    if span is not None:
        text = f"{text[: span[0]]}***{text[span[1] :]}"
    return _mask_query(text)


def check_credentials(url: str) -> None:
    """Refuse a SQL URL whose password SQLAlchemy would misread.

    SQLAlchemy ends the password at the first ``@``: ``user:p@ss@host`` connects as password
    ``p`` to host ``ss@host``, and the driver's errors then quote the rest of the password.

    Raises:
        LeaseConfigError: naming the fix (percent-encode the password), quoting none of it.
    """
    span = _password_span(url)
    if span is not None and "@" in url[span[0] : span[1]]:
        raise LeaseConfigError(
            f"the password in lease store URL {mask_url(url)!r} contains an unencoded '@': "
            "SQLAlchemy would read the text after it as the host name. Percent-encode the "
            "password (urllib.parse.quote(password, safe='') writes '@' as %40, '/' as %2F, "
            "'?' as %3F, '#' as %23, '%' as %25)"
        )


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
        from .sql import SQLLeaseStore  # which checks the URL's credentials first

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
