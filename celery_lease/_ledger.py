"""The idempotency ledger: side effects that take place at most once per identity and key.

An effect goes intent -> done in the store. Its intent is recorded (fenced: only the live owner
can) right before it runs, and done with a receipt right after. A later owner of the same
identity (a redelivery, a retry, a takeover after a crash) finds:

* done: the receipt comes back and the effect does not run again;
* intent without done: the earlier owner crashed in between, and nobody knows whether the
  effect took place. The task's ``reconcile_effect(key, lease)`` looks at the outside world and
  returns the receipt (it happened) or :data:`REDO` (it did not). Without that hook the task
  fails with :class:`EffectUnresolvedError` rather than replaying blindly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery._state import get_current_task

from . import _events as events
from . import _failpoints as failpoints
from ._codec import decode, encode
from ._errors import EffectUnresolvedError, LeaseConfigError
from ._eventlog import lease_log
from ._names import RESOURCE_PATTERN, RESOURCE_RULE, holder_task_id, show_value

if TYPE_CHECKING:
    from ._lease import Lease

__all__ = ["REDO", "Effect", "decode", "encode", "write_checkpoint"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Redo:
    """Returned by ``reconcile_effect`` when the effect did not take place: run it again."""

    def __repr__(self) -> str:
        return "REDO"


REDO = _Redo()


#: What the messages about a bad effect key or checkpoint step name suggest.
EFFECT_EXAMPLE = "e.g. lease.effect('charge:inv-42')"
STEP_EXAMPLE = (
    "pass the step's name first and its data second, e.g. lease.checkpoint('page', {'page': 3})"
)


def _valid_name(value: object, what: str, rule: str, fix: str) -> str:
    """Return ``value`` if it follows the resource-name rule, else raise LeaseConfigError.

    Effect keys and checkpoint step names share that rule (the stores key records by them),
    but a bad one must be called what it is: "invalid lease resource" sent users looking at
    the task's resource= when they had passed a checkpoint's data as its step.
    """
    if isinstance(value, str) and RESOURCE_PATTERN.fullmatch(value):
        return value
    raise LeaseConfigError(
        f"{what} {show_value(value)} is not valid: {rule} is {RESOURCE_RULE}; {fix}"
    )


def _needs_identity(lease: Lease, what: str) -> tuple[Any, str]:
    if lease.identity is None or lease.store is None:
        raise LeaseConfigError(
            f"{what} needs a task identity: this lease has none (dedup is off for the task, or "
            "the lease was claimed directly from a store without identity=)"
        )
    return lease.store, lease.identity


class Effect:
    """One ledgered side effect of a lease's identity (see the module docstring).

    Attributes:
        key: the effect's key, unique per identity (``"charge:inv-42"``).
        done: True when the effect is recorded done (before or by this owner).
        replayed: True when it was done by an earlier owner and did not run here.
        receipt: what the effect returned (JSON-serialisable), recorded with done.
        previous_fence: the fence of the earlier owner that left an unfinished intent.
    """

    def __init__(self, lease: Lease, key: str) -> None:
        self.lease = lease
        self.key = _valid_name(
            key, "lease.effect() key", "an effect key, unique per identity,", EFFECT_EXAMPLE
        )
        _needs_identity(lease, "lease.effect()")
        self.done = False
        self.replayed = False
        self.receipt: Any = None
        self.previous_fence: int | None = None
        self._begun = False

    def __enter__(self) -> Effect:
        lease = self.lease
        store, _ = _needs_identity(lease, "lease.effect()")
        lease.check()
        # One round trip: proves owner + fence + unexpired and records the intent.
        state, previous_fence, receipt = store.effect_begin(lease, self.key)
        self._begun = True
        if state == "done":
            self.done = self.replayed = True
            self.receipt = decode(receipt)
            events.count("celery_lease_effects_total", outcome="replayed")
            _log(
                "effect_done",
                lease,
                key=self.key,
                done_fence=previous_fence,
                action="effect already done: not run again, its receipt returned",
            )
            return self
        if state == "intent":
            self.previous_fence = previous_fence
            hook = lease.reconcile_effect
            if hook is None:
                events.count("celery_lease_reconciliations_total", outcome="unresolved")
                raise EffectUnresolvedError(
                    f"effect {self.key!r} of identity {lease.identity!r} was begun by an "
                    f"earlier owner (fence {previous_fence}) that never recorded it done; "
                    "define reconcile_effect(key, lease) on the task to check whether it took "
                    "place (return the receipt) or not (return REDO)",
                    lease.resource,
                    lease.identity,
                    self.key,
                )
            failpoints.hit("inside_reconcile")
            outcome = hook(self.key, lease)
            events.count(
                "celery_lease_reconciliations_total",
                outcome="redo" if outcome is REDO else "receipt",
            )
            if outcome is not REDO:
                self._record_done(outcome, "reconciled")
                self.replayed = True
            _log(
                "reconciled",
                lease,
                key=self.key,
                previous_fence=previous_fence,
                action=(
                    "reconcile_effect said REDO: it did not take place, runs now"
                    if outcome is REDO
                    else "reconcile_effect returned its receipt: it took place, not run again"
                ),
            )
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None or self.done:
            # On an error the effect may or may not have happened: the intent stays, and the
            # next owner reconciles.
            return
        failpoints.hit("after_effect_before_ledger")
        self._record_done(self.receipt, "recorded")

    def _record_done(self, receipt: Any, outcome: str) -> None:
        store, _ = _needs_identity(self.lease, "lease.effect()")
        if not store.effect_done(self.lease, self.key, encode(receipt)):
            events.count("celery_lease_effects_total", outcome="superseded")
            log.warning(
                "effect %r of %r: a newer owner took over its intent before it was recorded "
                "done (fence %d)",
                self.key,
                self.lease.identity,
                self.lease.fence,
            )
        else:
            events.count("celery_lease_effects_total", outcome=outcome)
        self.done = True
        self.receipt = receipt

    def __call__(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` as the effect unless it is already done; return the receipt."""
        with self as effect:
            if not effect.done:
                effect.receipt = fn()
        return effect.receipt  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<Effect {self.key!r} of {self.lease.identity!r} done={self.done}>"


def _log(event: str, lease: Lease, **fields: Any) -> None:
    """One lease event line for an effect of ``lease`` (see ``_eventlog``), naming the task
    execution that holds it when it is the one running here (its owner label ends with the
    running task's id, see ``_names.holder_task_id``)."""
    task = get_current_task()
    task_id = getattr(getattr(task, "request", None), "id", None)
    if task_id is None or holder_task_id(lease.owner.label) != task_id:
        task = task_id = None
    lease_log(
        event,
        logging.INFO,
        resource=lease.resource,
        fence=lease.fence,
        holder=lease.owner.label,
        task_id=task_id,
        task=getattr(task, "name", None),
        identity=lease.identity,
        **fields,
    )


def write_checkpoint(lease: Lease, step: str, data: Any) -> None:
    """Record ``data`` for ``step`` of the lease's identity (fenced; see Lease.checkpoint)."""
    store, _ = _needs_identity(lease, "lease.checkpoint()")
    _valid_name(step, "lease.checkpoint() step name", "a step name", STEP_EXAMPLE)
    lease.check()
    updated = {**lease.checkpoints, step: data}
    store.checkpoint(lease, encode(updated))
    lease.checkpoints = updated
