"""The commands that change leases: ``release --force`` (evict a holder) and ``sweep``."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from ._cli_common import (
    CommandError,
    UsageProblem,
    check_turns,
    duration,
    echo_json,
    fails_cleanly,
    resource_arg,
    store_of,
)
from ._errors import LeaseBusyError
from .stores.base import LOCK_PREFIX


@click.command(cls=CeleryCommand)
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
@fails_cleanly
def release(ctx: click.Context, resource: str, force: bool, yes: bool, fence: int | None) -> None:
    """Evict RESOURCE's holder (needs --force): its fence is bumped, so its fenced writes are
    refused once the resource is claimed again, and the evicted task runs again from the
    start. The next waiting task is woken, as a release wakes it.

    The eviction is bound to the lease shown at the prompt (or to --fence): if the resource
    changed hands meanwhile, nothing is evicted and the command exits 1."""
    from ._release import force_release

    resource = resource_arg(resource)
    if not force:
        raise UsageProblem(
            f"releasing {resource!r} evicts its holder, which may still be running: pass "
            "--force to do it (the holder's fenced writes are then refused)"
        )
    store = store_of(ctx)
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
        state = "expired" if info.expired else f"live, expires in {duration(info.expires_in)}"
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
    check_turns()


@click.command(name="sweep", cls=CeleryCommand)
@click.option("--dry-run", is_flag=True, help="Only list the expired leases a run would reclaim.")
@click.option("--limit", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@fails_cleanly
def sweep_command(ctx: click.Context, dry_run: bool, limit: int, as_json: bool) -> None:
    """Run the sweeper once: records past retention, and expired leases with on_expired hooks.

    Exits 1 when a cleanup hook failed (the lease is kept for the next run)."""
    from ._sweeper import run_sweep

    app = ctx.obj.app
    app.loader.import_default_modules()  # the task modules, where on_expired hooks live
    store = store_of(ctx)
    report = run_sweep(app, store=store, limit=limit, dry_run=dry_run)
    if as_json:
        echo_json(ctx, report.as_dict())
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
    check_turns()
    if report.cleanup_failed:
        raise CommandError(
            f"cleanup failed for {len(report.cleanup_failed)} expired lease(s): "
            f"{', '.join(report.cleanup_failed[:5])}; see the WARNING log lines"
        )
