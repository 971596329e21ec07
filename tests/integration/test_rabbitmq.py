"""Real workers on a real RabbitMQ broker: the wiring the RabbitMQ scenarios build on.

The session's RabbitMQ node (``rabbitmq_server``, tests/tooling/rabbitmq.py), a fresh vhost for
the test (``amqp_vhost``), a Redis lease store; the tasks are sent by an app of the test's own
whose broker is that vhost, and their results come back through the suite's Redis backend.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from celery_lease._app import WAKE_QUEUE_SUFFIX
from tests.integration.harness import check_exclusion, wait_results

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq, pytest.mark.slow]

CALLS = 12


def amqp_producer(it_app: Any, url: str) -> Celery:
    """An app that sends to the AMQP broker at ``url`` (results: the suite's Redis backend)."""
    return Celery("rabbitmq_it", broker=url, backend=it_app.app.conf.result_backend)


@pytest.mark.parametrize(
    ("wake_queue", "exchange"),
    [(True, None), (False, None), (True, "direct"), (False, "topic")],
    ids=["wake_queue", "negative_control", "quorum_direct", "quorum_topic"],
)
def test_calls_on_one_resource_never_overlap_and_waiters_are_woken_through_rabbitmq(
    amqp_vhost, it_app, start_worker, store_env, events, queue, wake_queue, exchange
):
    """Two workers (two threads each) on the AMQP broker: a first call holds the resource for
    a second while 11 more arrive; all 12 run, one at a time, with rising fences, and the
    refused ones are handed the lease through ``<queue>.lease-wake``, which the workers
    declared on RabbitMQ beside the task queue and both consume. Negative control
    (``lease_handoff_wake_queue`` off): the same exclusion, and RabbitMQ has no wake queue
    (so the checks below do look at the broker), nor was a copy delivered through one.

    ``quorum_*``: the task queue is a quorum queue (no global QoS: Celery sets the prefetch
    per consumer; every busy re-queue and back-stop copy is held in the workers' prefetch), on
    a direct exchange (it gets a classic wake queue beside it) or on a topic exchange, as
    Celery's docs set quorum queues up for native delayed delivery (a wake queue only serves
    a direct route, so wakes go by the waiter's own route, Q itself)."""
    env = {
        **store_env("redis"),
        "CL_BROKER": amqp_vhost.url,
        "CL_TTL": "5",
        "CL_REPORT_STARTS": "1",  # every copy a worker starts, with the route it came by
        "CL_WAKE_QUEUE": "1" if wake_queue or exchange else "0",
    }
    if exchange:
        env |= {"CL_QUORUM_QUEUE": queue, "CL_QUORUM_EXCHANGE": exchange}
    workers = [
        start_worker(env, queue=queue, pool="threads", concurrency=2, wait=False) for _ in range(2)
    ]
    for worker in workers:
        worker.wait_ready()
    assert all("amqp://guest:**@127.0.0.1" in w.log() for w in workers)  # (not the Redis one)
    producer = amqp_producer(it_app, amqp_vhost.url)
    if exchange:  # (declared as the workers declare it: RabbitMQ refuses a mismatch)
        arguments = {"x-queue-type": "quorum"}
        bound = Exchange(queue, type=exchange)
        producer.conf.task_queues = [
            Queue(queue, bound, routing_key=queue, queue_arguments=arguments)
        ]
    try:
        first = producer.send_task(it_app.exclusive.name, (0,), {"hold": 1.0}, queue=queue)
        events.wait(ev="enter", res=0)
        rest = [
            producer.send_task(it_app.exclusive.name, (0,), {"hold": 0.05}, queue=queue)
            for _ in range(CALLS - 1)
        ]
        fences = wait_results([first, *rest], timeout=120)
        queues = amqp_vhost.queues()  # (while the workers still consume)
    finally:
        producer.close()
    log = events.all()
    per_resource = check_exclusion(log)  # enter/exit alternate, fences strictly increase
    assert per_resource[0] == sorted(fences) and len(set(fences)) == CALLS, (fences, log)
    wake = queue + WAKE_QUEUE_SUFFIX
    routes = [e["rk"] for e in log if e["ev"] == "start"]
    assert queue in queues and queues[queue]["durable"] == "true", queues
    assert queues[queue]["type"] == ("quorum" if exchange else "classic"), queues
    if wake_queue:
        assert wake in queues, f"no {wake} on RabbitMQ: {sorted(queues)}"
        assert queues[wake]["durable"] == "true" and queues[wake]["consumers"] == "2", queues
        assert wake in routes, f"no copy came through {wake}: {routes}"
    else:
        assert wake not in queues, queues
        assert wake not in routes, routes
