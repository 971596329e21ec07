"""The commands that read leases and change nothing: ``ls``, ``show`` and ``stats``.

``ls``: leases, soonest expiry first; ``show``: one lease, its wait list and a task identity's
record; ``stats``: live and expired leases counted by resource prefix.
"""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import CeleryCommand

from ._cli_common import (
    duration,
    echo_json,
    echo_table,
    fails_cleanly,
    identity_json,
    iter_leases,
    lease_json,
    prefix_of,
    records_json,
    resource_arg,
    store_of,
    waiter_json,
)
from ._lease import LeaseInfo
from ._names import holder_task_id, parse_holder
from .stores.base import RECENT_EFFECTS, IdentityInfo, IdentityRecords, Waiter


@click.command(name="ls", cls=CeleryCommand)
@click.option("--prefix", default="", help="Only resources starting with this.")
@click.option("--expired", is_flag=True, help="Only leases that expired and were never released.")
@click.option("--limit", type=click.IntRange(1), default=1000, show_default=True)
@click.option(
    "--waiters", is_flag=True, help="Add each resource's wait-list length (a read per lease)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@fails_cleanly
def ls(
    ctx: click.Context, prefix: str, expired: bool, limit: int, waiters: bool, as_json: bool
) -> None:
    """List leases, soonest expiry first: holder (host:pid:task-id, then the task's name and
    arguments), fence, expiry, task id."""
    store = store_of(ctx)
    found = list(iter_leases(store, prefix=prefix, expired_only=expired, limit=limit + 1))
    shown, more = found[:limit], len(found) > limit
    waiting = {info.resource: len(store.waiters(info.resource)) for info in shown if waiters}
    if as_json:
        rows_json = [lease_json(info) for info in shown]
        if waiters:
            for row in rows_json:
                row["waiters"] = waiting[row["resource"]]
        echo_json(ctx, rows_json)
        return
    if not shown:
        ctx.obj.echo("No expired leases." if expired else "No leases.")
        return
    rows = [
        [
            info.resource,
            info.owner_label,
            str(info.fence),
            duration(info.expires_in) + (" (expired)" if info.expired else ""),
            holder_task_id(info.owner_label) or "-",
            *([str(waiting[info.resource])] if waiters else []),
        ]
        for info in shown
    ]
    header = ["RESOURCE", "HOLDER", "FENCE", "EXPIRES IN", "TASK ID"]
    echo_table(ctx, header + (["WAITERS"] if waiters else []), rows)
    if more:
        ctx.obj.echo(f"(more than {limit} leases; use --limit or --prefix)")


@click.command(cls=CeleryCommand)
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
@fails_cleanly
def show(
    ctx: click.Context, resource: str, identity: str | None, effects_limit: int, as_json: bool
) -> None:
    """Show RESOURCE's lease, its wait list, and a task identity's record with its checkpoints
    and recent effects (the holder's own task id, or --identity)."""
    resource = resource_arg(resource)
    store = store_of(ctx)
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
        note = _identity_note(holder)
    if as_json:
        out: dict[str, Any] = {
            "lease": None if info is None else lease_json(info),
            "waiters": [waiter_json(waiter) for waiter in queue],
        }
        if identity is not None or record is not None:
            out["identity"] = None if record is None else identity_json(record)
            if records is not None:
                out["identity"].update(records_json(records))
        if note is not None:
            out["note"] = note
        echo_json(ctx, out)
        return
    _echo_lease(ctx, resource, info, queue)
    if record is None:
        if identity is not None:
            ctx.obj.echo(f"identity {identity!r}: no record")
        elif note is not None:
            ctx.obj.echo(f"identity:    {note}")
        return
    assert records is not None
    _echo_record(ctx, record, records)


def _identity_note(holder: str | None) -> str:
    """Why ``show`` found no identity record for a lease without --identity."""
    where = (
        f"no identity record under the holder's task id {holder!r}"
        if holder is not None
        else "the holder's label names no task id"
    )
    return (
        f"{where}; a task that sets identity= keeps its record under that identity, "
        "which the lease does not record: pass --identity ID to see it"
    )


def _echo_lease(
    ctx: click.Context, resource: str, info: LeaseInfo | None, queue: list[Waiter]
) -> None:
    """``show``'s lines about the lease and its wait list."""
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
            ("expires in", duration(info.expires_in)),
        ):
            ctx.obj.echo(f"{name + ':':<13}{value}")
    if queue:
        ctx.obj.echo(f"waiters:     {len(queue)} (head first)")
        for waiter in queue:
            woken = ", woken" if waiter.woken else ""
            ctx.obj.echo(
                f"  {waiter.position}. {waiter.identity} (since {waiter.since.isoformat()}{woken})"
            )


def _echo_record(ctx: click.Context, record: IdentityInfo, records: IdentityRecords) -> None:
    """``show``'s lines about a task identity's record, its checkpoints and recent effects."""
    ctx.obj.echo(f"identity {record.identity!r}:")
    for name, value in (
        ("state", record.state),
        ("fence", str(record.fence)),
        ("holder", record.owner_label),
        ("result", "-" if record.result is None else record.result),
        ("kept until", record.expires_at.isoformat()),
    ):
        ctx.obj.echo(f"  {name + ':':<13}{value}")
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


@click.command(cls=CeleryCommand)
@click.option("--prefix", default="", help="Only resources starting with this.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@fails_cleanly
def stats(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """Count live and expired leases by resource prefix (up to the first / or :)."""
    store = store_of(ctx)
    counts: dict[str, dict[str, int]] = {}
    for info in iter_leases(store, prefix=prefix):
        group = counts.setdefault(prefix_of(info.resource), {"live": 0, "expired": 0})
        group["expired" if info.expired else "live"] += 1
    total = {
        "live": sum(c["live"] for c in counts.values()),
        "expired": sum(c["expired"] for c in counts.values()),
    }
    if as_json:
        echo_json(ctx, {"prefixes": counts, "total": total})
        return
    rows = [[p, str(c["live"]), str(c["expired"])] for p, c in sorted(counts.items())]
    rows.append(["(total)", str(total["live"]), str(total["expired"])])
    echo_table(ctx, ["PREFIX", "LIVE", "EXPIRED"], rows)
