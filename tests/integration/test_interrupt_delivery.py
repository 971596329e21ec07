"""A body that retries inside ``except Exception:`` stops when its lease is lost.

``LeaseInterrupt`` is sent once. While it was an ``Exception`` (a ``LeaseLostError``), an
ordinary retry loop around a flaky call -- ``except Exception: continue`` -- swallowed it and
the body went on acting without a lease until it happened to call ``lease.check()``. It is a
``BaseException`` now, as ``asyncio.CancelledError`` is since Python 3.8.

Real workers (threads pool: an asynchronous exception; prefork: SIGUSR1 in the pool child's main
thread) run ``retrying_body``, which reports every "call" and every exception it swallows and
gives up after a fixed number of calls. The test force-releases the lease (an admin action, as a
takeover would): the renewer finds it released and interrupts the body. Asserted: the interrupted
execution ends RETRY with the ``LeaseLostError`` (reason ``force_released``) and never swallowed the
interrupt nor ran to its end. Negative control: with ``LeaseInterrupt`` an ``Exception`` again
(``CL_INTERRUPT_AS_EXCEPTION``, the old class), the same body swallows it and runs every call.
"""

from __future__ import annotations

import pytest

from tests.conftest import unique
from tests.integration.harness import worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.redis]

CALLS = 60  # x 0.05 s: the body's whole run, if nothing stops it


def _run(it_app, start_worker, store_env, events, queue, request, pool, extra=None):
    env = {**store_env("redis"), "CL_TTL": "1.0", **(extra or {})}
    store = worker_store(env)
    request.addfinalizer(store.close)
    start_worker(env, queue=queue, pool=pool, concurrency=1)
    n = unique("r")
    result = it_app.retrying_body.apply_async((n, CALLS), queue=queue)
    first = events.wait(ev="calling", res=n, call=3)  # well inside its loop
    assert store.force_release(f"retrying-{n}") is not None
    ended = wait_for(
        lambda: events.where(ev="retry", task=first["task"]) or events.where(ev="ran_out", res=n),
        30,
        "the execution to end or run out of calls",
    )[0]
    assert result.get(timeout=60) is not None  # the re-run (a newer fence) completes
    mine = [e for e in events.where(res=n) if e.get("fence") == first["fence"]]
    return ended, mine


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_body_retrying_inside_except_exception_stops_when_the_lease_is_lost(
    it_app, start_worker, store_env, events, queue, request, pool
):
    """The interrupt passes through ``except Exception``: RETRY (force_released), loop cut short."""
    ended, mine = _run(it_app, start_worker, store_env, events, queue, request, pool)
    calls = sum(e["ev"] == "calling" for e in mine)
    print(f"{pool}: ended {ended}; the lost execution made {calls} calls")
    outcome = (ended["ev"], ended["exc"], ended["reason"])
    assert outcome == ("retry", "LeaseLostError", "force_released")
    assert not [e for e in mine if e["ev"] == "swallowed"], "the body swallowed the interrupt"
    assert not [e for e in mine if e["ev"] == "ran_out"], "the body ran on without its lease"


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_negative_control_an_exception_interrupt_is_swallowed_and_the_body_runs_on(
    it_app, start_worker, store_env, events, queue, request, pool
):
    """LeaseInterrupt as an Exception (the old class): the same body swallows it, runs on."""
    extra = {"CL_INTERRUPT_AS_EXCEPTION": "1"}
    ended, mine = _run(it_app, start_worker, store_env, events, queue, request, pool, extra)
    swallowed = [e for e in mine if e["ev"] == "swallowed"]
    print(f"ended {ended}; swallowed {swallowed}")
    assert swallowed and swallowed[0]["exc"] == "LeaseInterrupt"
    assert [e for e in mine if e["ev"] == "ran_out"], "the body did not run on"
