"""The worker's warning about a Redis broker pool smaller than a green pool's acks.

The failure itself (acks failing, a message lost) is shown with real workers in
tests/integration/test_connections.py; here, which configurations are warned about.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.concurrency import get_implementation

from celery_lease._app import LeaseBootstep, broker_pool_warning

GEVENT = get_implementation("gevent")
PREFORK = get_implementation("prefork")
THREADS = get_implementation("threads")


def make_app(broker: str, **transport_options: object) -> Celery:
    app = Celery("pool", broker=broker, set_as_current=False)
    if transport_options:
        app.conf.broker_transport_options = transport_options
    return app


def test_a_gevent_worker_on_the_default_redis_pool_is_warned() -> None:
    warning = broker_pool_warning(make_app("redis://127.0.0.1:1/0"), GEVENT, 50)
    assert warning is not None
    assert "-c 50" in warning
    assert "holds 10" in warning
    assert "{'max_connections': 60} (at least 52)" in warning


@pytest.mark.parametrize("broker", ["rediss://127.0.0.1:1/0", "redis+socket:///tmp/x.sock"])
def test_every_redis_url_counts(broker: str) -> None:
    assert broker_pool_warning(make_app(broker), GEVENT, 50) is not None


def test_a_pool_big_enough_is_not_warned() -> None:
    app = make_app("redis://127.0.0.1:1/0", max_connections=52)
    assert broker_pool_warning(app, GEVENT, 50) is None
    assert broker_pool_warning(app, GEVENT, 51) is not None  # one connection short
    # None: redis-py's own default (100 and up), not the transport's 10.
    app = make_app("redis://127.0.0.1:1/0", max_connections=None)
    assert broker_pool_warning(app, GEVENT, 50) is None


def test_a_green_pool_the_default_pool_can_serve_is_not_warned() -> None:
    app = make_app("redis://127.0.0.1:1/0")  # 10 connections: 8 acks and the consumer's
    assert broker_pool_warning(app, GEVENT, 8) is None
    assert broker_pool_warning(app, GEVENT, 9) is not None


@pytest.mark.parametrize("pool", [PREFORK, THREADS])
def test_other_pools_ack_from_the_consumer_loop(pool: object) -> None:
    assert broker_pool_warning(make_app("redis://127.0.0.1:1/0"), pool, 50) is None


def test_other_brokers_are_not_warned() -> None:
    assert broker_pool_warning(make_app("amqp://127.0.0.1:1//"), GEVENT, 50) is None
    assert broker_pool_warning(make_app("memory://"), GEVENT, 50) is None


@pytest.mark.parametrize(("top", "warned"), [(30, True), (None, False)])
def test_an_autoscaled_worker_is_warned_for_its_top(top, warned, caplog) -> None:
    """``-P gevent -c 2 --autoscale=30,2`` runs up to 30 tasks at once (a review saw 19 bodies
    running against the default pool of 10 with no warning: the check read ``-c`` only). The
    worker as Celery's Pool step leaves it for every step's ``create``: ``max_concurrency``
    is the top of ``--autoscale``, None without it."""
    app = make_app("redis://127.0.0.1:1/0")
    worker = SimpleNamespace(app=app, pool_cls=GEVENT, concurrency=2, max_concurrency=top)
    with caplog.at_level(logging.WARNING, logger="celery_lease"):
        LeaseBootstep(worker).create(worker)
    warnings = [r.getMessage() for r in caplog.records if "max_connections" in r.getMessage()]
    assert bool(warnings) is warned, warnings
    if warned:
        assert "-c 30" in warnings[0]
