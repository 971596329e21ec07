"""The wake queue beside each task queue: whether it is on, a wake routed there, consuming it.

A woken waiter's message goes to the wake queue of the task queue its copy came from
(``Q.lease-wake`` beside ``Q``), so it does not wait behind Q's backlog. The workers that
consume Q consume its wake queue too (``LeaseWakeQueues``), and only on a broker whose routing
was checked (Redis, AMQP); a woken copy takes its own route back (``ROUTE_HEADER``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from celery import bootsteps

__all__ = [
    "ROUTE_HEADER",
    "WAKE_QUEUE_SUFFIX",
    "LeaseWakeQueues",
    "task_wake_queues",
    "to_wake_queue",
    "wake_queue",
    "wake_queue_for",
    "wake_queues_on",
]

# (the logger these lines had before they left _app.py: logging settings that name it still apply)
log = logging.getLogger("celery_lease._app")

#: The wake route. In a waiter's wake message: the wake queue of the task queue its copy came
#: from (a string, written when that is certain). In a woken message sent to that wake queue:
#: [wake queue, exchange, routing key] of the waiter's own route, which the woken copy takes
#: as its delivery route (its retries, back-off copy and next wake go there). Honoured only on
#: a message delivered from that wake queue, so a copy sent elsewhere (a retry with queue=)
#: never follows a stale one.
ROUTE_HEADER = "celery_lease_wake_route"


#: A task queue's wake queue is its name with this after it: ``celery`` -> ``celery.lease-wake``.
WAKE_QUEUE_SUFFIX = ".lease-wake"
#: Broker transports (kombu's ``driver_type``) whose queue names and routing we checked: any
#: name up to 255 bytes on AMQP (but ``amq.*``), any key on Redis; a publish to the default
#: exchange ('') with the queue's name as routing key reaches that queue alone on both.
_WAKE_TRANSPORTS = frozenset({"redis", "amqp"})
_WAKE_QUEUE_ORDERS = frozenset({None, "round_robin", "priority"})
_wake_on: weakref.WeakKeyDictionary[Any, tuple[int, bool]] = weakref.WeakKeyDictionary()


def wake_queues_on(app: Any) -> bool:
    """Whether ``app``'s workers consume a wake queue beside each task queue (and wakes may
    go there): ``lease_handoff_wake_queue`` is not off and the broker is Redis or AMQP.

    Worked out once per app and settings generation (see ``forget_resolved_settings``).
    """
    from ._settings import Resolved

    known = _wake_on.get(app)
    if known is not None and known[0] == Resolved.generation:
        return known[1]
    on = app.conf.get("lease_handoff_wake_queue") is not False
    if on:
        # Redis serves the consumed queues in an order: round-robin (rotating the one just
        # served to the end) or "priority" (as consumed: each wake queue comes right before its
        # task queue, see _wakes_first); "sorted" (by name) puts Q.lease-wake after Q, behind
        # its backlog, and a custom order is unknown: no wake queues.
        options = app.conf.get("broker_transport_options") or {}
        on = options.get("queue_order_strategy") in _WAKE_QUEUE_ORDERS
    if on:
        try:
            conn = app.connection_for_read()
            try:
                on = getattr(conn.transport, "driver_type", None) in _WAKE_TRANSPORTS
            finally:
                conn.release()
        except Exception:  # noqa: BLE001 - an unknown transport: no wake queues
            on = False
    _wake_on[app] = (Resolved.generation, on)
    return on


def wake_queue(name: str) -> Any:
    """The wake queue named ``name``: a direct exchange of its own, bound by its own name, so a
    publish to it (Celery sends it through the default exchange, routing key = its name)
    reaches it alone. Publisher and worker declare it alike (AMQP refuses a second declaration
    that differs)."""
    from kombu.entity import Exchange, Queue

    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


def task_wake_queues(app: Any, name: Any) -> bool:
    """Whether a wake of task ``name`` may go to a wake queue: the app's workers consume them
    and the task does not turn them off (``lease_handoff_wake_queue``)."""
    task = app.tasks.get(name) if isinstance(name, str) else None
    return wake_queues_on(app) and getattr(task, "lease_handoff_wake_queue", None) is not False


def to_wake_queue(options: dict[str, Any], headers: dict[str, Any], via: str) -> None:
    """Send a wake message to the wake queue ``via`` instead of its own route, which goes in
    its ROUTE_HEADER (the woken copy takes it as its delivery route)."""
    if not via.endswith(WAKE_QUEUE_SUFFIX):
        return
    queue, exchange, routing_key = (options.get(k) for k in ("queue", "exchange", "routing_key"))
    if isinstance(queue, str) and queue and exchange is None and routing_key is None:
        route = ["", queue]  # sent on its queue's name (the default exchange)
    elif queue is None and isinstance(exchange, str) and isinstance(routing_key, str):
        route = [exchange, routing_key]
    else:
        return  # a route we would not rebuild exactly: its own
    for key in ("queue", "exchange", "routing_key"):
        options.pop(key, None)
    # Exchange and routing key set too: a route of task_routes or of the task's own options is
    # merged into a send's options where they are missing (it would send the wake there).
    options.update(queue=wake_queue(via), exchange="", routing_key=via, exchange_type="direct")
    headers[ROUTE_HEADER] = [via, *route]


# -- wake queues ---------------------------------------------------------------------------------
_AMQP_NAME_MAX = 255


def _has_wake_queue(queue: Any) -> str | None:
    """The name of ``queue``'s wake queue, or None when it gets none: a wake queue itself, a
    worker's own queue (``worker_direct``, auto-delete or exclusive: one worker's), bindings of
    its own, an exchange other than a direct one, or a name too long for AMQP."""
    name = getattr(queue, "name", None)
    if not isinstance(name, str) or not name or name.endswith(WAKE_QUEUE_SUFFIX):
        return None
    if name.endswith(".dq2") or name.startswith("amq."):
        return None
    if getattr(queue, "auto_delete", False) or getattr(queue, "exclusive", False):
        return None
    if getattr(queue, "bindings", None) or getattr(queue, "alias", None):
        return None
    exchange = getattr(queue, "exchange", None)
    if exchange is not None and exchange.name and exchange.type != "direct":
        return None
    wake = name + WAKE_QUEUE_SUFFIX
    if len(wake.encode()) > _AMQP_NAME_MAX:
        return None
    return wake


def wake_queue_for(app: Any, delivery: Any) -> str | None:
    """The wake queue of the one task queue a message with this ``delivery_info`` came from,
    among those this worker consumes, or None when that is not certain (none or several match,
    or the queue gets no wake queue).

    A message sent through the default exchange ('') came from the queue its routing key
    names; through a direct exchange, from a consumed queue bound to it with that routing key.
    (A prefork child knows the queues its worker consumed when the child started; a queue added
    since matches nothing, so its wakes take their own route.)
    """
    if not delivery:
        return None
    exchange, routing_key = delivery.get("exchange"), delivery.get("routing_key")
    if not isinstance(routing_key, str) or not routing_key:
        return None
    consumed = app.amqp.queues.consume_from
    if exchange == "":
        if routing_key not in consumed:  # ('in': a missing name would create the queue)
            return None
        return _has_wake_queue(consumed[routing_key])
    found = None
    for queue in consumed.values():
        bound = queue.exchange is not None and queue.exchange.name == exchange
        if bound and queue.routing_key == routing_key:
            if found is not None:
                return None  # several: a publish on the route reaches each
            found = queue
    return None if found is None else _has_wake_queue(found)


class LeaseWakeQueues(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: beside each task queue Q the worker consumes, consume Q's wake queue
    (``Q.lease-wake``), where a woken waiter's message goes so it does not wait behind Q's
    backlog. Added with Q (start, reconnect, ``add_consumer``), cancelled with Q
    (``cancel_consumer``; a warm shutdown cancels the task consumer, wake queues and all), so
    the workers that get Q's wakes are always the ones that consume Q."""

    label = "celery_lease wake queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def include_if(self, c: Any) -> bool:
        return wake_queues_on(c.app) and _handoff_anywhere(c.app)

    def start(self, c: Any) -> None:
        consumer = c.task_consumer
        if consumer is None:
            return
        for queue in list(consumer.queues):
            _add_wake_queue(consumer, queue, consume=False)  # (the event loop consumes them)
        _wakes_first(consumer)
        if not getattr(c, "_lease_wake_wrapped", False):
            c._lease_wake_wrapped = True
            add, cancel = c.add_task_queue, c.cancel_task_queue

            def add_task_queue(queue: str, *args: Any, **kwargs: Any) -> None:
                add(queue, *args, **kwargs)
                consumer = c.task_consumer
                if consumer is not None:
                    for known in list(consumer.queues):
                        if known.name == queue:
                            _add_wake_queue(consumer, known, consume=True)

            def cancel_task_queue(queue: str) -> None:
                name = c.app.amqp.queues.aliases.get(queue, queue)
                name = getattr(name, "name", name)  # (an alias maps to its Queue)
                cancel(queue)
                consumer = c.task_consumer
                if consumer is not None and isinstance(name, str):
                    consumer.cancel_by_queue(name + WAKE_QUEUE_SUFFIX)

            c.add_task_queue, c.cancel_task_queue = add_task_queue, cancel_task_queue


def _wakes_first(consumer: Any) -> None:
    """Put each wake queue right before its task queue in ``consumer``'s queues, the order
    it consumes them in when the event loop starts: Redis's "priority" order serves them so
    (a wake of Q before Q's backlog, Q's before the queues after Q)."""
    queues = getattr(consumer, "_queues", None)
    if not isinstance(queues, dict):
        return
    order: dict[str, Any] = {}
    for name, queue in queues.items():
        if name.endswith(WAKE_QUEUE_SUFFIX) and name[: -len(WAKE_QUEUE_SUFFIX)] in queues:
            continue  # (placed before its task queue)
        wake = name + WAKE_QUEUE_SUFFIX
        if wake in queues:
            order[wake] = queues[wake]
        order[name] = queue
    if list(order) != list(queues):
        queues.clear()
        queues.update(order)


def _wake_before_its_queue(channel: Any, wake: str, name: str) -> None:
    """A wake queue consumed after its task queue (``add_consumer``): move it right before
    that queue in a Redis channel's order of the queues it serves (see _wakes_first)."""
    active = getattr(channel, "_active_queues", None)
    update = getattr(channel, "_update_queue_cycle", None)
    if not isinstance(active, list) or update is None or wake not in active or name not in active:
        return
    active.remove(wake)
    active.insert(active.index(name), wake)
    update()


def _handoff_anywhere(app: Any) -> bool:
    """Whether a task of ``app`` may wait in a wait list (and so be woken): ``lease_handoff``
    is not off, or a task turns it on for itself. Otherwise no wake is ever sent to a wake
    queue and the worker consumes none."""
    if app.conf.get("lease_handoff") is not False:
        return True
    return any(getattr(task, "lease_handoff", None) is True for task in list(app.tasks.values()))


def _add_wake_queue(consumer: Any, queue: Any, *, consume: bool) -> None:
    wake = _has_wake_queue(queue)
    if wake is None or consumer.consuming_from(wake):
        return
    if any(q.name == wake for q in consumer.queues):
        return
    consumer.add_queue(wake_queue(wake))
    if consume:
        consumer.consume()
        _wake_before_its_queue(consumer.channel, wake, queue.name)
    log.debug("celery_lease: consuming wake queue %s beside %s", wake, queue.name)
