"""``celery -A proj lease ...``: inspect and manage leases from the command line.

Registered through the ``celery.commands`` entry point, so Celery loads it like its own
``celery list``: ``ctx.obj.app`` is the app named by ``-A`` and the store is that app's
``lease_store_url``. Commands print human tables by default and JSON with ``--json``. On an
error they print one line (``Error: ...``) to stderr and exit non-zero: 1 when the store failed
or refused, 2 for bad input or settings (a bad resource name, no ``lease_store_url``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from . import _clock
from ._app import _store_options, get_store
from ._errors import LeaseBusyError, LeaseConfigError, LeaseError, LeaseStoreError
from ._lease import LeaseInfo, Owner
from ._names import holder_task_id, parse_holder, validate_resource
from ._settings import LeaseSettings
from .stores.base import (
    LOCK_PREFIX,
    MAX_LIST_LIMIT,
    RECENT_EFFECTS,
    IdentityInfo,
    IdentityRecords,
    LeaseStore,
    Waiter,
)
from .stores.urls import store_kind

__all__ = ["holder_task_id", "lease", "prefix_of"]

F = TypeVar("F", bound=Callable[..., Any])

#: Exit status for a store failure (unreachable, refused, unhealthy under --strict).
EXIT_STORE = 1
#: Exit status for bad input or settings (click uses 2 for usage errors too).
EXIT_CONFIG = 2
#: Clock skew between the store and this host above which ``check`` warns, seconds.
SKEW_WARNING = 1.0
_HOST_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


class CommandError(click.ClickException):
    """A failure: ``Error: <message>`` on one line of stderr, exit status 1."""

    exit_code = EXIT_STORE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class UsageProblem(CommandError):
    """Bad input or settings: exit status 2."""

    exit_code = EXIT_CONFIG


def _fails_cleanly(command: F) -> F:
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


def _store(ctx: click.Context) -> LeaseStore:
    app = ctx.obj.app
    settings = LeaseSettings.resolve(app.conf)
    if not settings.store_url:
        raise LeaseConfigError(
            f"app {app.main or '?'!r} has no lease settings: set lease_store_url (e.g. "
            "app.conf.lease_store_url = 'redis://localhost:6379/0') in the module given to -A"
        )
    return get_store(app, settings)


def _check_turns() -> None:
    """Before the command ends: the turn checks of the wakes it sent (an eviction or a reclaimed
    lease woke the next waiting task), each once that task claimed or its grace is over (about
    2 s), so the turn goes on if the woken task never claims. Silent unless it has to wait;
    then one line on stderr."""
    from ._wakes import drain_turns

    def waiting(left: float) -> None:
        click.echo(f"waiting up to {left:.1f} s for the woken task to take its turn", err=True)

    drain_turns(on_wait=waiting)


def _resource(value: str) -> str:
    try:
        return validate_resource(value)
    except LeaseConfigError as exc:
        raise UsageProblem(str(exc)) from None


def prefix_of(resource: str) -> str:
    """The group a resource is counted under by ``stats``: up to its first ``/`` or ``:``."""
    match = re.search(r"[/:]", resource)
    return resource[: match.end()] if match else resource


def _iter_leases(
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


def _duration(seconds: float) -> str:
    sign = "-" if seconds < 0 else ""
    value = abs(seconds)
    if value < 60:
        return f"{sign}{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{sign}{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours}h{minutes:02d}m"


def _lease_json(info: LeaseInfo) -> dict[str, Any]:
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


def _identity_json(record: IdentityInfo) -> dict[str, Any]:
    return {
        "resource": record.resource,
        "identity": record.identity,
        "state": record.state,
        "fence": record.fence,
        "holder": record.owner_label,
        "result": record.result,
        "expires_at": record.expires_at.isoformat(),
    }


def _waiter_json(waiter: Waiter) -> dict[str, Any]:
    return {
        "position": waiter.position,
        "identity": waiter.identity,
        "since": waiter.since.isoformat(),
        "expires_at": waiter.expires_at.isoformat(),
        "woken": waiter.woken,
    }


def _table(ctx: click.Context, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        ctx.obj.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _dump(ctx: click.Context, value: Any) -> None:
    ctx.obj.echo(json.dumps(value, indent=2, sort_keys=True))


@click.group(name="lease")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def lease(ctx: click.Context) -> None:
    """Inspect and manage celery_lease leases (the app's lease_store_url)."""


@lease.command(name="ls", cls=CeleryCommand)
@click.option("--prefix", default="", help="Only resources starting with this.")
@click.option("--expired", is_flag=True, help="Only leases that expired and were never released.")
@click.option("--limit", type=click.IntRange(1), default=1000, show_default=True)
@click.option(
    "--waiters", is_flag=True, help="Add each resource's wait-list length (a read per lease)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_fails_cleanly
def ls(
    ctx: click.Context, prefix: str, expired: bool, limit: int, waiters: bool, as_json: bool
) -> None:
    """List leases, soonest expiry first: holder (host:pid:task-id, then the task's name and
    arguments), fence, expiry, task id."""
    store = _store(ctx)
    found = list(_iter_leases(store, prefix=prefix, expired_only=expired, limit=limit + 1))
    shown, more = found[:limit], len(found) > limit
    waiting = {info.resource: len(store.waiters(info.resource)) for info in shown if waiters}
    if as_json:
        rows_json = [_lease_json(info) for info in shown]
        if waiters:
            for row in rows_json:
                row["waiters"] = waiting[row["resource"]]
        _dump(ctx, rows_json)
        return
    if not shown:
        ctx.obj.echo("No expired leases." if expired else "No leases.")
        return
    rows = [
        [
            info.resource,
            info.owner_label,
            str(info.fence),
            _duration(info.expires_in) + (" (expired)" if info.expired else ""),
            holder_task_id(info.owner_label) or "-",
            *([str(waiting[info.resource])] if waiters else []),
        ]
        for info in shown
    ]
    header = ["RESOURCE", "HOLDER", "FENCE", "EXPIRES IN", "TASK ID"]
    _table(ctx, header + (["WAITERS"] if waiters else []), rows)
    if more:
        ctx.obj.echo(f"(more than {limit} leases; use --limit or --prefix)")


def _json_or_text(text: str | None) -> Any:
    """Stored JSON text as a value (checkpoints, receipts); text that is not JSON as it is."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _records_json(records: IdentityRecords) -> dict[str, Any]:
    return {
        "checkpoints": _json_or_text(records.checkpoints),
        "checkpoint_fence": records.checkpoint_fence,
        "effects": [
            {
                "key": effect.key,
                "state": effect.state,
                "fence": effect.fence,
                "receipt": _json_or_text(effect.receipt),
                "expires_at": effect.expires_at.isoformat(),
            }
            for effect in records.effects
        ],
    }


@lease.command(cls=CeleryCommand)
@click.argument("resource")
@click.option(
    "--identity",
    default=None,
    help="The task identity whose record to show (default: the holder's task id; a task "
    "that sets identity= needs this).",
)
@click.option(
    "--effects",
    "effects_limit",
    type=click.IntRange(1, 1000),
    default=RECENT_EFFECTS,
    show_default=True,
    help="How many of the identity's most recent effects to show.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_fails_cleanly
def show(
    ctx: click.Context, resource: str, identity: str | None, effects_limit: int, as_json: bool
) -> None:
    """Show RESOURCE's lease, its wait list, and a task identity's record with its checkpoints
    and recent effects (the holder's own task id, or --identity)."""
    resource = _resource(resource)
    store = _store(ctx)
    info = store.get(resource)
    queue = store.waiters(resource)
    # A lease task's identity is its task id unless the task sets identity=: without
    # --identity, show the holder's record when there is one. The lease records no identity,
    # so a custom identity= cannot be found from it: say so rather than show nothing.
    holder = holder_task_id(info.owner_label) if info is not None else None
    wanted = identity if identity is not None else holder
    record = store.identity_get(resource, wanted) if wanted is not None else None
    records = (
        store.identity_records(resource, wanted, limit=effects_limit)
        if record is not None and wanted is not None
        else None
    )
    note = None
    if info is not None and identity is None and record is None:
        where = (
            f"no identity record under the holder's task id {holder!r}"
            if holder is not None
            else "the holder's label names no task id"
        )
        note = (
            f"{where}; a task that sets identity= keeps its record under that identity, "
            "which the lease does not record: pass --identity ID to see it"
        )
    if as_json:
        out: dict[str, Any] = {
            "lease": None if info is None else _lease_json(info),
            "waiters": [_waiter_json(waiter) for waiter in queue],
        }
        if identity is not None or record is not None:
            out["identity"] = None if record is None else _identity_json(record)
            if records is not None:
                out["identity"].update(_records_json(records))
        if note is not None:
            out["note"] = note
        _dump(ctx, out)
        return
    if info is None:
        ctx.obj.echo(f"{resource}: no lease (free)")
    else:
        state = "expired, never released" if info.expired else "live"
        task_id, task, args = parse_holder(info.owner_label)
        for name, value in (
            ("resource", info.resource),
            ("state", state),
            ("holder", info.owner_label),
            ("task id", task_id or "-"),
            ("task", task or "-"),
            ("args", args or "-"),
            ("fence", str(info.fence)),
            ("acquired at", info.acquired_at.isoformat()),
            ("expires at", info.expires_at.isoformat()),
            ("expires in", _duration(info.expires_in)),
        ):
            ctx.obj.echo(f"{name + ':':<13}{value}")
    if queue:
        ctx.obj.echo(f"waiters:     {len(queue)} (head first)")
        for waiter in queue:
            woken = ", woken" if waiter.woken else ""
            ctx.obj.echo(
                f"  {waiter.position}. {waiter.identity} (since {waiter.since.isoformat()}{woken})"
            )
    if record is None:
        if identity is not None:
            ctx.obj.echo(f"identity {identity!r}: no record")
        elif note is not None:
            ctx.obj.echo(f"identity:    {note}")
        return
    ctx.obj.echo(f"identity {record.identity!r}:")
    for name, value in (
        ("state", record.state),
        ("fence", str(record.fence)),
        ("holder", record.owner_label),
        ("result", "-" if record.result is None else record.result),
        ("kept until", record.expires_at.isoformat()),
    ):
        ctx.obj.echo(f"  {name + ':':<13}{value}")
    assert records is not None
    if records.checkpoints is None:
        ctx.obj.echo("  checkpoints: none")
    else:
        ctx.obj.echo(f"  checkpoints: {records.checkpoints} (fence {records.checkpoint_fence})")
    if not records.effects:
        ctx.obj.echo("  effects:     none")
        return
    ctx.obj.echo(f"  effects:     {len(records.effects)} (most recent first)")
    rows = [
        [
            effect.key,
            effect.state,
            str(effect.fence),
            "-" if effect.receipt is None else effect.receipt,
            effect.expires_at.isoformat(),
        ]
        for effect in records.effects
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        ctx.obj.echo(f"    {'  '.join(cells)}  kept until {row[4]}")


@lease.command(cls=CeleryCommand)
@click.argument("resource")
@click.option("--force", is_flag=True, help="Required: evict whoever holds the lease.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--fence",
    type=click.IntRange(0),
    default=None,
    help="Evict only the lease with this fence (refused when the resource changed hands).",
)
@click.pass_context
@_fails_cleanly
def release(ctx: click.Context, resource: str, force: bool, yes: bool, fence: int | None) -> None:
    """Evict RESOURCE's holder (needs --force): its fence is bumped, so its fenced writes are
    refused once the resource is claimed again, and the evicted task runs again from the
    start. The next waiting task is woken, as a release wakes it.

    The eviction is bound to the lease shown at the prompt (or to --fence): if the resource
    changed hands meanwhile, nothing is evicted and the command exits 1."""
    from ._release import force_release

    resource = _resource(resource)
    if not force:
        raise UsageProblem(
            f"releasing {resource!r} evicts its holder, which may still be running: pass "
            "--force to do it (the holder's fenced writes are then refused)"
        )
    store = _store(ctx)
    info = store.get(resource)
    if info is None:
        ctx.obj.echo(f"{resource}: no lease, nothing to release")
        return
    if fence is not None and info.fence != fence:
        raise CommandError(
            f"{resource!r} is held by {info.owner_label!r} with fence {info.fence}, not fence "
            f"{fence}: nothing evicted"
        )
    if not yes:
        state = "expired" if info.expired else f"live, expires in {_duration(info.expires_in)}"
        click.confirm(
            f"Evict {info.owner_label!r} (fence {info.fence}, {state}) from {resource!r}?",
            abort=True,
            err=True,
        )
        fence = info.fence  # what was shown is what is evicted
    try:
        evicted = force_release(resource, app=ctx.obj.app, fence=fence, store=store)
    except LeaseBusyError as exc:
        raise CommandError(f"{exc}") from None
    if evicted is None:
        ctx.obj.echo(f"{resource}: the lease was gone already, nothing released")
        return
    if resource.startswith(LOCK_PREFIX):  # a publish lock (unique=): no run is evicted
        ctx.obj.echo(
            f"{resource}: freed the publish lock of {evicted.owner_label!r}; a copy of the task "
            "may be published again (a copy already queued still runs)"
        )
        return
    ctx.obj.echo(
        f"{resource}: evicted {evicted.owner_label!r} (fence {evicted.fence}); the next claim "
        "gets a higher fence, and the evicted task runs again from the start"
    )
    _check_turns()


@lease.command(cls=CeleryCommand)
@click.option("--prefix", default="", help="Only resources starting with this.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_fails_cleanly
def stats(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """Count live and expired leases by resource prefix (up to the first / or :)."""
    store = _store(ctx)
    counts: dict[str, dict[str, int]] = {}
    for info in _iter_leases(store, prefix=prefix):
        group = counts.setdefault(prefix_of(info.resource), {"live": 0, "expired": 0})
        group["expired" if info.expired else "live"] += 1
    total = {
        "live": sum(c["live"] for c in counts.values()),
        "expired": sum(c["expired"] for c in counts.values()),
    }
    if as_json:
        _dump(ctx, {"prefixes": counts, "total": total})
        return
    rows = [[p, str(c["live"]), str(c["expired"])] for p, c in sorted(counts.items())]
    rows.append(["(total)", str(total["live"]), str(total["expired"])])
    _table(ctx, ["PREFIX", "LIVE", "EXPIRED"], rows)


def _probe_clock(store: LeaseStore) -> dict[str, Any]:
    """Claim and release a probe lease: proves the store takes writes, measures clock skew."""
    host = _HOST_SAFE.sub("-", socket.gethostname())[:120] or "host"
    resource = f"celery_lease-check/{host}"
    owner = Owner.new(f"celery lease check@{socket.gethostname()}:{os.getpid()}")
    ttl = min(10.0, store.max_ttl)
    before = _clock.wall()
    try:
        probe = store.acquire(resource, owner, ttl)
    except LeaseBusyError:
        return {"resource": resource, "skipped": "another check holds the probe lease"}
    after = _clock.wall()
    store.release(probe)
    local_mid = (before + after) / 2
    skew = probe.acquired_at.timestamp() - local_mid
    return {
        "resource": resource,
        "clock_skew": round(skew, 4),
        "uncertainty": round((after - before) / 2, 4),
        "round_trip": round(after - before, 4),
    }


def _postgres_facts(store: Any) -> tuple[dict[str, Any], list[str]]:
    """PostgreSQL settings and the role's rights that matter to leases (cheap catalog reads).

    The role should hold exactly the rights the store needs on each table (``TABLE_RIGHTS``),
    own none of them, and be unable to create tables, roles or databases.
    """
    import sqlalchemy as sa

    from .stores.sql import TABLE_RIGHTS

    facts: dict[str, Any] = {}
    warnings: list[str] = []
    with store.engine.connect() as conn:
        for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"):
            facts[name] = conn.execute(sa.text(f"SHOW {name}")).scalar()
        role = conn.execute(
            sa.text(
                "SELECT current_user, rolsuper, rolcreaterole, rolcreatedb, "
                "has_schema_privilege(current_schema(), 'CREATE') "
                "FROM pg_roles WHERE rolname = current_user"
            )
        ).one()
        name, superuser, createrole, createdb, create_in_schema = role
        facts.update(
            role=name,
            superuser=bool(superuser),
            create_role=bool(createrole),
            create_db=bool(createdb),
            create_in_schema=bool(create_in_schema),
        )
        rights: dict[str, str] = {}
        owned: list[str] = []
        missing: dict[str, list[str]] = {}
        for kind, table in store.tables.items():
            row = conn.execute(
                sa.text(
                    "SELECT pg_get_userbyid(c.relowner) = current_user FROM pg_class c "
                    "WHERE c.oid = to_regclass(:t)"
                ),
                {"t": store.engine.dialect.identifier_preparer.quote(table.name)},
            ).first()
            if row is None:
                rights[table.name] = "missing table"
                warnings.append(
                    f"the lease table {table.name} does not exist: create the schema as its "
                    "owner (celery -A proj lease init-schema --url OWNER_URL --grant ROLE)"
                )
                continue
            if row[0]:
                owned.append(table.name)
            granted = [
                right
                for right in ("SELECT", "INSERT", "UPDATE", "DELETE")
                if conn.execute(
                    sa.text("SELECT has_table_privilege(:t, :r)"), {"t": table.name, "r": right}
                ).scalar()
            ]
            rights[table.name] = ",".join(granted) or "none"
            lacking = [right for right in TABLE_RIGHTS[kind] if right not in granted]
            if lacking:
                missing[kind] = lacking
        facts["table_rights"] = rights
        facts["owns_tables"] = owned
    if missing:
        grants = "; ".join(
            stmt for kind, stmt in zip(store.tables, store.grant_statements(name), strict=True)
            if kind in missing
        )  # fmt: skip
        lacks = ", ".join(
            f"{'/'.join(rights_)} on {store.tables[kind].name}" for kind, rights_ in missing.items()
        )
        warnings.append(
            f"role {name!r} lacks {lacks}, which the lease store needs: as the tables' owner "
            f"run {grants}"
        )
    if facts["statement_timeout"] in ("0", None):
        warnings.append(
            "PostgreSQL statement_timeout is 0 (none): a stuck statement can pin a lease row; "
            "let celery_lease set it (the default) or set one on the role"
        )
    if superuser or createrole or createdb:
        warnings.append(
            f"role {name!r} is a superuser or may create roles/databases: run the lease "
            "store as a least-privilege role (rights on the lease tables only)"
        )
    elif create_in_schema or owned:
        what = "owns the lease tables (it may alter or drop them)" if owned else ""
        what += " and " if owned and create_in_schema else ""
        what += "may create tables in its schema" if create_in_schema else ""
        warnings.append(
            f"role {name!r} {what}: for least privilege let another role own the schema "
            "(celery -A proj lease init-schema --url OWNER_URL --grant ROLE)"
        )
    return facts, warnings


def _facts_lines(facts: dict[str, Any]) -> list[str]:
    """``check``'s report as ``label:  value`` lines aligned on the longest label; a mapping
    (the per-table rights) goes one ``  table  value`` line per key below its label."""
    width = max(len(name) for name in facts) + 2
    lines: list[str] = []
    for name, value in facts.items():
        if isinstance(value, dict):
            lines.append(f"{name}:")
            table_width = max((len(str(key)) for key in value), default=0)
            lines += [f"  {key:<{table_width}}  {item}" for key, item in value.items()]
            continue
        shown = (", ".join(map(str, value)) or "none") if isinstance(value, list) else value
        lines.append(f"{name + ':':<{width}}{shown}")
    return lines


@lease.command(cls=CeleryCommand)
@click.option("--strict", is_flag=True, help="Exit 1 when there are warnings too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_fails_cleanly
def check(ctx: click.Context, strict: bool, as_json: bool) -> None:
    """Check the store: health, a write probe, clock skew, and for PostgreSQL its timeouts
    and the role's rights; list the lease tasks and where each lease comes from (decorator or
    lease_routes pattern).

    The verdict is the exit status, and ``"ok"`` in ``--json`` says the same: ok unless the
    write probe failed, or ``--strict`` is given and there are warnings. Warnings alone are
    advice (listed either way), not a failure."""
    store = _store(ctx)
    warnings = list(store.check_health())
    try:
        probe = _probe_clock(store)
    except LeaseStoreError as exc:  # still report the rest: it may say why (a missing right)
        probe = {"failed": " ".join(str(exc).split())}
    skew = probe.get("clock_skew")
    if skew is not None and abs(skew) > SKEW_WARNING + probe["uncertainty"]:
        warnings.append(
            f"the store clock is {skew:+.3f}s off this host's: leases run on the store clock, "
            "but times this host prints or compares (logs, --expired) disagree; sync with NTP"
        )
    out: dict[str, Any] = {"store": store.url, "probe": probe}
    tasks = _leased_tasks(ctx.obj.app, warnings)
    if store_kind(store.url) == "postgresql":
        try:
            facts, more = _postgres_facts(store)
        except Exception as exc:  # noqa: BLE001 - the catalog read is advice, not the check
            more = [f"could not read PostgreSQL settings and rights: {exc}".splitlines()[0]]
            facts = {}
        out["postgresql"] = facts
        warnings += more
    out["tasks"] = tasks
    out["warnings"] = warnings
    # One verdict for both forms: "ok" is what the exit status says (a script reading the JSON
    # must not fail a deploy that the exit status passes, or the reverse).
    out["strict"] = strict
    out["ok"] = "failed" not in probe and not (strict and warnings)
    if as_json:
        _dump(ctx, out)
    else:
        if "failed" in probe:
            outcome = f"FAILED ({probe['failed']})"
        elif skew is None:
            outcome = f"skipped ({probe['skipped']})"
        else:
            outcome = (
                f"ok, round trip {probe['round_trip'] * 1000:.1f} ms, clock skew "
                f"{skew:+.3f}s (+-{probe['uncertainty']:.3f}s, store minus this host)"
            )
        facts = {"store": store.url, "write probe": outcome, **out.get("postgresql", {})}
        for line in _facts_lines(facts):
            ctx.obj.echo(line)
        ctx.obj.echo(f"leased tasks: {len(tasks) or 'none'}")
        width = max((len(t["task"]) for t in tasks), default=0)
        for task in tasks:
            source = f"route {task['pattern']!r}" if task["source"] == "route" else task["source"]
            ctx.obj.echo(f"  {task['task']:<{width}}  {source}, resource {task['resource']!r}")
        for warning in warnings:
            ctx.obj.echo(f"WARNING: {warning}")
        if "failed" in probe:
            ctx.obj.echo("FAILED: the write probe failed")
        elif not warnings:
            ctx.obj.echo("OK")
        elif out["ok"]:
            ctx.obj.echo(f"OK, {len(warnings)} warning(s)")
        else:
            ctx.obj.echo(f"FAILED: {len(warnings)} warning(s) under --strict")
    if "failed" in probe:
        raise CommandError(f"the write probe failed: {probe['failed']}")
    if strict and warnings:
        raise CommandError(f"{len(warnings)} warning(s) about {store.url}")


def _leased_tasks(app: Any, warnings: list[str]) -> list[dict[str, Any]]:
    """The app's lease tasks, each with where its lease comes from (``decorator``, ``class``
    or ``route`` with its pattern); a route that matches no task adds a warning. Imports the
    app's task modules first (``imports``, ``include``), as a worker does."""
    from ._routes import leased_tasks, route_problems

    app.loader.import_default_modules()
    warnings += route_problems(app)  # (a route the worker would refuse raises here too)
    return leased_tasks(app)


#: What ``init-schema`` prints for a Redis store: the ACL a least-privilege user needs.
REDIS_ACL = (
    "ACL SETUSER <user> on ><password> resetkeys ~{prefix}* resetchannels -@all +evalsha "
    "+script|load +ping +time +get +hmget +hget +hset +hdel +zadd +zrem +zrangebyscore "
    "+zscore +hscan"
)


@lease.command(name="init-schema", cls=CeleryCommand)
@click.option(
    "--url",
    default=None,
    help="Connect as the schema's owner (default: the app's lease_store_url).",
)
@click.option(
    "--grant",
    "roles",
    multiple=True,
    metavar="ROLE",
    help="Grant ROLE the rights the store needs on the tables, and no more (repeatable).",
)
@click.pass_context
@_fails_cleanly
def init_schema(ctx: click.Context, url: str | None, roles: tuple[str, ...]) -> None:
    """Create the lease tables ahead of time, as their owner, and grant a role what it needs.

    Lets the workers run as a role that may create nothing (``create_tables`` finds the tables
    there). Idempotent: run it again after an upgrade. Redis needs no schema: it prints the ACL
    line of a least-privilege user instead. The memory store needs neither."""
    from .stores import store_from_url

    app = ctx.obj.app
    settings = LeaseSettings.resolve(app.conf)
    url = url or settings.store_url
    if not url:
        raise LeaseConfigError(
            f"app {app.main or '?'!r} has no lease settings: set lease_store_url, or pass "
            "--url postgresql+psycopg://OWNER@host/db"
        )
    options = _store_options(dataclasses.replace(settings, store_url=url))
    options.pop("create_tables", None)
    store: Any = store_from_url(url, **options)
    try:
        kind = store_kind(url)  # (store_from_url refused any URL of no kind)
        if kind == "redis":
            ctx.obj.echo(f"{store.url}: no schema to create. A least-privilege Redis user:")
            ctx.obj.echo("  " + REDIS_ACL.format(prefix=store.key_prefix))
            return
        if kind not in ("postgresql", "sqlite"):
            ctx.obj.echo(f"{store.url}: an in-process store: no schema to create, no ACL to set.")
            return
        import sqlalchemy as sa

        names = ", ".join(table.name for table in store.tables.values())
        ctx.obj.echo(f"{store.url}: lease tables ready ({names})")
        for role in roles:
            statements = store.grant_statements(role)
            if store.dialect != "postgresql":
                raise LeaseConfigError(f"--grant is for PostgreSQL; {store.url} has no roles")
            granting = store._connections.translate(f"granting {role!r} its rights")
            with granting, store.engine.begin() as conn:
                for statement in statements:
                    conn.execute(sa.text(statement))
            ctx.obj.echo(f"granted {role!r}:")
            for statement in statements:
                ctx.obj.echo(f"  {statement}")
    finally:
        store.close()


@lease.command(name="sweep", cls=CeleryCommand)
@click.option("--dry-run", is_flag=True, help="Only list the expired leases a run would reclaim.")
@click.option("--limit", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@_fails_cleanly
def sweep_command(ctx: click.Context, dry_run: bool, limit: int, as_json: bool) -> None:
    """Run the sweeper once: records past retention, and expired leases with on_expired hooks.

    Exits 1 when a cleanup hook failed (the lease is kept for the next run)."""
    from ._sweeper import run_sweep

    app = ctx.obj.app
    app.loader.import_default_modules()  # the task modules, where on_expired hooks live
    store = _store(ctx)
    report = run_sweep(app, store=store, limit=limit, dry_run=dry_run)
    if as_json:
        _dump(ctx, report.as_dict())
    elif dry_run:
        ctx.obj.echo(f"{len(report.expired)} expired lease(s) with an on_expired hook:")
        for resource in report.expired:
            ctx.obj.echo(f"  {resource}")
        ctx.obj.echo("(records past retention are not counted in a dry run)")
    else:
        ctx.obj.echo(f"swept:          {report.swept} record(s) past retention")
        ctx.obj.echo(f"reclaimed:      {len(report.reclaimed)} expired lease(s)")
        ctx.obj.echo(f"cleanup failed: {len(report.cleanup_failed)}")
        for resource in report.cleanup_failed:
            ctx.obj.echo(f"  {resource} (kept for the next run)")
    _check_turns()
    if report.cleanup_failed:
        raise CommandError(
            f"cleanup failed for {len(report.cleanup_failed)} expired lease(s): "
            f"{', '.join(report.cleanup_failed[:5])}; see the WARNING log lines"
        )
