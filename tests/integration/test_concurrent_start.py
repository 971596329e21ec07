"""Workers starting at once on a fresh PostgreSQL table prefix (a library bug, now fixed).

Found by the lost-update scenario (4 workers started together): one worker exited at start with
``LeaseStoreError: could not create the lease tables ... UniqueViolation: duplicate key value
violates unique constraint "pg_type_typname_nsp_index"``. Each worker's store runs
``SQLLeaseStore.create_tables``: ``metadata.create_all(checkfirst=True)`` in one transaction,
tried three times with no pause. Concurrent ``CREATE TABLE``s of one name in PostgreSQL block on
each other and the losers fail (``UniqueViolation`` on ``pg_type``, or ``DuplicateTable``);
with several processes a store can lose three races in a row. The ``LeaseBootstep`` does not
catch the error (it only catches ``check_health``'s), so the worker process dies at start.

Measured with this reproduction before the fix: 4 processes on a fresh prefix failed in 9 of 60
rounds, 8 processes in 26 of 30 rounds. The fix serialises the DDL under a transaction-scoped
advisory lock on PostgreSQL, retries a clash with jittered backoff, and the bootstep logs a
store that cannot be made instead of killing the worker.

The other multi-worker tests create the tables from the test process first
(``harness.prepare_store``), since they test something else.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from celery_lease.stores import store_from_url
from tests.conftest import unique

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

PROCESSES = 8
ROUNDS = 5


def _make_store(url: str, prefix: str, go: Any, answers: Any) -> None:
    go.wait(30)
    try:
        store_from_url(url, table_prefix=prefix).close()
    except Exception as exc:
        answers.put(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    else:
        answers.put("ok")


def test_stores_created_at_once_on_a_fresh_prefix_all_succeed(postgres_server):
    """8 processes make a store on one fresh table prefix at once, 5 times: all succeed."""
    context = multiprocessing.get_context("fork")
    failures = []
    for _ in range(ROUNDS):
        prefix = f"{unique('cs')}_"
        go, answers = context.Event(), context.Queue()
        processes = [
            context.Process(target=_make_store, args=(postgres_server.url, prefix, go, answers))
            for _ in range(PROCESSES)
        ]
        for process in processes:
            process.start()
        go.set()
        results = [answers.get(timeout=60) for _ in processes]
        for process in processes:
            process.join(30)
        failures += [r for r in results if r != "ok"]
    print(f"{len(failures)} of {PROCESSES * ROUNDS} store creations failed, e.g. {failures[:2]}")
    assert not failures
