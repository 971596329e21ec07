"""The commands that set a store up and check it: ``check`` and ``init-schema``.

``check``: the store's health, a write probe, clock skew, PostgreSQL's timeouts and the role's
rights, the lease tasks and where each lease comes from. ``init-schema``: the lease tables
made by their owner and a role granted what it needs (Redis: the ACL line to set).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Any

import click
from celery.bin.base import CeleryCommand

from . import _clock
from ._app_stores import _store_options
from ._cli_common import CommandError, echo_json, fails_cleanly, store_of
from ._errors import LeaseBusyError, LeaseConfigError, LeaseStoreError
from ._lease import Owner
from ._settings import LeaseSettings
from .stores.base import LeaseStore
from .stores.urls import store_kind

#: Clock skew between the store and this host above which ``check`` warns, seconds.
SKEW_WARNING = 1.0
_HOST_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


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
        rights, owned, missing = _table_rights(conn, store, warnings)
        facts["table_rights"] = rights
        facts["owns_tables"] = owned
    warnings += _role_warnings(store, facts, missing)
    return facts, warnings


def _table_rights(
    conn: Any, store: Any, warnings: list[str]
) -> tuple[dict[str, str], list[str], dict[str, list[str]]]:
    """The role's rights on each lease table (a missing table adds a warning), the tables it
    owns, and the rights it lacks by table kind."""
    import sqlalchemy as sa

    from .stores.sql import TABLE_RIGHTS

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
    return rights, owned, missing


def _role_warnings(store: Any, facts: dict[str, Any], missing: dict[str, list[str]]) -> list[str]:
    """What ``check`` warns about the role (rights it lacks, more than it needs) and the
    statement timeout, from what ``_postgres_facts`` read."""
    warnings: list[str] = []
    name, owned, create_in_schema = facts["role"], facts["owns_tables"], facts["create_in_schema"]
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
    if facts["superuser"] or facts["create_role"] or facts["create_db"]:
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
    return warnings


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


@click.command(cls=CeleryCommand)
@click.option("--strict", is_flag=True, help="Exit 1 when there are warnings too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@fails_cleanly
def check(ctx: click.Context, strict: bool, as_json: bool) -> None:
    """Check the store: health, a write probe, clock skew, and for PostgreSQL its timeouts
    and the role's rights; list the lease tasks and where each lease comes from (decorator or
    lease_routes pattern).

    The verdict is the exit status, and ``"ok"`` in ``--json`` says the same: ok unless the
    write probe failed, or ``--strict`` is given and there are warnings. Warnings alone are
    advice (listed either way), not a failure."""
    store = store_of(ctx)
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
        echo_json(ctx, out)
    else:
        _echo_check(ctx, out)
    if "failed" in probe:
        raise CommandError(f"the write probe failed: {probe['failed']}")
    if strict and warnings:
        raise CommandError(f"{len(warnings)} warning(s) about {store.url}")


def _echo_check(ctx: click.Context, out: dict[str, Any]) -> None:
    """``check``'s report as text: what ``--json`` prints, then the verdict."""
    probe, tasks, warnings = out["probe"], out["tasks"], out["warnings"]
    skew = probe.get("clock_skew")
    if "failed" in probe:
        outcome = f"FAILED ({probe['failed']})"
    elif skew is None:
        outcome = f"skipped ({probe['skipped']})"
    else:
        outcome = (
            f"ok, round trip {probe['round_trip'] * 1000:.1f} ms, clock skew "
            f"{skew:+.3f}s (+-{probe['uncertainty']:.3f}s, store minus this host)"
        )
    facts = {"store": out["store"], "write probe": outcome, **out.get("postgresql", {})}
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


@click.command(name="init-schema", cls=CeleryCommand)
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
@fails_cleanly
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
