"""Fenced side effects: a gate, SQL rows, Redis keys, HTTP gateways that reject stale owners.

A lease alone cannot give mutual exclusion: an owner paused past its ttl wakes up believing it
still holds the lease. The fence makes that safe only if the side effect checks it, atomically
with the write:

* :class:`FenceGate` - keeps, per key, the highest fence it admitted, and admits a write only if
  its fence is at least that high (a Redis script or one SQL statement, in any lease store). A
  gate on the lease store itself (``store=`` the lease store, or its URL and prefix) also
  refuses, for a key that is a lease resource, every fence older than the newest the store
  granted, whether or not its holder has written yet.
* :func:`fenced_update` - a SQLAlchemy ``UPDATE ... SET ..., fence = :fence WHERE ... AND
  fence <= :fence`` for Core tables and ORM models (``store=``: also checks the grants of a SQL
  lease store in the same database, in the same statement).
* :func:`fenced_set`, :func:`fenced_hset` - Redis writes by script that keep the highest fence
  next to the data (``store=``: also check the grants of the Redis lease store, same script).
* :func:`fencing_headers` and :func:`check_fencing_token` - an HTTP header (``Fencing-Token``)
  that a client sets and any WSGI/ASGI gateway checks, optionally signed with HMAC-SHA256
  (:class:`FenceSigner`, key ids for rotation, an expiry) so that a caller cannot forge a
  higher fence.
* :func:`fenced_request` (:func:`fenced_request_async`) and :func:`raise_for_fence` - the
  client side, for ``requests`` and ``httpx``: sends the token and turns the gateway's 409 into
  :class:`~celery_lease.StaleFenceError` and its 403 into
  :class:`~celery_lease.InvalidFenceTokenError`.

This module holds the gate and the tokens a gateway checks (signing, reading and admitting
them); the SQL helper lives in ``_fence_sql``, the Redis helpers in ``_fence_redis`` and the
client side in ``_fence_client``, all re-exported here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

from . import _clock
from . import _events as events
from ._errors import InvalidFenceTokenError, LeaseConfigError, StaleFenceError
from ._fence_args import fence_of
from ._fence_client import (
    FENCING_HEADER,
    _lifetime,
    fenced_request,
    fenced_request_async,
    fencing_headers,
    raise_for_fence,
)
from ._fence_redis import fenced_get, fenced_hset, fenced_set
from ._fence_sql import fenced_update
from ._interrupt import raise_if_interrupted
from ._lease import Lease
from ._names import (
    MAX_FENCE,
    RESOURCE_PATTERN,
    RESOURCE_RULE,
    show_value,
    validate_fence,
    validate_resource,
)
from .stores import LeaseStore, store_from_url
from .stores.base import FenceGateStore, ReadableFenceGateStore

__all__ = [
    "FENCING_HEADER",
    "FenceSigner",
    "check_fencing_token",
    "fenced_get",
    "fenced_hset",
    "fenced_request",
    "fenced_request_async",
    "fenced_set",
    "fenced_update",
    "fencing_headers",
    "raise_for_fence",
    "token_from_request",
]

_KID = re.compile(r"[A-Za-z0-9_-]{1,32}")
#: No store takes a larger fence (Redis compares fences as doubles; see _names.MAX_FENCE): a
#: token carrying one is refused as invalid, the same bound as FenceGate.admit's.
_MAX_FENCE = MAX_FENCE
# Every part of a token is checked against an ASCII-only pattern before it is converted or
# compared: int() accepts '²'-like digits and raises past 4300 digits, hmac.compare_digest
# raises TypeError on non-ASCII text, b64decode and .decode() raise on junk. A gateway must
# answer such input with InvalidFenceTokenError (403), not a crash (500).
_MAX_TOKEN = 1024  # a signed token of a 200-character resource is about 400 characters
_DIGITS = re.compile(r"[0-9]{1,19}")
_B64 = re.compile(r"[A-Za-z0-9_-]{2,270}")
_MAC = re.compile(r"[A-Za-z0-9_-]{43}")  # unpadded urlsafe base64 of a SHA-256 digest


# -- the gate -------------------------------------------------------------------------------------
class FenceGate:
    """Admits a fence for a key only if it is >= every fence admitted for that key before.

    A gate that shares the lease store (``store=`` the lease store, or the lease store's URL
    and ``key_prefix`` / ``table_prefix``; Redis: and ``shards``) knows every fence the store
    granted: for a key that is a lease resource, it also refuses every fence older than the
    newest granted for that resource, from the moment the newer claim returned (its holder may
    not have written yet) and after a force-release, in the same atomic step as the admit. Use
    the resource as the key to get this. A gate on a store of its own knows only the fences it
    admitted: an old owner can still write until the newer one first passes the gate.

    Args:
        url: the same URLs as the lease stores (``redis://``, ``postgresql+psycopg://``,
            ``sqlite:///``, ``memory://``); the gate can live next to the side effect rather
            than next to the leases.
        store: or an existing lease store to share connections with (not closed by close()).
        **options: store options (``key_prefix``, ``table_prefix``, ...) for a URL.

    Check the fence right before the write, in the task body:

    <!-- test: typecheck, needs a PostgreSQL server -->
    ```python
    from celery_lease import FenceGate, current_lease, lease_task

    gate = FenceGate("postgresql+psycopg://app@db/app")  # the lease store's URL

    @lease_task(resource="invoice/{invoice_id}")
    def send_invoice(invoice_id: int) -> None:
        gate.admit(f"invoice/{invoice_id}", current_lease())  # or StaleFenceError
        ...  # the write, only once admit() returned
    ```
    """

    def __init__(
        self, url: str | None = None, *, store: LeaseStore | None = None, **options: Any
    ) -> None:
        if (url is None) == (store is None):
            raise LeaseConfigError("FenceGate needs exactly one of url= or store=")
        backend = store if store is not None else store_from_url(url or "", **options)
        if not isinstance(backend, FenceGateStore):  # url and gate_admit: all admit() needs
            raise LeaseConfigError(f"{show_value(backend)} cannot serve as a fence gate")
        self._backend: FenceGateStore = backend
        self._owned: LeaseStore | None = None if store is not None else backend  # ours to close
        self.url = backend.url

    def admit(self, key: str, fence: int | Lease) -> int:
        """Admit ``fence`` (or a lease's fence) for ``key``; atomically record it.

        Returns:
            The admitted fence.

        Raises:
            StaleFenceError: a newer fence was admitted for ``key`` before, or (a gate sharing
                the lease store) granted for the resource ``key``; nothing changed.
            LeaseConfigError: ``key`` is not a valid name or ``fence`` not an integer.
            LeaseStoreError: the gate's store failed; treat the write as not admitted.
        """
        raise_if_interrupted()  # (also with a store that makes no shielded call: memory)
        value = fence_of(fence)
        admitted, highest = self._backend.gate_admit(key, value)
        if not admitted:
            events.count("celery_lease_stale_fence_rejections_total")
            raise StaleFenceError.rejected(key, value, highest)
        return value

    def highest(self, key: str) -> int | None:
        """The highest fence admitted for ``key`` so far, or None."""
        if not isinstance(self._backend, ReadableFenceGateStore):
            raise LeaseConfigError(
                f"the fence gate's store {self.url} has no gate_highest: it can admit fences "
                "but not say the highest one"
            )
        return self._backend.gate_highest(key)

    def close(self) -> None:
        if self._owned is not None:
            self._owned.close()

    def __repr__(self) -> str:
        return f"<FenceGate {self.url}>"


# -- HTTP -----------------------------------------------------------------------------------------
class FenceSigner:
    """HMAC-SHA256 signatures for fencing tokens that leave the process.

    Args:
        keys: key id -> secret (bytes or str, at least 32 bytes). Keep old keys here while
            tokens signed with them may still be in flight; sign with ``active``.
        active: the key id new tokens are signed with.
    """

    def __init__(self, keys: Mapping[str, bytes | str], active: str) -> None:
        self._keys: dict[str, bytes] = {}
        for kid, secret in keys.items():
            if not _KID.fullmatch(kid):
                raise LeaseConfigError(f"key id {kid!r} must be 1..32 of A-Z a-z 0-9 _ -")
            raw = secret.encode() if isinstance(secret, str) else bytes(secret)
            if len(raw) < 32:
                raise LeaseConfigError(f"the secret of key {kid!r} must be at least 32 bytes")
            self._keys[kid] = raw
        if active not in self._keys:
            raise LeaseConfigError(f"active key {active!r} is not among the keys")
        self.active = active

    def _mac(self, kid: str, payload: str) -> str:
        digest = hmac.new(self._keys[kid], payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def sign(self, resource: str, fence: int, *, expires_in: float | None = None) -> str:
        """A token ``v1.<kid>.<resource b64>.<fence>.<expiry or 0>.<mac>``.

        Args:
            resource: the lease's resource.
            fence: the lease's fence.
            expires_in: seconds from now after which :meth:`verify` refuses the token. The
                expiry is a Unix time in whole seconds (rounded down) from this machine's wall
                clock, and the verifier compares it with its own: leave room for the clocks'
                difference. None (0 in the token): it never expires. An expiry bounds how long a
                copied token (a log, a proxy) can be replayed; the fence order alone already
                refuses it once a newer owner's fence reached the gateway.
        """
        validate_resource(resource)
        fence = validate_fence(fence)  # (verify() refuses a larger one)
        lifetime = _lifetime(expires_in, ended_ok=True)
        # (never 0, which means "no expiry": a lifetime that already ended stays ended)
        expiry = 0 if lifetime is None else max(1, int(_clock.wall() + lifetime))
        encoded = base64.urlsafe_b64encode(resource.encode()).decode().rstrip("=")
        payload = f"v1.{self.active}.{encoded}.{int(fence)}.{expiry}"
        return f"{payload}.{self._mac(self.active, payload)}"

    def verify(self, token: str) -> tuple[str, int]:
        """Check a token's signature and expiry; return ``(resource, fence)``.

        Raises:
            InvalidFenceTokenError: malformed, unknown key, bad signature or expired.
        """
        malformed = InvalidFenceTokenError(
            f"malformed signed fencing token {show_value(token)}; expected "
            "v1.<key id>.<resource>.<fence>.<expiry>.<signature>"
        )
        if not isinstance(token, str) or len(token) > _MAX_TOKEN:
            raise malformed
        parts = token.split(".")
        if len(parts) != 6 or parts[0] != "v1":
            raise malformed
        _, kid, encoded, fence, expiry, mac = parts
        if not (
            _KID.fullmatch(kid)
            and _B64.fullmatch(encoded)
            and _DIGITS.fullmatch(fence)
            and _DIGITS.fullmatch(expiry)
            and _MAC.fullmatch(mac)
        ):
            raise malformed
        if kid not in self._keys:
            raise InvalidFenceTokenError(f"fencing token signed with unknown key {kid!r}")
        expected = self._mac(kid, ".".join(parts[:5]))
        if not hmac.compare_digest(expected.encode(), mac.encode()):
            raise InvalidFenceTokenError("fencing token signature does not match (forged?)")
        value = _parse_fence(fence, token)
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            resource = _parse_resource(raw.decode(), token)
        except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
            raise malformed from None
        deadline = int(expiry)
        if deadline and _clock.wall() > deadline:
            raise InvalidFenceTokenError("fencing token expired")
        return resource, value


def token_from_request(request: Any) -> str | None:
    """The Fencing-Token header from a WSGI environ, an ASGI scope, a headers mapping, or any
    headers object with a ``get(name)`` method (``http.server``'s ``self.headers``, an
    ``email.message.Message``: case-insensitive)."""
    if not isinstance(request, Mapping):  # (an HTTPMessage is no Mapping)
        get = getattr(request, "get", None)
        value = get(FENCING_HEADER) if callable(get) else None
        return None if value is None else str(value)
    if "HTTP_FENCING_TOKEN" in request:  # WSGI environ
        return str(request["HTTP_FENCING_TOKEN"])
    if request.get("type") in ("http", "websocket") and "headers" in request:  # ASGI scope
        for name, value in request["headers"]:
            if name.decode("latin-1").lower() == FENCING_HEADER.lower():
                return str(value.decode("latin-1"))
        return None
    for name, value in request.items():  # plain headers
        if str(name).lower() == FENCING_HEADER.lower():
            return str(value)
    return None


def check_fencing_token(
    request: Any,
    gate: FenceGate,
    *,
    key: str | None = None,
    resource: str | None = None,
    signer: FenceSigner | None = None,
) -> int:
    """Admit the request's fencing token through ``gate``; usable in any WSGI/ASGI app.

    Args:
        request: a WSGI environ, an ASGI scope, a headers mapping, any headers object with a
            case-insensitive ``get`` (``http.server``'s ``self.headers``), or the header's
            value.
        gate: where the highest admitted fence per key lives.
        key: the gate key (default: the token's resource).
        resource: when given, the token must name this resource.
        signer: require a valid signature (rejects forged and tampered tokens).

    Returns:
        the admitted fence.

    Raises:
        InvalidFenceTokenError: missing, malformed, unsigned when a signature is required,
            forged, tampered with, expired, or naming another resource (answer 403).
        StaleFenceError: a newer fence was admitted for the key (answer 409).
    """
    token = request if isinstance(request, str) else token_from_request(request)
    if not token:
        raise InvalidFenceTokenError(f"the request carries no {FENCING_HEADER} header")
    if signer is not None:
        named, fence = signer.verify(token)
    else:
        named, sep, raw = token.rpartition(";")
        if not sep or len(token) > _MAX_TOKEN:
            raise InvalidFenceTokenError(
                f"malformed {FENCING_HEADER} header {show_value(token)}; expected "
                "<resource>;<fence>"
            )
        fence = _parse_fence(raw, token)
        named = _parse_resource(named, token)
    if resource is not None and named != resource:
        raise InvalidFenceTokenError(
            f"fencing token names {named!r}, not {resource!r}: refusing a token for another "
            "resource"
        )
    return gate.admit(key or named, fence)


def _parse_fence(raw: str, token: str) -> int:
    """ASCII digits only, at most a 64-bit fence; else InvalidFenceTokenError."""
    if not _DIGITS.fullmatch(raw) or int(raw) > _MAX_FENCE:
        raise InvalidFenceTokenError(
            f"fencing token {show_value(token)} carries no valid fence: expected 0..{_MAX_FENCE} "
            "in ASCII digits"
        )
    return int(raw)


def _parse_resource(named: str, token: str) -> str:
    """A valid resource name (what fencing_headers and sign() write); else
    InvalidFenceTokenError, not the LeaseConfigError validate_resource raises for our callers."""
    if not RESOURCE_PATTERN.fullmatch(named):
        raise InvalidFenceTokenError(
            f"fencing token {show_value(token)} names no valid resource: a resource name is "
            f"{RESOURCE_RULE}"
        )
    return named
