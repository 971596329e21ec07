"""Configuration mistakes a new user makes, caught where they are made.

Typos in settings, keywords and class attributes; templates naming arguments the function does
not have; settings that cannot work together. Each is a ``LeaseConfigError`` that names the
value and the fix, raised when the task is defined or the worker starts, not at run time.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LeaseTask, current_lease, lease_task
from celery_lease._settings import LeaseSettings
from tests.conftest import unique


@pytest.fixture
def app(tmp_path):
    """A Celery app whose leases live in a real SQLite store."""
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
    app.conf.lease_ttl = 5
    return app


class TestTypos:
    def test_a_misspelt_decorator_keyword_is_refused_with_a_suggestion(self, app):
        """@lease_task(tll=30) does not run with the 60 s default: it names ttl."""
        with pytest.raises(LeaseConfigError, match=r"unknown keyword 'tll' \(did you mean 'ttl'"):

            @lease_task(app=app, resource="r", tll=30)
            def task():
                pass

    def test_a_misspelt_app_setting_is_refused_with_a_suggestion(self, app):
        """app.conf.lease_tll = 5 stops the task before it claims anything."""
        app.conf.lease_tll = 5
        ran = []

        @lease_task(app=app, resource="r")
        def task():
            ran.append(1)

        with pytest.raises(LeaseConfigError, match=r"lease_tll \(did you mean 'lease_ttl'\?\)"):
            task.apply(throw=True)
        with pytest.raises(LeaseConfigError, match="lease_tll"):
            LeaseSettings.resolve(app.conf)  # what the worker bootstep checks at start
        assert ran == []

    def test_a_misspelt_namespaced_setting_is_refused(self, tmp_path):
        """Django-style CELERY_LEASE_TLL (found in review: it ran with the 60 s default)."""

        class Config:
            CELERY_LEASE_STORE_URL = f"sqlite:///{tmp_path}/leases.db"
            CELERY_LEASE_TLL = 5

        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        app.config_from_object(Config, namespace="CELERY")
        with pytest.raises(LeaseConfigError, match=r"CELERY_LEASE_TLL \(did you mean 'lease_ttl'"):
            LeaseSettings.resolve(app.conf)
        Config.CELERY_LEASE_TLL, Config.CELERY_LEASE_TTL = None, 5  # control: the right name
        del Config.CELERY_LEASE_TLL
        app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
        app.config_from_object(Config, namespace="CELERY")
        assert LeaseSettings.resolve(app.conf).ttl == 5

    def test_a_misspelt_class_attribute_is_refused_with_a_suggestion(self):
        """class T(LeaseTask): lease_tll = 5 fails where the class is written."""
        with pytest.raises(LeaseConfigError, match=r"lease_tll \(did you mean 'lease_ttl'\?\)"):

            class Billing(LeaseTask):
                lease_resource = "invoice:{invoice_id}"
                lease_tll = 5

    def test_a_misspelt_store_option_is_refused_with_a_suggestion(self, app):
        """lease_store_options={"retension": ...} is a LeaseConfigError, not a bare TypeError."""
        app.conf.lease_store_options = {"retension": 3600.0}

        @lease_task(app=app, resource="r")
        def task():
            pass

        with pytest.raises(
            LeaseConfigError, match=r"no option 'retension' \(did you mean 'retention'\?\)"
        ):
            task.apply(throw=True)

    def test_celery_task_options_keep_working(self, app):
        """bind, name, autoretry_for, retry_backoff, queue and Task attributes pass through."""
        name = unique("t")

        @lease_task(
            app=app,
            resource="r-{n}",
            bind=True,
            name=name,
            autoretry_for=(KeyError,),
            retry_backoff=True,
            retry_jitter=False,
            max_retries=3,
            acks_late=True,
            queue="leased",
            rate_limit="100/s",
            serializer="json",
            ttl=7,
        )
        def task(self, n):
            return (self.name, current_lease().resource, current_lease().ttl)

        assert task.apply((4,)).get() == (name, "r-4", 7.0)
        assert (task.acks_late, task.max_retries, task.queue) == (True, 3, "leased")
        assert task.autoretry_for == (KeyError,)

    def test_own_attributes_go_on_a_base_class(self, app):
        """A custom attribute declared on a LeaseTask subclass is accepted as a keyword, and
        methods named lease_* on a subclass are not mistaken for settings."""

        class Audited(LeaseTask):
            audit_channel = "default"

            def lease_report(self):
                return f"{self.name} on {self.audit_channel}"

        @lease_task(app=app, resource="r", base=Audited, audit_channel="billing", bind=True)
        def task(self):
            return self.lease_report()

        assert task.apply().get().endswith("on billing")


class TestEverySettingHasAPerTaskTwin:
    def test_each_setting_is_a_class_attribute_and_a_keyword(self, app):
        """Every lease_* setting overrides per task (the docs found handoff=True refused)."""
        for name, value in (("handoff", False), ("dedup", False), ("retention", 10**7)):

            @lease_task(app=app, resource="r", name=f"twin_{name}", **{name: value})
            def task():
                return current_lease().fence

            assert getattr(task.lease_settings, name) == value

            attrs = {"lease_resource": "r", f"lease_{name}": value}
            own = type("Own", (LeaseTask,), attrs)  # what `class Own(LeaseTask): ...` runs

            @lease_task(app=app, base=own, name=f"based_{name}")
            def based():
                return None

            assert getattr(based.lease_settings, name) == value
        fields = LeaseSettings.__dataclass_fields__
        assert [n for n in fields if not hasattr(LeaseTask, f"lease_{n}")] == []


class TestDefinitionTime:
    def test_a_template_naming_a_missing_parameter_fails_at_definition(self, app):
        """resource="acct-{acount_id}" over def f(account_id) is refused at once, with a
        suggestion; before, every run ended FAILURE."""
        with pytest.raises(
            LeaseConfigError, match=r"names 'acount_id' \(did you mean 'account_id'\?\)"
        ):

            @lease_task(app=app, resource="acct-{acount_id}")
            def task(account_id):
                pass

    def test_an_identity_template_is_checked_too(self, app):
        with pytest.raises(LeaseConfigError, match=r"identity template 'inv:\{invoice\}'"):

            @lease_task(app=app, resource="r", identity="inv:{invoice}")
            def task(invoice_id):
                pass

    def test_bound_tasks_attributes_and_var_keywords_are_accepted(self, app):
        """bind=True drops self; {obj.attr} checks the argument; **kwargs may hold anything."""

        @lease_task(app=app, resource="acct-{account.id}", bind=True)
        def bound(self, account):
            return current_lease().resource

        @lease_task(app=app, resource="opt-{region}")
        def loose(**options):
            return current_lease().resource

        assert bound.apply((type("A", (), {"id": 3})(),)).get() == "acct-3"
        assert loose.apply(kwargs={"region": "eu"}).get() == "opt-eu"

    def test_a_lease_task_subclass_template_is_checked_when_bound(self, app):
        """class-based tasks: the template is checked when the task is bound to the app."""

        class Billing(LeaseTask):
            lease_resource = "invoice:{invoice_id}"

        with pytest.raises(LeaseConfigError, match="names 'invoice_id'"):

            @app.task(base=Billing, lazy=False, shared=False)  # created and bound at once
            def charge(invoice):
                pass

    @pytest.mark.parametrize(
        ("options", "smallest"),
        [
            ({"ttl": 0.01}, "0.48s"),  # the defaults: interval ttl/3, margin ttl/4
            ({"ttl": 0.3, "renew_interval": 0.05}, "0.334s"),
            ({"ttl": 0.5, "renew_interval": 0.1, "self_fence_margin": 0.25}, "0.55s"),
        ],
    )
    def test_a_ttl_too_short_to_renew_is_refused_with_the_smallest_allowed(
        self, app, options, smallest
    ):
        """The error names the smallest ttl that leaves a store call's timeout for a renewal."""
        with pytest.raises(LeaseConfigError, match="too short to renew safely") as caught:

            @lease_task(app=app, resource="r", **options)
            def task():
                pass

        message = str(caught.value)
        assert message.endswith(f"is {smallest}"), message
        assert "0.2s a store call may take" in message

    def test_the_smallest_ttl_is_accepted(self, app):
        """Exactly at the bound the settings resolve; just below they do not."""
        assert LeaseSettings.resolve(None, {"ttl": 0.48}).ttl == 0.48
        with pytest.raises(LeaseConfigError, match=r"0\.48s"):
            LeaseSettings.resolve(None, {"ttl": 0.47})
        app.conf.lease_ttl = 0.01
        with pytest.raises(LeaseConfigError, match="too short"):
            LeaseSettings.resolve(app.conf)


class TestRetention:
    def test_retention_shorter_than_a_run_is_refused_at_definition(self, app):
        """retention=3000 with max_runtime=3600: the records could expire mid-run."""
        with pytest.raises(LeaseConfigError) as caught:

            @lease_task(app=app, resource="r", retention=3000, max_runtime=3600)
            def task():
                pass

        message = str(caught.value)
        assert "lease_retention=3000" in message
        assert "lease_max_runtime=3600" in message

    def test_an_app_retention_shorter_than_the_default_runtime_is_refused(self, app):
        """app.conf.lease_retention = 3600 against the default max_runtime (3600) and the
        app's ttl (5): refused before anything is claimed, naming both values."""
        app.conf.lease_retention = 3600
        ran = []

        @lease_task(app=app, resource="r")
        def task():
            ran.append(1)

        with pytest.raises(
            LeaseConfigError, match=r"lease_retention=3600 .* lease_max_runtime=3600 \+"
        ):
            task.apply(throw=True)
        with pytest.raises(LeaseConfigError, match="lease_retention=3600"):
            LeaseSettings.resolve(app.conf)  # what the worker bootstep checks at start
        assert ran == []

    def test_the_broker_visibility_timeout_counts(self, app):
        """A redelivery may come only after the visibility timeout: it is part of the bound."""
        app.conf.broker_transport_options = {"visibility_timeout": 43200}
        app.conf.lease_max_runtime = 600
        needed = 600 + 5 + 43200
        app.conf.lease_retention = needed - 1
        with pytest.raises(LeaseConfigError, match=f"at least {needed}"):
            LeaseSettings.resolve(app.conf)
        app.conf.lease_retention = needed
        assert LeaseSettings.resolve(app.conf).retention == needed

    def test_at_least_an_hour_is_allowed_for_redelivery(self, app):
        """Without a visibility timeout: max_runtime + ttl + 3600 is the bound, inclusive."""
        app.conf.lease_max_runtime = 600
        app.conf.lease_retention = 600 + 5 + 3600
        assert LeaseSettings.resolve(app.conf).retention == 4205
        app.conf.lease_store_options = {"retention": 4204.0}  # the store's own wins: checked
        with pytest.raises(LeaseConfigError, match="lease_retention=4204"):
            LeaseSettings.resolve(app.conf)

    def test_the_defaults_pass(self, app):
        settings = LeaseSettings.resolve(app.conf)
        assert settings.retention >= settings.max_runtime + settings.ttl + 3600


class TestRenderTime:
    """What a template says for one call's arguments (the plain-names fast path included)."""

    @pytest.fixture
    def task(self, app):
        @lease_task(app=app, resource="acct-{account_id:0>4}-{region}")
        def task(account_id, region="eu"):
            pass

        return task

    def test_plain_names_render_with_defaults_and_format_specs(self, task):
        """Positional, keyword and default arguments all reach the name."""
        assert task.lease_resource_for((7,), {}) == "acct-0007-eu"
        assert task.lease_resource_for((), {"account_id": 7, "region": "us"}) == "acct-0007-us"

    def test_an_argument_given_as_none_is_named(self, task):
        """None would make every call share "acct-None": refused, naming the argument."""
        with pytest.raises(LeaseConfigError, match=r"argument 'region' is None"):
            task.lease_resource_for((7, None), {})

    def test_a_format_spec_that_does_not_fit_the_value_is_a_config_error(self, app):
        """A ValueError from str.format becomes a LeaseConfigError naming the template."""

        @lease_task(app=app, resource="acct-{account_id:d}")
        def task(account_id):
            pass

        with pytest.raises(LeaseConfigError, match=r"template 'acct-\{account_id:d\}'.*malformed"):
            task.lease_resource_for(("seven",), {})


class TestTemplateBinding:
    """How a resource template binds a call's arguments (the all-positional fast path too)."""

    def render(self, fn, spec, *args, **kwargs):
        import inspect

        from celery_lease._template import NameTemplate

        return NameTemplate(spec, inspect.signature(fn), "resource", "t").render(args, kwargs)

    def test_every_argument_by_position_or_by_keyword_names_the_same_resource(self):
        def f(account, region="eu"):
            pass

        spec = "acct-{account}-{region}"
        assert self.render(f, spec, 7, "us") == "acct-7-us"
        assert self.render(f, spec, account=7, region="us") == "acct-7-us"
        assert self.render(f, spec, 7) == "acct-7-eu"

    def test_a_keyword_only_default_counts_when_the_rest_come_by_position(self):
        """All positional parameters given by position still leaves a keyword-only one to its
        default (the fast path would have missed it: the template failed)."""

        def f(account, *, region="eu"):
            pass

        assert self.render(f, "acct-{account}-{region}", 7) == "acct-7-eu"

    def test_a_none_argument_by_position_is_refused(self):
        def f(account, region):
            pass

        with pytest.raises(LeaseConfigError, match="argument 'region' is None"):
            self.render(f, "acct-{account}-{region}", 7, None)
