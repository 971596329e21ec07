"""A real worker with its lease store on Redis over TLS, as an ACL user held to the key prefix
(the broker stays on the plain test Redis): tasks run, and nothing the worker does with the
store is refused but the health check's CONFIG GET, which the ACL leaves out on purpose."""

from __future__ import annotations

import pytest
import redis

from tests.integration.harness import wait_results
from tests.tooling.secure import REDIS_ADMIN_PASSWORD

pytestmark = pytest.mark.integration


def test_tasks_run_on_a_tls_store_as_an_acl_user(
    it_app, start_worker, store_env, events, queue, request
):
    """Three lease tasks on one resource run one after another with increasing fences."""
    env = {**store_env("redis_secure"), "CL_TTL": "5"}
    assert env["CL_STORE"].startswith("rediss://")
    worker = start_worker(env, queue=queue, concurrency=2)
    results = [it_app.exclusive.apply_async((1,), {"hold": 0.02}, queue=queue) for _ in range(3)]
    fences = wait_results(results, timeout=60)
    assert len(set(fences)) == 3 and all(f > 0 for f in fences)
    assert [e["fence"] for e in events.where(ev="enter")] == sorted(fences)
    server = request.getfixturevalue("redis_secure_server")
    with redis.Redis.from_url(server.url_for(password=REDIS_ADMIN_PASSWORD)) as admin:
        assert list(admin.scan_iter(match=env["CL_PREFIX"] + "*", count=1000))
    # The one refusal: the start-up health check may not read CONFIG (not granted on purpose).
    refused = [line for line in worker.log().splitlines() if "no permissions" in line]
    assert refused and all("could not read the Redis configuration" in x for x in refused)
