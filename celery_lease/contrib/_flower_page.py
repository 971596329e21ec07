"""The Leases page added to Flower: every lease held, its holder and fence, and who waits for it.

Flower has no plugin interface for pages (mher/flower#986). It builds its Tornado application
from the list ``flower.urls.handlers``, whose last route is a catch-all "not found" handler, and
it reads ``flowerconfig.py`` before it builds the application. :func:`install`, called from
``flowerconfig.py``, puts one route in that list right before the catch-all, so Flower's own
``url_prefix`` rewriting applies to it as to its own pages; the handler is a subclass of
Flower's ``BaseHandler``, so the page asks for the same login (``--basic-auth``, OAuth) as
Flower's own. When the list is not what this was written against (a Flower release that
changed it), nothing is added and a warning says so: the lease fields on task pages, which use
Flower's documented ``format_task`` option, keep working.

The store is read in Flower's thread pool, never on its event loop: one ``list`` per page of
leases and one ``waiters`` read per lease shown (at most ``limit``, 200 unless asked).
"""

from __future__ import annotations

import html
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any
from urllib.parse import quote

from .._errors import LeaseConfigError, LeaseError
from .._eventlog import redact
from .._lease import LeaseInfo
from .._names import holder_task_id
from ..stores.base import MAX_LIST_LIMIT, Waiter

__all__ = ["DEFAULT_LIMIT", "PATH", "ROUTE_NAME", "Row", "collect", "install", "render"]

log = logging.getLogger(__name__)

#: The route's name in Flower's application (``reverse_url``), and how a second install finds it.
ROUTE_NAME = "celery_lease_leases"
#: Leases shown unless ``?limit=`` asks for more (at most :data:`MAX_LIMIT`).
DEFAULT_LIMIT = 200
MAX_LIMIT = 2000
#: Waiters named per resource; the rest are counted.
WAITERS_SHOWN = 10


@dataclass(frozen=True, slots=True)
class Row:
    """One lease on the page, with its resource's wait list (head first)."""

    info: LeaseInfo
    waiters: list[Waiter]


def collect(store: Any, *, prefix: str = "", limit: int = DEFAULT_LIMIT) -> tuple[list[Row], bool]:
    """Read up to ``limit`` leases under ``prefix`` and each one's wait list; return the rows,
    contended first (longest wait list first), then live before expired, by resource, and
    whether there were more leases than ``limit``."""
    leases: list[LeaseInfo] = []
    cursor: str | None = None
    while len(leases) <= limit:
        page = store.list(
            prefix=prefix, limit=min(limit + 1 - len(leases), MAX_LIST_LIMIT), cursor=cursor
        )
        leases.extend(page.leases)
        if page.cursor is None:
            break
        cursor = page.cursor
    rows = [Row(info, list(store.waiters(info.resource))) for info in leases[:limit]]
    rows.sort(key=lambda row: (-len(row.waiters), row.info.expired, row.info.resource))
    return rows, len(leases) > limit


#: The name of a task id Flower knows ("" if it saw no name), or None.
TaskLookup = Callable[[str], "str | None"]


def render(
    rows: list[Row],
    more: bool,
    *,
    store_url: str,
    read_at: datetime,
    prefix: str = "",
    limit: int = DEFAULT_LIMIT,
    task_of: TaskLookup = lambda _: None,
    base: str = "",
    static: Callable[[str], str] = lambda path: f"/static/{path}",
    error: str | None = None,
) -> str:
    """The page's HTML (every value escaped; links under ``base``, Flower's ``url_prefix``)."""
    e = html.escape
    contended = [row for row in rows if row.waiters]
    expired = [row for row in rows if row.info.expired]
    if error is not None:
        summary = f'<p class="text-danger" role="alert">{e(redact(error))}</p>'
    elif not rows:
        where = f" under {e(repr(prefix))}" if prefix else ""
        summary = f"<p>No leases are held{where}.</p>"
    else:
        parts = [_count(len(rows), "lease") + " held"]
        waiting = sum(len(row.waiters) for row in contended)
        parts.append(
            f"{len(contended)} contended ({_count(waiting, 'task')} waiting)"
            if contended
            else "none contended"
        )
        if expired:
            parts.append(f"{len(expired)} expired and never released")
        summary = f'<p class="lease-summary">{e(", ".join(parts))}.</p>'
        if more:
            summary += (
                f"<p>Showing the first {limit} (longest wait lists first among them): narrow "
                "it with a prefix, or raise the limit.</p>"
            )
    table = _table(rows, task_of, base) if rows else ""
    return _PAGE.format(
        css=e(static("css/bootstrap.min.css")),
        flower_css=e(static("css/flower.css")),
        icon=e(static("favicon.ico")),
        home=e(base or "/"),
        workers=e(f"{base}/workers"),
        tasks=e(f"{base}/tasks"),
        broker=e(f"{base}/broker"),
        leases=e(f"{base}{PATH}"),
        summary=summary,
        prefix=e(prefix),
        limit=limit,
        source=e(f"Read from {redact(store_url)} at {read_at:%Y-%m-%d %H:%M:%S} UTC"),
        table=table,
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _table(rows: list[Row], task_of: TaskLookup, base: str) -> str:
    e = html.escape
    body = []
    for row in rows:
        info = row.info
        if info.expired:
            status = '<span class="badge text-bg-danger">expired</span>'
            expiry = f"expired {-info.expires_in:.1f}s ago, never released"
        elif row.waiters:
            status = '<span class="badge text-bg-warning">contended</span>'
            expiry = f"in {info.expires_in:.1f}s"
        else:
            status = '<span class="badge text-bg-success">held</span>'
            expiry = f"in {info.expires_in:.1f}s"
        holder = _task_cell(holder_task_id(info.owner_label), info.owner_label, task_of, base)
        body.append(
            "<tr>"
            f'<td class="font-monospace">{e(info.resource)}</td>'
            f"<td>{status}</td>"
            f'<td class="lease-holder">{holder}</td>'
            f'<td class="text-end font-monospace">{info.fence}</td>'
            f'<td class="text-nowrap">{e(expiry)}</td>'
            f'<td class="text-center">{len(row.waiters) or "&mdash;"}</td>'
            f'<td class="lease-queue">{_waiters(row.waiters, task_of, base)}</td>'
            "</tr>"
        )
    return _TABLE.format(rows="\n".join(body))


def _waiters(waiters: list[Waiter], task_of: TaskLookup, base: str) -> str:
    if not waiters:
        return ""
    items = []
    for waiter in waiters[:WAITERS_SHOWN]:
        # The identity is the task id unless the task sets identity=: link it when Flower
        # knows a task by that id.
        cell = _task_cell(waiter.identity, waiter.identity, task_of, base)
        woken = ' <span class="badge text-bg-info">woken</span>' if waiter.woken else ""
        items.append(f"<li>{cell}{woken}</li>")
    more = len(waiters) - WAITERS_SHOWN
    tail = f"<li>and {more} more</li>" if more > 0 else ""
    return f'<ol class="lease-waiters">{"".join(items)}{tail}</ol>'


def _task_cell(task_id: str | None, label: str, task_of: TaskLookup, base: str) -> str:
    e = html.escape
    known = task_of(task_id) if task_id else None
    if known is None or task_id is None:
        return f'<span class="font-monospace small lease-label">{e(label)}</span>'
    name = known or "task"
    link = f"{base}/task/{quote(task_id, safe='')}"
    return (
        f'<a class="lease-label" href="{e(link)}">{e(name)}</a><br>'
        f'<span class="font-monospace small text-body-secondary lease-label">{e(label)}</span>'
    )


def flower_lookup(application: Any) -> TaskLookup:
    """Names of the tasks Flower has seen (its event state), for the page's links."""
    tasks = getattr(getattr(getattr(application, "events", None), "state", None), "tasks", None)

    def lookup(task_id: str) -> str | None:
        task = tasks.get(task_id) if tasks is not None else None
        return None if task is None else str(getattr(task, "name", None) or "")

    return lookup


#: Where the page is, under Flower's ``url_prefix``.
PATH = "/leases"


def install(app: Any = None) -> bool:
    """Add the Leases page to the routes Flower builds its application from (see the module
    docstring). Returns whether the page is there; idempotent."""
    try:
        from flower import urls
    except ImportError:
        log.warning("celery_lease: Flower is not installed; the Leases page is not added")
        return False
    handlers = getattr(urls, "handlers", None)
    if not isinstance(handlers, list) or not handlers or not _catch_all(handlers[-1]):
        log.warning(
            "celery_lease: this Flower's route list (flower.urls.handlers) does not end in its "
            "catch-all route as Flower 2.x's does; the Leases page is not added (the lease "
            "field on task pages still works)"
        )
        return False
    if any(getattr(route, "name", None) == ROUTE_NAME for route in handlers):
        return True
    from tornado.web import url

    handlers.insert(len(handlers) - 1, url(PATH, _handler_class(), {"app": app}, ROUTE_NAME))
    return True


def _catch_all(route: Any) -> bool:
    pattern = route[0] if isinstance(route, tuple) and route else None
    regex = getattr(route, "regex", None)
    if regex is not None:
        pattern = regex.pattern
    return pattern in (".*", ".*$")


def _handler_class() -> type:
    from flower.views import BaseHandler
    from tornado import web
    from tornado.ioloop import IOLoop

    class LeasesPage(BaseHandler):  # type: ignore[misc]  # (Flower ships no type hints)
        """GET: the Leases page; ``?prefix=`` narrows it, ``?limit=`` shows more."""

        def initialize(self, app: Any = None) -> None:
            self.lease_app = app

        @web.authenticated
        async def get(self) -> None:
            from .._app_stores import get_store

            prefix = self.get_query_argument("prefix", "").strip()
            try:
                limit = min(MAX_LIMIT, max(1, int(self.get_query_argument("limit", ""))))
            except ValueError:
                limit = DEFAULT_LIMIT
            app = self.lease_app or self.application.capp
            rows: list[Row] = []
            more, error, url = False, None, "the lease store"
            try:
                store = get_store(app)
                url = store.url
                rows, more = await IOLoop.current().run_in_executor(
                    None, partial(collect, store, prefix=prefix, limit=limit)
                )
            except LeaseError as exc:
                error = f"Could not read the leases: {exc}"
                self.set_status(400 if isinstance(exc, LeaseConfigError) else 503)
            url_prefix = getattr(self.application.options, "url_prefix", "") or ""
            self.write(
                render(
                    rows,
                    more,
                    store_url=url,
                    read_at=datetime.now(timezone.utc),
                    prefix=prefix,
                    limit=limit,
                    task_of=flower_lookup(self.application),
                    base="/" + url_prefix.strip("/") if url_prefix.strip("/") else "",
                    static=self.static_url,
                    error=error,
                )
            )

    return LeasesPage


_TABLE = """<section class="tasks-table-card" aria-label="Leases">
<div class="table-responsive">
<table class="table table-hover w-100 mb-0 lease-table">
<thead><tr><th>Resource</th><th>State</th><th>Holder</th><th class="text-end">Fence</th>
<th>Expires</th><th class="text-center">Waiting</th><th>Wait list (next first)</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
</div>
</section>"""

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Leases &middot; Flower</title>
<link rel="icon" href="{icon}">
<link rel="stylesheet" href="{css}">
<link rel="stylesheet" href="{flower_css}">
<style>
.lease-table td, .lease-table th {{ padding: .6rem .9rem; vertical-align: top; }}
.lease-table .lease-label {{ word-break: break-all; }}
.lease-table .lease-holder {{ max-width: 22rem; }}
.lease-table .lease-queue {{ min-width: 24rem; }}
.lease-waiters {{ margin: 0; padding-left: 1.3rem; }}
.lease-summary {{ font-size: 1.1rem; }}
.lease-filter {{ display: flex; gap: .5rem; align-items: center; margin: .5rem 0 1rem; }}
</style>
</head>
<body class="app-body">
<nav class="app-navbar navbar navbar-expand-lg" aria-label="Primary navigation">
<div class="container-fluid justify-content-start">
<a class="app-brand navbar-brand" href="{home}"><img src="{icon}" width="32" height="32"
 class="app-brand-mark" alt=""> <span>Flower</span></a>
<ul class="app-nav navbar-nav flex-row">
<li class="nav-item"><a class="nav-link" href="{workers}">Workers</a></li>
<li class="nav-item"><a class="nav-link" href="{tasks}">Tasks</a></li>
<li class="nav-item"><a class="nav-link" href="{broker}">Broker</a></li>
<li class="nav-item"><a class="nav-link active" aria-current="page" href="{leases}">Leases</a></li>
</ul>
</div>
</nav>
<main class="app-content" id="main-content">
<div class="page-section">
<header class="page-header"><div><p class="page-eyebrow">Leases</p></div></header>
{summary}
<form class="lease-filter" method="get" action="{leases}">
<input class="form-control" style="max-width: 22rem" name="prefix" value="{prefix}"
 placeholder="resource prefix, e.g. invoice:" aria-label="Resource prefix">
<input class="form-control" style="max-width: 7rem" name="limit" value="{limit}"
 aria-label="Most leases shown">
<button class="btn btn-outline-secondary" type="submit">Show</button>
</form>
{table}
<p class="small text-body-secondary mt-3">{source}. Each task's own page says whether it holds,
waits (at which place) or ended.</p>
</div>
</main>
</body>
</html>
"""
