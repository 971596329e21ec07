"""What a lease task's messages carry: the headers it adds and reads, the message a waiter's
wake sends again, and the owner label a claim records.

Every copy of one execution (its back-stop copy, the copy a release wakes, an early copy, a
copy sent again while the store is down) is told apart by these headers alone: a copy knows
nothing else of its siblings. Pure functions of the request; no store, no broker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import json.encoder
import re
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.app.task import Context

from . import _clock
from ._eventlog import SHORTEN_LOOKAHEAD, shorten
from ._names import MAX_LABEL_LENGTH, label_task_id
from ._names import RESOURCE_PATTERN as _RESOURCE_RE
from ._pid import getpid
from ._settings import LeaseSettings
from ._wake_queues import wake_queue_for
from ._wakes import (
    EARLY_HEADER,
    ROUTE_HEADER,
    WAKE_QUEUE_SUFFIX,
    WOKEN_HEADER,
)

if TYPE_CHECKING:
    from ._setup import TaskSetup

# LINEAGE_HEADER, WOKEN_HEADER, ROUTE_HEADER, EARLY_HEADER and EARLY_RETRY_DELAYS: see _wakes.
#: How many times this execution waited for a busy resource (its busy budget).
WAITS_HEADER = "celery_lease_waits"
#: How many times this execution was run again after its lease was lost.
LOST_HEADER = "celery_lease_lost_retries"
#: How many times this execution was sent again while its store was down.
STORE_WAITS_HEADER = "celery_lease_store_waits"

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
#: How many times this copy of a waiter looked again at its task's state after its claim found
#: the identity done and the state was not final yet.
DONE_CHECKS_HEADER = "celery_lease_done_checks"
#: A task with ``unique=`` locked at publish: ``[key, fence, mode, expires, released]`` of the
#: lock its publish took (expires: seconds since the epoch, the publisher's clock; released: 1
#: once a worker gave it back at the start of the execution). See _unique.
UNIQUE_HEADER = "celery_lease_unique"
#: Headers every copy of one execution carries as its first message had them (Celery's
#: ``retry()`` and ``signature_from_request()`` send only ``request.headers``, which holds none
#: of a message's own headers).
CARRIED_HEADERS = (PUBLISHED_HEADER, UNIQUE_HEADER)

_WAITS_IN_PAYLOAD = re.compile(r'"' + WAITS_HEADER + r'": ?(\d+)')


def take_sent_route(request: Any) -> None:
    """A copy delivered from a wake queue, with the waiter's route in its ROUTE_HEADER: take
    that route as its delivery route, so everything that reads it (``retry()``, the busy
    re-queue, the next wake) sends where the waiter was sent. ``request.lease_wake_queue``
    keeps the wake queue it came from. Any other copy ignores the header."""
    route = read_header(request, ROUTE_HEADER)
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


def carry(request: Any, headers: dict[str, Any]) -> dict[str, Any]:
    """Put the headers every copy of this execution keeps (``CARRIED_HEADERS``) on ``headers``
    (a new message's), as this copy's request has them; returns ``headers``."""
    for name in CARRIED_HEADERS:
        value = read_header(request, name)
        if value is not None:
            headers[name] = value
    return headers


def count(value: Any) -> int:
    """A count header's value (0 when absent or not a whole number)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def request_get(request: Any, name: str) -> Any:
    """``request.get(name)`` for a field no ``Context`` defines on its class (our headers,
    ``idempotency_key``, ``argsrepr``): read from the instance's ``__dict__``, where Celery's
    ``Context`` keeps a message's fields, instead of ``getattr`` with a default, which builds
    and discards an ``AttributeError`` for every missing field (most of them, most of the time).
    Any other request object is asked through its ``get``."""
    if type(request) is Context:
        return request.__dict__.get(name)
    return request.get(name)


def task_request(task: Any) -> Any:
    """``task.request``: the request of ``task``'s execution running in this thread (or
    greenlet), read without the miss Celery's ``Local`` takes on every read.

    ``Task.request`` reads ``request_stack.top``, whose ``Local`` finds its per-thread values
    in ``__getattr__``, which Python calls only once the ordinary lookup failed with an
    AttributeError that is formatted and dropped: about 9k instructions per read (callgrind),
    twice per lease task. This reads the same stack the same way, without that lookup. A task
    class with a ``request`` of its own, or anything unexpected (an empty stack: the default
    request; another Celery's locals; a proxy of the task), is asked through ``task.request``.
    """
    if getattr(type(task), "request", None) is _TASK_REQUEST:
        try:
            local = task.request_stack._local
            return local.__storage__[local.__ident_func__()]["stack"][-1]
        except (AttributeError, KeyError, IndexError, TypeError):
            pass
    return task.request


#: Celery's ``Task.request`` property (what task_request stands in for).
_TASK_REQUEST = Task.request


def read_header(request: Any, name: str) -> Any:
    """A message header: top-level on a worker's request, in ``headers`` under apply()."""
    value = request_get(request, name)
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


def execution_options(request: Any) -> dict[str, Any]:
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


def waiter_name(task_id: str) -> str:
    """The name of the place of a task without an identity: its task id, or a digest of it
    where the id is no valid name (a space, a %: the names' rule is the resources')."""
    if _RESOURCE_RE.fullmatch(task_id):
        return task_id
    return "task-" + hashlib.sha256(task_id.encode()).hexdigest()[:40]


def place_options(request: Any, waiter: str | None, settings: LeaseSettings) -> dict[str, Any]:
    """The claim's options that name and order its place: ``waiter`` (a task without an
    identity: its task id) and, with ``order="publish"``, when its message was published."""
    options: dict[str, Any] = {}
    if waiter is not None:
        options["waiter"] = waiter
    if settings.order == "publish":
        published = read_header(request, PUBLISHED_HEADER)
        with contextlib.suppress(TypeError, ValueError):  # (not ours: placed by arrival)
            options["since"] = int(published)
    return options


def bound_size(payload: str, request: Any) -> int:
    """The size of a wake message as lease_handoff_max_payload bounds it: its bytes without
    the digits of its celery_lease_waits counter (the same for every copy of one execution)."""
    waits = int(read_header(request, WAITS_HEADER) or 0)
    return len(payload) - len(str(waits + 1))


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
dump_json: Callable[[Any], str]
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
if _c_make_encoder is not None:  # (CPython: always)
    _json_encoder = json.JSONEncoder()

    def _json_default(value: Any) -> Any:
        # Looked up on each call (only for what is not JSON): an app may patch
        # json.JSONEncoder.default after import (objects with to_json()), as json.dumps sees.
        return _json_encoder.default(value)

    def dump_json(value: Any) -> str:
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
    dump_json = json.JSONEncoder(separators=(",", ":")).encode


def listed_waits(payload: str) -> int:
    """The waits count a listed wake payload carries (0 when it carries none). Read from
    the text, not parsed: the hand-off's path. A key of that name inside the task's own
    arguments can only raise the count (one more backend read), never hide it."""
    return max((int(n) for n in _WAITS_IN_PAYLOAD.findall(payload)), default=0)


def listed_at(request: Any) -> float:
    """When a waiter's place counts as listed (wall clock): now, or earlier when this
    execution's place was listed before (a copy woken from it, refused again, re-arms it:
    its back-stop sibling may have given up since the first listing), or its claims began to
    fail earlier (a claim whose reply was lost may have listed the place while the store-down
    budget, which started at that earlier failure, kept running). The woken copy counts
    from there to know whether its sibling may have given up."""
    listed = _clock.wall()
    for name in (LISTED_HEADER, STORE_DOWN_HEADER):
        value = read_header(request, name)
        if value is not None:
            with contextlib.suppress(TypeError, ValueError):  # (not ours: ignored)
                listed = min(listed, float(value))
    return listed


#: At most this many characters of a holder's arguments go into its label.
MAX_LABEL_ARGUMENTS = 80
#: Fewer than this left for the arguments in a label: leave them out rather than show "(4...".
_MIN_ARGUMENTS = 12
_NO_ARGUMENTS = frozenset({"", "()", "[]", "{}"})


def owner_label(request: Any, name: str | None) -> str:
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
    if type(request) is Context:  # (see request_get)
        args, kwargs = request.__dict__.get("argsrepr"), request.__dict__.get("kwargsrepr")
    else:
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


def names_task(label: str | None, task_id: str | None) -> bool:
    """Whether an owner label (``host:pid:<task id>[ <note>]``, see owner_label) names this
    task id: its task-id part (up to the first space) is the task id as labels write it."""
    if label is None or task_id is None:
        return False
    parts = label.split(":", 2)  # (a task id may hold colons, a host name not)
    return (
        len(parts) == 3
        and parts[1].isdigit()
        and parts[2].partition(" ")[0] == label_task_id(task_id)
    )


def copy_kind(request: Any) -> str:
    """Which copy of its execution a message is, for the ``duplicate`` line: one a release
    woke (``woken``; ``early wake`` when sent as the release went out), the ``back-stop``
    copy a refused claim re-queued, a ``redelivered`` message, or the ``message`` as sent."""
    if read_header(request, EARLY_HEADER) is not None:
        return "early wake"
    if read_header(request, WOKEN_HEADER) is not None:
        return "woken"
    if int(read_header(request, WAITS_HEADER) or 0):
        return "back-stop"
    if (request.delivery_info or {}).get("redelivered"):
        return "redelivered"
    return "message"


def wake_payload(
    task: Any, setup: TaskSetup, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
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
    waits = request_get(request, WAITS_HEADER)
    if waits is None and isinstance(headers, dict):
        waits = headers.get(WAITS_HEADER)
    waits = int(waits or 0)
    if waits >= setup.settings.busy_max_waits:
        return None  # this attempt gives up if refused: it must not leave a place to wake
    options = execution_options(request)
    if headers:
        headers = {k: v for k, v in headers.items() if k not in _WAKE_DROPPED}
        headers[WAITS_HEADER] = waits + 1
    else:
        headers = {WAITS_HEADER: waits + 1}
    headers[LISTED_HEADER] = int(listed_at(request))  # (ten digits: a constant size)
    carry(request, headers)  # (order="publish": when it was published; unique=: its lock)
    options["headers"] = headers
    options["retries"] = request.retries or 0
    if request.ignore_result or task.ignore_result:
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
        if setup.wake_queues:
            via = wake_queue_for(task.app, delivery)
            if via is not None:  # the waker sends the wake there (see _execution.wake)
                headers[ROUTE_HEADER] = via
    try:
        payload = dump_json({"task": task.name, "args": args, "kwargs": kwargs, "options": options})
    except (TypeError, ValueError, RecursionError):
        return None
    return payload, setup.wait_ttl(waits)
