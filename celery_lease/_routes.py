"""``app.conf.lease_routes``: leases for tasks whose code says nothing of them.

A route maps a task name or glob pattern (matched as Celery matches ``task_routes``: exact
names first, then ``*`` globs and ``re.Pattern`` keys in order; a list of such mappings, the
first that matches wins) to the keywords ``@lease_task`` takes, e.g.
``{"billing.tasks.*": {"resource": "invoice:{invoice_id}"}}`` (docs/tasks.md).

How a plain ``@app.task`` / ``@shared_task`` becomes a lease task, and why this way:

* ``install(app)`` puts one entry first in ``task_annotations`` (Celery's own way to configure
  tasks one does not edit). Celery asks it about each task class when the class is first bound
  to the app (as the task is registered, or when the app is finalized), before the other
  annotations and before the class's ``on_bound``.
* For a task a route matches, the entry makes the task's class a ``LeaseTask``: it inserts
  ``LeaseTask`` among the bases of that class, before ``celery.Task`` (the class Celery made
  for this one function, in this one app: nothing else derives from it), and sets the
  attributes ``@lease_task`` would have set (:func:`_task.lease_attributes`, the decorator's
  own code). The result is the class ``@lease_task`` makes, so every path is the decorator's:
  ``LeaseTask.__call__`` claims before the body, ``apply_async``, ``on_bound`` (registration,
  checks) and every ``isinstance(task, LeaseTask)`` (worker start, Flower, the CLI). A base
  class's own ``__call__`` runs around the lease, as it would around ``Task.__call__``, and the
  task's other annotations (applied after this entry) wrap the lease's methods, not
  ``Task``'s. Making a subclass and swapping the instance's class instead was the other way:
  but Celery applies the other annotations to the original class after this entry, so an
  ``@__call__`` annotation there would sit before ``LeaseTask.__call__`` in the subclass's
  MRO and run the body without a lease.
* Errors raise from the binding itself (so from ``app.finalize()`` and at worker start), never
  from a signal, which Celery logs and swallows. Celery skips an annotation whose
  ``annotate`` raises ``AttributeError``: the entry turns any into a ``LeaseConfigError``.

Class-based tasks (``app.register_task(SomeTask())``) are refused: their class is the user's,
shared by its subclasses, so changing its bases would lease tasks no route names.
"""

from __future__ import annotations

import fnmatch
import inspect
import logging
import re
from collections.abc import Mapping
from typing import Any

from celery import Task

from ._app import on_check, on_install
from ._errors import LeaseConfigError
from ._gates import check_gates
from ._names import did_you_mean, show_value
from ._settings import LeaseSettings
from ._setup import check_templates, run_signature
from ._task import CELERY_DECORATOR_OPTIONS, SETTING_NAMES, LeaseTask, lease_attributes, lease_task

__all__ = [
    "ROUTE_ATTRIBUTE",
    "LeaseRoutes",
    "leased_tasks",
    "match_route",
    "route_keywords",
    "route_problems",
]

log = logging.getLogger(__name__)

#: The class attribute a routed task's class gets: the route's pattern, as written.
ROUTE_ATTRIBUTE = "_lease_route"
#: Keywords of ``@lease_task`` a route cannot carry: they choose the app and class itself.
_NOT_ROUTED = frozenset({"app", "base"})
_CONF_KEY = "lease_routes"


def route_keywords() -> frozenset[str]:
    """The keywords a route may carry: those of ``@lease_task`` (its keyword-only parameters,
    the lease settings, and the public data attributes ``LeaseTask`` adds to ``Task``), read
    from the decorator and the class, so a keyword added there is accepted here too."""
    named = {
        name
        for name, param in inspect.signature(lease_task).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    }
    added = {
        name
        for klass in LeaseTask.__mro__[: LeaseTask.__mro__.index(Task)]
        for name, value in vars(klass).items()
        if not name.startswith(("_", "lease_"))
        and not callable(value)
        and not isinstance(value, (staticmethod, classmethod, property))
    }
    return frozenset((named - _NOT_ROUTED) | set(SETTING_NAMES) | added)


def _route_maps(conf: Any) -> list[Mapping[Any, Any]]:
    routes = conf.get(_CONF_KEY)
    if not routes:
        return []
    if isinstance(routes, Mapping):
        return [routes]
    if isinstance(routes, (list, tuple)) and all(isinstance(m, Mapping) for m in routes):
        return list(routes)
    raise LeaseConfigError(
        f"app.conf.lease_routes={show_value(routes)} must be a mapping of task name or glob "
        "pattern -> @lease_task keywords, or a list of such mappings (the first that matches "
        "wins), as task_routes is"
    )


def _label(key: Any) -> str:
    return key.pattern if isinstance(key, re.Pattern) else str(key)


def _matches(key: Any, name: str) -> bool:
    if isinstance(key, re.Pattern):
        return key.match(name) is not None
    if isinstance(key, str) and "*" in key:  # (as celery.app.routes.MapRoute)
        return re.match(fnmatch.translate(key), name) is not None
    return False


def match_route(conf: Any, name: str) -> tuple[str, Any] | None:
    """The route for task ``name`` in ``conf.lease_routes``: ``(pattern, keywords)``, or None.

    As ``task_routes`` matches: in each mapping an exact name first, then the ``*`` globs and
    ``re.Pattern`` keys in their order; the first mapping that matches wins.

    Raises:
        LeaseConfigError: ``lease_routes`` is neither a mapping nor a list of mappings.
    """
    for routes in _route_maps(conf):
        if name in routes:  # (a task name holds no "*": never a glob)
            return name, routes[name]
        for key, keywords in routes.items():
            if _matches(key, name):
                return _label(key), keywords
    return None


def _where(pattern: str, name: str) -> str:
    return f"lease_routes {pattern!r} matches task {name!r}"


def _route_attributes(pattern: str, name: str, keywords: Any) -> dict[str, Any]:
    """The class attributes the route gives task ``name``, as ``@lease_task`` would."""
    where = _where(pattern, name)
    if not isinstance(keywords, Mapping):
        raise LeaseConfigError(
            f"{where}, whose value {show_value(keywords)} is not a mapping of @lease_task "
            f"keywords: write {{{pattern!r}: {{'resource': 'name:{{arg}}', 'ttl': 60}}}}"
        )
    known = route_keywords()
    for key in keywords:
        if key in known:
            continue
        hint = (
            "; it is a Celery task option: set it with task_annotations (Celery's own "
            "per-task configuration) or task_routes"
            if isinstance(key, str) and (key in CELERY_DECORATOR_OPTIONS or hasattr(Task, key))
            else did_you_mean(str(key), known)
        )
        raise LeaseConfigError(
            f"{where}, but {key!r} is not a keyword a route takes{hint}. A route takes "
            f"{', '.join(sorted(known))}: fix the key in app.conf.lease_routes[{pattern!r}]"
        )
    given = dict(keywords)
    explicit = {k: given.pop(k) for k in list(given) if k in _LEASE_TASK_NAMED}
    try:
        attrs = lease_attributes(LeaseTask, options=given, **explicit)
    except LeaseConfigError as exc:
        raise LeaseConfigError(f"{where}: {exc} (fix app.conf.lease_routes[{pattern!r}])") from None
    return {**attrs, **given}  # (what is left of given: attributes LeaseTask adds to Task)


_LEASE_TASK_NAMED = frozenset(
    name
    for name, param in inspect.signature(lease_attributes).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY and name != "options"
)


def _check_route(cls: type, app: Any, pattern: str, attrs: dict[str, Any]) -> None:
    """What ``LeaseTask.on_bound`` will check, checked first, with the route in the message."""
    name = cls.name  # type: ignore[attr-defined]
    overrides = {n: attrs.get(f"lease_{n}") for n in SETTING_NAMES}
    try:
        LeaseSettings.resolve(app.conf, overrides)
        signature = run_signature(cls)
        if signature is not None:
            check_templates(
                {what: attrs.get(f"lease_{what}") for what in ("resource", "identity")},
                signature,
                name,
            )
            check_gates(attrs.get("lease_gates"), signature, name)
    except LeaseConfigError as exc:
        raise LeaseConfigError(
            f"{_where(pattern, name)}: {exc}. Fix the route in app.conf.lease_routes"
            f"[{pattern!r}] (or narrow the pattern so that it does not match this task)"
        ) from None


def _lease_bases(bases: tuple[type, ...]) -> tuple[type, ...]:
    """``bases`` with ``LeaseTask`` inserted before ``celery.Task`` (or last): after the
    task's own bases, whose methods then wrap the lease's, as they wrap ``Task``'s."""
    listed = list(bases)
    listed.insert(listed.index(Task) if Task in listed else len(listed), LeaseTask)
    return tuple(listed)


def apply_route(cls: type, app: Any) -> bool:
    """Make task class ``cls`` a lease task if a route of ``app`` matches it (see the module
    docstring). Returns whether one did.

    Raises:
        LeaseConfigError: the route is bad for this task, or the task is a lease task already
            or a class-based task.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str):
        return False
    found = match_route(app.conf, name)
    if found is None:
        return False
    pattern, keywords = found
    where = _where(pattern, name)
    if issubclass(cls, LeaseTask):
        if vars(cls).get(ROUTE_ATTRIBUTE) == pattern:
            return True  # (routed already: install() after this task was bound)
        raise LeaseConfigError(
            f"{where}, which is a lease task already (@lease_task or a LeaseTask class): a "
            "route would lease it a second time. Remove the route, or narrow the pattern so "
            "that it leaves this task out"
        )
    if not vars(cls).get("_decorated"):
        raise LeaseConfigError(
            f"{where}, a class-based task: lease_routes leases tasks made by @app.task or "
            "@shared_task. Derive its class from celery_lease.LeaseTask instead, or narrow "
            "the pattern so that it leaves this task out"
        )
    attrs = _route_attributes(pattern, name, keywords)
    _check_route(cls, app, pattern, attrs)
    cls.__bases__ = _lease_bases(cls.__bases__)
    for key, value in attrs.items():
        setattr(cls, key, value)
    setattr(cls, ROUTE_ATTRIBUTE, pattern)
    return True


class LeaseRoutes:
    """The ``task_annotations`` entry ``install(app)`` puts first: applies ``lease_routes``.

    Returns None for every task, so that Celery goes on to the user's own annotations
    (Celery applies only the first entry that returns something).
    """

    def annotate(self, task: type) -> None:
        app = getattr(task, "_app", None)
        if app is None:
            return
        try:
            apply_route(task, app)
        except AttributeError as exc:  # Celery's firstmethod would skip this entry silently
            raise LeaseConfigError(
                f"lease_routes could not be applied to task {getattr(task, 'name', task)!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def __repr__(self) -> str:
        return "<celery_lease lease_routes>"


def _first_annotation(app: Any, conf: Any, entry: LeaseRoutes) -> None:
    """Put ``entry`` first in ``conf``'s ``task_annotations`` (keeping the others)."""
    # Celery caches the prepared task_annotations at the first bind (app.annotations, a
    # cached_property): forget a copy made without the entry, so the next bind reads the conf.
    cached = vars(app).get("annotations")
    if cached is not None and not any(isinstance(a, LeaseRoutes) for a in cached):
        del vars(app)["annotations"]
    current = conf.get("task_annotations")
    if current is None:
        listed: list[Any] = []
    elif isinstance(current, (list, tuple)):
        listed = list(current)
    else:
        listed = [current]
    listed = [a for a in listed if not isinstance(a, LeaseRoutes)]
    conf["task_annotations"] = [entry, *listed]


def install_routes(app: Any) -> None:
    """Put the lease_routes entry first in ``app``'s ``task_annotations``, now if the app is
    configured and each time its configuration is (re)loaded; route the tasks bound already."""
    entry = LeaseRoutes()

    def configured(source: Any = None, **_: Any) -> None:
        _first_annotation(app, source, entry)

    app.on_after_configure.connect(configured, weak=False)
    app.on_after_finalize.connect(_warn_unmatched, weak=False)
    if not app.configured:
        return
    _first_annotation(app, app.conf, entry)
    for task in list(app._tasks.values()):  # bound before install(): route them now
        cls = type(task)
        if getattr(cls, "__bound__", False) and apply_route(cls, app):
            cls.on_bound(app)


def _warn_unmatched(sender: Any = None, **_: Any) -> None:
    # (a signal: Celery logs what a receiver raises; this only warns)
    for pattern in route_problems(sender, check=False):
        log.warning("celery_lease: %s", pattern)


def route_problems(app: Any, *, check: bool = True) -> list[str]:
    """Warnings about ``app``'s routes: each pattern that matches no registered task.

    With ``check`` (at worker start), also raise for a task a route matches whose class is not
    routed: ``install(app)`` came too late for it, or ``task_annotations`` was replaced after
    it (the route would silently not apply).

    Raises:
        LeaseConfigError: as above, or a bad route.
    """
    maps = _route_maps(app.conf)
    if not maps:
        return []
    names = [name for name in list(app.tasks) if isinstance(name, str)]
    warnings = []
    for routes in maps:
        for key in routes:
            label = _label(key)
            if not any(name == key or _matches(key, name) for name in names):
                warnings.append(
                    f"lease_routes {label!r} matches no registered task: check the name (the "
                    "task's full name, e.g. 'proj.tasks.charge'), or that its module is imported "
                    "by the worker (imports / include / autodiscover_tasks)"
                )
    if check:
        for name in names:
            found = match_route(app.conf, name)
            if found is None:
                continue
            cls = type(app.tasks[name])
            if vars(cls).get(ROUTE_ATTRIBUTE) != found[0] and not issubclass(cls, LeaseTask):
                raise LeaseConfigError(
                    f"{_where(found[0], name)} but it was not leased: call "
                    "celery_lease.install(app) in the module that creates the app, before its "
                    "tasks are bound, and keep celery_lease's entry in task_annotations (set "
                    "task_annotations before install(), not after)"
                )
    return warnings


def leased_tasks(app: Any) -> list[dict[str, Any]]:
    """Each lease task of ``app``: its name, where its lease comes from (``decorator`` or
    ``route``, with the pattern) and its resource template (for ``lease check``)."""
    out = []
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, LeaseTask):
            continue
        pattern = vars(type(task)).get(ROUTE_ATTRIBUTE)
        if pattern is not None:
            source = "route"
        else:
            source = "decorator" if vars(type(task)).get("_decorated") else "class"
        resource = inspect.getattr_static(task, "lease_resource", None)
        out.append(
            {
                "task": name,
                "source": source,
                "pattern": pattern,
                "resource": resource if isinstance(resource, str) else show_value(resource),
            }
        )
    return out


on_install(install_routes)
on_check(route_problems)
