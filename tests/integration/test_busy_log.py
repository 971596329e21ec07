"""What a real worker logs for a busy wait (issue 33, item 5): one short line.

A waiter refused while another task holds its resource joins the wait list and is woken by
the release. Celery logs the re-queue as ``Task <name>[<id>] retry: <reason>``; that reason
was ``Retry in 1.0s: LeaseBusyError("resource ... held by ...", ...)``: some 300 characters
naming the back-stop's delay, while the hand-off woke the waiter as soon as the holder let go.
"""

from __future__ import annotations

import pytest

from tests.conftest import unique

pytestmark = [pytest.mark.integration]

ENV = {"CL_TTL": "1.0", "CL_BACKOFF_BASE": "0.05", "CL_BACKOFF_CAP": "3.0"}
#: Longest reason accepted after "retry: " (the resource and a Redis fence take 40 of it).
LONGEST = 160


def test_a_listed_waiter_logs_one_short_line_saying_the_release_wakes_it(
    it_app, start_worker, store_env, events, coord, queue
):
    """The waiter's retry line names the resource, the holder's fence and its place, says the
    release wakes it, and carries no error repr. Was ``Retry in 1.0s: LeaseBusyError(...)``,
    420 characters here."""
    worker = start_worker({**store_env("redis"), **ENV}, queue=queue, pool="threads")
    n, go = unique("b"), unique("go")
    holder = it_app.fifo_gate.apply_async((n, 0, go), queue=queue)
    events.wait(ev="enter", res=n, k=0)
    waiter = it_app.fifo_hold.apply_async((n, 1, 0.0), queue=queue)
    events.wait(ev="retry", task=waiter.id)
    coord.rpush(go, 1)
    assert holder.get(timeout=30) == 0
    assert waiter.get(timeout=30) == 1
    lines = [line for line in worker.log().splitlines() if f"[{waiter.id}] retry: " in line]
    assert len(lines) == 1, lines  # refused once, then woken: one line
    reason = lines[0].split(" retry: ", 1)[1]
    print(lines[0])
    assert "Retry in" not in reason and "LeaseBusyError(" not in reason
    assert reason.startswith(f"busy: fifo-{n} is held (fence ")
    assert "waiting at place 1 of its wait list, woken when it is released" in reason
    assert len(reason) <= LONGEST, len(reason)
