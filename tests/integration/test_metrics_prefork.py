"""Lease metrics from a real prefork worker: the pool children's counts, summed, on one port.

``--lease-metrics-port`` puts prometheus_client in multiprocess mode before the pool forks and
serves the sum over every process. The negative control serves the default registry from the
main process, as one did before: after the same tasks it reports 0 claims.
"""

from __future__ import annotations

import os
import urllib.request
from typing import Any

import pytest

from celery_lease import Owner
from tests.integration.harness import worker_store
from tests.tooling.servers import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]
parser = pytest.importorskip("prometheus_client.parser")


def scrape(port: int) -> dict[str, float]:
    """``{'name{label="v"}': value}`` for every celery_lease sample served on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("celery_lease_"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def run_workload(it_app: Any, env: dict[str, str], queue: str, events: Any) -> set[int]:
    """4 claims on free resources, 1 busy conflict then its claim, 1 run + 1 duplicate.

    Returns the pids of the pool processes that ran the bodies.
    """
    exclusive = it_app.exclusive
    results = [exclusive.apply_async((n, 0.3), queue=queue) for n in range(4)]
    for result in results:
        result.get(timeout=60)
    store = worker_store(env)
    try:
        holder = store.acquire("res-50", Owner.new("metrics-test-holder"), 30)
        busy = exclusive.apply_async((50, 0.0), queue=queue)
        wait_for(
            lambda: any(e["ev"] == "retry" and e["task"] == busy.id for e in events.all()),
            30,
            "the busy task to wait",
        )
        store.release(holder)
        busy.get(timeout=60)
    finally:
        store.close()
    key = {"idempotency_key": f"metrics-{queue}"}
    exclusive.apply_async((60, 0.0), queue=queue, headers=key).get(timeout=60)
    exclusive.apply_async((60, 0.0), queue=queue, headers=key).get(timeout=60)
    return {e["pid"] for e in events.all() if e["ev"] == "enter"}


def test_a_prefork_worker_serves_the_sum_of_its_pool_processes(
    it_app, start_worker, store_env, events, queue
):
    """Claims, a conflict, a duplicate, renewals of nothing: the scrape shows what the
    children counted, which the main process alone never saw."""
    env = {**store_env("redis"), "CL_TTL": "5"}
    port = free_port()
    worker = start_worker(
        env,
        queue=queue,
        concurrency=2,
        extra_args=("--lease-metrics-port", str(port), "--lease-metrics-address", "127.0.0.1"),
    )
    pids = run_workload(it_app, env, queue, events)
    assert len(pids) == 2, f"both pool children should have run bodies: {pids}"
    assert worker.pid not in pids

    def settled() -> dict[str, float] | None:
        values = scrape(port)
        return values if values.get("celery_lease_releases_total") == 6 else None

    values = wait_for(settled, 30, "the scrape to show every release")
    assert values["celery_lease_claims_total"] == 6
    assert values["celery_lease_claim_conflicts_total"] >= 1
    assert values["celery_lease_busy_waits_total"] == values["celery_lease_claim_conflicts_total"]
    assert values["celery_lease_duplicates_total"] == 1
    assert values['celery_lease_acquire_seconds_count{result="claimed"}'] == 6
    assert values['celery_lease_acquire_seconds_count{result="duplicate"}'] == 1
    assert values['celery_lease_acquire_seconds_count{result="busy"}'] >= 1
    assert values["celery_lease_hold_seconds_count"] == 6
    assert values["celery_lease_hold_seconds_sum"] >= 4 * 0.3
    assert values.get("celery_lease_renewal_failures_total", 0) == 0
    directory = next(
        line.split("PROMETHEUS_MULTIPROC_DIR=", 1)[1].split()[0]
        for line in worker.log().splitlines()
        if "PROMETHEUS_MULTIPROC_DIR=" in line
    )
    assert os.path.isdir(directory)
    worker.stop()
    assert not os.path.exists(directory), "the worker's metrics directory outlived it"


def test_negative_control_the_main_process_alone_reports_zero(
    it_app, start_worker, store_env, events, queue
):
    """Serving the default registry from a prefork worker's main process (the old way) shows 0
    claims after the same tasks: the counts live in the pool children."""
    env = {**store_env("redis"), "CL_TTL": "5", "CL_PLAIN_METRICS_PORT": str(free_port())}
    start_worker(env, queue=queue, concurrency=2)
    pids = run_workload(it_app, env, queue, events)
    assert len(pids) == 2
    values = scrape(int(env["CL_PLAIN_METRICS_PORT"]))
    assert values["celery_lease_claims_total"] == 0
    assert values["celery_lease_duplicates_total"] == 0
