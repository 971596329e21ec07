"""The argument checks every store makes before any I/O, so bad input never reaches a store.

Each check raises ``LeaseConfigError`` saying what is wrong. A claim's and a release's
checks also come in one pass (``_claim_checks``, ``_release_checks``): the arguments a lease
task sends pass in one expression, anything else goes through each check. The stores get them
through :class:`~.base.BaseLeaseStore`.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from .._errors import LeaseConfigError
from .._lease import Lease, Owner, identity_outcome, split_identity_state
from .._names import IDENTITY_RULE, MAX_FENCE, show_value, validate_resource, validate_ttl
from .._names import RESOURCE_PATTERN as _RESOURCE_RE

__all__ = [
    "IDENTITY_OUTCOMES",
    "LOCK_MAX_TTL",
    "LOCK_PREFIX",
    "MAX_LIST_LIMIT",
    "MAX_SWEEP_LIMIT",
    "StoreChecks",
]

#: Resources under this prefix are publish locks (``unique=``): a lock's ttl is how long a
#: queued copy keeps its key (an hour by default), bounded by ``LOCK_MAX_TTL`` instead.
LOCK_PREFIX = "unique:"
LOCK_MAX_TTL = 30 * 86400.0
MAX_LIST_LIMIT = 10_000
MAX_SWEEP_LIMIT = 100_000


IDENTITY_OUTCOMES = ("done", "failed", "retry")
#: The longest a waiter's place may be kept (``acquire``'s ``wait_ttl``), seconds.
_MAX_WAIT_TTL = 365 * 86400.0
_INF = float("inf")


def _positive_int(value: object, name: str) -> int:
    """``value`` when it is an int >= 1 (not a bool: the stores send it as it is, and the Redis
    store keeps it packed with its script's keys, where ``True == 1`` would reuse a head)."""
    if type(value) is not int or value < 1:
        raise LeaseConfigError(f"{name} must be an int >= 1, got {show_value(value)}")
    return value


class StoreChecks:
    """The argument checks of :class:`~.base.BaseLeaseStore` (a store's ``max_ttl`` bounds
    the ttls)."""

    max_ttl: float

    def _claim_checks(
        self,
        resource: str,
        owner: Owner,
        ttl: float,
        identity: str | None,
        waiter: str | None,
        since: int | None,
        wait: str | None,
        wait_ttl: float,
        attempt: int | None,
    ) -> tuple[float, str | None, str | None, str, int | None]:
        """Every check of a claim's arguments, in the order ``acquire`` makes them
        (``_claim_args``, ``_identity_args``, ``_waiter_args``, ``_wait_args``,
        ``_attempt_args``): returns ``(ttl, identity, place name, wait payload, attempt)``.

        The arguments a lease task sends (plain types, valid names, no waiter name or
        ``since``) pass in one expression here, the same rules as those checks apply (a
        claim's eleven Python calls of them cost it about 10k instructions); anything else goes
        through each check, which also says what is wrong.
        """
        if (
            type(resource) is str
            and _RESOURCE_RE.fullmatch(resource) is not None
            and type(owner) is Owner
            and (type(ttl) is float or type(ttl) is int)
            and 0 < ttl <= self.max_ttl
            and ttl < _INF
            and (
                identity is None
                or (type(identity) is str and _RESOURCE_RE.fullmatch(identity) is not None)
            )
            and waiter is None
            and since is None
            and (
                wait is None
                or (
                    identity is not None
                    and type(wait) is str
                    and wait != ""
                    and "\x00" not in wait
                    and wait.isascii()
                    and type(wait_ttl) is float
                    and 0.0 < wait_ttl <= _MAX_WAIT_TTL
                )
            )
            and (attempt is None or (type(attempt) is int and attempt >= 0))
        ):
            return float(ttl), identity, identity, "" if wait is None else wait, attempt
        ttl = self._claim_args(resource, owner, ttl)
        identity = self._identity_args(identity)
        name = self._waiter_args(identity, waiter, since)  # (its place's name)
        payload = self._wait_args(name, wait, wait_ttl)
        return ttl, identity, name, payload, self._attempt_args(attempt)

    def _release_checks(self, lease: Lease, outcome: str | None) -> None:
        """``_renew_ttl(lease, None)`` then ``_outcome_args(lease, outcome)``: a release's
        checks, the common case (a Lease of a claim, an outcome of attempt 0) in one
        expression, anything else through each check."""
        if type(lease) is Lease:
            ttl = lease.ttl
            if (
                type(ttl) is float
                and 0.0 < ttl <= self.max_ttl
                and ttl < _INF
                and type(lease.resource) is str
                and (
                    outcome is None
                    or (
                        type(outcome) is str
                        and outcome in IDENTITY_OUTCOMES
                        and lease.identity is not None
                    )
                )
            ):
                return
        self._renew_ttl(lease, None)
        self._outcome_args(lease, outcome)

    def _claim_args(self, resource: str, owner: Owner, ttl: float) -> float:
        validate_resource(resource)
        if not isinstance(owner, Owner):
            raise LeaseConfigError(
                f"owner must be an Owner (use Owner.new(label)), got {show_value(owner)}"
            )
        return validate_ttl(ttl, self._ttl_bound(resource))

    def _renew_ttl(self, lease: Lease, ttl: float | None) -> float:
        if not isinstance(lease, Lease):
            raise LeaseConfigError(f"expected a Lease from acquire(), got {show_value(lease)}")
        return validate_ttl(lease.ttl if ttl is None else ttl, self._ttl_bound(lease.resource))

    def _ttl_bound(self, resource: str) -> float:
        """The longest ttl of a claim on ``resource``: ``max_ttl``, or for a publish lock
        (under ``LOCK_PREFIX``) ``LOCK_MAX_TTL``, whichever is longer."""
        if resource.startswith(LOCK_PREFIX):
            return max(self.max_ttl, LOCK_MAX_TTL)
        return self.max_ttl

    @staticmethod
    def _identity_args(identity: str | None) -> str | None:
        if identity is None:
            return None
        try:
            return validate_resource(identity)
        except LeaseConfigError:
            raise LeaseConfigError(
                f"invalid task identity {show_value(identity)}: it follows the resource-name "
                f"rule ({IDENTITY_RULE})"
            ) from None

    @staticmethod
    def _waiter_args(identity: str | None, waiter: str | None, since: int | None) -> str | None:
        """The name of the claim's place (its identity, else ``waiter``), ``since`` checked."""
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
            raise LeaseConfigError(
                f"since must be microseconds since the epoch (an int), got {show_value(since)}"
            )
        if waiter is None:
            return identity
        try:
            validate_resource(waiter)
        except LeaseConfigError:
            raise LeaseConfigError(
                f"invalid waiter name {show_value(waiter)}: it follows the resource-name "
                f"rule ({IDENTITY_RULE})"
            ) from None
        return identity if identity is not None else waiter

    @staticmethod
    def _wait_args(identity: str | None, wait: str | None, wait_ttl: float) -> str:
        """``identity``: the place's name (the claim's identity or waiter name)."""
        if wait is None:
            return ""
        if identity is None:
            raise LeaseConfigError(
                "acquire(wait=...) needs identity= or waiter= (the name of the waiter's place)"
            )
        if not isinstance(wait, str) or not wait:
            raise LeaseConfigError(f"wait must be a non-empty string, got {show_value(wait)}")
        # Every store refuses the same payloads: PostgreSQL's JSON cannot hold U+0000, and
        # no store can encode a lone surrogate (the UTF-8 the stores count and keep).
        if "\x00" in wait:
            raise LeaseConfigError(
                f"wait payload has a NUL character (U+0000) at position {wait.index(chr(0))}, "
                "which not every store can keep; escape it (a task's wake message is JSON, "
                "which writes it as \\u0000)"
            )
        if not wait.isascii():
            try:
                wait.encode()
            except UnicodeEncodeError as exc:
                raise LeaseConfigError(
                    f"wait payload has a lone surrogate ({wait[exc.start]!a}) at position "
                    f"{exc.start}, which UTF-8 cannot encode (the stores keep payloads as "
                    "UTF-8); pass valid Unicode text"
                ) from None
        validate_ttl(wait_ttl, _MAX_WAIT_TTL, name="wait_ttl")
        return wait

    @staticmethod
    def _attempt_args(attempt: int | None) -> int | None:
        if attempt is None:
            return None
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise LeaseConfigError(
                f"attempt must be a non-negative int or None, got {show_value(attempt)}"
            )
        return attempt

    @staticmethod
    def _outcome_args(lease: Lease, outcome: str | None) -> None:
        if outcome is None:
            return
        name, attempt = split_identity_state(outcome)
        # (with the attempt of a retried task: "retry:2", see split_identity_state)
        if name not in IDENTITY_OUTCOMES or outcome != identity_outcome(name, attempt):
            raise LeaseConfigError(
                f"release outcome {show_value(outcome)} must be one of {IDENTITY_OUTCOMES}"
            )
        if lease.identity is None:
            raise LeaseConfigError("release(outcome=...) needs a lease claimed with identity=")

    @staticmethod
    def _ledger_args(lease: Lease, key: str) -> tuple[str, str]:
        if lease.identity is None:
            raise LeaseConfigError("the ledger needs a lease claimed with identity=")
        return lease.identity, validate_resource(key)

    @classmethod
    def _records_args(cls, resource: str, identity: str, limit: int) -> tuple[str, str, int]:
        validate_resource(resource)
        # (through the class: a patch of the store's or BaseLeaseStore's check applies)
        ident = cls._identity_args(identity) or ""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise LeaseConfigError(f"limit must be an integer 1..1000, got {show_value(limit)}")
        return resource, ident, limit

    @staticmethod
    def _list_args(prefix: str, limit: int) -> int:
        if not isinstance(prefix, str) or (prefix and not _prefix_ok(prefix)):
            raise LeaseConfigError(
                f"list prefix {show_value(prefix)} must be empty or the start of a valid "
                "resource name"
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LIST_LIMIT:
            raise LeaseConfigError(f"list limit must be 1..{MAX_LIST_LIMIT}, got {limit!r}")
        return limit

    @staticmethod
    def _wake_due_args(
        resources: Sequence[str] | None, limit: int
    ) -> tuple[builtins.list[str] | None, int]:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LIST_LIMIT:
            raise LeaseConfigError(f"wake_due limit must be 1..{MAX_LIST_LIMIT}, got {limit!r}")
        if resources is None:
            return None, limit
        if isinstance(resources, str):
            raise LeaseConfigError(
                f"wake_due resources= takes a list of names, got the string {show_value(resources)}"
            )
        return [validate_resource(r) for r in dict.fromkeys(resources)], limit

    @staticmethod
    def _fence_arg(fence: int | None) -> int | None:
        if fence is None:
            return None
        if isinstance(fence, bool) or not isinstance(fence, int) or not 0 <= fence <= MAX_FENCE:
            raise LeaseConfigError(
                f"fence must be an int from 0 to {MAX_FENCE} (the fence shown for the lease), "
                f"got {show_value(fence)}"
            )
        return fence

    @staticmethod
    def _sweep_args(limit: int) -> int:
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 0 < limit <= MAX_SWEEP_LIMIT
        ):
            raise LeaseConfigError(f"sweep limit must be 1..{MAX_SWEEP_LIMIT}, got {limit!r}")
        return limit


def _prefix_ok(prefix: str) -> bool:
    try:
        validate_resource(prefix)
    except LeaseConfigError:
        return False
    return True
