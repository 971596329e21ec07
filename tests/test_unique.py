"""unique= at publish, in the publishing process: the lock on the unique key, each conflict
strategy, resends, a publish that fails, names checked at publish, key_of.

Against real stores (SQLite, Redis, PostgreSQL); messages go to kombu's in-memory broker,
which no worker reads: what a worker does with the lock is in tests/integration/test_unique.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals

from celery_lease import AlreadyQueuedError, LeaseConfigError, Owner, key_of, lease_task
from celery_lease._app import override_store
from celery_lease._message import UNIQUE_HEADER
from celery_lease._settings import LeaseSettings
from tests.conftest import make_store, unique


@pytest.fixture(params=("sqlite", "redis", "postgres"))
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    instance = make_store(request.param, request, tmp_path)
    with override_store(instance):
        yield instance
    instance.close()


@pytest.fixture
def app(store: Any) -> Celery:
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = "sqlite:///unused.db"  # (the store above wins)
    return app


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every message published while the test runs."""
    seen: list[dict[str, Any]] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    signals.before_task_publish.connect(record, weak=False)
    yield seen
    signals.before_task_publish.disconnect(record)


def _task(app: Celery, **options: Any) -> Any:
    @lease_task(app=app, resource="acct-{n}", name=unique("t"), **options)
    def step(n: int) -> int:
        return n

    return step


class TestTheLock:
    def test_a_second_copy_is_refused_while_the_first_holds_the_key(self, app, store, published):
        step = _task(app, unique="until_executed")
        first = step.delay(1)
        with pytest.raises(AlreadyQueuedError) as refused:
            step.delay(1)
        assert refused.value.task_id == first.id
        assert refused.value.key == f"unique:{step.name}:acct-1"
        assert first.id in str(refused.value) and "until_executed" in str(refused.value)
        assert len(published) == 1  # nothing was published for the refused copy
        info = store.get(refused.value.key)
        assert info is not None and not info.expired
        assert first.id in info.owner_label and "unique=until_executed" in info.owner_label
        key, fence, mode, _expires, released = published[0][UNIQUE_HEADER]
        assert (key, fence, mode, released) == (refused.value.key, info.fence, mode, 0)

    def test_other_arguments_are_another_key(self, app):
        step = _task(app, unique="until_executed")
        assert step.delay(1).id != step.delay(2).id

    def test_while_executing_takes_no_lock(self, app, store, published):
        step = _task(app)  # the default
        step.delay(1)
        step.delay(1)
        assert len(published) == 2 and UNIQUE_HEADER not in published[0]
        assert store.get(f"unique:{step.name}:acct-1") is None

    def test_a_resend_of_the_same_task_id_is_never_a_conflict(self, app, published):
        step = _task(app, unique="until_executed")
        first = step.delay(1)
        assert step.apply_async((1,), task_id=first.id).id == first.id
        assert len(published) == 2

    def test_the_lock_lives_its_ttl_plus_a_countdown_past_the_stores_max_ttl(self, app, store):
        """unique_ttl is longer than a claim's default max_ttl (600 s): a lock may be."""
        step = _task(app, unique="until_expired", unique_ttl=3600)
        step.apply_async((1,), countdown=100)
        info = store.get(f"unique:{step.name}:acct-1")
        left = (info.expires_at - info.acquired_at).total_seconds()
        assert 3699 <= left <= 3701, left

    def test_a_publish_that_fails_gives_the_lock_back(self, app, store):
        """The broker refuses the connection (a closed loopback port, no retry)."""
        app.conf.broker_url = "redis://127.0.0.1:9/0"
        app.conf.task_publish_retry = False
        step = _task(app, unique="until_executed")
        with pytest.raises(Exception, match=r"(?i)connect|refused"):
            step.delay(1)
        info = store.get(f"unique:{step.name}:acct-1")
        assert info is None or info.expired or info.owner_label is None, info
        assert LeaseSettings.resolve(app.conf).unique == "while_executing"  # (task's own)

    def test_send_task_takes_no_lock(self, app, store):
        """A documented limit: app.send_task does not go through the task's apply_async."""
        step = _task(app, unique="until_executed")
        step.delay(1)
        assert app.send_task(step.name, (1,)) is not None

    def test_eager_takes_no_lock(self, app):
        app.conf.task_always_eager = True
        step = _task(app, unique="until_executed")
        assert step.delay(1).get() == 1
        assert step.delay(1).get() == 1


class TestConflicts:
    def test_return_existing_gives_the_holders_result(self, app, published):
        step = _task(app, unique="until_executed", on_conflict="return_existing")
        first = step.delay(1)
        again = step.delay(1)
        assert again.id == first.id and len(published) == 1

    def test_skip_returns_none(self, app, published):
        step = _task(app, unique="until_executing", on_conflict="skip")
        step.delay(1)
        assert step.delay(1) is None and len(published) == 1

    def test_replace_frees_the_key_of_a_copy_not_started(self, app, store, published):
        step = _task(app, unique="until_executed", on_conflict="replace")
        first = step.delay(1)
        second = step.delay(1)
        assert second.id != first.id and len(published) == 2
        info = store.get(f"unique:{step.name}:acct-1")
        assert second.id in info.owner_label and first.id not in info.owner_label
        assert info.fence > published[0][UNIQUE_HEADER][1]

    def test_replace_refuses_when_the_holder_has_started(self, app, store):
        """The first copy's run holds its resource (a worker claimed it): it is not revoked."""
        step = _task(app, unique="until_executed", on_conflict="replace")
        first = step.delay(1)
        running = Owner.new(f"w1:1:{first.id} {step.name}")
        store.acquire("acct-1", running, 30)
        with pytest.raises(AlreadyQueuedError) as refused:
            step.delay(1)
        assert refused.value.task_id == first.id


class TestReviewFindings:
    """Found by a review of unique= (each failed before its fix)."""

    def test_replace_reads_the_holders_own_resource(self, app, store):
        """unique_key differs from resource: the holder ran on another resource than the new
        call's, and it has started: replace refuses (it used to look at the new call's
        resource, find it free, and replace a running copy)."""

        @lease_task(
            app=app,
            resource="rep-{n}-{variant}",
            unique="until_executed",
            unique_key="{n}",
            on_conflict="replace",
            name=unique("t"),
        )
        def step(n: int, variant: str) -> int:
            return n

        first = step.delay(1, "a")
        store.acquire("rep-1-a", Owner.new(f"w1:1:{first.id} {step.name}"), 30)  # it runs
        with pytest.raises(AlreadyQueuedError) as refused:
            step.delay(1, "b")
        assert refused.value.task_id == first.id

    def test_a_skipped_copy_of_the_running_task_keeps_its_lock(self, app, store):
        """A redelivered copy (no identity) of the task id that holds the resource is skipped:
        its lock is the running copy's and stays held (it used to be given back)."""
        step = _task(app, unique="until_executed", on_busy="skip", identity=False)
        first = step.delay(1)
        store.acquire("acct-1", Owner.new(f"w1:1:{first.id} {step.name}"), 30)
        key = f"unique:{step.name}:acct-1"
        step.push_request(  # the redelivered copy, as a worker runs it
            id=first.id,
            args=(1,),
            kwargs={},
            is_eager=False,
            called_directly=False,
            celery_lease_unique=[key, store.get(key).fence, "until_executed", 0, 0],
        )
        try:
            with pytest.raises(Exception, match="skipped"):
                step(1)
        finally:
            step.pop_request()
        with pytest.raises(AlreadyQueuedError):
            step.delay(1)

    def test_key_of_binds_the_arguments_and_keeps_them_apart(self, app, store):
        @lease_task(
            app=app,
            resource="kk-{a}",
            unique="until_executed",
            unique_key=key_of,
            name=unique("t"),
        )
        def kk(a: str, b: str = "x") -> str:
            return a

        kk.delay("p")
        for same in ((("p",), {}), ((), {"a": "p"}), (("p", "x"), {})):
            with pytest.raises(AlreadyQueuedError):
                kk.apply_async(*same)
        assert key_of("p:q", "r") != key_of("p", "q:r")

    @pytest.mark.parametrize("form", ["naive", "iso"])
    def test_an_eta_in_any_form_extends_the_lock(self, app, store, form):
        from datetime import datetime, timedelta, timezone

        step = _task(app, unique="until_executed", unique_ttl=60)
        eta = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=600)
        step.apply_async((1,), eta=eta if form == "naive" else eta.isoformat())
        info = store.get(f"unique:{step.name}:acct-1")
        left = (info.expires_at - info.acquired_at).total_seconds()
        assert 640 <= left <= 670, left

    def test_a_bad_resource_fails_at_publish_also_with_a_unique_key(self, app):
        @lease_task(
            app=app,
            resource="acct {n}",
            unique="until_executed",
            unique_key="{n}",
            name=unique("t"),
        )
        def step(n: int) -> int:
            return n

        with pytest.raises(LeaseConfigError, match="not a valid resource name"):
            step.delay(1)

    def test_a_unique_ttl_over_30_days_is_refused_where_the_task_is_defined(self, app):
        with pytest.raises(LeaseConfigError, match="over 30 days"):
            _task(app, unique="until_executed", unique_ttl=40 * 86400)


class TestNamesAtPublish:
    def test_a_resource_that_is_no_valid_name_fails_in_the_caller(self, app):
        @lease_task(app=app, resource="acct {n}", name=unique("t"))
        def step(n: int) -> int:
            return n

        with pytest.raises(LeaseConfigError, match=r"acct 1.*not a valid resource name"):
            step.delay(1)

    def test_a_callable_unique_key_that_gives_no_name_fails_in_the_caller(self, app):
        @lease_task(
            app=app,
            resource="acct-{n}",
            unique="until_executed",
            unique_key=lambda n: f"{n} {n}",
            name=unique("t"),
        )
        def step(n: int) -> int:
            return n

        with pytest.raises(LeaseConfigError, match=r"unique_key .* gave '1 1'.*key_of"):
            step.delay(1)

    def test_an_identity_template_that_gives_no_name_fails_in_the_caller(self, app):
        @lease_task(app=app, resource="acct-{n}", identity="run {n}", name=unique("t"))
        def step(n: int) -> int:
            return n

        with pytest.raises(LeaseConfigError, match=r"'run 1'.*not a valid identity"):
            step.delay(1)

    def test_key_of_keys_by_every_argument(self, app, store):
        step = _task(app, unique="until_executed", unique_key=key_of)
        step.delay(1)
        assert store.get(f"unique:{step.name}:1") is not None

    def test_a_unique_key_template_naming_no_parameter_fails_at_definition(self, app):
        with pytest.raises(LeaseConfigError, match="nope"):
            _task(app, unique="until_executed", unique_key="k-{nope}")


def test_key_of_gives_valid_names_for_anything():
    assert key_of(42, "de") == "42:de"
    assert key_of(user=7) == "user.7"
    digest = key_of("Hello world", {"a": 1})
    assert digest.startswith("Hello.") and len(digest) == len("Hello.") + 32
    assert digest == key_of("Hello world", {"a": 1}) != key_of("Hello world", {"a": 2})
    long = key_of("x" * 300)
    assert len(long) <= 200


@pytest.mark.parametrize(
    ("setting", "value", "hint"),
    [
        ("unique", "until_done", "until_executed"),
        ("on_conflict", "ignore", "return_existing"),
        ("unique_ttl", 0, "unique_ttl"),
    ],
)
def test_bad_settings_name_the_value_and_the_choices(setting, value, hint):
    with pytest.raises(LeaseConfigError) as bad:
        LeaseSettings.resolve(None, {setting: value})
    assert repr(value) in str(bad.value) and hint in str(bad.value)
