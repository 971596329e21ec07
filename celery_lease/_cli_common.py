"""What every ``celery lease`` command shares: errors and exit statuses, the app's store, output.

Errors: a celery_lease error becomes one ``Error: ...`` line on stderr and exit status 1 (the
store failed or refused) or 2 (bad input or settings). Output: human tables and lines, or JSON
(``--json``), through ``ctx.obj.echo``; the JSON shape of a lease, an identity record and a
waiter is the same in every command.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

import click

from ._app_stores import get_store
from ._errors import LeaseConfigError, LeaseError
from ._lease import LeaseInfo
from ._names import parse_holder, validate_resource
from ._settings import LeaseSettings
from .stores.base import MAX_LIST_LIMIT, IdentityInfo, IdentityRecords, LeaseStore, Waiter

F = TypeVar("F", bound=Callable[..., Any])

#: Exit status for a store failure (unreachable, refused, unhealthy under --strict).
EXIT_STORE = 1
#: Exit status for bad input or settings (click uses 2 for usage errors too).
EXIT_CONFIG = 2


class CommandError(click.ClickException):
    """A failure: ``Error: <message>`` on one line of stderr, exit status 1."""

    exit_code = EXIT_STORE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class UsageProblem(CommandError):
    """Bad input or settings: exit status 2."""

    exit_code = EXIT_CONFIG


def fails_cleanly(command: F) -> F:
    """Turn celery_lease errors into a one-line message and a non-zero exit status."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except LeaseConfigError as exc:
            raise UsageProblem(str(exc)) from None
        except LeaseError as exc:
            raise CommandError(str(exc)) from None

    return wrapper  # type: ignore[return-value]


def store_of(ctx: click.Context) -> LeaseStore:
    """The store of the app given to ``-A`` (its ``lease_store_url``)."""
    app = ctx.obj.app
    settings = LeaseSettings.resolve(app.conf)
    if not settings.store_url:
        raise LeaseConfigError(
            f"app {app.main or '?'!r} has no lease settings: set lease_store_url (e.g. "
            "app.conf.lease_store_url = 'redis://localhost:6379/0') in the module given to -A"
        )
    return get_store(app, settings)


def check_turns() -> None:
    """Before the command ends: the turn checks of the wakes it sent (an eviction or a reclaimed
    lease woke the next waiting task), each once that task claimed or its grace is over (about
    2 s), so the turn goes on if the woken task never claims. Silent unless it has to wait;
    then one line on stderr."""
    from ._wakes import drain_turns

    def waiting(left: float) -> None:
        click.echo(f"waiting up to {left:.1f} s for the woken task to take its turn", err=True)

    drain_turns(on_wait=waiting)


def resource_arg(value: str) -> str:
    """A RESOURCE argument, validated (a bad name: exit status 2)."""
    try:
        return validate_resource(value)
    except LeaseConfigError as exc:
        raise UsageProblem(str(exc)) from None


def prefix_of(resource: str) -> str:
    """The group a resource is counted under by ``stats``: up to its first ``/`` or ``:``."""
    match = re.search(r"[/:]", resource)
    return resource[: match.end()] if match else resource


def iter_leases(
    store: LeaseStore, *, prefix: str = "", expired_only: bool = False, limit: int | None = None
) -> Iterator[LeaseInfo]:
    cursor: str | None = None
    left = math.inf if limit is None else limit
    while left > 0:
        page = store.list(
            prefix=prefix,
            expired_only=expired_only,
            limit=int(min(left, MAX_LIST_LIMIT)),
            cursor=cursor,
        )
        yield from page.leases
        left -= len(page.leases)
        if page.cursor is None:
            return
        cursor = page.cursor


def duration(seconds: float) -> str:
    sign = "-" if seconds < 0 else ""
    value = abs(seconds)
    if value < 60:
        return f"{sign}{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{sign}{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours}h{minutes:02d}m"


def lease_json(info: LeaseInfo) -> dict[str, Any]:
    task_id, task, args = parse_holder(info.owner_label)
    return {
        "resource": info.resource,
        "holder": info.owner_label,
        "fence": info.fence,
        "task_id": task_id,
        "task": task,
        "args": args,
        "acquired_at": info.acquired_at.isoformat(),
        "expires_at": info.expires_at.isoformat(),
        "expires_in": round(info.expires_in, 3),
        "expired": info.expired,
    }


def identity_json(record: IdentityInfo) -> dict[str, Any]:
    return {
        "resource": record.resource,
        "identity": record.identity,
        "state": record.state,
        "fence": record.fence,
        "holder": record.owner_label,
        "result": record.result,
        "expires_at": record.expires_at.isoformat(),
    }


def waiter_json(waiter: Waiter) -> dict[str, Any]:
    return {
        "position": waiter.position,
        "identity": waiter.identity,
        "since": waiter.since.isoformat(),
        "expires_at": waiter.expires_at.isoformat(),
        "woken": waiter.woken,
    }


def echo_table(ctx: click.Context, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        ctx.obj.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def echo_json(ctx: click.Context, value: Any) -> None:
    ctx.obj.echo(json.dumps(value, indent=2, sort_keys=True))


def json_or_text(text: str | None) -> Any:
    """Stored JSON text as a value (checkpoints, receipts); text that is not JSON as it is."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def records_json(records: IdentityRecords) -> dict[str, Any]:
    return {
        "checkpoints": json_or_text(records.checkpoints),
        "checkpoint_fence": records.checkpoint_fence,
        "effects": [
            {
                "key": effect.key,
                "state": effect.state,
                "fence": effect.fence,
                "receipt": json_or_text(effect.receipt),
                "expires_at": effect.expires_at.isoformat(),
            }
            for effect in records.effects
        ],
    }
