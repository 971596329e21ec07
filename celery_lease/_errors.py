"""The exception tree of celery_lease.

```text
LeaseError                  one root: ``except LeaseError`` catches everything below
├── LeaseBusyError          the resource is held by a live lease of another owner
├── LeaseLostError          this owner no longer holds the lease (expired, taken over,
│                           force-released, renewal failed past the self-fence deadline)
├── StaleFenceError         a side effect saw a fence older than the newest it accepted
├── LeaseStoreError         the store could not be reached or answered with an error;
│                           the outcome of the operation is unknown (``refused``: the
│                           store refused the connection and nothing was sent)
├── LeaseConfigError        bad input or settings: the message names the value and the fix
├── IdentityDoneError       the task identity already completed (a duplicate delivery)
├── AlreadyQueuedError      a publish found its unique key locked by another copy (unique=)
├── EffectUnresolvedError   an earlier owner began an effect and nobody knows if it happened
└── InvalidFenceTokenError  a fencing token was forged, tampered with, expired or malformed
```

Every error keeps its whole state in ``args`` (the message first, then plain JSON-friendly
values), so it survives pickling and ``cls(*exc.args)``, which is how Celery rebuilds an
exception read back from a result backend. Messages never contain an owner token or a DSN
password.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlreadyQueuedError",
    "EffectUnresolvedError",
    "IdentityDoneError",
    "InvalidFenceTokenError",
    "LeaseBusyError",
    "LeaseConfigError",
    "LeaseError",
    "LeaseLostError",
    "LeaseStoreError",
    "StaleFenceError",
]


class LeaseError(Exception):
    """Root of every error raised by celery_lease. ``args[0]`` is the full message."""

    def __init__(self, message: str = "", *details: Any) -> None:
        super().__init__(message, *details)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message


class LeaseConfigError(LeaseError, ValueError):
    """Bad input or settings. The message names the bad value, the rule and the fix."""


class LeaseStoreError(LeaseError):
    """The lease store failed or could not be reached; the operation's outcome is unknown.

    A renewal that ends in this error is *uncertain*, not lost: the owner keeps retrying until
    its self-fence deadline and then treats the lease as lost.

    Attributes:
        refused: True when the store refused the connection (nothing listens there: it is
            down or the address is wrong) before anything of the operation was sent, so the
            operation did not happen.
        transient: True when the store cancelled a statement of the operation for
            contention (PostgreSQL: a lock or statement timeout, a deadlock, a serialization
            failure) and rolled that statement back. An operation of one statement, such as
            a release, then did not happen, and sent again it may succeed.
    """

    def __init__(self, message: str = "", refused: bool = False, transient: bool = False) -> None:
        super().__init__(message, refused)
        self.refused = refused
        self.transient = transient


#: The end of a busy claim's message; a skipped task's message leaves it out (it will not retry).
BUSY_ADVICE = "; retry later or raise the lease wait budget"


class LeaseBusyError(LeaseError):
    """The resource is held by another owner's live lease.

    Attributes:
        resource: the contested resource.
        holder_label: the holder's human label (host, pid, task id), never its token.
        fence: the holder's fence.
        expires_in: seconds until the holder's lease expires unless renewed (store clock).
        duplicate: True when the holder runs the *same* task identity (this claim is a
            redelivered or duplicated copy of work that is running now), False for other work
            contending for the resource. A duplicate is re-armed whatever ``on_busy`` says.
        position: the claimant's place (1 = next) in the resource's FIFO wait list when the
            refused claim joined it (``acquire(wait=...)``), else None.
        polling: True when that place is a polling one (nobody will send the claimant's
            message: its own back-off copy must come back to claim, see invariant 12).
        wake: set by the store (not part of ``args``): the wake payload of a head waiter that
            the claimant must send, because the resource is free but reserved for that waiter
            and nobody woke it (its releaser died).
    """

    def __init__(
        self,
        message: str = "",
        resource: str | None = None,
        holder_label: str | None = None,
        fence: int | None = None,
        expires_in: float | None = None,
        duplicate: bool = False,
        position: int | None = None,
        polling: bool = False,
    ) -> None:
        super().__init__(
            message, resource, holder_label, fence, expires_in, duplicate, position, polling
        )
        self.polling = polling
        self.resource = resource
        self.holder_label = holder_label
        self.fence = fence
        self.expires_in = expires_in
        self.duplicate = duplicate
        self.position = position
        self.wake: str | None = None

    @classmethod
    def held(
        cls,
        resource: str,
        holder_label: str | None,
        fence: int | None,
        expires_in: float | None,
        *,
        duplicate: bool = False,
        position: int | None = None,
        wake: str | None = None,
        polling: bool = False,
    ) -> LeaseBusyError:
        """Build the error with a message that names the holder and when it expires."""
        if holder_label is None:
            detail = "by an owner that is not visible yet (a claim racing this one)"
        else:
            when = "unknown" if expires_in is None else f"{max(expires_in, 0.0):.3f}s"
            detail = f"by {holder_label!r} with fence {fence}, expiring in {when} unless renewed"
        if position:
            detail += f"; waiting at place {position} of its wait list"
            if polling:
                detail += " (polling: its own copy comes back to claim)"
        busy = cls(
            f"resource {resource!r} is held {detail}{BUSY_ADVICE}",
            resource,
            holder_label,
            fence,
            expires_in,
            duplicate,
            position or None,
            bool(position) and polling,
        )
        busy.wake = wake
        return busy


#: Lost-lease reasons a store gives after reading the lease record and finding no live holder
#: (it ran out, was released or force-released, or the store lost its data): only then does a
#: loss without a holder mean "nobody holds it now".
NO_HOLDER_REASONS = frozenset({"expired", "released", "force_released", "store_reset"})


class LeaseLostError(LeaseError):
    """This owner no longer holds the lease; it must stop acting on the resource.

    Attributes:
        resource: the resource whose lease was lost.
        fence: the fence this owner held.
        holder_label: who holds the resource now, when known.
        reason: a short machine-readable cause (``expired``, ``taken_over``, ``released``,
            ``force_released`` (an administrator evicted it), ``self_fenced``, ``max_runtime``,
            ``renew_failed``, ``store_reset``, ``stale_fence``).
    """

    def __init__(
        self,
        message: str = "",
        resource: str | None = None,
        fence: int | None = None,
        holder_label: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, resource, fence, holder_label, reason)
        self.resource = resource
        self.fence = fence
        self.holder_label = holder_label
        self.reason = reason

    @classmethod
    def lost(
        cls,
        resource: str,
        fence: int,
        reason: str,
        holder_label: str | None = None,
        holder_fence: int | None = None,
        holder_expired: bool = False,
    ) -> LeaseLostError:
        """Build the error with a message naming the resource, our fence and the holder.

        ``holder_expired``: the owner that took the lease over (``holder_label``,
        ``holder_fence``) has let it expire too; the message says so and ``holder_label`` is
        None, as nobody holds the resource now.
        """
        if holder_expired and (holder_label is not None or holder_fence is not None):
            by = "" if holder_label is None else f" by {holder_label!r}"
            fenced = "" if holder_fence is None else f" (fence {holder_fence})"
            now = f"; it was taken over{by}{fenced}, whose lease has since expired"
            holder_label = None
        elif holder_label is not None:
            now = f"; now held by {holder_label!r}"
            if holder_fence is not None:
                now += f" with fence {holder_fence}"
        elif reason in NO_HOLDER_REASONS:
            now = "; no live holder now"
        else:
            # The owner noticed by itself (its renewals failed, its runtime cap, a gate saw a
            # newer fence) and did not ask the store: "no live holder" would be a guess, and a
            # wrong one after a takeover.
            now = "; who holds it now is not known here"
        return cls(
            f"lease on {resource!r} with fence {fence} is lost ({reason}){now}; "
            "stop acting on the resource",
            resource,
            fence,
            holder_label,
            reason,
        )


class StaleFenceError(LeaseError):
    """A fenced side effect rejected a fence older than the newest one it accepted, or (a gate
    or fenced write that checks the lease store) older than the newest the store granted.

    Attributes:
        key: the fenced key (resource, row, gateway key).
        fence: the rejected fence.
        highest: the newest fence the side effect had accepted or the store granted, when
            known.
    """

    def __init__(
        self,
        message: str = "",
        key: str | None = None,
        fence: int | None = None,
        highest: int | None = None,
    ) -> None:
        super().__init__(message, key, fence, highest)
        self.key = key
        self.fence = fence
        self.highest = highest

    @classmethod
    def rejected(cls, key: str, fence: int, highest: int | None) -> StaleFenceError:
        """Build the error with a message naming the key and both fences."""
        newer = "a newer fence" if highest is None else f"fence {highest}"
        return cls(
            f"stale fence {fence} rejected for {key!r}: {newer} was accepted or granted "
            "there before; a newer owner holds the lease, stop acting",
            key,
            fence,
            highest,
        )


class IdentityDoneError(LeaseError):
    """The task identity already completed: this message is a duplicate and must not run.

    Raised by a store's ``acquire(..., identity=...)``; the task layer turns it into a SUCCESS
    with the recorded result. Attributes: ``resource``, ``identity``, ``fence`` (of the run that
    completed it), ``result`` (its return value as JSON text, or None) and ``owner_label`` (the
    label of the owner that completed it, ``host:pid:task-id`` for a task; None from a store
    that does not say).
    """

    def __init__(
        self,
        message: str = "",
        resource: str | None = None,
        identity: str | None = None,
        fence: int | None = None,
        result: str | None = None,
        owner_label: str | None = None,
    ) -> None:
        super().__init__(message, resource, identity, fence, result, owner_label)
        self.resource = resource
        self.identity = identity
        self.fence = fence
        self.result = result
        self.owner_label = owner_label

    @classmethod
    def completed(
        cls,
        resource: str,
        identity: str,
        fence: int | None,
        result: str | None,
        owner_label: str | None = None,
    ) -> IdentityDoneError:
        return cls(
            f"identity {identity!r} on {resource!r} already completed (fence {fence}); "
            "this delivery is a duplicate and returns the recorded result",
            resource,
            identity,
            fence,
            result,
            owner_label,
        )


class AlreadyQueuedError(LeaseError):
    """A publish of a task with ``unique=`` (a mode locked at publish) found its unique key
    held by another copy, and ``on_conflict="raise"``: nothing was published.

    Attributes:
        key: the unique key (the lease resource ``celery lease ls`` shows the lock under).
        task_id: the id of the copy that holds it (None when its holder is not a task of
            this library, e.g. a lease claimed by hand on that name).
    """

    def __init__(self, message: str = "", key: str | None = None, task_id: str | None = None):
        super().__init__(message, key, task_id)
        self.key = key
        self.task_id = task_id


class EffectUnresolvedError(LeaseError):
    """An effect was started by an earlier owner and never recorded done, and nothing says
    whether it took place. Replaying it blindly could do it twice, so the task stops here.

    Define ``reconcile_effect(self, key, lease)`` on the task to look at the outside world and
    return the receipt (it happened) or ``REDO`` (it did not).
    """


class InvalidFenceTokenError(LeaseError):
    """A fencing token presented to a side effect is malformed, forged, tampered with,
    expired, signed with an unknown key, or names another resource. Reject the request
    (an HTTP gateway answers 403); unlike a stale fence this is not a lost race."""
