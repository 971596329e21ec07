"""One attempt of a lease task: claim the lease (with a place in the wait list to be woken
from, when it may wait), check what the claim found, admit the fence at the task's gates, run
the body under the lease while the renewer keeps it, and release it.

A refused claim goes to ``_waiting``; a claim that finds a copy of work that already ran to
``_copies``; a store that is down, a lost lease or a refusing gate to ``_outcomes``.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from . import _clock, _copies, _execution, _outcomes, _unique, _waiting, metrics
from . import _events as events
from . import _failpoints as failpoints
from . import _outage as outage
from ._errors import (
    IdentityDoneError,
    LeaseBusyError,
    LeaseLostError,
    LeaseStoreError,
    StaleFenceError,
)
from ._eventlog import log as event_log
from ._interrupt import Interrupter, LeaseInterrupt
from ._lease import CURRENT_LEASE, Lease, Owner, identity_outcome
from ._message import (
    POLLS_HEADER,
    PUBLISHED_HEADER,
    UNIQUE_HEADER,
    WAITS_HEADER,
    bound_size,
    owner_label,
    read_header,
    request_get,
    waiter_name,
    wake_payload,
)
from ._renewer import Hold, Renewer, get_renewer
from ._wakes import EARLY_HEADER, WOKEN_HEADER
from .stores._bounds import POLL

if TYPE_CHECKING:
    from ._setup import TaskSetup
    from .stores import LeaseStore

#: Whether a waiter that cannot have its message kept (no identity, a message over its bound)
#: polls in a place in the wait list (the tests' negative control sets False: it then waits
#: with the back-off, not listed, as before issue 32).
POLLING_PLACES = True
#: What a claim passes a store that can tell the next waiter (see Lease.next_wake).
_EARLY_WAKE: dict[str, Any] = {"early_wake": True}
_NO_EXTRA: dict[str, Any] = {}
#: What an early copy's claim passes such a store: the waits count of its own listed place.
_OWN_WAKE: dict[str, Any] = {"own_wake": True}
_OWN_WAKE_EARLY: dict[str, Any] = {**_EARLY_WAKE, **_OWN_WAKE}
#: The series every claim counts (looked up once, not per task).
_CLAIMED = events.Recorder(
    metrics.Series("c", "celery_lease_claims_total"),
    metrics.Series("h", "celery_lease_acquire_seconds", result="claimed"),
)


class Attempt:
    """One attempt of ``task`` (the Celery task object, its ``request`` the execution's) with
    the call's ``args`` and ``kwargs``; ``direct``: called directly, not through a worker
    or ``apply()``. :meth:`run` does it all and returns the body's result."""

    __slots__ = (
        "args",
        "direct",
        "early",
        "extra",
        "identity",
        "kwargs",
        "plain_first",
        "poll",
        "request",
        "resource",
        "setup",
        "store",
        "task",
        "too_large",
        "wait",
        "waiter",
    )
    resource: str
    identity: str | None
    store: LeaseStore
    #: The claim's plan (see _plan).
    wait: tuple[str, float] | None
    waiter: str | None
    poll: float | None
    too_large: int
    early: bool
    plain_first: bool
    extra: dict[str, Any]

    def __init__(
        self,
        task: Any,
        setup: TaskSetup,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        direct: bool,
    ) -> None:
        self.task = task
        self.setup = setup
        self.request = request
        self.args = args
        self.kwargs = kwargs
        self.direct = direct

    def run(self) -> Any:
        task, setup, request = self.task, self.setup, self.request
        resource = self.resource = task._resource(setup, self.args, self.kwargs)
        self.identity = task._identity(setup, self.args, self.kwargs, request)
        gates = setup.gates
        gated = None if gates is None else gates.keys(resource, self.args, self.kwargs)
        try:
            store = self.store = setup.current_store()
        except LeaseStoreError as exc:  # the store could not be made: its server is unreachable
            _outcomes.store_down(task, setup, exc, resource)
        owner = Owner.fresh(owner_label(request, task.name))
        renewer = get_renewer()
        renewer.prepare(store)  # the renewal connection opens while the claim runs
        self._plan()
        claim_started = _clock.monotonic()
        try:
            lease = self._claim(owner, claim_started)
        except IdentityDoneError as done:
            _observe_acquire(claim_started, "duplicate")
            return _copies.duplicate_done(task, done)
        claim_seconds = _clock.monotonic() - claim_started
        woken = (
            read_header(request, WOKEN_HEADER)
            if self.identity is not None or self.wait is not None
            else None
        )
        if woken is not None and (self.wait is not None or self.early):
            with contextlib.suppress(TypeError, ValueError):
                events.observe("celery_lease_handoff_seconds", _clock.wall() - float(woken))
        if outage.down:  # (one dict test while the store is fine)
            outage.claim_succeeded(store.url)
        failpoints.hit("after_acquire")
        _CLAIMED.record(claim_seconds)
        if event_log.isEnabledFor(logging.DEBUG):  # (not the call, when it is off)
            _execution.log_event(
                task, "claimed", logging.DEBUG, lease.resource, lease.fence, lease.owner.label
            )
        if (
            lease.identity_state is not None
            or lease.identity_attempt > (request.retries or 0)
            or (woken is not None and self.identity is not None)
        ):
            self._check_copy(lease)  # or this copy ends here
        lease.margin = setup.settings.effective_margin
        if lease.remaining() <= 0:
            self._too_late(lease)
        if gated:
            self._admit_at_gates(gated, lease)  # or the attempt ends here
        hook = getattr(task, "reconcile_effect", None)
        if hook is not None:
            lease.reconcile_effect = hook
        if lease.recovered:
            _recovered(task, lease)
        if (
            setup.settings.unique == "until_executing"
            and request_get(request, UNIQUE_HEADER) is not None
        ):
            _unique.at_body(task, setup, request)  # its publish lock goes before the body
        return self._run_leased(lease, renewer)

    # -- the claim ------------------------------------------------------------------------------
    def _plan(self) -> None:
        """How this attempt claims: with a place to be woken from (``wait``: its wake payload
        and the place's lifetime; POLL for a place that polls), as an early copy (which must
        not re-arm its place), plainly first (``plain_first``), or plainly."""
        task, setup, request = self.task, self.setup, self.request
        settings = setup.settings
        self.wait, self.too_large, self.poll, self.waiter = None, 0, None, None
        self.plain_first = False
        can_wait = settings.handoff and settings.on_busy == "retry" and not self.direct
        waiting = can_wait and self.identity is not None
        # Sent before the release that wakes it (see _execution.release): its claim must not
        # re-arm the place, which that release may not have woken yet (it then wakes it, not
        # again).
        self.early = early = waiting and read_header(request, EARLY_HEADER) is not None
        self.extra = (
            _EARLY_WAKE
            if settings.handoff
            and settings.handoff_early_wake
            and getattr(self.store, "supports_early_wake", False)
            else _NO_EXTRA
        )
        if waiting and not early:
            wait = self.wait = wake_payload(task, setup, request, self.args, self.kwargs)
            # (ASCII-only JSON: its length is its size in bytes)
            if wait is not None and len(wait[0]) > settings.handoff_max_payload:
                # Measured without its celery_lease_waits counter, which grows by a digit now
                # and then (9 -> 10): a listed waiter's next copy measures the same, so it is
                # re-armed rather than left to lapse out of the list.
                size = bound_size(wait[0], request)
                if size > settings.handoff_max_payload:  # it polls in its place
                    self.too_large = size
                    self.wait = (POLL, wait[1]) if POLLING_PLACES else None
        elif (
            can_wait
            and self.identity is None
            and not request.is_eager
            and request.id is not None
            and POLLING_PLACES
        ):
            # No identity to tell two copies apart: no message to wake, one copy at a time
            # that polls in a place named by its task id (invariant 12). A first arrival
            # claims plainly and takes a place only when refused (one round trip less when
            # the resource is free); a copy back from polling names its place at once.
            if read_header(request, POLLS_HEADER) is None:
                self.plain_first = True
            else:
                self._poll_in_place()
        if self.wait is not None and self.wait[0] == POLL:
            # (comes back by itself: once a grace, so it is there when its turn comes)
            self.poll = float(getattr(self.store, "handoff_grace", 2.0))
        elif self.wait is not None or (
            waiting and int(read_header(request, WAITS_HEADER) or 0) >= settings.busy_max_waits
        ):
            # (its last allowed wait sends no place to wake, but a copy of this waiter that
            # listed one earlier may have been woken, refused and given up already)
            _copies.drop_if_finished(task, request, self.resource)

    def _poll_in_place(self) -> None:
        """Claim with a polling place named by the task id (a task without an identity)."""
        self.wait = (POLL, self.setup.wait_ttl(0))
        self.waiter = waiter_name(self.request.id)
        self.poll = float(getattr(self.store, "handoff_grace", 2.0))

    def _claim(self, owner: Owner, claim_started: float) -> Lease:
        """The store's claim as planned; a refusal or a store that fails ends the attempt."""
        store, resource, settings = self.store, self.resource, self.setup.settings
        try:
            if self.plain_first:
                lease = self._plain_claim(owner)
                if lease is not None:
                    return lease
                self._poll_in_place()
            wait, extra = self.wait, self.extra
            if wait is not None:
                if self.waiter is not None or settings.order == "publish":
                    extra = {**extra, **self._place_options()}
                return store.acquire(
                    resource,
                    owner,
                    settings.ttl,
                    identity=self.identity,
                    wait=wait[0],
                    wait_ttl=wait[1],
                    # (so a copy of an older attempt, a back-stop sent before a retry, never
                    # takes over the place and wake of this identity's newer attempt)
                    attempt=self.request.retries or 0,
                    **extra,
                )
            if self.early:
                return store.acquire(
                    resource,
                    owner,
                    settings.ttl,
                    identity=self.identity,
                    attempt=self.request.retries or 0,
                    # (its place's waits count: re-armed since the waker's claim named it?)
                    **(
                        (_OWN_WAKE_EARLY if extra else _OWN_WAKE)
                        if getattr(store, "supports_early_wake", False)
                        else extra
                    ),
                )
            return store.acquire(resource, owner, settings.ttl, identity=self.identity, **extra)
        except IdentityDoneError:
            raise
        except LeaseBusyError as busy:
            _observe_acquire(claim_started, "busy")
            self._refused(busy)
        except LeaseStoreError as exc:
            _observe_acquire(claim_started, "error")
            # The claim's outcome is unknown; if it happened, the lease expires within its ttl.
            # One sent with a place to wake may have been refused and listed it: the next
            # release then wakes a copy of this message.
            listed = (self.wait is not None or self.early) and not exc.refused
            _outcomes.store_down(self.task, self.setup, exc, resource, listed)

    def _plain_claim(self, owner: Owner) -> Lease | None:
        """A claim without a place: the lease, or None when refused (a head waiter nobody
        woke is woken, as any refused claim does)."""
        store, resource = self.store, self.resource
        try:
            return store.acquire(resource, owner, self.setup.settings.ttl, **self.extra)
        except LeaseBusyError as busy:
            if busy.wake is not None:
                _execution.wake(self.task, busy.wake, resource, "claim", busy.fence, store=store)
            return None

    def _place_options(self) -> dict[str, Any]:
        """The claim's options that name and order its place: ``waiter`` (a task without an
        identity: its task id) and, with ``order="publish"``, when its message was
        published."""
        options: dict[str, Any] = {}
        if self.waiter is not None:
            options["waiter"] = self.waiter
        if self.setup.settings.order == "publish":
            published = read_header(self.request, PUBLISHED_HEADER)
            with contextlib.suppress(TypeError, ValueError):  # (not ours: placed by arrival)
                options["since"] = int(published)
        return options

    def _refused(self, busy: LeaseBusyError) -> NoReturn:
        """Hand a refused claim to ``_waiting``, with what the claim knew of it."""
        setup, wait = self.setup, self.wait
        # (every store of this package has a wait_cap; a third-party one may not)
        cap = budget = None
        too_large = self.too_large
        if wait is not None and wait[0] != POLL:
            cap = _wait_bounds(self.store)
            budget = getattr(self.store, "wait_bytes_cap", None)
            if (not busy.position or busy.polling) and budget is not None and len(wait[0]) > budget:
                # bigger than the list's whole budget: too large, not "the list is full"
                too_large, cap = len(wait[0]), None
            else:
                budget = None
        poll = (
            self.poll if self.poll is not None else float(getattr(self.store, "handoff_grace", 2.0))
        )
        _waiting.lease_busy(self.task, setup, busy, _waiting.Refused(cap, too_large, budget, poll))

    # -- what the claim found -------------------------------------------------------------------
    def _too_late(self, lease: Lease) -> NoReturn:
        """The claim's reply came back after the self-fence deadline (the store was slow or
        unreachable): holding it would be lost at once. Give it back and wait."""
        task, resource = self.task, self.resource
        outcome = identity_outcome("retry", self.request.retries or 0)
        _execution.release(task, lease, outcome if lease.identity else "failed", None)
        _outcomes.store_down(
            task,
            self.setup,
            LeaseStoreError(
                f"the claim of {resource!r} took longer than its ttl minus the self-fence "
                "margin to come back; the store is slow or unreachable"
            ),
            resource,
        )

    def _check_copy(self, lease: Lease) -> None:
        """End this copy here when its claim found it is a copy of work that already ran,
        failed or moved on (see _copies); return to run it."""
        task, request = self.task, self.request
        if lease.identity_state == "failed":
            if _copies.copy_of_failed(lease, request):
                # A copy of this execution that already ran and failed (a waiter's woken copy
                # and its back-stop copy: the one that claimed first ran the body).
                _copies.failed_copy(task, lease)
        elif lease.identity_attempt > (request.retries or 0):
            # A copy of an attempt the identity has moved past (a back-stop re-queued before
            # a woken copy ran this attempt and retried): a copy of the newer one runs it.
            _waiting.lease_busy(task, self.setup, _copies.superseded(task, lease))
        elif (
            lease.identity_state == "retry"
            and read_header(request, WOKEN_HEADER) is not None
            and _copies.copy_of_run(lease, request)
        ):
            # Another copy of this execution ran this attempt and ended without an outcome
            # (SystemExit in a prefork child: Celery stored a WorkerLostError FAILURE, unless
            # acks_late and reject_on_worker_lost redeliver it; a lost lease: RETRY). The
            # result backend tells (back-stop copies read it before their claim).
            _copies.drop_if_finished(task, request, self.resource, lease)
        elif self.identity is not None and _copies.sibling_may_have_given_up(
            task, request, self.setup.settings, lease
        ):
            # A woken copy whose back-stop sibling may have ended FAILURE without claiming
            # ("gave up after N busy waits", or on an unreachable store), leaving this place
            # listed. The result backend tells; on a final state the lease is given back
            # (waking the next waiter) and this copy ends unrun.
            _copies.drop_if_finished(task, request, self.resource, lease)

    def _admit_at_gates(self, gated: Any, lease: Lease) -> None:
        """Admit the new fence at each of the task's gates (``gates=``), before the body.

        A refusal ends this attempt once the lease is given back (as a claim that did not run
        the body): a stale fence there as a lost lease (run again later), a key the gate
        refuses as a bad resource would (LeaseConfigError), any other failure as a lease store
        outage (sent again on ``lease_store_down_max_wait``).
        """
        task, request, gates = self.task, self.request, self.setup.gates
        assert gates is not None
        try:
            refusal = gates.admit(gated, lease, request.id)
        except BaseException:  # SystemExit, KeyboardInterrupt: the worker stops; give it back
            _execution.release(task, lease, identity_outcome("retry", request.retries or 0), None)
            raise
        if refusal is not None:
            _execution.release(task, lease, identity_outcome("retry", request.retries or 0), None)
            _outcomes.gate_refused(task, self.setup, refusal, lease)

    # -- the body -------------------------------------------------------------------------------
    def _run_leased(self, lease: Lease, renewer: Renewer) -> Any:
        """Run the body while the renewer keeps the lease; release it whatever happens."""
        task, request, settings = self.task, self.request, self.setup.settings
        interrupter = Interrupter()
        context_token = CURRENT_LEASE.set(lease)
        started = _clock.monotonic()
        hold: Hold | None = None
        outcome = "failed"
        ended = False  # the execution ends here (its publish lock, if any, is given back)
        attempt = request.retries or 0  # copies of earlier attempts are superseded
        result: Any = None
        try:
            try:
                interrupter.arm()
                hold = renewer.hold(
                    lease,
                    interval=settings.effective_renew_interval,
                    max_runtime=settings.max_runtime,
                    on_lost=partial(
                        _outcomes.lease_lost_in_flight,
                        task,
                        interrupter,
                        request.id,
                        request.hostname,
                    ),
                )
                if lease.recovered:
                    failpoints.hit("inside_reconcile")
                    task._reconcile(lease)
                result = self._invoke_body(lease)
                interrupter.disarm()
                lease.check()  # never report success for a lease known lost or past deadline
                outcome = "done"
                ended = True
            except (LeaseLostError, LeaseInterrupt) as exc:
                # (LeaseInterrupt is a BaseException: an except Exception in the body lets it
                # through, and so must every clause here that means "the lease is lost".)
                interrupter.disarm()
                outcome = "retry"
                lost = lease.lost or lease.mark_lost(
                    exc
                    if isinstance(exc, LeaseLostError)
                    else LeaseLostError.lost(lease.resource, lease.fence, "interrupted")
                )
                _outcomes.lease_lost(task, self.setup, lost, lease)
            except StaleFenceError as exc:
                # A side effect saw a newer fence: a newer owner exists, our lease is lost.
                interrupter.disarm()
                outcome = "retry"
                _outcomes.stale_fence(task, self.setup, lease, exc)
            except SoftTimeLimitExceeded:
                interrupter.disarm()
                if lease.lost is not None:
                    outcome = "retry"
                    _outcomes.lease_lost(task, self.setup, lease.lost, lease)
                ended = lease.lost is None
                raise
            except (Retry, Ignore, Reject) as exc:
                interrupter.disarm()
                outcome = "retry"  # not finished: a later delivery runs it again
                if isinstance(exc, Retry):  # self.retry(): the next attempt is the current one
                    attempt += 1
                # (the body's own Ignore, or a Reject that drops the message, ends it all the
                # same for its publish lock)
                ended = isinstance(exc, Ignore) or (isinstance(exc, Reject) and not exc.requeue)
                raise
            except Exception:
                interrupter.disarm()
                ended = True
                raise  # a failure: copies of this execution end without running it again
            except BaseException:
                interrupter.disarm()
                # SystemExit, KeyboardInterrupt, GreenletExit: the worker stops, Celery stores
                # no failure and a redelivery runs the attempt again
                outcome = "retry"
                raise
        finally:
            if hold is not None:
                renewer.drop(hold)
            CURRENT_LEASE.reset(context_token)
            _execution.release(
                task,
                lease,
                identity_outcome(outcome, attempt),
                result,
                held_since=started,
                early=True,
            )
            if ended and request_get(request, UNIQUE_HEADER) is not None:
                # Before Celery stores the result and sends a chain's next step, which may
                # need this key (after_return comes after both).
                _unique.finished(task, request)
        failpoints.hit("after_ledger_before_ack")
        return result

    def _invoke_body(self, lease: Lease) -> Any:
        task = self.task
        if not self.direct:
            # The worker (or apply()) already pushed this execution's request.
            self.request.lease = lease
            return task.run(*self.args, **self.kwargs)
        _task_stack.push(task)
        task.push_request(args=self.args, kwargs=self.kwargs, lease=lease)
        try:
            return task.run(*self.args, **self.kwargs)
        finally:
            task.pop_request()
            _task_stack.pop()


def _recovered(task: Any, lease: Lease) -> None:
    """Say that this claim took over from an owner that did not finish."""
    events.count("celery_lease_takeovers_total")
    _execution.log_event(
        task,
        "recovered",
        logging.WARNING,
        lease.resource,
        lease.fence,
        lease.owner.label,
        previous_holder=lease.previous_owner_label,
        previous_fence=lease.previous_fence,
        state=lease.identity_state or "expired without release",
    )
    _execution.lease_event(
        task,
        "task-lease-recovered",
        resource=lease.resource,
        fence=lease.fence,
        previous_owner=lease.previous_owner_label,
        previous_fence=lease.previous_fence,
    )


def _observe_acquire(started: float, result: str) -> None:
    events.observe("celery_lease_acquire_seconds", _clock.monotonic() - started, result=result)


def _wait_bounds(store: LeaseStore) -> str:
    """The store's wait list bounds, as a full list's refusal names them (past either one a
    refused claim is not listed)."""
    cap = int(getattr(store, "wait_cap", 0))
    if not cap:
        return ""
    shown = f"wait_cap {cap} waiters"
    cap_bytes = getattr(store, "wait_bytes_cap", None)
    if cap_bytes:
        shown += f" or wait_bytes_cap {int(cap_bytes)} bytes of wake messages"
    return shown
