"""The ``lease_*`` settings: read from ``app.conf`` and per-task overrides, validated once.

Every setting is a lowercase ``lease_*`` key on ``app.conf`` with a same-named task attribute
(``LeaseTask.lease_ttl``) and a decorator keyword without the prefix (``@lease_task(ttl=...)``),
the way ``task_acks_late`` pairs with ``Task.acks_late``. Bad values raise
:class:`LeaseConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ._errors import LeaseConfigError
from ._names import did_you_mean, mask_url, show_value

__all__ = [
    "DEFAULT_HANDOFF_MAX_PAYLOAD",
    "DEFAULT_MARGIN_FRACTION",
    "DEFAULT_RENEW_FRACTION",
    "DEFAULT_RETENTION",
    "MIN_STORE_CALL",
    "SETTINGS_DOC",
    "LeaseSettings",
    "Resolved",
    "did_you_mean",
    "forget_resolved_settings",
]

ON_BUSY = ("retry", "skip", "fail")
#: When a task's copies are kept unique (issue 28; the words of sidekiq-unique-jobs): only
#: while the body runs (the run's lease on its resource, always there), or also from publish.
UNIQUE_MODES = (
    "while_executing",
    "until_executing",
    "until_executed",
    "until_and_while_executing",
    "until_expired",
)
#: The longest a publish lock may live (the stores' LOCK_MAX_TTL).
UNIQUE_TTL_MAX = 30 * 86400.0
#: What a publish does when the unique key is held by another copy.
ON_CONFLICT = ("raise", "return_existing", "skip", "replace")
#: The orders waiters on one resource may run in: as they arrive at the store, or as their
#: messages were published (issue 33, item 6).
ORDERS = ("arrival", "publish")

#: Seconds a store call may take before it times out, at the least (the stores' socket and
#: statement timeouts are ttl - margin - renew_interval, see ``_app_stores.store_timeout``, but
#: never below this). A renewal must be able to take that long and still be answered before the
#: self-fence deadline, which bounds the smallest ttl.
MIN_STORE_CALL = 0.2


#: Default renewal cadence and self-fence margin, as fractions of the ttl.
DEFAULT_RENEW_FRACTION = 1 / 3
DEFAULT_MARGIN_FRACTION = 0.25
#: Seconds identity, ledger and checkpoint records are kept after their last write (7 days).
DEFAULT_RETENTION = 7 * 86400.0
#: Most bytes of a wake message (the task's message sent again when it is woken) that joins a
#: wait list: a store keeps at most 128 KiB of them per list (``wait_bytes_cap``), so a bigger
#: one would crowd out a list of small ones. A task with small arguments sends about 360 bytes.
DEFAULT_HANDOFF_MAX_PAYLOAD = 8192
#: A store's default ``wait_bytes_cap`` (stores/base.py), the whole budget of a wait list: the
#: most ``lease_handoff_max_payload`` may be (a bigger message could never be listed).
WAIT_BYTES_CAP = 128 * 1024


class Resolved:  # a namespace: one attribute read per call, as cheap as a global
    """What tasks resolved: ``generation`` changes when :func:`forget_resolved_settings` runs."""

    generation = 0


def forget_resolved_settings() -> None:
    """Make every lease task resolve its settings (and store) again at its next call.

    A task resolves ``app.conf`` and its own ``lease_*`` attributes once, at its first call,
    and keeps the result. ``celery_lease.testing`` calls this around every test, so a setting a
    test changes (``app.conf.lease_ttl = 1``) is not shadowed by what an earlier test resolved.
    """
    Resolved.generation += 1


@dataclass(frozen=True, kw_only=True)
class LeaseSettings:
    """Resolved lease settings of one task (app defaults overlaid with the task's own)."""

    store_url: str = ""
    ttl: float = 60.0
    renew_interval: float | None = None
    self_fence_margin: float | None = None
    max_runtime: float = 3600.0
    on_busy: str = "retry"
    busy_backoff_base: float = 1.0
    busy_backoff_cap: float = 60.0
    busy_backoff_jitter: float = 0.5
    busy_max_waits: int = 1000
    store_down_max_wait: float = 600.0
    lost_max_retries: int = 5
    lost_retry_delay: float = 1.0
    key_prefix: str = "celery_lease:"
    table_prefix: str = "celery_lease_"
    store_options: dict[str, Any] = field(default_factory=dict)
    allow_direct_call: bool = False
    send_events: bool = True
    dedup: bool = True
    handoff: bool = True
    handoff_max_payload: int = DEFAULT_HANDOFF_MAX_PAYLOAD
    handoff_wake_queue: bool = True
    handoff_early_wake: bool = True
    order: str = "arrival"
    retention: float = DEFAULT_RETENTION
    unique: str = "while_executing"
    unique_ttl: float = 3600.0
    on_conflict: str = "raise"

    def __repr__(self) -> str:
        # Settings appear in logs and tracebacks: never with the store URL's password or a
        # secret among the store options (dataclass leaves a __repr__ defined here alone).
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "store_url":
                value = mask_url(value)
            elif f.name == "store_options":
                value = _masked_options(value)
            shown.append(f"{f.name}={value!r}")
        return f"LeaseSettings({', '.join(shown)})"

    @property
    def effective_renew_interval(self) -> float:
        return (
            self.renew_interval if self.renew_interval is not None else self.ttl / 3
        )  # DEFAULT_RENEW_FRACTION

    @property
    def effective_margin(self) -> float:
        return (
            self.self_fence_margin
            if self.self_fence_margin is not None
            else self.ttl * DEFAULT_MARGIN_FRACTION
        )

    @classmethod
    def resolve(cls, conf: Any, overrides: dict[str, Any] | None = None) -> LeaseSettings:
        """Build settings from ``app.conf`` (``lease_<name>`` keys) and per-task overrides.

        Raises:
            LeaseConfigError: a value is of the wrong type or out of range (key named).
        """
        values: dict[str, Any] = {}
        if conf is not None:
            _check_conf_keys(conf)
        for f in fields(cls):
            value = conf.get(f"lease_{f.name}") if conf is not None else None
            if value is not None:
                values[f.name] = value
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = value
        settings = cls._validated(values)
        if conf is not None:
            _check_retention(settings, _visibility_timeout(conf))
        elif "retention" in values and "max_runtime" in values:
            # Without app.conf (a task being defined) only what is certain: the app may still
            # lower the ttl, and the broker's visibility timeout is not known yet.
            _check_retention(settings, None, ttl=float(values.get("ttl", 0.0)))
        return settings

    @classmethod
    def _validated(cls, values: dict[str, Any]) -> LeaseSettings:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            name = sorted(unknown)[0]
            raise LeaseConfigError(
                f"unknown lease setting {name!r}{did_you_mean(name, known)}; known settings: "
                f"{', '.join(sorted(known))}"
            )
        for name in (
            "ttl",
            "max_runtime",
            "busy_backoff_base",
            "busy_backoff_cap",
            "lost_retry_delay",
            "retention",
            "store_down_max_wait",
            "unique_ttl",
        ):
            if name in values:
                values[name] = _positive(name, values[name])
        for name in ("renew_interval", "self_fence_margin"):
            if name in values:
                values[name] = _positive(name, values[name])
        if "busy_backoff_jitter" in values:
            jitter = values["busy_backoff_jitter"]
            if not _number(jitter) or not 0 <= jitter <= 1:
                raise LeaseConfigError(
                    f"lease_busy_backoff_jitter={show_value(jitter)} must be a number in [0, 1]"
                )
        for name in ("busy_max_waits", "lost_max_retries"):
            if name in values:
                value = values[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise LeaseConfigError(
                        f"lease_{name}={show_value(value)} must be a whole number >= 0"
                    )
        if "handoff_max_payload" in values:
            value = values["handoff_max_payload"]
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 1 <= value <= WAIT_BYTES_CAP
            ):
                raise LeaseConfigError(
                    f"lease_handoff_max_payload={show_value(value)} must be a whole number of "
                    f"bytes >= 1 and at most {WAIT_BYTES_CAP} (a store's wait_bytes_cap, the "
                    "whole budget of a wait list: a bigger message is never kept; default "
                    f"{DEFAULT_HANDOFF_MAX_PAYLOAD}); a task whose wake message is bigger polls "
                    "in its place in the wait list instead of being woken; to keep every task "
                    "out of the wait list set lease_handoff=False"
                )
        for name in ("handoff_wake_queue", "handoff_early_wake"):
            if name in values and not isinstance(values[name], bool):
                raise LeaseConfigError(
                    f"lease_{name}={show_value(values[name])} must be True or False"
                )
        if values.get("order", "arrival") not in ORDERS:
            raise LeaseConfigError(
                f"lease_order={show_value(values['order'])} must be one of "
                f"{', '.join(map(repr, ORDERS))} (publish: waiters on one resource run in the "
                "order their messages were published)"
            )
        if values.get("unique_ttl", 0) > UNIQUE_TTL_MAX:
            raise LeaseConfigError(
                f"lease_unique_ttl={show_value(values['unique_ttl'])} is over 30 days "
                f"({UNIQUE_TTL_MAX:.0f} s), the longest a publish lock may live; a lock is how "
                "long a queued copy keeps its key"
            )
        if values.get("unique", "while_executing") not in UNIQUE_MODES:
            raise LeaseConfigError(
                f"lease_unique={show_value(values['unique'])} must be one of "
                f"{', '.join(map(repr, UNIQUE_MODES))} (while_executing: a lease while the body "
                "runs, the default; until_*: a lock taken when the task is published)"
            )
        if values.get("on_conflict", "raise") not in ON_CONFLICT:
            raise LeaseConfigError(
                f"lease_on_conflict={show_value(values['on_conflict'])} must be one of "
                f"{', '.join(map(repr, ON_CONFLICT))} (what a publish does when its unique key "
                "is held by another copy)"
            )
        if values.get("on_busy", "retry") not in ON_BUSY:
            raise LeaseConfigError(
                f"lease_on_busy={show_value(values['on_busy'])} must be one of "
                f"{', '.join(map(repr, ON_BUSY))}"
            )
        for name in ("store_url", "key_prefix", "table_prefix"):
            if name in values and not isinstance(values[name], str):
                raise LeaseConfigError(f"lease_{name}={show_value(values[name])} must be a string")
        if "store_options" in values and not isinstance(values["store_options"], dict):
            raise LeaseConfigError("lease_store_options must be a dict of store keyword options")
        settings = cls(**values)
        ttl = settings.ttl
        if settings.effective_renew_interval >= ttl:
            raise LeaseConfigError(
                f"lease_renew_interval={settings.effective_renew_interval:g} must be shorter "
                f"than lease_ttl={ttl:g} (a third of it is the default)"
            )
        if settings.effective_margin >= ttl - settings.effective_renew_interval * 0.5:
            raise LeaseConfigError(
                f"lease_self_fence_margin={settings.effective_margin:g} leaves no time to act "
                f"within lease_ttl={ttl:g} after a renewal; use about a quarter of the ttl"
            )
        _check_renew_window(settings)
        return settings


#: ``app.conf`` keys of celery_lease that are no per-task setting (read by their own module).
APP_ONLY_KEYS = ("lease_routes",)


def _check_conf_keys(conf: Any) -> None:
    """Refuse a ``lease_*`` key on ``app.conf`` that is no setting (a typo would be ignored)."""
    try:
        keys = list(conf.keys())
    except (AttributeError, TypeError):  # not a mapping: nothing to check
        return
    known = {f"lease_{f.name}" for f in fields(LeaseSettings)} | set(APP_ONLY_KEYS)
    for key in keys:
        if not isinstance(key, str):
            continue
        # A Django-style namespace (config_from_object(..., namespace="CELERY")) spells the
        # settings CELERY_LEASE_TTL: check those too, whatever the case.
        name = key.lower()
        name = name.removeprefix("celery_") if name.startswith("celery_lease_") else name
        if name.startswith("lease_") and name not in known:
            raise LeaseConfigError(
                f"app.conf.{key}{did_you_mean(name, known)} is not a celery_lease setting; "
                f"the settings are {', '.join(sorted(known))}"
            )


#: Seconds allowed, at the least, between a crashed run's lease expiring and the next owner's
#: claim: the broker redelivers, the copy may wait for a busy resource or a store outage.
REDELIVERY_ALLOWANCE = 3600.0


def _visibility_timeout(conf: Any) -> float | None:
    options = conf.get("broker_transport_options") or {}
    value: Any = options.get("visibility_timeout") if isinstance(options, dict) else None
    return float(value) if _number(value) else None


def _check_retention(
    settings: LeaseSettings, visibility_timeout: float | None, ttl: float | None = None
) -> None:
    """Identity, ledger and checkpoint records must outlive the run that wrote them.

    A record expires ``retention`` after its last write. The run that wrote an effect intent
    may go on for ``max_runtime``, crash, its lease expire ``ttl`` later, and the broker
    redeliver the message after its visibility timeout (at least an hour is allowed for that
    and for busy waits). If the intent is gone by then, the next owner repeats the effect
    without asking ``reconcile_effect``.
    """
    retention = settings.store_options.get("retention", settings.retention)
    ttl = settings.ttl if ttl is None else ttl
    redelivery = max(REDELIVERY_ALLOWANCE, visibility_timeout or 0.0)
    needed = settings.max_runtime + ttl + redelivery
    if _number(retention) and retention >= needed:
        return
    shown = f"{retention:g}" if _number(retention) else show_value(retention)
    raise LeaseConfigError(
        f"lease_retention={shown} is shorter than one run may need its records: "
        f"lease_max_runtime={settings.max_runtime:g} + lease_ttl={ttl:g} + {redelivery:g}s "
        "for the broker to redeliver a crashed run (the longer of 1 h and the broker's "
        f"visibility_timeout) = {needed:g}s. A run that outlives its records and then crashes "
        "leaves no effect intent, so the next owner would repeat its effects. Raise "
        f"lease_retention to at least {needed:g} or lower lease_max_runtime"
    )


def _check_renew_window(settings: LeaseSettings) -> None:
    """A renewal must fit between its send and the self-fence deadline, store timeout and all.

    A renewal is sent ``renew_interval`` after the previous one and must be answered before
    ``ttl - margin`` after it, when the owner stops acting; a store call may take
    ``MIN_STORE_CALL`` before it times out. A shorter window loses healthy leases.
    """
    ttl, interval, margin = (
        settings.ttl,
        settings.effective_renew_interval,
        settings.effective_margin,
    )
    window = ttl - margin - interval
    if window >= MIN_STORE_CALL - 1e-9:  # (float rounding at the bound itself)
        return
    # ttl - margin - interval is linear in ttl: solve it for the window of one store call.
    fixed = (settings.renew_interval or 0.0) + (settings.self_fence_margin or 0.0)
    fraction = (DEFAULT_RENEW_FRACTION if settings.renew_interval is None else 0.0) + (
        DEFAULT_MARGIN_FRACTION if settings.self_fence_margin is None else 0.0
    )
    smallest = (MIN_STORE_CALL + fixed) / (1 - fraction)
    raise LeaseConfigError(
        f"lease_ttl={ttl:g} is too short to renew safely: a renewal is sent {interval:.3g}s "
        f"after the previous one and must be answered {margin:.3g}s before the ttl runs out, "
        f"which leaves {window:.3g}s, less than the {MIN_STORE_CALL:g}s a store call may take "
        f"before it times out; the smallest ttl allowed with this renew interval and margin is "
        f"{math.ceil(smallest * 1000) / 1000:g}s"
    )


_SECRET_KEY = ("pass", "secret", "token", "key", "auth")


def _masked_options(options: Any) -> Any:
    """Store options with the values of secret-looking keys (password, ...) masked."""
    if not isinstance(options, dict):
        return options
    return {
        key: "***"
        if isinstance(key, str)
        and any(word in key.lower() for word in _SECRET_KEY)
        and not key.endswith("prefix")
        else _masked_options(value)
        for key, value in options.items()
    }


def _number(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(float(value))
    )


def _positive(name: str, value: Any) -> float:
    if not _number(value) or value <= 0:
        raise LeaseConfigError(
            f"lease_{name}={show_value(value)} must be a positive number of seconds"
        )
    return float(value)


#: One line per setting (a summary; docs/settings.md is the reference, checked by the tests).
SETTINGS_DOC = {
    "store_url": "where leases live: redis://, rediss://, unix://, postgresql+psycopg://, "
    "sqlite:///path (required; never falls back to the broker URL)",
    "ttl": "seconds a claim or renewal keeps the lease alive without further renewal (60)",
    "renew_interval": "seconds between renewals of a held lease (ttl / 3)",
    "self_fence_margin": "the owner stops acting this many seconds before ttl runs out since "
    "the last renewal it sent (ttl / 4)",
    "max_runtime": "hard cap on the total time one execution may hold a lease (3600)",
    "on_busy": "what a task does when its resource is held: retry | skip | fail (retry)",
    "busy_backoff_base": "first busy wait in seconds, doubled per wait (1)",
    "busy_backoff_cap": "longest busy wait in seconds; also kept below half the broker's "
    "visibility_timeout (60)",
    "busy_backoff_jitter": "fraction of each busy wait that is random, 0..1 (0.5)",
    "busy_max_waits": "busy waits allowed before the task fails with LeaseBusyError; "
    "separate from max_retries (1000)",
    "store_down_max_wait": "seconds a task waits for an unreachable store (its claim fails, "
    "it is sent again with the busy backoff) before it fails with LeaseStoreError; separate "
    "from busy_max_waits and max_retries (600)",
    "lost_max_retries": "re-runs after a lost lease before the task fails with "
    "LeaseLostError; separate from max_retries (5)",
    "lost_retry_delay": "seconds before a task whose lease was lost runs again (1)",
    "key_prefix": "Redis key prefix (celery_lease:)",
    "table_prefix": "SQL table name prefix (celery_lease_)",
    "store_options": "extra keyword options for the store constructor ({})",
    "allow_direct_call": "calling the task function directly runs it without a lease (False)",
    "send_events": "send task-lease-* events when the worker sends task events (True)",
    "dedup": "record each execution's identity (the identity template, the message's "
    "idempotency_key header, or the task id) so a duplicate delivery of a completed one "
    "returns its result instead of running (True)",
    "handoff": "a busy task joins the resource's FIFO wait list and is woken at release "
    "(every store; with on_busy='retry'; a task without an identity polls in its place) (True)",
    "handoff_max_payload": "most bytes of a task's wake message (its message, sent again when "
    "woken) for the wait list to keep it; a bigger one polls in its place (8192)",
    "order": "the order waiters on one resource run in: arrival (as their claims reach the "
    "store) or publish (as their messages were published, by the publisher's clock) (arrival)",
    "handoff_wake_queue": "workers consume a wake queue beside each task queue (Q.lease-wake) "
    "and a woken waiter's message goes there, not behind Q's backlog (Redis and AMQP brokers) "
    "(True)",
    "handoff_early_wake": "on a store that can (Redis), a releasing task sends the next "
    "waiter's wake message while its release's reply is on the way instead of after it, so the "
    "release's round trip overlaps the wake's trip through the broker (True)",
    "retention": "seconds identity, ledger and checkpoint records are kept (604800 = 7 days)",
    "unique": "when copies of the task are kept unique: while_executing (a lease while the "
    "body runs), until_executing, until_executed, until_and_while_executing or until_expired "
    "(a lock on the unique key from publish) (while_executing)",
    "unique_ttl": "seconds a publish lock lives without being released (a countdown or eta "
    "adds its delay); no lock outlives it (3600)",
    "on_conflict": "what a publish does when its unique key is held by another copy: raise "
    "(AlreadyQueuedError) | return_existing (its AsyncResult) | skip (None) | replace (revoke "
    "a copy that has not started) (raise)",
}
