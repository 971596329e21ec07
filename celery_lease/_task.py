"""LeaseTask and @lease_task: claim before the body runs, renew while it runs, release after.

The claim happens in ``Task.__call__``, in the thread that runs the body, inside one
try/finally that also releases: it is the only hook that sees success, failure, retry, ignore,
reject and time limits alike (``task_prerun`` cannot veto; ``after_return`` is skipped on retry).

Outcomes:
* resource busy: re-queued with a jittered, capped backoff (``on_busy="retry"``), skipped
  (``"skip"``) or failed (``"fail"``); busy waits have their own budget, not ``max_retries``.
  A duplicate of the execution holding the lease (same identity) is always re-queued.
  With an identity and ``on_busy="retry"``, the refused claim also joins the resource's FIFO
  wait list (same round trip, the message to send again as its wake payload); the releaser
  sends the head waiter's message at once (hand-off), and the back-off copy, sent no sooner
  than the lease ttl, is only the back-stop (identity dedup makes the second copy harmless).
* lease lost while running (taken over, renewal failed past the self-fence deadline, runtime
  cap): the body is interrupted and the task goes to RETRY with :class:`LeaseLostError`, never
  SUCCESS; lost-lease re-runs have their own budget too.
* eager (``apply()``) and direct calls never spin: a busy or lost lease raises at once.
* gates (``gates=``, see ``_gates``): right after the claim, before ``reconcile`` and the body,
  each listed gate admits the new fence; a gate that refuses it as stale ends the attempt as a
  lost lease, one that fails as a store outage does (the lease is given back first).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import json.encoder
import logging
import random
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from celery import Task, shared_task, states
from celery._state import _task_stack
from celery.app.task import Context
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from . import _clock, metrics
from . import _events as events
from . import _failpoints as failpoints
from . import _outage as outage
from ._app import (
    AdoptsAppOptions,
    get_store,
    install,
    overridden_store,
    register_task_type,
    wake_queue_for,
    wake_queues_on,
)
from ._codec import decode, encode
from ._errors import (
    BUSY_ADVICE,
    IdentityDoneError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
    LeaseStoreError,
    StaleFenceError,
)
from ._eventlog import SHORTEN_LOOKAHEAD, lease_log, shorten
from ._eventlog import log as event_log
from ._gates import Gates, GatesSpec, Refusal, check_gates
from ._interrupt import Interrupter, LeaseInterrupt, eventlet_patched
from ._lease import CURRENT_LEASE, Lease, Owner, identity_outcome
from ._names import (
    IDENTITY_RULE,
    MAX_LABEL_LENGTH,
    did_you_mean,
    label_task_id,
    mask_url,
    show_value,
    validate_resource,
)
from ._names import RESOURCE_PATTERN as _RESOURCE_RE
from ._pid import getpid
from ._renewer import Hold, Renewer, get_renewer
from ._settings import LeaseSettings, Resolved
from ._template import NameTemplate
from ._wakes import (
    EARLY_HEADER,
    EARLY_RETRY_DELAYS,
    LINEAGE_HEADER,
    ROUTE_HEADER,
    WAKE_QUEUE_SUFFIX,
    WOKEN_HEADER,
    send_wake,
)
from ._wakes import to_wake_queue as _to_wake_queue
from .stores._bounds import POLL

if TYPE_CHECKING:
    from .stores import LeaseStore

__all__ = ["LeaseTask", "current_lease", "lease_task"]

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

SETTING_NAMES = tuple(f.name for f in fields(LeaseSettings))
#: Keywords Celery's task decorators and autoretry take that are not ``Task`` attributes;
#: every ``Task`` attribute (``acks_late``, ``max_retries``, ...) is accepted as well.
CELERY_DECORATOR_OPTIONS = frozenset(
    {
        "autoretry_for",
        "bind",
        "delivery_mode",
        "dont_autoretry_for",
        "exchange",
        "exchange_type",
        "filter",
        "immediate",
        "lazy",
        "mandatory",
        "name",
        "pydantic",
        "pydantic_context",
        "pydantic_dump_kwargs",
        "pydantic_strict",
        "queue",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "retry_kwargs",
        "routing_key",
        "shared",
    }
)
LEASE_TASK_KEYWORDS = (
    "resource",
    "identity",
    "gates",
    "reconcile",
    "reconcile_effect",
    "app",
    "base",
)
WAITS_HEADER = "celery_lease_waits"
LOST_HEADER = "celery_lease_lost_retries"
STORE_WAITS_HEADER = "celery_lease_store_waits"
# LINEAGE_HEADER, WOKEN_HEADER, ROUTE_HEADER, EARLY_HEADER and EARLY_RETRY_DELAYS: see _wakes.
# An early copy (EARLY_HEADER) claims without re-arming its place, so the release that sent it
# still wakes it (the releaser sent that wake already).
#: Such a copy that came through a wake queue is sent again through it too, on the waiter's
#: route (the tests' negative control sets False): on its task queue it waited behind the
#: burst's first attempts, 0.5-0.8 s where 20 ms was meant.
EARLY_RETRY_VIA_WAKE_QUEUE = True
#: Whether a waiter that cannot have its message kept (no identity, a message over its bound)
#: polls in a place in the wait list (the tests' negative control sets False: it then waits
#: with the back-off, not listed, as before issue 32).
POLLING_PLACES = True
#: An early wake only follows a body shorter than this (seconds): the claim's guess at the
#: next waiter grows stale as the body runs (a back-stop copy re-arms it with a new message),
#: and past a few seconds the round trip it saves is noise.
EARLY_WAKE_MAX_HELD = 5.0
#: When (wall clock, seconds since the epoch) this execution's claims began to fail.
STORE_DOWN_HEADER = "celery_lease_store_down_since"
#: In a waiter's wake message: when (wall clock, whole seconds since the epoch) the refused
#: claim listed or re-armed its place. A woken copy listed longer ago than
#: ``store_down_max_wait`` may have a sibling copy that gave up on an unreachable store.
LISTED_HEADER = "celery_lease_listed_at"
#: How many times this copy of a waiter in a polling place came back (see _lease_busy).
POLLS_HEADER = "celery_lease_polls"
#: When (microseconds since the epoch, the publisher's clock) a task with order="publish" was
#: published: its place in the wait list is by it (stores' ``acquire(since=...)``).
PUBLISHED_HEADER = "celery_lease_published_at"
#: The share of ``store_down_max_wait`` by which a woken copy reads the result backend early
#: (see ``_sibling_may_have_given_up``): the listing and the give-up are stamped on the wall
#: clocks of the workers involved, so this tolerates clocks apart by up to a quarter of the
#: budget (150 s by default) at the cost of one backend read for places listed longer ago
#: than half of it.
GAVE_UP_CLOCK_SLACK = 0.5
#: How many times this copy of a waiter looked again at its task's state after its claim found
#: the identity done and the state was not final yet.
DONE_CHECKS_HEADER = "celery_lease_done_checks"
#: The countdowns of those looks: the copy that ran may be between its release and Celery
#: storing its result (a pause there, a slow backend); after the last, the copy ends with the
#: recorded result.
DONE_RECHECKS = (1.0, 2.0, 4.0)
#: Lost-lease reasons that mean the lease ran out while the body was still running.
EXPIRY_REASONS = frozenset({"expired", "self_fenced", "renew_failed", "max_runtime"})

#: What a claim passes a store that can tell the next waiter (see Lease.next_wake).
_EARLY_WAKE: dict[str, Any] = {"early_wake": True}
_NO_EXTRA: dict[str, Any] = {}
#: What an early copy's claim passes such a store: the waits count of its own listed place.
_OWN_WAKE: dict[str, Any] = {"own_wake": True}
_OWN_WAKE_EARLY: dict[str, Any] = {**_EARLY_WAKE, **_OWN_WAKE}
#: A waits count in a wake payload (the JSON our encoder writes); see _listed_waits.
_WAITS_IN_PAYLOAD = re.compile(r'"' + WAITS_HEADER + r'": ?(\d+)')
#: The series every claim and release counts (looked up once, not per task).
_CLAIMED = events.Recorder(
    metrics.Series("c", "celery_lease_claims_total"),
    metrics.Series("h", "celery_lease_acquire_seconds", result="claimed"),
)
_RELEASED = events.Recorder(
    metrics.Series("c", "celery_lease_releases_total"),
    metrics.Series("h", "celery_lease_hold_seconds"),
)

_current = CURRENT_LEASE  # (defined below the task layer: the fencing helpers read it)


def current_lease() -> Lease:
    """The lease held by the task execution that is running here.

    Works anywhere in the task's call stack (a context variable), also in eager mode.

    Raises:
        LeaseError: no lease task execution is running in this context.
    """
    lease = _current.get()
    if lease is None:
        raise LeaseError(
            "no lease is held here: current_lease() works inside the execution of a "
            "@lease_task / LeaseTask"
        )
    return lease


class LeaseTask(Task):  # type: ignore[misc]
    """A Celery task that runs its body only while it holds a lease on its resource.

    Set ``lease_resource`` (a ``str.format`` template over the task's arguments, or a callable
    taking them) and optionally any ``lease_<setting>`` attribute to override the app's
    ``lease_<setting>``. See ``docs/settings.md``.
    """

    #: The resource template (``"browser/account-{account_id}"``) or a callable.
    lease_resource: str | Callable[..., str] | None = None
    #: The identity template or callable (``"invoice:{invoice_id}"``); None: the message's
    #: ``idempotency_key`` header or the task id; False: no identity (no dedup, no ledger).
    lease_identity: str | Callable[..., str] | bool | None = None
    #: Gates that admit each new fence right after the claim, before the body: a gate (its key
    #: is the resource) or a ``(gate, key template or callable)`` pair per entry, the gate
    #: possibly a no-argument callable returning it (asked at each claim); see _gates.
    lease_gates: GatesSpec | None = None
    lease_store_url: str | None = None
    lease_ttl: float | None = None
    lease_renew_interval: float | None = None
    lease_self_fence_margin: float | None = None
    lease_max_runtime: float | None = None
    lease_on_busy: str | None = None
    lease_busy_backoff_base: float | None = None
    lease_busy_backoff_cap: float | None = None
    lease_busy_backoff_jitter: float | None = None
    lease_busy_max_waits: int | None = None
    lease_store_down_max_wait: float | None = None
    lease_lost_max_retries: int | None = None
    lease_lost_retry_delay: float | None = None
    lease_key_prefix: str | None = None
    lease_table_prefix: str | None = None
    lease_store_options: dict[str, Any] | None = None
    lease_allow_direct_call: bool | None = None
    lease_send_events: bool | None = None
    lease_dedup: bool | None = None
    lease_handoff: bool | None = None
    lease_handoff_max_payload: int | None = None
    lease_handoff_wake_queue: bool | None = None
    lease_handoff_early_wake: bool | None = None
    lease_order: str | None = None
    lease_retention: float | None = None

    _lease_settings_cache: tuple[int, LeaseSettings] | None = None  # (Resolved.generation, ..)
    _lease_compiled: _TaskSetup | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A misspelt setting (lease_tll = 5) would be a plain attribute nothing reads.
        for name, value in vars(cls).items():
            if (
                name.startswith("lease_")
                and name not in _LEASE_ATTRIBUTES
                and not isinstance(value, (staticmethod, classmethod, property))
                and not inspect.isfunction(value)
            ):
                raise LeaseConfigError(
                    f"{cls.__qualname__}.{name}"
                    f"{did_you_mean(name, _LEASE_ATTRIBUTES)} is not a LeaseTask setting; the "
                    f"settings are {', '.join(f'lease_{n}' for n in SETTING_NAMES)}, plus "
                    "lease_resource, lease_identity and lease_gates"
                )

    @classmethod
    def on_bound(cls, app: Any) -> None:
        install(app)
        register_task_type(cls)
        # Bad settings fail here, at import or app finalization (Celery's own Task.bind reads
        # app.conf at this point too), not at the first run.
        LeaseSettings.resolve(app.conf, cls._lease_overrides())
        signature = _run_signature(cls)
        if signature is not None:
            specs = {what: _raw_attr(cls, f"lease_{what}") for what in ("resource", "identity")}
            _check_templates(specs, signature, cls.name)
        check_gates(_raw_attr(cls, "lease_gates"), signature, cls.name)

    @classmethod
    def _lease_overrides(cls) -> dict[str, Any]:
        return {name: getattr(cls, f"lease_{name}", None) for name in SETTING_NAMES}

    def _resolve_lease_settings(self) -> LeaseSettings:
        """Resolve this task's settings now, without keeping them (what the worker checks at
        start: resolving must not fix what a later run, or a test, sees)."""
        # The instance's attributes, as Celery reads task options: a test may set
        # ``task.lease_ttl`` (a monkeypatch) on the one task object of its app.
        overrides = {name: getattr(self, f"lease_{name}", None) for name in SETTING_NAMES}
        return LeaseSettings.resolve(self.app.conf, overrides)

    @property
    def lease_settings(self) -> LeaseSettings:
        """This task's resolved settings (app ``lease_*`` keys overlaid with its own)."""
        cached = self._lease_settings_cache
        if cached is not None and cached[0] == Resolved.generation:
            return cached[1]
        settings = self._resolve_lease_settings()
        self._lease_settings_cache = (Resolved.generation, settings)
        return settings

    # -- the resource --------------------------------------------------------------------------
    def _compiled(self) -> _TaskSetup:
        """Settings, store and name templates of this task, worked out once per process."""
        compiled = self._lease_compiled
        if (
            compiled is None
            or compiled.pid != getpid()
            or compiled.generation != Resolved.generation
        ):
            compiled = self._lease_compiled = _TaskSetup(self)
        return compiled

    def lease_resource_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The resource name for one call, from ``lease_resource`` and the call's arguments.

        Raises:
            LeaseConfigError: no resource is configured, an argument the template needs is
                missing or None, or the result is not a valid resource name.
        """
        return self._resource(self._compiled(), args, kwargs)

    def _resource(
        self, compiled: _TaskSetup, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> str:
        if compiled.resource is None:
            raise LeaseConfigError(
                f"task {self.name!r} has no lease resource: pass resource= to @lease_task or "
                "set lease_resource on the LeaseTask subclass"
            )
        resource = compiled.resource.render(args, kwargs)
        if _RESOURCE_RE.fullmatch(resource):
            return resource
        try:
            return validate_resource(resource)
        except LeaseConfigError as exc:
            raise LeaseConfigError(
                f"task {self.name!r}: resource {show_value(compiled.resource.spec)} gave "
                f"{show_value(resource)}, which is not a valid resource name ({exc})"
            ) from None

    def lease_identity_for(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], request: Any = None
    ) -> str | None:
        """The identity of one execution, or None when dedup is off for this task.

        The message's ``idempotency_key`` header wins; then ``lease_identity`` (a template or
        callable over the arguments, like the resource); then the task id, which is stable
        across retry, requeue and redelivery.
        """
        request = self.request if request is None else request
        return self._identity(self._compiled(), args, kwargs, request)

    def _identity(
        self,
        compiled: _TaskSetup,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        request: Any,
    ) -> str | None:
        if not compiled.dedup:
            return None
        key = _header(request, "idempotency_key")
        if key is not None:
            return self._checked_identity(str(key), "the idempotency_key header")
        if compiled.identity is not None:
            return self._checked_identity(
                compiled.identity.render(args, kwargs), "the identity template"
            )
        return request.id if request.id is not None else None

    def _checked_identity(self, value: str, source: str) -> str:
        if _RESOURCE_RE.fullmatch(value):
            return value
        raise LeaseConfigError(
            f"task {self.name!r}: {source} gave {show_value(value)}, which is not a valid "
            f"identity ({IDENTITY_RULE})"
        )

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """As ``Task.apply_async``; with ``order="publish"``, the message says when it was
        published (this process's clock), which places it in its resource's wait list."""
        if self.lease_settings.order == "publish":
            headers = options.get("headers") or {}
            if PUBLISHED_HEADER not in headers:
                options["headers"] = {**headers, PUBLISHED_HEADER: int(_clock.wall() * 1e6)}
        return super().apply_async(*args, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.get(ROUTE_HEADER) is not None:  # woken through a wake queue (or stale)
            _take_sent_route(request)
        compiled = self._compiled()
        settings = compiled.settings
        direct = bool(request.called_directly)
        if direct and settings.allow_direct_call:
            return super().__call__(*args, **kwargs)
        resource = self._resource(compiled, args, kwargs)
        identity = self._identity(compiled, args, kwargs, request)
        gated = None if compiled.gates is None else compiled.gates.keys(resource, args, kwargs)
        try:
            store = compiled.current_store(task=self)
        except LeaseStoreError as exc:  # the store could not be made: its server is unreachable
            return self._store_down(exc, settings, resource)
        owner = Owner.fresh(_owner_label(request, self.name))
        renewer = get_renewer()
        renewer.prepare(store)  # the renewal connection opens while the claim runs
        wait, too_large, poll, waiter = None, 0, None, None
        can_wait = settings.handoff and settings.on_busy == "retry" and not direct
        waiting = can_wait and identity is not None
        # Sent before the release that wakes it (see _release): its claim must not re-arm the
        # place, which that release may not have woken yet (it then wakes it, not again).
        early = waiting and _header(request, EARLY_HEADER) is not None
        extra = (
            _EARLY_WAKE
            if settings.handoff
            and settings.handoff_early_wake
            and getattr(store, "supports_early_wake", False)
            else _NO_EXTRA
        )
        if waiting and not early:
            wait = self._wake_payload(request, args, kwargs, settings)
            # (ASCII-only JSON: its length is its size in bytes)
            if wait is not None and len(wait[0]) > settings.handoff_max_payload:
                # Measured without its celery_lease_waits counter, which grows by a digit now
                # and then (9 -> 10): a listed waiter's next copy measures the same, so it is
                # re-armed rather than left to lapse out of the list.
                size = _bound_size(wait[0], request)
                if size > settings.handoff_max_payload:
                    # it polls in its place
                    too_large, wait = size, (POLL, wait[1]) if POLLING_PLACES else None
        elif (
            can_wait
            and identity is None
            and not request.is_eager
            and request.id is not None
            and POLLING_PLACES
        ):
            # No identity to tell two copies apart: no message to wake, one copy at a time
            # that polls in a place named by its task id (invariant 12).
            wait, waiter = (POLL, self._wait_ttl(0, settings)), _waiter_name(request.id)
        if wait is not None and wait[0] == POLL:
            # (comes back by itself: once a grace, so it is there when its turn comes)
            poll = float(getattr(store, "handoff_grace", 2.0))
        elif wait is not None or (
            waiting and int(_header(request, WAITS_HEADER) or 0) >= settings.busy_max_waits
        ):
            # (its last allowed wait sends no place to wake, but a copy of this waiter that
            # listed one earlier may have been woken, refused and given up already)
            self._drop_if_finished(request, resource)
        claim_started = _clock.monotonic()
        try:
            if wait is not None:
                if waiter is not None or settings.order == "publish":
                    extra = {**extra, **_place_options(request, waiter, settings)}
                lease = store.acquire(
                    resource,
                    owner,
                    settings.ttl,
                    identity=identity,
                    wait=wait[0],
                    wait_ttl=wait[1],
                    # (so a copy of an older attempt, a back-stop sent before a retry, never
                    # takes over the place and wake of this identity's newer attempt)
                    attempt=request.retries or 0,
                    **extra,
                )
            elif early:
                lease = store.acquire(
                    resource,
                    owner,
                    settings.ttl,
                    identity=identity,
                    attempt=request.retries or 0,
                    # (its place's waits count: re-armed since the waker's claim named it?)
                    **(
                        (_OWN_WAKE_EARLY if extra else _OWN_WAKE)
                        if getattr(store, "supports_early_wake", False)
                        else extra
                    ),
                )
            else:
                lease = store.acquire(resource, owner, settings.ttl, identity=identity, **extra)
        except IdentityDoneError as done:
            _observe_acquire(claim_started, "duplicate")
            return self._duplicate_done(done)
        except LeaseBusyError as busy:
            _observe_acquire(claim_started, "busy")
            # (every store of this package has a wait_cap; a third-party one may not)
            cap = budget = None
            if wait is not None and wait[0] != POLL:
                cap = _wait_bounds(store)
                budget = getattr(store, "wait_bytes_cap", None)
                if (
                    (not busy.position or busy.polling)
                    and budget is not None
                    and len(wait[0]) > budget
                ):
                    # bigger than the list's whole budget: too large, not "the list is full"
                    too_large, cap = len(wait[0]), None
                else:
                    budget = None
            return self._lease_busy(
                busy,
                settings,
                wait_cap=cap,
                too_large=too_large,
                budget=budget,
                poll=poll if poll is not None else float(getattr(store, "handoff_grace", 2.0)),
            )
        except LeaseStoreError as exc:
            _observe_acquire(claim_started, "error")
            # The claim's outcome is unknown; if it happened, the lease expires within its ttl.
            # One sent with a place to wake may have been refused and listed it: the next
            # release then wakes a copy of this message.
            listed = (wait is not None or early) and not exc.refused
            return self._store_down(exc, settings, resource, listed)
        claim_seconds = _clock.monotonic() - claim_started
        if wait is not None or early:
            woken = _header(request, WOKEN_HEADER)
            if woken is not None:
                with contextlib.suppress(TypeError, ValueError):
                    events.observe("celery_lease_handoff_seconds", _clock.wall() - float(woken))
        if outage.down:  # (one dict test while the store is fine)
            outage.claim_succeeded(store.url)
        failpoints.hit("after_acquire")
        _CLAIMED.record(claim_seconds)
        self._log("claimed", logging.DEBUG, lease.resource, lease.fence, lease.owner.label)
        if lease.identity_state == "failed":
            if _copy_of_failed(lease, request):
                # A copy of this execution that already ran and failed (a waiter's woken copy
                # and its back-stop copy: the one that claimed first ran the body).
                return self._failed_copy(lease)
        elif lease.identity_attempt > (request.retries or 0):
            # A copy of an attempt the identity has moved past (a back-stop re-queued before
            # a woken copy ran this attempt and retried): a copy of the newer one runs it.
            return self._superseded(lease, settings)
        elif (
            lease.identity_state == "retry"
            and _header(request, WOKEN_HEADER) is not None
            and _copy_of_run(lease, request)
        ):
            # Another copy of this execution ran this attempt and ended without an outcome
            # (SystemExit in a prefork child: Celery stored a WorkerLostError FAILURE, unless
            # acks_late and reject_on_worker_lost redeliver it; a lost lease: RETRY). The
            # result backend tells (back-stop copies read it before their claim).
            self._drop_if_finished(request, resource, lease)
        elif identity is not None and self._sibling_may_have_given_up(request, settings, lease):
            # A woken copy whose back-stop sibling may have ended FAILURE without claiming
            # ("gave up after N busy waits", or on an unreachable store), leaving this place
            # listed. The result backend tells; on a final state the lease is given back
            # (waking the next waiter) and this copy ends unrun.
            self._drop_if_finished(request, resource, lease)
        lease.margin = settings.effective_margin
        if lease.remaining() <= 0:
            # The claim's reply came back after the self-fence deadline (the store was slow or
            # unreachable): holding it would be lost at once. Give it back and wait.
            outcome = identity_outcome("retry", request.retries or 0)
            self._release(lease, outcome if lease.identity else "failed", None)
            return self._store_down(
                LeaseStoreError(
                    f"the claim of {resource!r} took longer than its ttl minus the self-fence "
                    "margin to come back; the store is slow or unreachable"
                ),
                settings,
                resource,
            )
        if gated:
            self._admit_at_gates(compiled, gated, lease, settings)  # or the attempt ends here
        hook = getattr(self, "reconcile_effect", None)
        if hook is not None:
            lease.reconcile_effect = hook
        if lease.recovered:
            events.count("celery_lease_takeovers_total")
            self._log(
                "recovered",
                logging.WARNING,
                resource,
                lease.fence,
                lease.owner.label,
                previous_holder=lease.previous_owner_label,
                previous_fence=lease.previous_fence,
                state=lease.identity_state or "expired without release",
            )
            self._lease_event(
                "task-lease-recovered",
                resource=resource,
                fence=lease.fence,
                previous_owner=lease.previous_owner_label,
                previous_fence=lease.previous_fence,
            )
        return self._run_leased(lease, settings, args, kwargs, direct, request, renewer)

    def _admit_at_gates(
        self,
        compiled: _TaskSetup,
        gated: Sequence[tuple[Any, str]],
        lease: Lease,
        settings: LeaseSettings,
    ) -> None:
        """Admit the new fence at each of the task's gates (``gates=``), before the body.

        A refusal ends this attempt once the lease is given back (as a claim that did not run
        the body): a stale fence there as a lost lease (run again later), a key the gate
        refuses as a bad resource would (LeaseConfigError), any other failure as a lease store
        outage (sent again on ``lease_store_down_max_wait``).
        """
        assert compiled.gates is not None
        request = self.request
        try:
            refusal = compiled.gates.admit(gated, lease, request.id)
        except BaseException:  # SystemExit, KeyboardInterrupt: the worker stops; give it back
            self._release(lease, identity_outcome("retry", request.retries or 0), None)
            raise
        if refusal is not None:
            self._release(lease, identity_outcome("retry", request.retries or 0), None)
            self._gate_refused(refusal, lease, settings)

    def _gate_refused(self, refusal: Refusal, lease: Lease, settings: LeaseSettings) -> Any:
        error = refusal.error
        if isinstance(error, StaleFenceError) and _gate_outlived_store(error, lease):
            raise LeaseConfigError(
                f"task {self.name!r}: fence gate {refusal.gate} already admitted fence "
                f"{error.highest} for key {refusal.key!r}, higher than any fence the lease "
                f"store {_store_url(lease)} ever granted for {lease.resource!r} (its newest: "
                f"{lease.fence}): the gate outlived its lease store (the store was reset or "
                "replaced, e.g. moved from Redis to SQL, or a test's in-memory store), so no "
                "claim would ever pass it. Reset the gate's record of that key (its row or "
                "key), or give the gate the lease store's fences (FenceGate(store=lease_store) "
                "or the store's URL and prefix); the task does not run again by itself"
            )
        if isinstance(error, StaleFenceError):
            newer = "a newer fence" if error.highest is None else f"fence {error.highest}"
            lost = lease.mark_lost(
                LeaseLostError(
                    f"lease on {lease.resource!r} with fence {lease.fence} is stale at its claim: "
                    f"fence gate {refusal.gate} already admitted {newer} for key "
                    f"{refusal.key!r}; the task runs again later",
                    lease.resource,
                    lease.fence,
                    None,
                    "stale_fence",
                )
            )
            return self._lease_lost(lost, lease, settings)
        if isinstance(error, LeaseStoreError):
            return self._store_down(error, settings, lease.resource, gate=refusal.gate)
        raise error

    def reconcile(self, lease: Lease) -> None:
        """Called before the body when an earlier owner of this work did not finish.

        ``lease.recovered`` is true: the lease was taken over from an owner whose lease expired
        without release, or this identity was begun and not completed. ``lease.checkpoints``,
        ``lease.previous_fence`` and ``lease.previous_owner_label`` tell what is known; inspect
        the outside world before continuing, never replay blindly. The default does nothing.
        """

    def _reconcile(self, lease: Lease) -> None:
        try:
            self.reconcile(lease)
        except BaseException:
            events.count("celery_lease_reconciliations_total", outcome="failed")
            raise
        events.count("celery_lease_reconciliations_total", outcome="ok")

    def _superseded(self, lease: Lease, settings: LeaseSettings) -> Any:
        """Drop a copy of an attempt its identity has moved past without running the body:
        give the lease back with the identity's record as it was found (so the copy of the
        current attempt still sees it) and end without storing a result (that copy's is).

        Only a copy of this task id is dropped: another task id sharing the identity (an
        identity template, an idempotency key) would never get a result from the newer
        attempt's copy, so while that attempt is still to run it waits as a duplicate of
        running work and ends with the recorded result once it is done."""
        request = self.request
        found = identity_outcome(lease.identity_state or "retry", lease.identity_attempt)
        if lease.identity != request.id and (lease.identity_state or "retry") == "retry":
            self._release(lease, found, None)
            busy = LeaseBusyError(
                f"{lease.identity!r} is at attempt {lease.identity_attempt}, run by another "
                f"task id than {request.id}: waiting for its result",
                lease.resource,
                lease.owner.label,
                lease.fence,
                None,
                True,
            )
            return self._lease_busy(busy, settings)
        self._log_dropped(
            lease,
            current_attempt=lease.identity_attempt,
            action="dropped a copy of a superseded attempt",
            why=f"its task retried since: attempt {lease.identity_attempt} runs in a copy of its "
            "own",
        )
        self._release(lease, found, None)
        raise Ignore(
            f"attempt {request.retries or 0} of {lease.identity!r} was superseded by attempt "
            f"{lease.identity_attempt}"
        )

    def _log_dropped(self, lease: Lease, **fields: Any) -> None:
        """Count and log a copy of this task that ends without running its body (``fields``
        go after the identity and attempt: what it was a copy of, and the action)."""
        events.count("celery_lease_duplicates_total")
        self._log(
            "duplicate",
            logging.INFO,
            lease.resource,
            lease.fence,
            lease.owner.label,
            identity=lease.identity,
            attempt=self.request.retries or 0,
            copy=_copy_kind(self.request),
            **fields,
        )

    def _failed_copy(self, lease: Lease) -> Any:
        """Drop a copy of an execution whose body already ran and failed: give the lease back
        with the identity's record as it was found (a new message sharing the identity still
        runs) and end without storing a result (the FAILURE of the run that happened stays)."""
        request = self.request
        self._log_dropped(
            lease,
            action="dropped a copy of a failed execution",
            why=f"attempt {request.retries or 0} already ran and failed; its FAILURE stays",
        )
        why = (
            f"attempt {request.retries or 0} of {lease.identity!r} already ran and failed "
            f"(task id {request.id})"
        )
        error = LeaseError(f"{why}; this copy ended without running it")
        # Read and stored under the lease, so the next copy of this execution sees it.
        errbacks = self._store_failed_copy(request, error)
        self._release(lease, identity_outcome("failed", lease.identity_attempt), None)
        if errbacks:
            try:  # the chord part return, the chain and link_error, as Celery's failure does
                self.backend.mark_as_failure(
                    request.id, error, request=request, store_result=False, call_errbacks=True
                )
            except Exception:
                log.exception("task %s[%s]: marking the failure failed", self.name, request.id)
        raise Ignore(why)

    def _store_failed_copy(self, request: Any, error: LeaseError) -> bool:
        """Store ``error`` as this dropped copy's FAILURE where the failed run's is not in the
        result backend; whether Celery's other failure effects (chord part return, chain,
        errbacks) are still due. The run's FAILURE stays when it is there. It is not when
        Celery stored STARTED over it for this copy (task_track_started: the run's errbacks
        ran, or its worker died before them, which the backend does not tell: stored only),
        or when the worker of the run died after its release and before Celery marked the
        failure (the message came back as a copy): then nothing saw the failure, and it is
        marked as Celery would. The first exception is gone; ``error`` says what happened.
        Nothing is read or stored when the task ignores its result or there is no result
        backend."""
        if request.is_eager or _ignores_result(self, request) or not _has_backend(self):
            return False
        try:
            stored = self.backend.get_task_meta(request.id, cache=False).get("status")
            if stored in states.READY_STATES:
                return False
            self.backend.store_result(request.id, error, states.FAILURE, request=request)
        except Exception:
            log.exception("task %s[%s]: storing the failure failed", self.name, request.id)
            return False
        return not self.track_started

    def _drop_if_finished(
        self, request: Any, resource: str, lease: Lease | None = None, done: bool = False
    ) -> None:
        """End this back-stop copy of a waiter (it counts its waits, no wake sent it) when the
        result backend already holds a final state for its task id: another copy of it ran
        (its woken copy) and that state is the task's. Checked before the claim, so
        the identity's record, which another task id sharing the identity may have written
        since, does not decide: the copy ends ``Ignore``d without running the body or storing
        over that state. One backend read per back-stop copy; not on a woken copy (the
        hand-off's path) unless ``lease`` is given: it claimed and found that another copy of
        this execution ran this attempt and ended without an outcome (the lease is given back
        with the record as found when the copy ends), or ``done``: its claim found the identity
        done, or its last allowed wait was refused (this task id's other copy may have run to
        its end, or given up). Not read where ``_task_state`` says."""
        state = self._task_state(request, woken=lease is not None or done)
        if state is not None and state in states.READY_STATES:
            self._drop_finished(request, resource, state, lease)

    def _task_state(self, request: Any, woken: bool = False) -> str | None:
        """This waiter's copy's task state in the result backend; None when not read: not a
        waiter's copy, a woken copy (unless ``woken``), with ``task_track_started`` (Celery
        stored STARTED over it for this copy already), when the task stores no result, with
        no result backend or one a worker cannot read another task's state from (``rpc://``),
        or when the read fails."""
        if (
            request.is_eager
            or request.id is None
            or self.track_started
            or _ignores_result(self, request)
            or not _backend_readable(self)
            or not int(_header(request, WAITS_HEADER) or 0)
            or (not woken and _header(request, WOKEN_HEADER) is not None)
        ):
            return None
        try:
            state = self.backend.get_task_meta(request.id, cache=False).get("status")
        except Exception:  # noqa: BLE001 - the backend failed: decide without it
            return None
        return None if state is None else str(state)

    def _drop_finished(
        self, request: Any, resource: str, state: str, lease: Lease | None = None
    ) -> None:
        """End this copy unrun: its task id already ended ``state`` (another copy ran it)."""
        events.count("celery_lease_duplicates_total")
        self._log(
            "duplicate",
            logging.INFO,
            resource,
            None,
            None,
            copy=_copy_kind(request),
            state=state,
            action="dropped a copy of a finished task",
            why=f"its task id already ended {state} in the result backend (another copy of it "
            "ran, or gave up): running it again would repeat that or store over it",
        )
        if lease is not None:  # give it back with the identity's record as found
            found = identity_outcome(lease.identity_state or "retry", lease.identity_attempt)
            self._release(lease, found, None)
        raise Ignore(f"task {request.id} already ended {state}: a copy of it ends unrun")

    def _sibling_may_have_given_up(
        self, request: Any, settings: LeaseSettings, lease: Lease | None = None
    ) -> bool:
        """A woken copy whose back-stop sibling may have ended FAILURE without claiming: it
        would not wait again when refused (the last allowed wait: it gave up), or its place
        was listed longer ago than ``store_down_max_wait`` (it may have given up on an
        unreachable store). Rare, so only then does a woken copy read the result backend.

        An early copy carries the waits count its waker's claim saw; its place may have been
        re-armed since (its back-stop copy refused while the waker's body ran), so the count
        its claim found in its own place (``lease.own_wake``) counts too. An early copy whose
        claim found no place of its own (it lapsed while the copy waited behind a backlog, or
        the claim was sent again after a lost reply and the first one took it) cannot tell
        its count: it reads the result backend."""
        if _header(request, WOKEN_HEADER) is None:
            return False
        waits = int(_header(request, WAITS_HEADER) or 0)
        if lease is not None and lease.own_wake is not None:
            waits = max(waits, _listed_waits(lease.own_wake))
        elif _own_count_unknown(request, lease):
            return True
        if waits >= settings.busy_max_waits:
            return True
        # Its back-stop copy may have found the store unreachable until store_down_max_wait
        # ran out (that budget starts no sooner than the listing, see _listed_at): only a
        # place listed about that long ago. The two times are read on different workers'
        # wall clocks, so the read starts GAVE_UP_CLOCK_SLACK of the budget early.
        listed = _header(request, LISTED_HEADER)  # (None in an older version's message)
        try:
            return listed is not None and _clock.wall() - float(listed) >= (
                settings.store_down_max_wait * (1 - GAVE_UP_CLOCK_SLACK)
            )
        except (TypeError, ValueError):
            return False

    def _duplicate_done(self, done: IdentityDoneError) -> Any:
        request = self.request
        if done.resource is not None:
            # A waiter's copy (woken, or its back-stop) finds the identity done: when this task
            # id's other copy ran it to its end, its success path (the result, link callbacks,
            # a chain's next step) ran too, and this copy ends unrun instead of running it again.
            # Rare (off the hand-off's path), so one backend read here.
            state = self._task_state(request, woken=True)
            if state is not None and state in states.READY_STATES:
                self._drop_finished(request, done.resource, state)
            checks = int(_header(request, DONE_CHECKS_HEADER) or 0)
            if (
                state is not None
                and checks < len(DONE_RECHECKS)
                and _names_task(done.owner_label, request.id)
            ):
                # Not final yet, and this task id's other copy completed the identity: it may
                # be between its release and Celery storing its result (its link callbacks and
                # chain step go first). Look again later, holding no slot; past the last look
                # its worker died in between: end with the result. (Another task id sharing
                # the identity completed it: end with its result now.)
                return self._requeue(
                    done,
                    DONE_RECHECKS[checks],
                    {DONE_CHECKS_HEADER: checks + 1, WOKEN_HEADER: None, EARLY_HEADER: None},
                    store=False,
                )
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        events.count("celery_lease_duplicates_total")
        self._log(
            "duplicate",
            logging.INFO,
            done.resource,
            done.fence,
            None,
            identity=done.identity,
            redelivered=redelivered,
            copy=_copy_kind(request),
            action="returned the recorded result",
        )
        return decode(done.result)

    def _run_leased(
        self,
        lease: Lease,
        settings: LeaseSettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        direct: bool,
        request: Any = None,
        renewer: Renewer | None = None,
    ) -> Any:
        request = self.request if request is None else request
        renewer = get_renewer() if renewer is None else renewer
        interrupter = Interrupter()
        context_token = _current.set(lease)
        started = _clock.monotonic()
        hold: Hold | None = None
        outcome = "failed"
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
                        self._lease_lost_in_flight,
                        interrupter,
                        request.id,
                        request.hostname,
                    ),
                )
                if lease.recovered:
                    failpoints.hit("inside_reconcile")
                    self._reconcile(lease)
                result = self._invoke_body(lease, args, kwargs, direct, request)
                interrupter.disarm()
                lease.check()  # never report success for a lease known lost or past deadline
                outcome = "done"
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
                return self._lease_lost(lost, lease, settings)
            except StaleFenceError as exc:
                # A side effect saw a newer fence: a newer owner exists, our lease is lost.
                interrupter.disarm()
                outcome = "retry"
                newer_fence, newer_holder = _newer_holder(lease, exc)
                lost = lease.lost or lease.mark_lost(
                    LeaseLostError.lost(
                        lease.resource,
                        lease.fence,
                        "stale_fence",
                        newer_holder,
                        newer_fence if newer_holder is not None else None,
                    )
                )
                self._log(
                    "stale_fence",
                    logging.WARNING,
                    lease.resource,
                    lease.fence,
                    lease.owner.label,
                    key=exc.key,
                    rejected_fence=exc.fence if exc.fence != lease.fence else None,
                    newer_fence=newer_fence,
                    newer_holder=newer_holder,
                )
                return self._lease_lost(lost, lease, settings)
            except SoftTimeLimitExceeded:
                interrupter.disarm()
                if lease.lost is not None:
                    outcome = "retry"
                    return self._lease_lost(lease.lost, lease, settings)
                raise
            except (Retry, Ignore, Reject) as exc:
                interrupter.disarm()
                outcome = "retry"  # not finished: a later delivery runs it again
                if isinstance(exc, Retry):  # self.retry(): the next attempt is the current one
                    attempt += 1
                raise
            except Exception:
                interrupter.disarm()
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
            _current.reset(context_token)
            self._release(
                lease, identity_outcome(outcome, attempt), result, held_since=started, early=True
            )
        failpoints.hit("after_ledger_before_ack")
        return result

    def _invoke_body(
        self,
        lease: Lease,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        direct: bool,
        request: Any = None,
    ) -> Any:
        if not direct:
            # The worker (or apply()) already pushed this execution's request.
            (self.request if request is None else request).lease = lease
            return self.run(*args, **kwargs)
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs, lease=lease)
        try:
            return self.run(*args, **kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _release(
        self,
        lease: Lease,
        outcome: str,
        result: Any,
        held_since: float | None = None,
        early: bool = False,
    ) -> None:
        """Give the lease back (recording the identity's outcome) and wake the next waiter;
        with ``held_since`` (monotonic), also record how long the lease was held.

        With ``early`` (a body that ran and ended, not lost), the waiter the claim said a
        release would wake (``lease.next_wake``, stores that tell) is woken once the release is
        sent, while its reply is awaited, instead of after it: the release's round trip then
        overlaps the wake's trip through the broker. The release's answer decides: when it
        hands the resource to that same message nothing more is sent; otherwise its own wake
        is sent as usual, and the early copy is one more copy of a listed waiter (identity
        dedup runs the body once). A copy that comes before the release landed (the store
        read the two out of order) is refused and sent again shortly (``EARLY_HEADER``); if
        the release never lands, the lease runs out and the waiter's copies claim it as after
        any crash."""
        assert lease.store is not None
        failpoints.hit("inside_release")
        sent: list[str] = []
        meanwhile: dict[str, Any] = _NO_EXTRA
        upcoming, lease.next_wake = lease.next_wake, None
        if (
            early
            and upcoming is not None
            and upcoming != POLL  # (a polling waiter comes back by itself)
            and held_since is not None
            and lease.lost is None
            and _clock.monotonic() - held_since < EARLY_WAKE_MAX_HELD
            and lease.remaining() > 0
        ):

            def wake_early() -> None:  # (the store runs it once its release is sent)
                if self._wake(
                    upcoming, lease.resource, "release", lease.fence, early=True, store=lease.store
                ):
                    sent.append(upcoming)
                failpoints.hit("after_early_wake")

            meanwhile = {"meanwhile": wake_early}
        recorded = None
        if lease.identity is not None and outcome == "done":
            try:
                recorded = "null" if result is None else encode(result)
            except LeaseConfigError as exc:
                log.warning(
                    "task %s: result not recorded for duplicates of identity %r: %s",
                    self.name,
                    lease.identity,
                    exc,
                )
        released = False
        try:
            released = lease.store.release(
                lease,
                outcome=outcome if lease.identity is not None else None,
                result=recorded,
                **meanwhile,
            )
            if released:
                self._log(
                    "released",
                    logging.DEBUG,
                    lease.resource,
                    lease.fence,
                    lease.owner.label,
                    outcome=outcome,
                )
        except LeaseError as exc:
            log.warning(
                "could not release %r (it expires by itself within its ttl): %s", lease, exc
            )
            return
        finally:
            if held_since is not None:
                held = _clock.monotonic() - held_since
                if released:
                    _RELEASED.record(held)
                else:
                    events.observe_hold(held)
        if lease.handoff is not None:
            payload, lease.handoff = lease.handoff, None
            if sent and (payload == sent[0] or self._rearmed_wake(sent[0], payload)):
                return  # that waiter's wake went out with the release
            failpoints.hit("before_wake")
            self._wake(payload, lease.resource, "release", lease.fence, store=lease.store)
            failpoints.hit("after_wake")

    # -- hand-off -------------------------------------------------------------------------------
    def _rearmed_wake(self, early: str, payload: str) -> bool:
        """Whether the release handed the resource to the very execution whose early copy is
        out (``early``), its place re-armed since the claim named it: its back-stop copy was
        refused while this body ran, so ``payload`` counts more waits and is otherwise the
        same message (task id, attempt, arguments, route). The early copy is then its woken
        copy; a second one would only run as a duplicate (and, with no result backend to tell
        it so, end with the recorded result: link callbacks twice). The early copy's claim
        reads the place's newer count (``Lease.own_wake``), so at the last allowed wait it too
        reads the result backend before it runs (see _sibling_may_have_given_up). Rare (a place
        re-armed during a short body), so the two messages are parsed only then."""
        try:
            a, b = json.loads(early), json.loads(payload)
            waits_a = int(a["options"]["headers"].pop(WAITS_HEADER))
            waits_b = int(b["options"]["headers"].pop(WAITS_HEADER))
        except (ValueError, TypeError, KeyError, AttributeError):
            return False
        return a == b and waits_b > waits_a

    def _backstop_delay(self, waits: int, settings: LeaseSettings) -> float:
        """When a queued waiter's own copy runs if nobody wakes it: no sooner than the lease
        ttl (a crashed holder's lease has run out by then), capped like the busy backoff."""
        cap = self._busy_cap(settings)
        return min(cap, max(self._busy_delay(waits, settings), settings.ttl))

    def _wake_payload(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], settings: LeaseSettings
    ) -> tuple[str, float] | None:
        """The message a waiter's wake sends (this execution again, no countdown) and how long
        its place in the wait list is kept; None when it cannot be written as JSON (then the
        task waits with the back-off alone).

        This runs on every claim of a waiting-capable task, refused or not, so it reads the
        request's fields directly (what ``signature_from_request()`` would send, without the
        options that are None), dumps the message once with a prepared encoder, and works out
        the place's lifetime once per number of waits.
        """
        if request.is_eager or request.id is None:
            return None
        headers = request.headers
        waits = request.get(WAITS_HEADER)
        if waits is None and isinstance(headers, dict):
            waits = headers.get(WAITS_HEADER)
        waits = int(waits or 0)
        if waits >= settings.busy_max_waits:
            return None  # this attempt gives up if refused: it must not leave a place to wake
        options = _execution_options(request)
        if headers:
            headers = {k: v for k, v in headers.items() if k not in _WAKE_DROPPED}
            headers[WAITS_HEADER] = waits + 1
        else:
            headers = {WAITS_HEADER: waits + 1}
        headers[LISTED_HEADER] = int(_listed_at(request))  # (ten digits: a constant size)
        published = _header(request, PUBLISHED_HEADER)
        if published is not None:  # (order="publish": every copy keeps when it was published)
            headers[PUBLISHED_HEADER] = published
        options["headers"] = headers
        options["retries"] = request.retries or 0
        if request.ignore_result or self.ignore_result:
            options["ignore_result"] = True
        delivery = request.delivery_info
        if delivery:
            priority = delivery.get("priority")
            if priority is not None:
                options["priority"] = priority
            routing_key = delivery.get("routing_key")
            if routing_key and delivery.get("exchange") == "":
                options["queue"] = routing_key
            else:
                options.update({k: v for k, v in delivery.items() if v is not None})
            if self._compiled().wake_queues:
                via = wake_queue_for(self.app, delivery)
                if via is not None:  # the waker sends the wake there (see _wake)
                    headers[ROUTE_HEADER] = via
        try:
            payload = _dump_json(
                {"task": self.name, "args": args, "kwargs": kwargs, "options": options}
            )
        except (TypeError, ValueError, RecursionError):
            return None
        return payload, self._wait_ttl(waits, settings)

    def _wait_ttl(self, waits: int, settings: LeaseSettings) -> float:
        """How long a waiter's place is kept: past its longest back-stop delay (the jitter
        only shortens it), worked out once per number of waits (per process and settings)."""
        compiled = self._compiled()
        cache = compiled.wait_ttls if compiled.settings is settings else {}
        keep = cache.get(waits)
        if keep is None:
            cap = self._busy_cap(settings)
            longest = min(
                cap, max(min(cap, settings.busy_backoff_base * 2 ** min(waits, 30)), settings.ttl)
            )
            keep = cache[waits] = longest + settings.ttl + 10.0
        return keep

    def _wake(
        self,
        payload: str,
        resource: str,
        by: str,
        fence: int | None = None,
        early: bool = False,
        store: LeaseStore | None = None,
    ) -> bool:
        """Send a woken waiter's message now (see ``_wakes.send_wake``); with ``store``, the
        turn is checked once its grace is over. Returns whether it was sent."""
        return send_wake(
            self.app,
            payload,
            resource,
            by,
            fence,
            early=early,
            wake_queues=self._compiled().wake_queues,
            store=store,
        )

    # -- busy and lost ------------------------------------------------------------------------
    def _lease_busy(
        self,
        busy: LeaseBusyError,
        settings: LeaseSettings,
        wait_cap: str | None = None,
        too_large: int = 0,
        budget: int | None = None,
        poll: float = 2.0,
    ) -> Any:
        """A refused claim: wait (re-queue), fail or skip; ``wait_cap`` tells the store's wait
        list bounds when the claim asked to join the wait list (None when it did not);
        ``too_large`` the size of a wake message too big to ask (0: none), or too big for the
        store's whole wait list budget (``budget``, its wait_bytes_cap) when that is given;
        ``poll``: how often a copy in a polling place comes back (the store's grace)."""
        events.count("celery_lease_claim_conflicts_total")
        request = self.request
        if request.is_eager or request.called_directly:
            if settings.on_busy == "skip" and not busy.duplicate:
                raise _skipped(busy) from None
            raise busy
        # A copy of work running now (same identity under a live lease: a redelivery, a
        # duplicate send) is re-armed whatever on_busy says, also past busy_max_waits: acking
        # it would leave no copy if the running one dies, and failing it would store FAILURE
        # under the running task's id. on_busy is for *other* work contending for the resource.
        duplicate = busy.duplicate
        if settings.on_busy == "fail" and not duplicate:
            raise busy
        if settings.on_busy == "skip" and not duplicate:
            self._skip(busy)
        if busy.wake is not None:  # the resource is free for a head waiter nobody woke
            payload, busy.wake = busy.wake, None
            self._wake(
                payload,
                busy.resource or "?",
                "claim",
                busy.fence,
                store=self._compiled().current_store(task=self),
            )
        waits = int(_header(request, WAITS_HEADER) or 0)
        early = _header(request, EARLY_HEADER)
        left = min(_count(early), len(EARLY_RETRY_DELAYS))
        if left and not duplicate:
            # Woken with a release (see _release) that had not landed when it claimed: its
            # claim left the place as it was, for that release to wake. Soon again.
            delay = EARLY_RETRY_DELAYS[len(EARLY_RETRY_DELAYS) - left]
            self._log(
                "busy",
                logging.INFO,
                busy.resource,
                busy.fence,
                busy.holder_label,
                action="early wake: sent again",
                wait=f"{delay:.2f}s",
            )
            return self._requeue(
                busy,
                delay,
                # (0 after the last: still an early copy, see the give-up below)
                {EARLY_HEADER: left - 1},
                store=self.track_started or not waits,
                via_wake_queue=EARLY_RETRY_VIA_WAKE_QUEUE,
            )
        if waits >= settings.busy_max_waits and not duplicate and early is None:
            # A late copy of a waiter that gave up already (its other copy was refused at its
            # last allowed wait first): the task's FAILURE is stored and its errbacks ran.
            # (An early copy refused past its short retries is not given up: the release
            # that woke it may not have landed yet, and it sends no second wake for it. It
            # waits on with the back-off, as a woken copy without the early header.)
            self._drop_if_finished(request, busy.resource or "?", done=True)
            raise LeaseBusyError(
                f"{busy} (gave up after {waits} busy waits; raise lease_busy_max_waits to wait "
                "longer)",
                *busy.args[1:],
            )
        full = too_big = None
        polls = _count(_header(request, POLLS_HEADER))
        if busy.position and busy.polling and not duplicate:
            # Its place polls (invariant 12): nobody sends its message, so this copy comes
            # back once a grace, to be there when its turn comes (the free resource is then
            # held for it two graces). Polls are no busy waits: its place keeps its turn.
            events.observe("celery_lease_wait_list_length", float(busy.position))
            delay = min(self._busy_delay(0, settings), poll)
            if too_large:
                events.count("celery_lease_wait_payload_too_large_total")
                if budget is None:
                    too_big = f"{too_large} > {settings.handoff_max_payload} bytes"
                    over = f"lease_handoff_max_payload={settings.handoff_max_payload}"
                else:
                    too_big = f"{too_large} > {budget} bytes (wait_bytes_cap)"
                    over = (
                        f"the store's whole wait list budget (wait_bytes_cap {budget} bytes; "
                        f"lease_handoff_max_payload={settings.handoff_max_payload})"
                    )
                why = f"its wake message is {too_large} bytes, over {over}"
            elif not self._compiled().dedup:
                why = "it has no identity to tell its copies apart (identity=False)"
            else:
                events.count("celery_lease_wait_list_full_total")
                full = wait_cap or "at its cap"
                why = f"its wait list had no room for its message ({full})"
            self._log(
                "busy",
                logging.INFO,
                busy.resource,
                busy.fence,
                busy.holder_label,
                action="poll",
                wait=f"{delay:.2f}s",
                position=busy.position,
                wait_list_full=full,
                wait_payload_too_large=too_big,
            )
            if not polls:  # (said once, with the state RETRY; later polls store nothing)
                busy = LeaseBusyError(
                    f"{busy} ({why}: it polls in its place, coming back every {delay:.1f}s)",
                    *busy.args[1:],
                )
                self._lease_event(
                    "task-lease-busy", action="poll", wait=delay, **_busy_fields(busy)
                )
            events.count("celery_lease_busy_waits_total")
            updates: dict[str, Any] = {
                POLLS_HEADER: polls + 1,
                STORE_WAITS_HEADER: None,
                STORE_DOWN_HEADER: None,
                WOKEN_HEADER: None,
                EARLY_HEADER: None,
            }
            return self._requeue(
                busy, delay, updates, store=not polls and not waits and not self.track_started
            )
        if busy.position:  # queued: the release wakes it; this copy is the back-stop
            events.observe("celery_lease_wait_list_length", float(busy.position))
            delay = self._backstop_delay(waits, settings)
        else:
            delay = self._busy_delay(waits, settings)
            if wait_cap is not None and not duplicate:
                # It asked to wait in the list and was not listed: the list is at its cap
                # (of waiters or of payload bytes). Say so (else it reads like a claim that
                # never asked to wait).
                full = wait_cap or "at its cap"
                events.count("celery_lease_wait_list_full_total")
                busy = LeaseBusyError(
                    f"{busy} (its wait list is full ({full}): waiting with the back-off, "
                    "not in the list)",
                    *busy.args[1:],
                )
            elif too_large and not duplicate:
                # It would have waited in the list but its wake message is over the bound:
                # say so, as for a full list (else it reads like a claim that never asked).
                events.count("celery_lease_wait_payload_too_large_total")
                if budget is None:
                    too_big = f"{too_large} > {settings.handoff_max_payload} bytes"
                    over = f"lease_handoff_max_payload={settings.handoff_max_payload}"
                else:
                    too_big = f"{too_large} > {budget} bytes (wait_bytes_cap)"
                    over = (
                        f"the store's whole wait list budget (wait_bytes_cap {budget} bytes; "
                        f"lease_handoff_max_payload={settings.handoff_max_payload})"
                    )
                busy = LeaseBusyError(
                    f"{busy} (its wake message is {too_large} bytes, over {over}: waiting with "
                    "the back-off, not in the wait list)",
                    *busy.args[1:],
                )
        events.count("celery_lease_busy_waits_total")
        self._log(
            "busy",
            logging.INFO,
            busy.resource,
            busy.fence,
            busy.holder_label,
            action="wait",
            wait=f"{delay:.2f}s",
            waits=waits + 1,
            duplicate=duplicate or None,
            position=busy.position,
            wait_list_full=full,
            wait_payload_too_large=too_big,
        )
        self._lease_event("task-lease-busy", action="wait", wait=delay, **_busy_fields(busy))
        # The store answered: a later outage starts its own budget.
        updates = {
            WAITS_HEADER: waits + 1,
            STORE_WAITS_HEADER: None,
            STORE_DOWN_HEADER: None,
            WOKEN_HEADER: None,
            EARLY_HEADER: None,
        }
        if busy.fence is not None and _header(request, LINEAGE_HEADER) is None:
            # This waiting execution's start. Refused by a run of this very identity (a
            # redelivery or duplicate of running work): that run counts as after the start,
            # so if it fails this message's copies end unrun.
            updates[LINEAGE_HEADER] = busy.fence - 1 if duplicate else busy.fence
        if waits and not self.track_started:
            # A copy of a waiting execution refused again: its first refusal stored RETRY,
            # or another copy of it has ended since and its final state must stay (backends
            # keep only SUCCESS from being stored over).
            return self._requeue(busy, delay, updates, store=False)
        return self._requeue(busy, delay, updates)

    def _skip(self, busy: LeaseBusyError) -> None:
        """on_busy="skip": end FAILURE with a LeaseBusyError that says why, without running.

        ``Ignore`` alone stores no state, so a caller's ``result.get()`` waited forever. The
        reason (resource, holder) is stored through the result backend first, with the chord
        and errbacks handled as for any failure; ``Ignore`` then keeps Celery from storing
        over it or logging a task failure with a traceback.
        """
        request = self.request
        skipped = _skipped(busy)
        self._log(
            "skipped",
            logging.WARNING,
            busy.resource,
            busy.fence,
            busy.holder_label,
            why="on_busy='skip'",
        )
        self._lease_event("task-lease-busy", action="skip", **_busy_fields(busy))
        if not (self.ignore_result or getattr(request, "ignore_result", False)):
            try:
                self.backend.mark_as_failure(request.id, skipped, request=request)
            except Exception:
                log.exception("task %s[%s]: storing the skip failed", self.name, request.id)
        raise Ignore(str(skipped))

    def _store_down(
        self,
        exc: LeaseStoreError,
        settings: LeaseSettings,
        resource: str,
        listed: bool = False,
        gate: str | None = None,
    ) -> Any:
        """The store failed at claim time: wait for it, on a budget of its own.

        Each attempt is sent again with the busy backoff until ``store_down_max_wait`` seconds
        have passed since this execution's first failed claim (a message header), then the task
        fails with a LeaseStoreError saying so. The outage is reported once per interval per
        process (``_outage``), not once per attempt.

        A copy of a waiter (it counts busy waits) may have a sibling copy that ran the task
        or gave up already: it reads the task's state in the result backend first and ends
        unrun on a final one (the backend is often up when the store is not), and is sent
        again without storing RETRY over another copy's state, as a back-stop copy (which
        reads that state before its claim), not as a woken one. So is a message whose claim
        was sent with a place to wake and got no answer (``listed``): it may have listed that
        place, and a copy of it may be woken and run while this one waits; it is sent again
        counting one wait, as the copy of a waiter it may be.

        With ``gate`` (its label) it is a fence gate of ``gates=`` that failed after the claim
        (given back by then): the outage is reported, and the give-up worded, for that gate.
        """
        request = self.request
        if request.is_eager or request.called_directly:
            raise exc
        busy_waits = int(_header(request, WAITS_HEADER) or 0)
        copy_of_waiter = bool(busy_waits or listed) and not self.track_started
        if copy_of_waiter:
            state = self._task_state(request, woken=True)
            if state is not None and state in states.READY_STATES:
                self._drop_finished(request, resource, state)
        made = self._compiled().store
        store = made.url if made is not None else mask_url(settings.store_url)
        budget = settings.store_down_max_wait
        if gate is None:
            outage.claim_failed(store, exc, budget)
        else:
            outage.claim_failed(gate, exc, budget, what="fence gate")
        now = _clock.wall()
        try:
            since = float(_header(request, STORE_DOWN_HEADER) or now)
        except (TypeError, ValueError):  # not ours: start counting now
            since = now
        waited = max(0.0, now - since)
        if waited >= budget:
            raise LeaseStoreError(
                f"gave up claiming the lease after waiting {waited:.1f}s for "
                f"{'the lease store' if gate is None else f'its fence gate {gate}'}, "
                f"which {'refuses connections' if exc.refused else 'keeps failing'} "
                f"(lease_store_down_max_wait={budget:g}s; raise it to wait longer): {exc}",
                exc.refused,
            ) from exc
        waits = int(_header(request, STORE_WAITS_HEADER) or 0)
        delay = min(self._busy_delay(waits, settings), since + budget - now)
        log.debug(
            "task %s[%s] could not claim its lease, retrying in %.2fs: %s",
            self.name,
            request.id,
            delay,
            exc,
        )
        updates: dict[str, Any] = {STORE_WAITS_HEADER: waits + 1, STORE_DOWN_HEADER: since}
        if copy_of_waiter:
            updates[WOKEN_HEADER] = updates[EARLY_HEADER] = None
            if not busy_waits:
                updates[WAITS_HEADER] = 1
            return self._requeue(exc, delay, updates, store=False)
        return self._requeue(exc, delay, updates)

    def _busy_cap(self, settings: LeaseSettings) -> float:
        compiled = self._compiled()
        if compiled.settings is settings:  # (reading app.conf costs ~15 us: once per process)
            if compiled.busy_cap is None:
                compiled.busy_cap = self._read_busy_cap(settings)
            return compiled.busy_cap
        return self._read_busy_cap(settings)

    def _read_busy_cap(self, settings: LeaseSettings) -> float:
        cap = settings.busy_backoff_cap
        options = self.app.conf.get("broker_transport_options") or {}
        visibility = options.get("visibility_timeout")
        if visibility:
            # A countdown longer than the visibility timeout would be redelivered early.
            cap = min(cap, float(visibility) / 2)
        return float(cap)

    def _busy_delay(self, waits: int, settings: LeaseSettings) -> float:
        cap = self._busy_cap(settings)
        delay = min(cap, settings.busy_backoff_base * (2 ** min(waits, 30)))
        return float(delay * (1 - settings.busy_backoff_jitter * random.random()))

    def _lease_lost(self, lost: LeaseLostError, lease: Lease, settings: LeaseSettings) -> Any:
        request = self.request
        reason = lost.reason or "unknown"
        events.count("celery_lease_leases_lost_total", reason=reason)
        if reason in EXPIRY_REASONS:
            events.count("celery_lease_expired_while_running_total")
        eager = bool(request.is_eager or request.called_directly)
        retries = int(_header(request, LOST_HEADER) or 0)
        gave_up = not eager and retries >= settings.lost_max_retries
        if not lease.extra.pop("lost_logged", False):  # said once, when it happened
            self._log(
                "lost",
                logging.WARNING,
                lease.resource,
                lease.fence,
                lost.holder_label,
                reason=reason,
                action="raise" if eager else ("fail" if gave_up else "rerun"),
            )
        if eager:
            raise lost
        if gave_up:
            raise LeaseLostError(
                f"{lost} (gave up after {retries} re-runs; raise lease_lost_max_retries)",
                *lost.args[1:],
            )
        return self._requeue(lost, settings.lost_retry_delay, {LOST_HEADER: retries + 1})

    def _lease_lost_in_flight(
        self,
        interrupter: Interrupter,
        task_id: str | None,
        hostname: str | None,
        hold: Hold,
        error: LeaseLostError,
    ) -> None:
        """Renewer callback: the lease is gone while the body runs. Stop the body."""
        lease = hold.lease
        lease.extra["lost_logged"] = True
        lease_log(
            "lost",
            logging.WARNING,
            resource=lease.resource,
            fence=lease.fence,
            holder=error.holder_label,
            task_id=task_id,
            task=self.name,
            reason=error.reason,
            action="interrupt the body",
        )
        interrupter.interrupt()
        self._lease_event(
            "task-lease-lost",
            task_id=task_id,
            hostname=hostname,
            resource=lease.resource,
            fence=lease.fence,
            reason=error.reason,
            holder=error.holder_label,
        )

    def _requeue(
        self,
        exc: LeaseError,
        delay: float,
        updates: dict[str, Any],
        store: bool = True,
        via_wake_queue: bool = False,
    ) -> Any:
        """Send this execution again after ``delay`` without touching ``request.retries``.

        ``updates`` sets our budget headers on the new message (None drops one). Ends with
        ``Retry`` (Celery stores RETRY), or with ``Ignore`` (nothing stored) when not ``store``.
        With ``via_wake_queue``, a copy delivered from a wake queue is sent through it again
        (on its own route as a wake is, see _to_wake_queue), not behind its queue's backlog.
        """
        request = self.request
        headers = dict(request.headers or {})
        published = _header(request, PUBLISHED_HEADER)
        if published is not None:  # (order="publish": every copy keeps when it was published)
            headers[PUBLISHED_HEADER] = published
        headers.pop(ROUTE_HEADER, None)  # (it goes on the route the copy was sent on)
        for header, value in updates.items():
            if value is None:
                headers.pop(header, None)
            else:
                headers[header] = value
        signature = self.signature_from_request(
            request, countdown=delay, retries=request.retries or 0, headers=headers
        )
        via = getattr(request, "lease_wake_queue", None) if via_wake_queue else None
        if isinstance(via, str):
            _to_wake_queue(signature.options, signature.options.setdefault("headers", {}), via)
        signature.apply_async()
        if not store:
            raise Ignore(f"{exc}: sent again in {delay:.2f}s") from exc
        raise Retry(_retry_message(exc, delay), exc=exc, when=delay, sig=signature)

    def _log(
        self,
        event: str,
        level: int,
        resource: str | None,
        fence: int | None,
        holder: str | None,
        **fields: Any,
    ) -> None:
        """One structured line for a lease event of this execution (see _eventlog)."""
        if not event_log.isEnabledFor(level):  # claimed/released are DEBUG: the hot path
            return
        lease_log(
            event,
            level,
            resource=resource,
            fence=fence,
            holder=holder,
            task_id=self.request.id,
            task=self.name,
            **{k: v for k, v in fields.items() if v is not None},
        )

    def _lease_event(
        self,
        type_: str,
        task_id: str | None = None,
        hostname: str | None = None,
        **fields_: Any,
    ) -> None:
        if not self.lease_settings.send_events:
            return
        request = self.request
        events.send_event(
            self.app, hostname or request.hostname, task_id or request.id, type_, **fields_
        )


class _TaskSetup:
    """What a lease task works out once per process (and again after a fork).

    Holds the task's resolved ``settings``; the ``resource`` and ``identity`` templates
    (:class:`NameTemplate`, or None); its ``gates`` (:class:`Gates`, or None); ``dedup``
    (whether calls carry an identity); the ``store`` (made at the first claim, see
    :meth:`current_store`); ``busy_cap`` (the longest busy wait,
    from the broker's visibility timeout); and the ``pid`` and settings ``generation`` it was
    made in (see :func:`forget_resolved_settings`).
    """

    __slots__ = (
        "busy_cap",
        "dedup",
        "gates",
        "generation",
        "identity",
        "pid",
        "resource",
        "settings",
        "store",
        "wait_ttls",
        "wake_queues",
    )

    def __init__(self, task: LeaseTask) -> None:
        if eventlet_patched():
            raise LeaseConfigError(
                f"task {task.name!r}: celery_lease does not support the eventlet pool (a lost "
                "lease could not be stopped in the right green thread); run the worker with "
                "-P prefork, threads, solo or gevent"
            )
        self.pid = getpid()
        self.generation = Resolved.generation  # (forget_resolved_settings() makes a new one)
        self.settings = task.lease_settings
        self.busy_cap: float | None = None  # (see LeaseTask._busy_cap)
        self.wait_ttls: dict[int, float] = {}  # waits -> a waiter's place lifetime (_wait_ttl)
        self.store: LeaseStore | None = None  # made at the first claim (current_store)
        # Wakes may go to the wake queue of the waiter's task queue (the workers consume them).
        self.wake_queues = self.settings.handoff_wake_queue and wake_queues_on(task.app)
        signature = inspect.signature(task.run)
        resource = _raw_attr(task, "lease_resource")
        self.resource = (
            None if resource is None else NameTemplate(resource, signature, "resource", task.name)
        )
        identity = _raw_attr(task, "lease_identity")
        self.dedup = identity is not False and (identity is not None or self.settings.dedup)
        self.identity = (
            NameTemplate(identity, signature, "identity", task.name)
            if identity not in (None, True, False)
            else None
        )
        gates = _raw_attr(task, "lease_gates")
        self.gates = Gates(gates, signature, task.name) if gates else None

    def current_store(self, task: LeaseTask) -> LeaseStore:
        """The store this call claims in: a test's override, else the app's (made once)."""
        override = overridden_store()
        if override is not None:
            if isinstance(override, AdoptsAppOptions):  # celery_lease.testing's store
                options = {"retention": self.settings.retention, **self.settings.store_options}
                override.adopt_app_options(options)
            return override
        store = self.store
        if store is None:
            store = self.store = get_store(task.app, self.settings)  # (not kept if it raises)
            before = mask_url(self.settings.store_url)
            if outage.down and before != store.url:  # an outage counted before it was made
                outage.claim_succeeded(before)
        return store


_LEASE_ATTRIBUTES = frozenset(name for name in dir(LeaseTask) if name.startswith("lease_"))


def _run_signature(cls: type[LeaseTask]) -> inspect.Signature | None:
    """The signature a task class's ``run`` is called with, or None for an abstract base."""
    run = inspect.getattr_static(cls, "run", None)
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    if not inspect.isfunction(run) or run is Task.run:
        return None
    signature = inspect.signature(run)  # bound: drop self
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _check_templates(specs: dict[str, Any], signature: inspect.Signature, task: str) -> None:
    """Compile the resource and identity templates once, so that a bad one (a parameter the
    function does not have, a positional field) fails where the task is defined."""
    for what, spec in specs.items():
        if isinstance(spec, str):
            NameTemplate(spec, signature, what, task)


def _raw_attr(task: Any, name: str) -> Any:
    """A class attribute as written (a function stored there would come back as a method)."""
    value = inspect.getattr_static(task, name, None)
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return value


def _observe_acquire(started: float, result: str) -> None:
    events.observe("celery_lease_acquire_seconds", _clock.monotonic() - started, result=result)


def _skipped(busy: LeaseBusyError) -> LeaseBusyError:
    """The error of a task skipped by ``on_busy="skip"``: why, without "retry later"."""
    reason = str(busy).removesuffix(BUSY_ADVICE)
    return LeaseBusyError(f"skipped (on_busy='skip'): {reason}", *busy.args[1:])


def _copy_kind(request: Any) -> str:
    """Which copy of its execution a message is, for the ``duplicate`` line: one a release
    woke (``woken``; ``early wake`` when sent as the release went out), the ``back-stop``
    copy a refused claim re-queued, a ``redelivered`` message, or the ``message`` as sent."""
    if _header(request, EARLY_HEADER) is not None:
        return "early wake"
    if _header(request, WOKEN_HEADER) is not None:
        return "woken"
    if int(_header(request, WAITS_HEADER) or 0):
        return "back-stop"
    if (request.delivery_info or {}).get("redelivered"):
        return "redelivered"
    return "message"


def _gate_outlived_store(refused: StaleFenceError, lease: Lease) -> bool:
    """Whether a gate's refusal at claim names a fence above every fence the lease store ever
    granted for the resource (read after the lease was given back: a newer claim since then
    raises the store's fence too, and then this is an ordinary stale claim)."""
    if refused.highest is None or refused.highest <= lease.fence or lease.store is None:
        return False
    try:
        granted = lease.store.highest_fence(lease.resource)
    except LeaseError:  # unknown: treat it as the ordinary stale claim it most likely is
        return False
    return granted is not None and refused.highest > granted


def _store_url(lease: Lease) -> str:
    return str(getattr(lease.store, "url", "?"))


def _newer_holder(lease: Lease, refused: StaleFenceError) -> tuple[int | None, str | None]:
    """The newer fence behind a side effect's refusal, and its holder when read from the store.

    A ``FenceGate`` names the fence it accepted (so does a gateway's 409 whose body says
    ``{"highest": N}``); a 409 may name none, and then the store tells who holds the resource
    now, or, when nobody does (the newer owner released already), the newest fence it granted
    (a read or two, on this rare path; nothing when it fails or granted no newer fence)."""
    if refused.highest is not None:
        return refused.highest, None
    store = lease.store
    if store is None:
        return None, None
    try:
        info = store.get(lease.resource)
        if info is not None and info.fence > lease.fence:
            # (an expired lease's owner holds nothing: name its fence, not it)
            return info.fence, None if info.expired else info.owner_label
        highest = store.highest_fence(lease.resource)
    except LeaseError:
        return None, None
    return (highest, None) if highest is not None and highest > lease.fence else (None, None)


def _retry_message(exc: LeaseError, delay: float) -> str:
    """What Celery's retry line says for an execution sent again (``Task proj.x[id] retry:
    <this>``): one short sentence. Celery's own, ``Retry in 15.0s: <the error's repr>``, ran to
    300 characters and named the back-stop's delay, while a listed waiter is woken by the
    release, often within milliseconds. The holder's label is left to the ``busy`` event line
    and the RETRY state (the whole error goes to the result backend, as before)."""
    if not isinstance(exc, LeaseBusyError):
        return f"{exc}: sent again in {delay:.2f}s"
    if exc.duplicate:
        return (
            f"busy: a copy of this execution holds {exc.resource} (fence {exc.fence}): "
            f"looking again in {delay:.2f}s"
        )
    held = f"busy: {exc.resource} is held (fence {exc.fence})"
    if exc.position and exc.polling:
        # Why its place polls (no identity, its message too big, no room), as _lease_busy put
        # it after the advice.
        _, _, note = str(exc).partition(BUSY_ADVICE)
        return (
            f"{held}: polling at place {exc.position} of its wait list, back in {delay:.1f}s"
            f"{' ' + note.strip() if note.strip() else ''}"
        )
    if exc.position:
        return (
            f"{held}: waiting at place {exc.position} of its wait list, woken when it is "
            f"released (back-stop copy in {delay:.1f}s)"
        )
    # Why it is not in the wait list (full, or its message too big), as _lease_busy appended
    # it after the advice: the busy event line saying so is logged once per 10 s only.
    _, _, note = str(exc).partition(BUSY_ADVICE)
    return f"{held}: trying again in {delay:.2f}s{' ' + note.strip() if note.strip() else ''}"


def _busy_fields(busy: LeaseBusyError) -> dict[str, Any]:
    return {
        "resource": busy.resource,
        "holder": busy.holder_label,
        "fence": busy.fence,
        "expires_in": busy.expires_in,
    }


def _take_sent_route(request: Any) -> None:
    """A copy delivered from a wake queue, with the waiter's route in its ROUTE_HEADER: take
    that route as its delivery route, so everything that reads it (``retry()``, the busy
    re-queue, the next wake) sends where the waiter was sent. ``request.lease_wake_queue``
    keeps the wake queue it came from. Any other copy ignores the header."""
    route = _header(request, ROUTE_HEADER)
    delivery = request.delivery_info
    if not isinstance(route, list) or len(route) != 3 or not isinstance(delivery, dict):
        return
    via, exchange, routing_key = route
    if not isinstance(via, str) or not via.endswith(WAKE_QUEUE_SUFFIX):
        return
    if delivery.get("routing_key") != via or delivery.get("exchange") not in ("", via):
        return
    request.delivery_info = {**delivery, "exchange": exchange, "routing_key": routing_key}
    request.lease_wake_queue = via


def _count(value: Any) -> int:
    """A count header's value (0 when absent or not a whole number)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def _header(request: Any, name: str) -> Any:
    """A message header: top-level on a worker's request, in ``headers`` under apply()."""
    value = request.get(name)
    if value is None and isinstance(request.headers, dict):
        value = request.headers.get(name)
    return value


#: Headers a wake's message does not carry: our per-attempt ones (the woken copy starts its own
#: outage budget and latency clock) and RabbitMQ's dead-letter trail, as Celery's
#: ``Context.as_execution_options()`` drops it.
_WAKE_DROPPED = frozenset(
    {
        STORE_WAITS_HEADER,
        STORE_DOWN_HEADER,
        WOKEN_HEADER,
        EARLY_HEADER,
        ROUTE_HEADER,
        LISTED_HEADER,
        DONE_CHECKS_HEADER,
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
#: (option, request attribute) of ``Context.as_execution_options()`` but headers, retries and
#: the time limits, which are worked out apart (tests/test_handoff.py checks the two agree).
_EXECUTION_OPTIONS = (
    ("task_id", "id"),
    ("root_id", "root_id"),
    ("parent_id", "parent_id"),
    ("group_id", "group"),
    ("group_index", "group_index"),
    ("shadow", "shadow"),
    ("chord", "chord"),
    ("chain", "chain"),
    ("link", "callbacks"),
    ("link_error", "errbacks"),
    ("expires", "expires"),
    ("reply_to", "reply_to"),
    ("replaced_task_nesting", "replaced_task_nesting"),
    ("origin", "origin"),
)


def _execution_options(request: Any) -> dict[str, Any]:
    """``request.as_execution_options()`` without the None values, headers and retries."""
    values = getattr(request, "__dict__", None)
    if type(request) is Context and values is not None:
        # A worker's request holds what its message set in its __dict__ (most of it None);
        # the rest are the class's defaults, of which only some are not None.
        options = {
            _OPTION_OF[attribute]: value
            for attribute, value in values.items()
            if value is not None and attribute in _OPTION_OF
        }
        for attribute, default in _CONTEXT_DEFAULTS:
            if attribute not in values:
                options[_OPTION_OF[attribute]] = default
    else:
        options = {}
        for option, attribute in _EXECUTION_OPTIONS:
            value = getattr(request, attribute, None)
            if value is not None:
                options[option] = value
    timelimit = request.timelimit
    if timelimit:
        hard, soft = timelimit
        if soft is not None:
            options["soft_time_limit"] = soft
        if hard is not None:
            options["time_limit"] = hard
    stamps, stamped = getattr(request, "stamps", None), getattr(request, "stamped_headers", None)
    if stamps is not None and stamped is not None:
        options["stamped_headers"] = stamped
        options.update((k, v) for k, v in stamps.items() if k in stamped and v is not None)
    return options


def _waiter_name(task_id: str) -> str:
    """The name of the place of a task without an identity: its task id, or a digest of it
    where the id is no valid name (a space, a %: the names' rule is the resources')."""
    if _RESOURCE_RE.fullmatch(task_id):
        return task_id
    return "task-" + hashlib.sha256(task_id.encode()).hexdigest()[:40]


def _place_options(request: Any, waiter: str | None, settings: LeaseSettings) -> dict[str, Any]:
    """The claim's options that name and order its place: ``waiter`` (a task without an
    identity: its task id) and, with ``order="publish"``, when its message was published."""
    options: dict[str, Any] = {}
    if waiter is not None:
        options["waiter"] = waiter
    if settings.order == "publish":
        published = _header(request, PUBLISHED_HEADER)
        with contextlib.suppress(TypeError, ValueError):  # (not ours: placed by arrival)
            options["since"] = int(published)
    return options


def _bound_size(payload: str, request: Any) -> int:
    """The size of a wake message as lease_handoff_max_payload bounds it: its bytes without
    the digits of its celery_lease_waits counter (the same for every copy of one execution)."""
    waits = int(_header(request, WAITS_HEADER) or 0)
    return len(payload) - len(str(waits + 1))


def _wait_bounds(store: Any) -> str:
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


_OPTION_OF = {attribute: option for option, attribute in _EXECUTION_OPTIONS}
#: (attribute, default) of the execution options whose Context class default is not None.
_CONTEXT_DEFAULTS = tuple(
    (attribute, getattr(Context, attribute))
    for _, attribute in _EXECUTION_OPTIONS
    if getattr(Context, attribute, None) is not None
)
#: The wake payload's JSON: compact, with json's circular-reference check (a circular
#: argument is a ValueError, "not JSON"; without the check it recurses in C, which a raised
#: recursion limit lets overflow the C stack). The markers dict is made per call: the C
#: encoder leaves entries behind when it fails, and threads may encode at once.
_dump_json: Callable[[Any], str]
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
if _c_make_encoder is not None:  # (CPython: always)
    _json_encoder = json.JSONEncoder()

    def _json_default(value: Any) -> Any:
        # Looked up on each call (only for what is not JSON): an app may patch
        # json.JSONEncoder.default after import (objects with to_json()), as json.dumps sees.
        return _json_encoder.default(value)

    def _dump_json(value: Any) -> str:
        return "".join(
            _c_make_encoder(  # type: ignore[misc]
                {},  # markers: the circular-reference check
                _json_default,
                json.encoder.encode_basestring_ascii,
                None,  # indent
                ":",
                ",",
                False,  # sort_keys
                False,  # skipkeys
                True,  # allow_nan
            )(value, 0)
        )

else:  # pragma: no cover - a Python without the C accelerator
    _dump_json = json.JSONEncoder(separators=(",", ":")).encode


def _own_count_unknown(request: Any, lease: Lease | None) -> bool:
    """An early copy whose claim on a store that answers with the claimant's own place
    (``own_wake``) found none: it lapsed, or the claim was sent again after a lost reply."""
    return (
        lease is not None
        and _header(request, EARLY_HEADER) is not None
        and getattr(lease.store, "supports_early_wake", False)
    )


def _listed_waits(payload: str) -> int:
    """The waits count a listed wake payload carries (0 when it carries none). Read from
    the text, not parsed: the hand-off's path. A key of that name inside the task's own
    arguments can only raise the count (one more backend read), never hide it."""
    return max((int(n) for n in _WAITS_IN_PAYLOAD.findall(payload)), default=0)


def _listed_at(request: Any) -> float:
    """When a waiter's place counts as listed (wall clock): now, or earlier when this
    execution's place was listed before (a copy woken from it, refused again, re-arms it:
    its back-stop sibling may have given up since the first listing), or its claims began to
    fail earlier (a claim whose reply was lost may have listed the place while the store-down
    budget, which started at that earlier failure, kept running). The woken copy counts
    from there to know whether its sibling may have given up."""
    listed = _clock.wall()
    for name in (LISTED_HEADER, STORE_DOWN_HEADER):
        value = _header(request, name)
        if value is not None:
            with contextlib.suppress(TypeError, ValueError):  # (not ours: ignored)
                listed = min(listed, float(value))
    return listed


#: At most this many characters of a holder's arguments go into its label.
MAX_LABEL_ARGUMENTS = 80
#: Fewer than this left for the arguments in a label: leave them out rather than show "(4...".
_MIN_ARGUMENTS = 12
_NO_ARGUMENTS = frozenset({"", "()", "[]", "{}"})


def _owner_label(request: Any, name: str | None) -> str:
    """``host:pid:task-id task-name arguments``: who holds a lease, for people (ls, show,
    errors, logs). See _names for the format; at most MAX_LABEL_LENGTH characters, the task
    id never cut for the note (a note that does not fit is shortened or left out).

    Made on every claim, so written for few operations: about 12k instructions per claim with
    arguments recorded, 2.7k without (callgrind), the redaction's fast paths included."""
    task_id = request.id
    if not task_id:
        task_id = "direct"
    elif type(task_id) is not str or "%" in task_id or " " in task_id:
        task_id = label_task_id(str(task_id))
    label = f"{request.hostname or socket.gethostname()}:{getpid()}:{task_id}"
    room = MAX_LABEL_LENGTH - len(label) - 1
    if not name or len(name) > room or " " in name:
        return label
    room -= len(name) + 1
    # What `celery inspect active` shows: the argument text the sender recorded in the message
    # (a user's argsrepr= hides secrets there too), never a repr made here (not on every claim,
    # and an object's __repr__ is user code). Eager runs and direct calls record none.
    args = getattr(request, "argsrepr", None)
    kwargs = getattr(request, "kwargsrepr", None)
    if not isinstance(args, str) or args in _NO_ARGUMENTS:
        args = ""
    if not isinstance(kwargs, str) or kwargs in _NO_ARGUMENTS:
        kwargs = ""
    if not (args or kwargs) or room < _MIN_ARGUMENTS:
        return f"{label} {name}"
    limit = min(room, MAX_LABEL_ARGUMENTS)
    if args and kwargs:
        # (each cut to what shorten reads at most: a huge argsrepr is not copied)
        read = limit + SHORTEN_LOOKAHEAD + 1
        args = f"{args[:read]} {kwargs[:read]}"
    return f"{label} {name} {shorten(args or kwargs, limit)}"


def _ignores_result(task: Any, request: Any) -> bool:
    return bool(task.ignore_result or getattr(request, "ignore_result", False))


def _has_backend(task: Any) -> bool:
    """Whether the task's app has a result backend (not Celery's DisabledBackend)."""
    return not isinstance(task.backend, DisabledBackend)


def _backend_readable(task: Any) -> bool:
    """Whether a worker can read another task's state from the task's result backend: not
    without one, nor from ``rpc://`` (results travel to their caller's reply queue)."""
    return not isinstance(task.backend, (DisabledBackend, RPCBackend))


def _names_task(label: str | None, task_id: str | None) -> bool:
    """Whether an owner label (``host:pid:<task id>[ <note>]``, see _owner_label) names this
    task id: its task-id part (up to the first space) is the task id as labels write it."""
    if label is None or task_id is None:
        return False
    parts = label.split(":", 2)  # (a task id may hold colons, a host name not)
    return (
        len(parts) == 3
        and parts[1].isdigit()
        and parts[2].partition(" ")[0] == label_task_id(task_id)
    )


def _copy_of_run(lease: Lease, request: Any) -> bool:
    """Whether the run the identity's record names (its attempt) was a run of this
    execution by another of its hand-off copies: see _copy_of_failed."""
    return (request.retries or 0) == lease.identity_attempt and _copy_of_failed(lease, request)


def _copy_of_failed(lease: Lease, request: Any) -> bool:
    """Whether this message is a copy of the execution whose failure the identity's record
    names (its body ran and raised): the same task id (the owner label the record names ends
    with it, see _owner_label), and an earlier attempt or a copy of the failed one that the
    hand-off made (a woken or back-stop copy: it counts its waits). Another task id sharing
    the identity is a new submission and runs; so do a later attempt (``self.retry()`` sent
    before the failure) and a redelivery of the failed message itself (its worker died before
    Celery stored the failure).

    A hand-off copy carries the fence its waiting execution began at (LINEAGE_HEADER): the
    failed run must be newer (``identity_fence``), else it ran before this message was sent
    (the task id was sent again after its failure) and this one runs. Copies without it (older
    workers') and stores that do not give the fence: the rule above alone."""
    task_id = request.id
    retries = request.retries or 0
    if task_id is None or retries > lease.identity_attempt:
        return False
    if not _names_task(lease.identity_owner_label or lease.previous_owner_label, task_id):
        return False
    if retries < lease.identity_attempt:
        return True
    if not int(_header(request, WAITS_HEADER) or 0):
        return False
    since = _header(request, LINEAGE_HEADER)
    if since is None or lease.identity_fence is None:
        return True
    try:
        return lease.identity_fence > int(since)
    except (TypeError, ValueError):  # not ours
        return True


def lease_task(
    *args: Any,
    resource: str | Callable[..., str] | None = None,
    identity: str | Callable[..., str] | bool | None = None,
    gates: GatesSpec | None = None,
    reconcile: Callable[[Lease], None] | None = None,
    reconcile_effect: Callable[[str, Lease], Any] | None = None,
    app: Any = None,
    base: type[LeaseTask] | None = None,
    **options: Any,
) -> Any:
    """Register a function as a Celery task that runs under a lease on ``resource``.

    Used like ``shared_task`` (or ``app.task`` when ``app`` is given):

    ```python
    from celery_lease import lease_task

    @lease_task(resource="browser/account-{account_id}", ttl=60, acks_late=True)
    def drive_browser(account_id): ...
    ```

    Args:
        resource: a ``str.format`` template over the task's arguments (positional or keyword,
            defaults applied, ``{obj.attr}`` allowed) or a callable taking the arguments.
        identity: the execution's identity for dedup and the effect ledger: a template or
            callable like ``resource``; default: the message's ``idempotency_key`` header, else
            the task id; ``False`` turns dedup off for this task.
        gates: fence gates that admit each new fence right after the claim, before
            ``reconcile`` and the body, so an older owner's late write is refused there from
            the claim on, not only from the new owner's first write: gates that do not share
            the lease store (another database, an HTTP gateway of another service). Each entry
            is a gate (anything with ``admit(key, fence)``; its key is the resource) or a
            ``(gate, key)`` pair, the key a template over the task's arguments like
            ``resource`` (``"account-{account_id}"``) or a callable taking them. The gate may
            also be a callable taking no arguments that returns it (``lambda: gate``), asked
            at each claim, so that a gate a test swaps in is the one admitted at.
        reconcile: ``reconcile(lease)``, called before the body when an earlier owner of the
            work did not finish (``lease.recovered``).
        reconcile_effect: ``reconcile_effect(key, lease)`` for an effect begun by an earlier
            owner and never recorded done: return its receipt, or ``REDO``.
        app: register on this app instead of as a shared task.
        base: a ``LeaseTask`` subclass to use as the base class.
        **options: lease settings without the ``lease_`` prefix (``ttl``, ``on_busy``,
            ``max_runtime``, ...) and every Celery task option (``bind``, ``acks_late``,
            ``max_retries``, ``name``, ...).

    Raises:
        LeaseConfigError: no resource, a base that is not a LeaseTask, a bad setting, or a
            ``gates`` entry that is no gate or a key template naming no parameter.
    """
    base = base or LeaseTask
    if not (isinstance(base, type) and issubclass(base, LeaseTask)):
        raise LeaseConfigError(f"base must be a LeaseTask subclass, got {show_value(base)}")
    attrs: dict[str, Any] = {}
    for name in SETTING_NAMES:
        if name in options:
            attrs[f"lease_{name}"] = options.pop(name)
    if identity is not None:
        if not (isinstance(identity, (str, bool)) or callable(identity)):
            raise LeaseConfigError(
                f"identity must be a template string, a callable or False, got "
                f"{show_value(identity)}"
            )
        attrs["lease_identity"] = staticmethod(identity) if callable(identity) else identity
    for hook_name, hook in (("reconcile", reconcile), ("reconcile_effect", reconcile_effect)):
        if hook is not None:
            if not callable(hook):
                raise LeaseConfigError(f"{hook_name} must be callable, got {show_value(hook)}")
            attrs[hook_name] = staticmethod(hook)
    if resource is not None:
        if not (isinstance(resource, str) or callable(resource)):
            raise LeaseConfigError(
                f"resource must be a template string or a callable, got {show_value(resource)}"
            )
        attrs["lease_resource"] = resource
    elif base.lease_resource is None:
        raise LeaseConfigError(
            "lease_task needs resource=, e.g. @lease_task(resource='invoice:{invoice_id}')"
        )
    if gates is not None:
        # A copy (checked in define(), where the task's name is known): appending to the
        # caller's list later changes nothing.
        attrs["lease_gates"] = tuple(gates) if isinstance(gates, (list, tuple)) else gates
    LeaseSettings.resolve(None, {name: attrs.get(f"lease_{name}") for name in SETTING_NAMES})
    for name in options:
        if name not in CELERY_DECORATOR_OPTIONS and not hasattr(base, name):
            candidates = [
                *SETTING_NAMES,
                *LEASE_TASK_KEYWORDS,
                *CELERY_DECORATOR_OPTIONS,
                *(n for n in dir(base) if not n.startswith("_")),
            ]
            raise LeaseConfigError(
                f"@lease_task got an unknown keyword {name!r}{did_you_mean(name, candidates)}; "
                f"it takes the lease settings ({', '.join(SETTING_NAMES)}), resource, identity, "
                "gates, reconcile, reconcile_effect, app, base and Celery's task options; a task "
                "attribute of your own goes on a LeaseTask subclass passed as base="
            )
    specs = {
        what: attrs.get(f"lease_{what}", _raw_attr(base, f"lease_{what}"))
        for what in ("resource", "identity")
    }
    if app is not None:
        # Now, at import: a worker parses its command line (the --lease-* options) before the
        # app is finalized and its tasks are bound.
        install(app)
    register = app.task if app is not None else shared_task
    decorator = register(base=base, **attrs, **options)

    def define(fun: F) -> Any:
        signature = inspect.signature(fun)
        if options.get("bind"):  # the task itself comes first
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        name = options.get("name") or f"{fun.__module__}.{fun.__qualname__}"
        _check_templates(specs, signature, name)
        check_gates(attrs.get("lease_gates", _raw_attr(base, "lease_gates")), signature, name)
        return decorator(fun)

    if len(args) == 1 and callable(args[0]) and not options:
        return define(args[0])
    if args:
        raise LeaseConfigError("lease_task takes keyword arguments only (resource=..., ttl=...)")
    return define
