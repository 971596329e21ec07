"""What a worker's main process says about its lease tasks.

At start (``_app.LeaseBootstep``): the lease ttl of each lease task on the "ready" line (a
task's ``ttl=`` overrides the app's ``lease_ttl``, so the app's alone says little), and a
warning for each crash-recovery setting that leaves a crashed step waiting or lost:

* a lease task with ``acks_late`` but neither ``reject_on_worker_lost`` nor Celery 5.7's
  ``retry_on_worker_lost``, on a prefork worker: when the pool process running it dies
  (SIGKILL, the OOM killer), Celery stores FAILURE (``WorkerLostError``), acks the message,
  and the step never runs again;
* a Redis or SQS broker whose ``visibility_timeout`` is far above the ttl of an ``acks_late``
  lease task (see :func:`far_above`): a worker killed whole leaves that task's message unacked
  that long, while its lease expires within the ttl and ``celery lease ls`` shows it free.

Later, in the same process: :func:`on_task_failure` (connected to Celery's ``task_failure``
signal by ``_app``) logs a lease task whose pool process died mid-task, with its resource and
the fence it held.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from billiard.exceptions import WorkerLostError

from ._errors import LeaseError
from ._eventlog import lease_log
from ._names import holder_task_id
from ._settings import LeaseSettings

__all__ = [
    "VISIBILITY_FLOOR",
    "VISIBILITY_TTL_FACTOR",
    "crash_recovery_warnings",
    "far_above",
    "on_task_failure",
    "ttl_summary",
]

#: A broker's visibility timeout is "far above" a lease ttl when it is more than
#: ``VISIBILITY_TTL_FACTOR`` ttls *and* more than ``VISIBILITY_FLOOR`` seconds. After a worker
#: is killed whole, the resource is free again within one ttl (and a renew interval), but the
#: step's message comes back only after the visibility timeout: past ten ttls that wait, not
#: the lease, decides when the step runs again. A wait under five minutes is left alone: a
#: timeout shorter than the longest run makes the broker deliver a running task again (a lease
#: task's copy then waits as a duplicate, but a plain task on the same broker runs twice).
VISIBILITY_TTL_FACTOR = 10
VISIBILITY_FLOOR = 300.0
#: Task names listed in one line before "and N more".
NAMES_SHOWN = 3

#: The brokers whose unacked messages come back only after a visibility timeout, and kombu's
#: default for it (read from the transport when it has it).
_VISIBILITY_DEFAULT_ATTR = {"redis": "visibility_timeout", "sqs": "default_visibility_timeout"}
_BROKER_NAMES = {"redis": "Redis", "sqs": "SQS"}


def far_above(visibility_timeout: float, ttl: float) -> bool:
    """Whether a broker's visibility timeout is far above a lease ttl (see the constants)."""
    return visibility_timeout > max(VISIBILITY_TTL_FACTOR * ttl, VISIBILITY_FLOOR)


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def _lease_tasks(count: int) -> str:
    return f"{count} lease task{'s' if count != 1 else ''}"


def ttl_summary(app_ttl: float, ttls: Mapping[str, float]) -> str:
    """The ttls of the worker's lease tasks for its "ready" line (task name -> ttl).

    ``ttl 60s for all 12 lease tasks``; when they differ, the ttl most of them have and the
    others by name: ``ttl 60s for 10 lease tasks; 15s for proj.browse, proj.pay``; with no
    lease task registered, the app's ``lease_ttl``.
    """
    if not ttls:
        return f"no lease tasks registered; lease_ttl {app_ttl:g}s"
    groups: dict[float, list[str]] = {}
    for name, ttl in sorted(ttls.items()):
        groups.setdefault(ttl, []).append(name)
    if len(groups) == 1:
        ((ttl, names),) = groups.items()
        if len(names) == 1:
            return f"ttl {ttl:g}s for its lease task {names[0]}"
        return f"ttl {ttl:g}s for all {_lease_tasks(len(names))}"
    # The biggest group first (on a tie, the app's ttl, then the shortest), the rest by ttl.
    main = min(groups, key=lambda t: (-len(groups[t]), t != app_ttl, t))
    parts = [f"ttl {main:g}s for {_lease_tasks(len(groups[main]))}"]
    parts += [f"{ttl:g}s for {_names(groups[ttl])}" for ttl in sorted(groups) if ttl != main]
    return "; ".join(parts)


def broker_visibility(app: Any) -> tuple[str, float, bool] | None:
    """``(broker, visibility timeout, is kombu's default)`` of a Redis or SQS broker; None for
    other brokers (RabbitMQ gives a dead consumer's messages back at once)."""
    conn = app.connection_for_read()
    try:
        try:
            transport = conn.transport
        except Exception:  # noqa: BLE001 - a warning's check never stops the worker: the
            return None  # consumer's own connection says what is wrong with the broker
        driver = getattr(transport, "driver_type", None)
        if driver not in _VISIBILITY_DEFAULT_ATTR:
            return None
        options = conn.transport_options or {}
        value = options.get("visibility_timeout")
        default = value is None
        if default:
            value = getattr(transport.Channel, _VISIBILITY_DEFAULT_ATTR[driver], None)
    finally:
        conn.release()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return _BROKER_NAMES[driver], float(value), default


def crash_recovery_warnings(
    app: Any, tasks: Sequence[tuple[Any, LeaseSettings]], prefork: bool
) -> list[str]:
    """What the worker warns about at start: crash-recovery settings of its lease tasks
    (``tasks``: each with its resolved settings) that leave a crashed step lost or waiting
    long after its lease is free. One message per setting, naming the tasks."""
    warnings = []
    late = [(task, settings) for task, settings in tasks if task.acks_late]
    not_rejected = [
        task.name
        for task, _ in late
        if not task.reject_on_worker_lost and not getattr(task, "retry_on_worker_lost", None)
    ]
    if prefork and not_rejected:
        warnings.append(
            f"lease task{'s' if len(not_rejected) > 1 else ''} {_names(sorted(not_rejected))} "
            f"{'have' if len(not_rejected) > 1 else 'has'} acks_late without "
            "task_reject_on_worker_lost: if the pool process running "
            f"{'one' if len(not_rejected) > 1 else 'it'} dies (SIGKILL, the OOM killer), "
            "Celery stores FAILURE (WorkerLostError), acks the message and the "
            "step never runs again. Set app.conf.task_reject_on_worker_lost = True (or "
            "reject_on_worker_lost=True on the task) to requeue it; its next run takes the "
            "lease over"
        )
    found = broker_visibility(app) if late else None
    if found is not None:
        broker, visibility, default = found
        waiting = sorted(
            (settings.ttl, task.name)
            for task, settings in late
            if far_above(visibility, settings.ttl)
        )
        if waiting:
            shortest = waiting[0][0]
            suggested = max(VISIBILITY_TTL_FACTOR * shortest, VISIBILITY_FLOOR)
            where = "kombu's default" if default else "broker_transport_options"
            warnings.append(
                f"the {broker} broker's visibility_timeout is {visibility:g}s ({where}), far "
                f"above the lease ttl of {_names([name for _, name in waiting])} "
                f"({shortest:g}s{' and up' if waiting[-1][0] > shortest else ''}): a worker "
                "killed whole leaves such a running task's message unacked for "
                f"{visibility:g}s, while its lease expires within its ttl and `celery lease "
                "ls` shows the resource free. Put {'visibility_timeout': "
                f"{suggested:g}}} in app.conf.broker_transport_options (no more than "
                f"{VISIBILITY_TTL_FACTOR} ttls or {VISIBILITY_FLOOR:g}s, whichever is more; but "
                "above your longest task run and countdown, or the broker delivers a running "
                "task again)"
            )
    return warnings


def on_task_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    **_: Any,
) -> None:
    """``task_failure`` receiver: log a lease task whose pool process died mid-task.

    Celery sends ``task_failure`` with a ``WorkerLostError`` from the worker's main process
    when it stores that FAILURE; a message it requeues instead (``reject_on_worker_lost``) gets
    no signal, and its next run logs ``recovered`` with the dead owner's fence. The process
    that held the lease is gone: the resource comes from the request's arguments, the fence
    from the store when the lease there is still this task's (its holder label ends with the
    task id). That read is one store call on a rare path, in the main process; a store that
    does not answer holds it up to the store's call timeout, and the line then says why no
    fence is shown.
    """
    if not isinstance(exception, WorkerLostError):
        return  # (every task failure in every process comes here: this test first)
    # A lease task, by what it has (this module sits below _task, which imports _app: no
    # import of LeaseTask here, see tests/test_layout.py).
    resource_for = getattr(sender, "lease_resource_for", None)
    compiled = getattr(sender, "_compiled", None)
    if not callable(resource_for) or not callable(compiled):
        return
    fields: dict[str, Any] = {}
    fence = holder = resource = None
    try:
        resource = resource_for(tuple(args or ()), dict(kwargs or {}))
        info = compiled().current_store().get(resource)
    except LeaseError as exc:
        fields["lease"] = f"not read: {exc}"
    else:
        if info is not None and task_id and holder_task_id(info.owner_label) == task_id:
            fence, holder = info.fence, info.owner_label
            fields["expires_in"] = f"{max(info.expires_in, 0.0):.1f}s"
        else:
            fields["lease"] = (
                "none of this task in the store (released before the process died, or taken "
                "over since)"
            )
    if not sender.acks_late:
        fields["fix"] = "task_acks_late = True and task_reject_on_worker_lost = True"
    elif not sender.reject_on_worker_lost:
        fields["fix"] = "task_reject_on_worker_lost = True"
    lease_log(
        "worker_lost",
        logging.WARNING,
        resource=resource,
        fence=fence,
        holder=holder,
        task_id=task_id,
        task=sender.name,
        error=str(exception),
        action="FAILURE stored, the step does not run again",
        **fields,
    )
