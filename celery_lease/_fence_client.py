"""The client side of an HTTP gate: send the fencing token, turn the gateway's refusals into errors.

A tool gateway that checks tokens with :func:`celery_lease.fencing.check_fencing_token` answers
409 to a stale fence and 403 to a bad token. :func:`fenced_request` sends a call with the lease's
token and raises :class:`~celery_lease.StaleFenceError` on 409 and
:class:`~celery_lease.InvalidFenceTokenError` on 403, so the task body stops acting at once (a
StaleFenceError raised in a lease task's body marks the lease lost and sends the task to RETRY).

Neither ``requests`` nor ``httpx`` is imported here: any client with ``request(method, url,
headers=..., **kwargs)`` returning a response with ``status_code`` works (a ``requests.Session``,
the ``requests`` module, an ``httpx.Client``, the ``httpx`` module; an ``httpx.AsyncClient``
through :func:`fenced_request_async`). Re-exported by :mod:`celery_lease.fencing`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from ._errors import InvalidFenceTokenError, LeaseConfigError, LeaseError, StaleFenceError
from ._interrupt import raise_if_interrupted
from ._lease import CURRENT_LEASE, Lease
from ._names import MAX_FENCE, mask_url, show_value


class TokenSigner(Protocol):
    """What the helpers ask of a signer: ``celery_lease.FenceSigner`` (defined with the gates
    that verify its tokens, above this module)."""

    def sign(self, resource: str, fence: int, *, expires_in: float | None = None) -> str: ...


__all__ = [
    "DEFAULT_TOKEN_LIFETIME",
    "FENCING_HEADER",
    "fenced_request",
    "fenced_request_async",
    "fencing_headers",
    "raise_for_fence",
]

FENCING_HEADER = "Fencing-Token"
#: How long a token that :func:`fenced_request` signs stays valid, in seconds: long enough for
#: the request to reach the gateway and for the two machines' clocks to differ a little, short
#: enough that a token copied from a log or a proxy is soon worthless.
DEFAULT_TOKEN_LIFETIME = 60.0
#: The longest lifetime a token takes, in seconds (about 31,700 years): its expiry, a Unix time
#: in whole seconds, must fit the token's 19 digits. None means no expiry.
_MAX_LIFETIME = 1e12


def _lease_or_current(lease: Lease | None, helper: str) -> Lease:
    if lease is not None:
        if not isinstance(lease, Lease):
            raise LeaseConfigError(f"{helper}: lease= takes a Lease, got {show_value(lease)}")
        return lease
    current = CURRENT_LEASE.get()
    if current is None:
        raise LeaseError(
            f"{helper}: no lease is held here; call it inside the execution of a @lease_task / "
            "LeaseTask (it sends the current lease's fence), or pass lease="
        )
    return current


def _lifetime(expires_in: object, *, ended_ok: bool = False) -> float | None:
    """``expires_in`` as float seconds (None: no expiry), or LeaseConfigError naming it.

    A token's lifetime is a finite number of seconds, and a positive one: a lifetime that has
    already ended would send a token every gateway refuses (``ended_ok``: FenceSigner.sign,
    which a test may ask for an expired token on purpose).
    """
    if expires_in is None:
        return None
    if isinstance(expires_in, bool) or not isinstance(expires_in, (int, float)):
        raise LeaseConfigError(
            f"expires_in must be a number of seconds or None, got {show_value(expires_in)}"
        )
    value = float(expires_in)
    if not math.isfinite(value) or value > _MAX_LIFETIME:
        raise LeaseConfigError(
            f"expires_in={show_value(expires_in)} is no lifetime a token can carry: give a "
            f"finite number of seconds up to {_MAX_LIFETIME:.0e}, or None for a token that "
            "never expires"
        )
    if value <= 0 and not ended_ok:
        raise LeaseConfigError(
            f"expires_in={show_value(expires_in)}: a token's lifetime must be > 0 seconds "
            "(this one would have ended before it is sent, and every gateway would refuse "
            "it); give the seconds the token stays valid (60 by default), or None for no "
            "expiry"
        )
    return value


def fencing_headers(
    lease: Lease | None = None,
    *,
    signer: TokenSigner | None = None,
    expires_in: float | None = None,
) -> dict[str, str]:
    """Headers a client sends with a fenced call: ``{"Fencing-Token": ...}``.

    Unsigned: ``<resource>;<fence>``. With a signer: a signed token, so the gateway can reject a
    caller that invents a higher fence.

    Args:
        lease: the lease whose fence to send; default the current lease task's.
        signer: sign the token (the gateway verifies it with the same keys).
        expires_in: with a signer, how many seconds the token stays valid, counted on this
            machine's wall clock from now; the gateway compares the expiry with its own wall
            clock, so leave room for the clocks' difference. None (the default here): the
            token never expires, and a copy of it stays usable for as long as its fence is the
            newest. Without a signer there is no expiry (nothing would stop a caller changing
            it). A finite number above 0 (up to 1e12), or None.

    Raises:
        LeaseConfigError: ``expires_in`` is not finite or not above 0.
        LeaseError: no lease given and none held in this context.
    """
    lease = _lease_or_current(lease, "fencing_headers")
    lifetime = _lifetime(expires_in)
    if signer is not None:
        token = signer.sign(lease.resource, lease.fence, expires_in=lifetime)
        return {FENCING_HEADER: token}
    return {FENCING_HEADER: f"{lease.resource};{lease.fence}"}


def _prepare(
    helper: str,
    lease: Lease | None,
    signer: TokenSigner | None,
    expires_in: float | None,
    headers: Mapping[str, str] | None,
) -> tuple[Lease, dict[str, str]]:
    lease = _lease_or_current(lease, helper)
    # A lease known lost sends nothing: the newer owner may be acting on the resource already.
    raise_if_interrupted()
    lease.check()
    sent = {k: v for k, v in (headers or {}).items() if k.lower() != FENCING_HEADER.lower()}
    sent.update(fencing_headers(lease, signer=signer, expires_in=expires_in))
    return lease, sent


def fenced_request(
    client: Any,
    method: str,
    url: str,
    *,
    lease: Lease | None = None,
    signer: TokenSigner | None = None,
    expires_in: float | None = DEFAULT_TOKEN_LIFETIME,
    headers: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """Call an HTTP gate with the lease's fencing token; a refusal raises.

    The token goes in the ``Fencing-Token`` header (any of ``headers`` is sent too); the other
    keyword arguments go to ``client.request`` unchanged (``json=``, ``timeout=``, ...).

    <!-- test: typecheck, needs a gateway on the network -->
    ```python
    import requests

    from celery_lease import lease_task
    from celery_lease.fencing import FenceSigner, fenced_request

    signer = FenceSigner({"2026-12": b"the active secret, 32 bytes or more"}, active="2026-12")
    browser = requests.Session()

    @lease_task(resource="browser/account-{account_id}")
    def refresh(account_id: int) -> None:
        fenced_request(browser, "POST", "http://gateway/act", json={"click": "Refresh"},
                       signer=signer, timeout=30)  # StaleFenceError: a newer owner exists
    ```

    Args:
        client: a ``requests.Session``, the ``requests`` module, an ``httpx.Client``, the
            ``httpx`` module: anything with ``request(method, url, headers=..., **kwargs)``.
        method: the HTTP method.
        url: the gateway's URL.
        lease: the lease whose fence to send; default the current lease task's.
        signer: sign the token; the gateway then refuses invented fences.
        expires_in: seconds a signed token stays valid (see :func:`fencing_headers`); one is
            signed for every call, so it only has to outlive the request's way to the gateway
            and the difference between the two clocks. None: never expires. A finite number
            above 0 (up to 1e12), else LeaseConfigError and nothing is sent.
        headers: more headers to send.
        **kwargs: passed on to ``client.request``.

    Returns:
        the client's response, for any status but 409 and 403.

    Raises:
        StaleFenceError: the gateway answered 409: it accepted a newer fence for the resource
            (a newer owner exists). In a lease task's body the task goes to RETRY.
        InvalidFenceTokenError: the gateway answered 403: the token is missing, malformed,
            forged, signed with a key it does not know, expired or for another resource.
        LeaseLostError: the lease is known lost already; nothing was sent.
        LeaseError: no lease given and none held in this context.
    """
    lease, sent = _prepare("fenced_request", lease, signer, expires_in, headers)
    response = client.request(method, url, headers=sent, **kwargs)
    return raise_for_fence(response, lease)


async def fenced_request_async(
    client: Any,
    method: str,
    url: str,
    *,
    lease: Lease | None = None,
    signer: TokenSigner | None = None,
    expires_in: float | None = DEFAULT_TOKEN_LIFETIME,
    headers: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """:func:`fenced_request` for an ``httpx.AsyncClient`` (``await client.request(...)``)."""
    lease, sent = _prepare("fenced_request_async", lease, signer, expires_in, headers)
    response = await client.request(method, url, headers=sent, **kwargs)
    return raise_for_fence(response, lease)


def raise_for_fence(response: Any, lease: Lease | None = None) -> Any:
    """Turn a gateway's 409 into StaleFenceError and its 403 into InvalidFenceTokenError.

    For calls made without :func:`fenced_request` (``requests.post(url,
    headers=fencing_headers(...))``). Any other status is left to the caller.

    Args:
        response: a ``requests`` or ``httpx`` response (anything with ``status_code``).
        lease: the lease whose token was sent (named in the error); default the current one.

    Returns:
        ``response``, when its status is neither 409 nor 403.

    Raises:
        StaleFenceError: on 409; its ``highest`` is the fence the answer's JSON body names as
            ``{"highest": N}``, else None.
        InvalidFenceTokenError: on 403.
    """
    status = getattr(response, "status_code", None)
    if status not in (403, 409):
        return response
    if lease is None:
        lease = CURRENT_LEASE.get()
    resource, fence = (None, None) if lease is None else (lease.resource, lease.fence)
    what = "its fencing token" if lease is None else f"fence {fence} for {resource!r}"
    where = _where(response)
    if status == 409:
        highest = _highest_in(response)
        newer = "a newer fence" if highest is None else f"fence {highest}"
        raise StaleFenceError(
            f"the gateway refused {what} as stale ({where} answered 409): it accepted {newer}, "
            "a newer owner holds or held the lease; stop acting",
            resource,
            fence,
            highest,
        )
    raise InvalidFenceTokenError(
        f"the gateway refused {what} ({where} answered 403): the token is missing, malformed, "
        "forged, signed with a key it does not know, expired (check expires_in and both "
        "machines' clocks) or for another resource"
    )


def _highest_in(response: Any) -> int | None:
    """The newer fence a 409's JSON body names (``{"highest": N}``, as the gateways in
    docs/fencing.md answer), or None: no JSON, no such field, or no fence a store grants."""
    try:
        body = response.json()
    except Exception:  # noqa: BLE001 - any body, any library: the fence is then unknown
        return None
    highest = body.get("highest") if isinstance(body, dict) else None
    if isinstance(highest, bool) or not isinstance(highest, int) or not 0 < highest <= MAX_FENCE:
        return None
    return highest


def _where(response: Any) -> str:
    """``METHOD url`` of the response's request, without the query (it may carry an API key)
    and with any password masked."""
    try:
        request = response.request
    except (AttributeError, RuntimeError):  # (httpx: a response built without a request)
        request = None
    method = getattr(request, "method", None)
    url = getattr(response, "url", None) or getattr(request, "url", None)
    shown = mask_url(str(url).split("?", 1)[0].split("#", 1)[0]) if url else "the gateway"
    return f"{method} {shown}" if method else shown
