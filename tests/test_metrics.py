"""The lease counters as Prometheus exposes them (the collector reads METRICS on scrape)."""

from __future__ import annotations

import re

import pytest
from celery import Celery

from celery_lease import LeaseBusyError, Owner, lease_task
from celery_lease._app import get_store
from celery_lease._events import register_prometheus
from tests.conftest import unique

prometheus_client = pytest.importorskip("prometheus_client")


def scrape(name: str) -> float:
    text = prometheus_client.generate_latest().decode()
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} is not exposed:\n{text}"
    return float(match.group(1))


def test_claims_releases_and_conflicts_are_scraped(tmp_path):
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"

    @lease_task(app=app, resource="inv:{n}")
    def task(n):
        return n

    assert register_prometheus()  # idempotent: the first lease app registered it already
    before = {
        name: scrape(name)
        for name in (
            "celery_lease_claims_total",
            "celery_lease_releases_total",
            "celery_lease_claim_conflicts_total",
        )
    }
    for n in range(3):
        task.apply((n,)).get()
    held = get_store(app).acquire("inv:9", Owner.new("other"), 30)
    assert isinstance(task.apply((9,)).result, LeaseBusyError)
    get_store(app).release(held)
    assert scrape("celery_lease_claims_total") == before["celery_lease_claims_total"] + 3
    assert scrape("celery_lease_releases_total") == before["celery_lease_releases_total"] + 3
    conflicts = scrape("celery_lease_claim_conflicts_total")
    assert conflicts == before["celery_lease_claim_conflicts_total"] + 1
    assert scrape("celery_lease_hold_seconds_sum") > 0


#: The series a claim and a release count, once each per task.
CLAIM_KEYS = (
    "celery_lease_claims_total",
    "celery_lease_releases_total",
    "celery_lease_acquire_seconds_count",
    "celery_lease_hold_seconds_count",
)


def _claim_counting_task(tmp_path):
    """A lease task of a fresh app on a SQLite store, run with apply()."""
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"

    @lease_task(app=app, resource="inv:{n}")
    def task(n):
        return n

    return task


class TestCounting:
    def test_a_counter_takes_exactly_its_labels(self):
        """A name or label set that is not declared raises: names stay in one table."""
        from celery_lease import metrics

        with pytest.raises(KeyError):
            metrics.inc("celery_lease_no_such_total")
        with pytest.raises(KeyError):
            metrics.inc("celery_lease_leases_lost_total")  # needs reason=
        before = metrics.snapshot().get('celery_lease_leases_lost_total{reason="test"}', 0)
        metrics.inc("celery_lease_leases_lost_total", reason="test")
        after = metrics.snapshot()
        assert after['celery_lease_leases_lost_total{reason="test"}'] == before + 1
        assert scrape('celery_lease_leases_lost_total{reason="test"}') == before + 1

    def test_the_internal_entry_point_never_raises(self):
        """A task must not fail because a metric name is unknown (it is logged once)."""
        from celery_lease import _events

        _events.count("celery_lease_no_such_total")
        _events.observe("celery_lease_no_such_seconds", 1.0)


class TestSeries:
    def test_a_claim_and_a_release_count_once_each(self, tmp_path):
        """Per task: one claim, one claim latency, one release, one hold time."""
        from celery_lease import metrics

        task, keys = _claim_counting_task(tmp_path), CLAIM_KEYS
        before = metrics.snapshot()
        for n in range(3):
            task.apply((n,)).get()
        after = metrics.snapshot()
        assert [after[k] - before.get(k, 0) for k in keys] == [3, 3, 3, 3]
        claimed = 'celery_lease_acquire_seconds_count{result="claimed"}'
        assert scrape(claimed) >= 3

    def test_claims_and_releases_count_into_a_replaced_counter(self, tmp_path, monkeypatch):
        """Code that replaces metrics.METRICS (a test resetting the counts, then undoing it)
        after a claim and a release were counted: later ones count into the current one, as
        every other series does (the claim's and release's recorder bound the old one)."""
        from collections import Counter

        from celery_lease import metrics

        task, keys = _claim_counting_task(tmp_path), CLAIM_KEYS
        task.apply((1,)).get()  # the recorders bind (if no earlier test made them)
        original = metrics.METRICS
        monkeypatch.setattr(metrics, "METRICS", Counter())
        task.apply((2,)).get()
        assert [metrics.snapshot().get(k, 0) for k in keys] == [1, 1, 1, 1]
        monkeypatch.undo()
        assert metrics.METRICS is original
        before = metrics.snapshot()
        task.apply((3,)).get()
        after = metrics.snapshot()
        assert [after.get(k, 0) - before.get(k, 0) for k in keys] == [1, 1, 1, 1]

    def test_an_unknown_series_fails_where_it_is_declared(self):
        from celery_lease import metrics

        with pytest.raises(KeyError):
            metrics.Series("c", "celery_lease_no_such_total")

    def test_a_series_looks_its_entry_up_again_after_a_mode_change(self, monkeypatch):
        """enable_multiprocess() rebuilds the entries: a Series must not keep the old one."""
        from celery_lease import metrics

        series = metrics.Series("c", "celery_lease_claims_total")
        old = series.entry()
        monkeypatch.setattr(metrics, "_entries", {})
        monkeypatch.setattr(metrics, "_generation", metrics._generation + 1)
        assert series.entry() is not old


class TestUpdater:
    """Claims and releases update their Prometheus children directly (metrics._updater)."""

    BOUNDS = (0.001, 0.01, 0.1, 1.0)

    def samples(self, histogram):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in histogram.collect()
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    @pytest.mark.parametrize(
        "values",
        [
            [0.0, 0.0005, 0.001, 0.0011, 0.01, 0.5, 1.0, 1.5, 1e9],  # edges: a bound is "<="
            [-1.0, float("inf")],
            [float("nan"), 0.2],
        ],
    )
    def test_a_histogram_ends_as_its_own_observe_leaves_it(self, values):
        from celery_lease.metrics import _updater

        fast = prometheus_client.Histogram("h_fast", "h", buckets=self.BOUNDS, registry=None)
        slow = prometheus_client.Histogram("h_slow", "h", buckets=self.BOUNDS, registry=None)
        add = _updater(fast, "h")
        assert add != fast.observe  # the direct path is the one under test
        for value in values:
            add(value)
            slow.observe(value)
        got = {(n.replace("h_fast", "h"), k): v for (n, k), v in self.samples(fast).items()}
        want = {(n.replace("h_slow", "h"), k): v for (n, k), v in self.samples(slow).items()}
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == value or (value != value and got[key] != got[key]), key

    def test_a_counter_ends_as_its_own_inc_leaves_it(self):
        from celery_lease.metrics import _updater

        counter = prometheus_client.Counter("c_fast", "c", registry=None)
        add = _updater(counter, "c")
        for _ in range(3):
            add(1)
        assert counter._value.get() == 3

    def test_a_child_without_the_known_internals_keeps_the_public_calls(self):
        from celery_lease.metrics import _updater

        class Child:
            def inc(self, amount):
                pass

            def observe(self, seconds):
                pass

        child = Child()
        assert _updater(child, "c") == child.inc
        assert _updater(child, "h") == child.observe
