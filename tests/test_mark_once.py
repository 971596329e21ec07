"""``mark_once``: one caller per key holds the mark (a copy's give-up, see
``_copies.give_up_once``); the same token again still holds it; it expires."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_lease.stores.memory import MemoryLeaseStore
from tests.conftest import unique


def test_one_token_holds_a_key(store: Any) -> None:
    key = f"gave-up:{unique('t')}"
    assert store.mark_once(key, "a", 30.0) is True
    assert store.mark_once(key, "b", 30.0) is False
    # the same caller asking again (its first reply lost) still holds it
    assert store.mark_once(key, "a", 30.0) is True
    assert store.mark_once(f"{key}-other", "b", 30.0) is True


def test_callers_racing_for_a_key_one_holds_it(store: Any) -> None:
    key = f"gave-up:{unique('r')}"
    start = threading.Barrier(8)
    held: list[bool] = []

    def mark(token: str) -> None:
        start.wait()
        held.append(store.mark_once(key, token, 30.0))

    threads = [threading.Thread(target=mark, args=(f"t{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(held) == [False] * 7 + [True]


def test_an_expired_mark_is_taken_by_another(store: Any) -> None:
    key = f"gave-up:{unique('e')}"
    assert store.mark_once(key, "a", 0.2) is True
    assert store.mark_once(key, "b", 0.2) is False
    deadline = time.monotonic() + 10
    while not store.mark_once(key, "b", 30.0):
        assert time.monotonic() < deadline, "the mark never expired"
        time.sleep(0.1)
    assert store.mark_once(key, "a", 30.0) is False


def test_memory_mark_expires_on_the_store_clock() -> None:
    now = [1000.0]
    store = MemoryLeaseStore(clock=lambda: now[0])
    assert store.mark_once("gave-up:x", "a", 5.0)
    now[0] += 4.9
    assert not store.mark_once("gave-up:x", "b", 5.0)
    now[0] += 0.2
    assert store.mark_once("gave-up:x", "b", 5.0)


def test_a_bad_key_is_refused(store: Any) -> None:
    from celery_lease import LeaseConfigError

    with pytest.raises(LeaseConfigError):
        store.mark_once("", "a", 1.0)
