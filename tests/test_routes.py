"""``app.conf.lease_routes``: leases for plain ``@app.task`` / ``@shared_task`` tasks by
configuration, and the mistakes in it caught when the app is finalized.

Calls here go through Celery's own ``apply()`` (eager) against a real SQLite store; the same
tasks in real workers are in ``tests/integration/test_routes.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery, Task, shared_task

from celery_lease import (
    AlreadyQueuedError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseTask,
    Owner,
    current_lease,
    install,
    lease_task,
)
from celery_lease._app import _check_settings, get_store
from celery_lease._routes import leased_tasks, match_route, route_keywords, route_problems
from tests.conftest import unique

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def make_app(tmp_path):
    """A Celery app with ``install()`` called, as the app module would, and a SQLite store."""

    def make(routes=None, **conf):
        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        install(app)
        app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
        app.conf.lease_ttl = 5
        if routes is not None:
            app.conf.lease_routes = routes
        app.conf.update(conf)
        return app

    return make


def _fence(task, *args):
    return task.apply(args=args, throw=True).get()


class TestMatching:
    """Routes match task names as Celery's task_routes does."""

    def test_an_exact_name_wins_over_an_earlier_glob(self):
        """In one mapping the exact name is looked up first, as MapRoute does."""
        conf = {"lease_routes": {"proj.*": {"resource": "a"}, "proj.charge": {"resource": "b"}}}
        assert match_route(conf, "proj.charge") == ("proj.charge", {"resource": "b"})
        assert match_route(conf, "proj.other") == ("proj.*", {"resource": "a"})
        assert match_route(conf, "other.charge") is None

    def test_the_first_mapping_of_a_list_that_matches_wins(self):
        """A list of mappings is read in order, as task_routes' list of routers is."""
        conf = {
            "lease_routes": [
                {"billing.*": {"resource": "first"}},
                {"billing.charge": {"resource": "second"}},
            ]
        }
        assert match_route(conf, "billing.charge") == ("billing.*", {"resource": "first"})

    def test_regular_expressions_and_globs(self):
        """re.Pattern keys match from the start; a glob must match the whole name."""
        conf = {
            "lease_routes": {
                re.compile(r"vendor\.(sync|push)_"): {"resource": "r"},
                "a.*.run": {"resource": "g"},
            }
        }
        assert match_route(conf, "vendor.sync_all")[0] == r"vendor\.(sync|push)_"
        assert match_route(conf, "x.vendor.sync_all") is None
        assert match_route(conf, "a.b.c.run")[0] == "a.*.run"
        assert match_route(conf, "a.b.run.later") is None

    def test_the_keywords_are_the_decorators(self):
        """The route keywords come from @lease_task itself: resource, the settings, ..."""
        known = route_keywords()
        assert {"resource", "identity", "gates", "reconcile", "ttl", "on_busy", "order"} <= known
        assert not {"app", "base", "bind", "name"} & known


class TestRoutedTask:
    """A plain task a route matches behaves as the same function under @lease_task."""

    def test_a_plain_task_runs_under_a_lease(self, make_app):
        """current_lease() works in the body, and each run's fence is higher."""
        app = make_app({"billing.ch*": {"resource": "invoice:{invoice_id}", "ttl": 7}})

        @app.task(name="billing.charge", shared=False)
        def charge(invoice_id):
            lease = current_lease()
            return [lease.resource, lease.fence, lease.ttl]

        first, second = _fence(charge, 42), _fence(charge, 42)
        assert first[0] == second[0] == "invoice:42"
        assert second[1] > first[1]
        assert first[2] == 7
        task = app.tasks["billing.charge"]
        assert isinstance(task, LeaseTask)
        assert [t for t in leased_tasks(app) if t["task"] == "billing.charge"] == [
            {
                "task": "billing.charge",
                "source": "route",
                "pattern": "billing.ch*",
                "resource": "invoice:{invoice_id}",
            }
        ]

    def test_a_route_carries_unique(self, make_app):
        """unique=, unique_key= and on_conflict= on a route lock at publish as on the decorator."""
        app = make_app(
            {
                "billing.send": {
                    "resource": "invoice:{invoice_id}",
                    "unique": "until_executed",
                    "unique_key": "{invoice_id}",
                }
            }
        )

        @app.task(name="billing.send", shared=False)
        def send(invoice_id):
            return invoice_id

        app.finalize()
        first = app.tasks["billing.send"].delay(17)
        with pytest.raises(AlreadyQueuedError) as refused:
            app.tasks["billing.send"].delay(17)
        assert (refused.value.key, refused.value.task_id) == ("unique:billing.send:17", first.id)

    def test_a_busy_resource_refuses_the_routed_task(self, make_app):
        """Exclusion: while another owner holds the resource, the routed body does not run."""
        app = make_app({"billing.charge": {"resource": "invoice:{invoice_id}"}})
        ran = []

        @app.task(name="billing.charge", shared=False)
        def charge(invoice_id):
            ran.append(invoice_id)

        store = get_store(app)
        held = store.acquire("invoice:7", Owner.new("someone else"), 30)
        try:
            with pytest.raises(LeaseBusyError, match="invoice:7"):
                charge.apply(args=(7,), throw=True)
        finally:
            store.release(held)
        assert ran == []
        charge.apply(args=(7,), throw=True)
        assert ran == [7]

    def test_negative_control_without_the_route_the_body_runs_while_held(self, make_app):
        """Without the route the same task is plain: it runs though the resource is held."""
        app = make_app({"other.*": {"resource": "x"}})
        ran = []

        @app.task(name="billing.charge", shared=False)
        def charge(invoice_id):
            ran.append(invoice_id)

        store = get_store(app)
        held = store.acquire("invoice:7", Owner.new("someone else"), 30)
        try:
            charge.apply(args=(7,), throw=True)
        finally:
            store.release(held)
        assert ran == [7]
        assert not isinstance(app.tasks["billing.charge"], LeaseTask)
        assert LeaseTask not in type(app.tasks["billing.charge"]).__mro__

    def test_a_shared_task_is_routed_in_the_app_that_routes_it(self, make_app):
        """@shared_task: leased in the app with the route, plain in another app."""
        name = unique("vendor.sync")

        @shared_task(name=name)
        def sync(account):
            return current_lease().resource

        routed = make_app({"vendor.*": {"resource": "account-{account}"}})
        plain = make_app()
        routed.finalize()
        plain.finalize()
        assert routed.tasks[name].apply(args=("a1",), throw=True).get() == "account-a1"
        assert isinstance(routed.tasks[name], LeaseTask)
        assert not isinstance(plain.tasks[name], LeaseTask)

    def test_a_bound_task_and_its_base_call_wrap_the_lease(self, make_app):
        """bind=True and a base class with its own __call__: the base's __call__ runs around
        the lease, as around Task.__call__; the lease is held inside the body."""
        seen = []

        class Traced(Task):
            def __call__(self, *args, **kwargs):
                seen.append("base in")
                try:
                    return super().__call__(*args, **kwargs)
                finally:
                    seen.append("base out")

        app = make_app({"jobs.*": {"resource": "job-{job}"}})

        @app.task(name="jobs.run", bind=True, base=Traced, shared=False)
        def run(self, job):
            seen.append(("body", self.request.lease.resource, current_lease().fence > 0))

        run.apply(args=("j",), throw=True)
        assert seen == ["base in", ("body", "job-j", True), "base out"]

    def test_an_annotation_wrapping_call_wraps_the_leased_call(self, make_app):
        """A user's '@__call__' annotation (applied after the route) wraps the lease's
        __call__: the body still runs under the lease."""
        seen = []

        def around(call):
            def wrapped(self, *args, **kwargs):
                seen.append("around")
                return call(self, *args, **kwargs)

            return wrapped

        app = make_app(
            {"jobs.*": {"resource": "job-{job}"}},
            task_annotations={"jobs.run": {"@__call__": around, "rate_limit": "5/s"}},
        )

        @app.task(name="jobs.run", shared=False)
        def run(job):
            seen.append(current_lease().resource)

        run.apply(args=("j",), throw=True)
        assert seen == ["around", "job-j"]
        assert app.tasks["jobs.run"].rate_limit == "5/s"

    def test_tasks_bound_before_install_are_routed(self, tmp_path):
        """install() after the app was finalized routes the tasks bound already."""
        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
        app.conf.lease_routes = {"late.*": {"resource": "r-{n}"}}

        @app.task(name="late.job", shared=False)
        def job(n):
            return current_lease().resource

        app.finalize()  # (another test module's shared lease task may have installed it)
        install(app)
        assert job.apply(args=(3,), throw=True).get() == "r-3"

    def test_annotations_cached_before_install_are_read_again(self, tmp_path):
        """Celery caches the prepared task_annotations at the first bind: install() after that
        (a @lease_task bound first installs it mid-finalize) still routes the later tasks."""
        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
        app.conf.lease_routes = {"late.*": {"resource": "r-{n}"}}
        assert app.annotations == ()  # cached without the entry
        install(app)

        @app.task(name="late.job", shared=False)
        def job(n):
            return current_lease().resource

        assert job.apply(args=(4,), throw=True).get() == "r-4"


class TestFinalizeChecks:
    """Mistakes in lease_routes raise from app.finalize() and at worker start."""

    def test_an_unknown_keyword_names_the_task_the_pattern_and_the_fix(self, make_app):
        """A typo (tll) is refused with a suggestion, from app.finalize() itself."""
        app = make_app({"billing.*": {"resource": "r", "tll": 30}})

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        with pytest.raises(LeaseConfigError) as caught:
            app.finalize()
        message = str(caught.value)
        assert "'billing.*'" in message and "'billing.charge'" in message
        assert "did you mean 'ttl'" in message and "lease_routes['billing.*']" in message

    def test_a_celery_option_points_to_task_annotations(self, make_app):
        """acks_late is Celery's: the error says to set it where Celery reads it."""
        app = make_app({"billing.*": {"resource": "r", "bind": True}})

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        with pytest.raises(LeaseConfigError, match="task_annotations"):
            app.finalize()

    def test_a_template_naming_a_missing_argument_is_refused(self, make_app):
        """resource='invoice:{invoice}' on a task taking invoice_id: named with the route."""
        app = make_app({"billing.*": {"resource": "invoice:{invoice}"}})

        @app.task(name="billing.charge", shared=False)
        def charge(invoice_id):
            pass

        with pytest.raises(LeaseConfigError) as caught:
            app.finalize()
        message = str(caught.value)
        assert "'billing.*'" in message and "'billing.charge'" in message
        assert "'invoice'" in message and "invoice_id" in message
        assert "narrow the pattern" in message

    def test_a_bad_setting_value_is_refused(self, make_app):
        """ttl=-1 fails at finalize, naming the route."""
        app = make_app({"billing.*": {"resource": "r", "ttl": -1}})

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        with pytest.raises(LeaseConfigError, match=r"'billing\.\*'.*lease_ttl=-1"):
            app.finalize()

    def test_a_route_without_a_resource_is_refused(self, make_app):
        """A route must say what the lease is on."""
        app = make_app({"billing.*": {"ttl": 5}})

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        with pytest.raises(LeaseConfigError, match="needs resource="):
            app.finalize()

    def test_a_lease_task_matching_a_route_is_refused(self, make_app):
        """No double lease: @lease_task plus a route matching it is an error."""
        app = make_app({"billing.*": {"resource": "r"}})

        @lease_task(app=app, name="billing.charge", resource="invoice", shared=False)
        def charge():
            pass

        with pytest.raises(LeaseConfigError, match="lease task already"):
            app.finalize()

    def test_a_class_based_task_is_refused(self, make_app):
        """A class-based task's class is the user's: derive it from LeaseTask instead."""
        app = make_app({"billing.*": {"resource": "r"}})

        class Charge(Task):
            name = "billing.charge"

            def run(self):
                pass

        with pytest.raises(LeaseConfigError, match="class-based task"):
            app.register_task(Charge())

    def test_lease_routes_of_the_wrong_type_is_refused(self, make_app):
        """A string is neither a mapping nor a list of mappings."""
        app = make_app("billing.*")

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        with pytest.raises(LeaseConfigError, match="must be a mapping"):
            app.finalize()

    def test_a_pattern_matching_no_task_is_a_warning(self, make_app, caplog):
        """A route for no task is reported at finalize and at worker start, naming it."""
        app = make_app({"billing.*": {"resource": "r"}, "biling.refund": {"resource": "r"}})

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        with caplog.at_level(logging.WARNING, logger="celery_lease._routes"):
            app.finalize()
        assert "'biling.refund' matches no registered task" in caplog.text
        assert "billing.*" not in caplog.text
        assert route_problems(app) == [
            problem for problem in route_problems(app) if "'biling.refund'" in problem
        ]
        assert len(route_problems(app)) == 1

    def test_a_route_lost_with_the_annotations_stops_the_worker(self, make_app):
        """task_annotations replaced after install(): the worker's start check refuses to run
        the matched task without its lease; with the annotations kept, it passes."""
        app = make_app({"billing.*": {"resource": "r"}})
        assert app.conf.lease_ttl == 5  # (configured: the entry is in place now)
        app.conf.task_annotations = {"billing.charge": {"rate_limit": "1/s"}}  # replaced

        @app.task(name="billing.charge", shared=False)
        def charge():
            pass

        app.finalize()
        assert not isinstance(app.tasks["billing.charge"], LeaseTask)
        with pytest.raises(LeaseConfigError, match="was not leased"):
            _check_settings(app)  # what the worker bootstep runs at start

        kept = make_app({"billing.*": {"resource": "r"}})

        @kept.task(name="billing.charge", shared=False)
        def charge_kept():
            pass

        kept.finalize()
        _check_settings(kept)
        assert isinstance(kept.tasks["billing.charge"], LeaseTask)


class TestCheckCommand:
    """``celery -A proj lease check`` lists the lease tasks and where each lease comes from."""

    def test_decorator_and_route_sources(self, make_app):
        """leased_tasks() tells a @lease_task from a routed task, with its pattern."""
        app = make_app({"jobs.*": {"resource": "job-{job}"}})

        @app.task(name="jobs.run", shared=False)
        def run(job):
            pass

        @lease_task(app=app, name="billing.charge", resource="invoice", shared=False)
        def charge():
            pass

        app.finalize()
        mine = {"billing.charge", "jobs.run"}
        assert [
            (t["task"], t["source"], t["pattern"]) for t in leased_tasks(app) if t["task"] in mine
        ] == [
            ("billing.charge", "decorator", None),
            ("jobs.run", "route", "jobs.*"),
        ]

    def test_the_command_lists_routed_tasks_and_warns_of_unmatched_routes(self, tmp_path):
        """The routes app of the integration tests, checked from the command line."""
        routes = {
            "tests.integration.routed_tasks.*": {"resource": "res-{n}"},
            "tests.routed_pkg.*": {"resource": "account-{account}"},
            "nothing.here": {"resource": "x"},
        }
        env = {
            **os.environ,
            "CL_STORE": f"sqlite:///{tmp_path}/leases.db",
            "CL_ROUTES": json.dumps(routes),
            "PYTHONPATH": str(ROOT),
        }
        command = [sys.executable, "-m", "celery", "-A", "tests.integration.routes_app"]
        done = subprocess.run(
            [*command, "lease", "check", "--json"],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert {(t["task"], t["source"], t["pattern"]) for t in report["tasks"]} == {
            ("tests.integration.routed_tasks.hold", "route", "tests.integration.routed_tasks.*"),
            ("tests.routed_pkg.tasks.sync_account", "route", "tests.routed_pkg.*"),
        }
        assert any("'nothing.here' matches no registered task" in w for w in report["warnings"])
        text = subprocess.run(
            [*command, "lease", "check"],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert "route 'tests.routed_pkg.*', resource 'account-{account}'" in text

    def test_a_bad_route_fails_the_command(self, tmp_path):
        """A route naming an argument the task does not take: exit 2, the error named."""
        env = {
            **os.environ,
            "CL_STORE": f"sqlite:///{tmp_path}/leases.db",
            "CL_ROUTES": json.dumps({"tests.routed_pkg.*": {"resource": "account-{acount}"}}),
            "PYTHONPATH": str(ROOT),
        }
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.integration.routes_app",
                "lease",
                "check",
            ],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert "'tests.routed_pkg.*'" in done.stderr and "did you mean 'account'" in done.stderr
