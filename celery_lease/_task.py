"""LeaseTask and @lease_task: claim before the body runs, renew while it runs, release after.

The claim happens in ``Task.__call__``, in the thread that runs the body, inside one
try/finally that also releases: it is the only hook that sees success, failure, retry, ignore,
reject and time limits alike (``task_prerun`` cannot veto; ``after_return`` is skipped on retry).

This module is the Celery-facing surface: the task class, its settings and name templates, the
decorator. What one call does lives in rooms of its own, each deciding one thing:

* ``_attempt``: one attempt: claim, what the claim found, gates, the body, release;
* ``_waiting``: a refused claim: wait in the resource's wait list (woken by the release),
  poll in a place, back off, skip or fail (``on_busy``); busy waits have their own budget;
* ``_copies``: a copy of an execution that already ran, failed or moved on: end it unrun;
* ``_outcomes``: a store down at the claim, a lease lost while running (interrupted, sent
  again on a budget of its own, never SUCCESS), a gate that refuses the fence;
* ``_execution``: what they all do: log lines and events, re-queue, release and wake;
* ``_message`` (the headers every copy carries, the wake payload) and ``_setup`` (what a task
  works out once per process). The hand-off's rules: docs/handoff.md.

Eager (``apply()``) and direct calls never spin: a busy or lost lease raises at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

from celery import Task, shared_task

from . import _clock, _unique
from . import _events as events
from ._app import install
from ._app_stores import register_task_type
from ._attempt import Attempt
from ._errors import LeaseConfigError, LeaseError
from ._gates import GatesSpec, check_gates
from ._lease import CURRENT_LEASE, Lease
from ._message import (
    PUBLISHED_HEADER,
    UNIQUE_HEADER,
    read_header,
    request_get,
    take_sent_route,
    task_request,
)
from ._names import IDENTITY_RULE, did_you_mean, show_value, validate_resource
from ._names import RESOURCE_PATTERN as _RESOURCE_RE
from ._pid import getpid
from ._settings import LeaseSettings, Resolved
from ._setup import TaskSetup, check_templates, raw_attr, run_signature
from ._wake_queues import ROUTE_HEADER

__all__ = ["LeaseTask", "current_lease", "lease_task"]

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
    "unique_key",
    "gates",
    "reconcile",
    "reconcile_effect",
    "app",
    "base",
)


def current_lease() -> Lease:
    """The lease held by the task execution that is running here.

    Works anywhere in the task's call stack (a context variable), also in eager mode.

    Raises:
        LeaseError: no lease task execution is running in this context.
    """
    lease = CURRENT_LEASE.get()
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
    #: ``reconcile_effect(key, lease)``: define it (or pass ``reconcile_effect=``) to settle an
    #: effect an earlier owner began (see ``Lease.effect``). None here, not absent, so the claim
    #: reads it without building an AttributeError per task.
    reconcile_effect: Callable[[str, Lease], Any] | None = None
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
    lease_unique: str | None = None
    lease_unique_ttl: float | None = None
    lease_on_conflict: str | None = None
    #: The key a publish lock (``unique=`` but ``"while_executing"``) is taken on: a template
    #: or callable over the arguments, like ``lease_resource``; None: the task's name and
    #: resource.
    lease_unique_key: str | Callable[..., str] | None = None

    _lease_settings_cache: tuple[int, LeaseSettings] | None = None  # (Resolved.generation, ..)
    _lease_compiled: TaskSetup | None = None

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
                    "lease_resource, lease_identity, lease_unique_key and lease_gates"
                )

    @classmethod
    def on_bound(cls, app: Any) -> None:
        install(app)
        register_task_type(cls)
        # Bad settings fail here, at import or app finalization (Celery's own Task.bind reads
        # app.conf at this point too), not at the first run.
        LeaseSettings.resolve(app.conf, cls._lease_overrides())
        signature = run_signature(cls)
        if signature is not None:
            specs = {what: raw_attr(cls, f"lease_{what}") for what in _TEMPLATES}
            check_templates(specs, signature, cls.name)
        check_gates(raw_attr(cls, "lease_gates"), signature, cls.name)

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
    def _compiled(self) -> TaskSetup:
        """Settings, store and name templates of this task, worked out once per process."""
        compiled = self._lease_compiled
        if (
            compiled is None
            or compiled.pid != getpid()
            or compiled.generation != Resolved.generation
        ):
            compiled = self._lease_compiled = TaskSetup(self)
        return compiled

    def lease_resource_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The resource name for one call, from ``lease_resource`` and the call's arguments.

        Raises:
            LeaseConfigError: no resource is configured, an argument the template needs is
                missing or None, or the result is not a valid resource name.
        """
        return self._resource(self._compiled(), args, kwargs)

    def _resource(
        self, compiled: TaskSetup, args: tuple[Any, ...], kwargs: Mapping[str, Any]
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
        compiled: TaskSetup,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        request: Any,
    ) -> str | None:
        if not compiled.dedup:
            return None
        key = read_header(request, "idempotency_key")
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

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        """As ``Task.apply_async``. With ``order="publish"``, the message says when it was
        published (this process's clock), which places it in its resource's wait list. With
        ``unique=`` locked at publish, the lock on its unique key is taken first (see
        ``on_conflict`` for a key another copy holds).

        Raises:
            AlreadyQueuedError: ``on_conflict="raise"`` and another copy holds the unique key.
            LeaseConfigError: the call's resource, identity or unique key is not a valid name.
        """
        settings = self.lease_settings
        if settings.order == "publish":
            headers = options.get("headers") or {}
            if PUBLISHED_HEADER not in headers:
                options["headers"] = {**headers, PUBLISHED_HEADER: int(_clock.wall() * 1e6)}
        if more or self.app.conf.task_always_eager:  # (eager: the call itself checks)
            return super().apply_async(args, kwargs, task_id, *more, **options)
        setup = self._compiled()
        call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
        # Names are checked where they are made: a bad one fails here, in the caller.
        resource = self._resource(setup, call_args, call_kwargs)
        if setup.identity is not None:
            self._checked_identity(
                setup.identity.render(call_args, call_kwargs), "the identity template"
            )
        if settings.unique == "while_executing":
            return super().apply_async(args, kwargs, task_id, **options)
        return _unique.publish(
            self, setup, super().apply_async, call_args, call_kwargs, task_id, options, resource
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = task_request(self)
        if request_get(request, ROUTE_HEADER) is not None:  # woken through a wake queue (or stale)
            take_sent_route(request)
        setup = self._compiled()
        direct = bool(request.called_directly)
        if direct and setup.settings.allow_direct_call:
            return super().__call__(*args, **kwargs)
        if not direct and request_get(request, UNIQUE_HEADER) is not None:
            _unique.at_start(self, setup, request)
        return Attempt(self, setup, request, args, kwargs, direct).run()

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        """Celery's hook after a SUCCESS or FAILURE: an ``until_executed`` lock is given back
        (call ``super().after_return(...)`` when you override it)."""
        request = task_request(self)
        if request_get(request, UNIQUE_HEADER) is not None:
            _unique.finished(self, request)
        super().after_return(*args, **kwargs)

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


_LEASE_ATTRIBUTES = frozenset(name for name in dir(LeaseTask) if name.startswith("lease_"))
#: The names a task works out from its arguments (templates or callables).
_TEMPLATES = ("resource", "identity", "unique_key")


def lease_task(
    *args: Any,
    resource: str | Callable[..., str] | None = None,
    identity: str | Callable[..., str] | bool | None = None,
    unique_key: str | Callable[..., str] | None = None,
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
        unique_key: with ``unique=`` locked at publish (``"until_executed"``, ...), the key a
            copy's lock is taken on: a template or callable like ``resource`` (build one from
            any arguments with ``celery_lease.key_of``); default: the task's name and its
            resource. See also ``unique``, ``unique_ttl`` and ``on_conflict`` (settings).
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
    attrs = lease_attributes(
        base,
        resource=resource,
        identity=identity,
        unique_key=unique_key,
        gates=gates,
        reconcile=reconcile,
        reconcile_effect=reconcile_effect,
        options=options,
    )
    specs = {
        what: attrs.get(f"lease_{what}", raw_attr(base, f"lease_{what}")) for what in _TEMPLATES
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
        check_templates(specs, signature, name)
        check_gates(attrs.get("lease_gates", raw_attr(base, "lease_gates")), signature, name)
        return decorator(fun)

    if len(args) == 1 and callable(args[0]) and not options:
        return define(args[0])
    if args:
        raise LeaseConfigError("lease_task takes keyword arguments only (resource=..., ttl=...)")
    return define


def lease_attributes(
    base: type[LeaseTask],
    *,
    resource: str | Callable[..., str] | None = None,
    identity: str | Callable[..., str] | bool | None = None,
    unique_key: str | Callable[..., str] | None = None,
    gates: GatesSpec | None = None,
    reconcile: Callable[[Lease], None] | None = None,
    reconcile_effect: Callable[[str, Lease], Any] | None = None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """The class attributes ``@lease_task`` gives a task for its lease keywords, checked.

    The lease settings among ``options`` (``ttl``, ``on_busy``, ...) are taken out of it; what
    is left are Celery's task options. ``lease_routes`` gives a routed task the same attributes
    (``_routes``): a keyword added to ``@lease_task`` is mapped here, for both.

    Raises:
        LeaseConfigError: as ``lease_task``.
    """
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
    if unique_key is not None:
        if not (isinstance(unique_key, str) or callable(unique_key)):
            raise LeaseConfigError(
                f"unique_key must be a template string or a callable, got {show_value(unique_key)}"
            )
        attrs["lease_unique_key"] = staticmethod(unique_key) if callable(unique_key) else unique_key
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
                "unique_key, gates, reconcile, reconcile_effect, app, base and Celery's task "
                "options; a task attribute of your own goes on a LeaseTask subclass passed as base="
            )
    return attrs
