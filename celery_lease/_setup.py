"""What a lease task works out once per process: its settings, name templates, gates and
store, and the waits its settings imply (busy back-off, back-stop delay, a place's lifetime).

Made at a task's first call in a process (and again after a fork, or after the settings were
forgotten); every attempt of the task reads it.
"""

from __future__ import annotations

import inspect
import random
from typing import TYPE_CHECKING, Any

from celery import Task

from . import _outage as outage
from ._app_stores import AdoptsAppOptions, get_store, overridden_store
from ._errors import LeaseConfigError
from ._gates import Gates
from ._interrupt import eventlet_patched
from ._names import mask_url
from ._pid import getpid
from ._settings import Resolved
from ._template import NameTemplate
from ._wake_queues import wake_queues_on

if TYPE_CHECKING:
    from .stores import LeaseStore


class TaskSetup:
    """What a lease task works out once per process (and again after a fork).

    Holds the task's ``app`` and resolved ``settings``; the ``resource``, ``identity`` and
    ``unique_key`` templates (:class:`NameTemplate`, or None); its ``gates`` (:class:`Gates`,
    or None);
    ``dedup`` (whether calls carry an identity); the ``store`` (made at the first claim, see
    :meth:`current_store`); ``cap`` (the longest busy wait, see :meth:`busy_cap`); and the
    ``pid`` and settings ``generation`` it was made in (see :func:`forget_resolved_settings`).
    """

    __slots__ = (
        "app",
        "cap",
        "dedup",
        "gates",
        "generation",
        "identity",
        "pid",
        "resource",
        "settings",
        "store",
        "unique_key",
        "wait_ttls",
        "wake_queues",
    )

    def __init__(self, task: Task) -> None:
        if eventlet_patched():
            raise LeaseConfigError(
                f"task {task.name!r}: celery_lease does not support the eventlet pool (a lost "
                "lease could not be stopped in the right green thread); run the worker with "
                "-P prefork, threads, solo or gevent"
            )
        self.pid = getpid()
        self.generation = Resolved.generation  # (forget_resolved_settings() makes a new one)
        self.app = task.app
        self.settings = task.lease_settings
        self.cap: float | None = None  # (see busy_cap)
        self.wait_ttls: dict[int, float] = {}  # waits -> a waiter's place lifetime (wait_ttl)
        self.store: LeaseStore | None = None  # made at the first claim (current_store)
        # Wakes may go to the wake queue of the waiter's task queue (the workers consume them).
        self.wake_queues = self.settings.handoff_wake_queue and wake_queues_on(task.app)
        signature = inspect.signature(task.run)
        resource = raw_attr(task, "lease_resource")
        self.resource = (
            None if resource is None else NameTemplate(resource, signature, "resource", task.name)
        )
        identity = raw_attr(task, "lease_identity")
        self.dedup = identity is not False and (identity is not None or self.settings.dedup)
        self.identity = (
            NameTemplate(identity, signature, "identity", task.name)
            if identity not in (None, True, False)
            else None
        )
        gates = raw_attr(task, "lease_gates")
        self.gates = Gates(gates, signature, task.name) if gates else None
        unique_key = raw_attr(task, "lease_unique_key")
        self.unique_key = (
            None
            if unique_key is None
            else NameTemplate(unique_key, signature, "unique_key", task.name)
        )

    def current_store(self) -> LeaseStore:
        """The store this call claims in: a test's override, else the app's (made once)."""
        override = overridden_store()
        if override is not None:
            if isinstance(override, AdoptsAppOptions):  # celery_lease.testing's store
                options = {"retention": self.settings.retention, **self.settings.store_options}
                override.adopt_app_options(options)
            return override
        store = self.store
        if store is None:
            store = self.store = get_store(self.app, self.settings)  # (not kept if it raises)
            before = mask_url(self.settings.store_url)
            if outage.down and before != store.url:  # an outage counted before it was made
                outage.claim_succeeded(before)
        return store

    # -- the waits its settings imply ---------------------------------------------------------
    def busy_cap(self) -> float:
        """The longest busy wait: ``busy_backoff_cap``, at most half the broker's visibility
        timeout (a longer countdown would be redelivered early). Read once per process:
        reading app.conf costs about 15 us."""
        cap = self.cap
        if cap is None:
            cap = self.settings.busy_backoff_cap
            options = self.app.conf.get("broker_transport_options") or {}
            visibility = options.get("visibility_timeout")
            if visibility:
                cap = min(cap, float(visibility) / 2)
            cap = self.cap = float(cap)
        return cap

    def busy_delay(self, waits: int) -> float:
        """The jittered, capped exponential back-off after ``waits`` busy waits."""
        settings = self.settings
        delay = min(self.busy_cap(), settings.busy_backoff_base * (2 ** min(waits, 30)))
        return float(delay * (1 - settings.busy_backoff_jitter * random.random()))

    def backstop_delay(self, waits: int) -> float:
        """When a queued waiter's own copy runs if nobody wakes it: no sooner than the lease
        ttl (a crashed holder's lease has run out by then), capped like the busy backoff."""
        return min(self.busy_cap(), max(self.busy_delay(waits), float(self.settings.ttl)))

    def wait_ttl(self, waits: int) -> float:
        """How long a waiter's place is kept: past its longest back-stop delay (the jitter
        only shortens it), worked out once per number of waits."""
        keep = self.wait_ttls.get(waits)
        if keep is None:
            settings, cap = self.settings, self.busy_cap()
            longest = min(
                cap, max(min(cap, settings.busy_backoff_base * 2 ** min(waits, 30)), settings.ttl)
            )
            keep = self.wait_ttls[waits] = longest + settings.ttl + 10.0
        return keep


def run_signature(cls: type[Task]) -> inspect.Signature | None:
    """The signature a task class's ``run`` is called with, or None for an abstract base."""
    run = inspect.getattr_static(cls, "run", None)
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    if not inspect.isfunction(run) or run is Task.run:
        return None
    signature = inspect.signature(run)  # bound: drop self
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def check_templates(specs: dict[str, Any], signature: inspect.Signature, task: str) -> None:
    """Compile the resource and identity templates once, so that a bad one (a parameter the
    function does not have, a positional field) fails where the task is defined."""
    for what, spec in specs.items():
        if isinstance(spec, str):
            NameTemplate(spec, signature, what, task)


def raw_attr(task: Any, name: str) -> Any:
    """A class attribute as written (a function stored there would come back as a method)."""
    value = inspect.getattr_static(task, name, None)
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return value
