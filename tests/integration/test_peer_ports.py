"""celery-once's and celery-singleton's README examples, ported as docs/migrating.md says, run
against real workers next to the original library (both on the same Redis, in the same
worker): what the second ``delay()`` returns or raises while the first is queued or running,
and that a call made after the first finished runs again. The tasks are at the end of
tests/integration/worker_app.py: each README task as it is, with a ``go`` signal from the test
in place of its ``sleep()``. ``delay(...)`` here is the task's ``apply_async`` to the test's
queue (the READMEs use both)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_lease import AlreadyQueuedError
from tests.conftest import unique
from tests.integration.test_unique import publish_to  # noqa: F401 - a fixture
from tests.tooling.servers import wait_for

AlreadyQueued = pytest.importorskip("celery_once").AlreadyQueued
DuplicateTaskError = pytest.importorskip("celery_singleton").DuplicateTaskError

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _delayer(queue: str) -> Callable[..., Any]:
    def delay(task: Any, *args: Any, **kwargs: Any) -> Any:
        return task.apply_async(args, kwargs, queue=queue)

    return delay


def _again(
    delay: Callable[..., Any], task: Any, *args: Any, not_id: str | None = None, **kwargs: Any
) -> Any:
    """A call made after the first one (``not_id``) finished: a new copy is published (polled:
    both peers, and celery_lease, give their lock back just after the result is stored)."""

    def published() -> Any:
        try:
            result = delay(task, *args, **kwargs)
        except (AlreadyQueued, AlreadyQueuedError):
            return None
        return result if result is not None and result.id not in (None, not_id) else None

    return wait_for(published, 10, f"{task.name} to be published again")


def _runs(events: Any, name: str) -> int:
    return len(events.where(ev="enter", res=name))


def test_celery_once_readme(it_app, start_worker, publish_to, events, queue):  # noqa: F811
    """QueueOnce (AlreadyQueued), ``graceful`` and ``unlock_before_run``; Redis store."""
    env = publish_to("redis")
    delay = _delayer(queue)
    push = events.client.rpush
    go = {name: events.key_for(unique("go")) for name in ("p", "l", "pg", "lg", "pu", "lu")}

    # queued (no worker yet): the second copy is refused, by either library
    peer = delay(it_app.once_slow_task, go["p"])
    with pytest.raises(AlreadyQueued):
        delay(it_app.once_slow_task, go["p"])
    port = delay(it_app.port_once_slow_task, go["l"])
    with pytest.raises(AlreadyQueuedError) as refused:
        delay(it_app.port_once_slow_task, go["l"])
    assert refused.value.task_id == port.id

    # graceful: no exception. celery-once returns a REJECTED EagerResult whose id and result
    # are None (its README says "return None"); on_conflict="skip" returns None itself.
    delay(it_app.once_slow_task_graceful, go["pg"])
    skipped = delay(it_app.once_slow_task_graceful, go["pg"])
    assert skipped is not None and skipped.id is None and skipped.result is None
    delay(it_app.port_once_slow_task_graceful, go["lg"])
    assert delay(it_app.port_once_slow_task_graceful, go["lg"]) is None

    # unlock_before_run / until_executing: refused while queued ...
    peer_u = delay(it_app.once_unlock_before_run, go["pu"])
    with pytest.raises(AlreadyQueued):
        delay(it_app.once_unlock_before_run, go["pu"])
    port_u = delay(it_app.port_once_unlock_before_run, go["lu"])
    with pytest.raises(AlreadyQueuedError):
        delay(it_app.port_once_unlock_before_run, go["lu"])

    start_worker(env, queue=queue, pool="threads", concurrency=8)
    for name, result in [
        ("once_slow_task", peer),
        ("port_once_slow_task", port),
        ("once_unlock_before_run", peer_u),
        ("port_once_unlock_before_run", port_u),
    ]:
        events.wait(ev="enter", res=name, task=result.id)
    # running: still refused (the lock is held until the task ends) ...
    with pytest.raises(AlreadyQueued):
        delay(it_app.once_slow_task, go["p"])
    with pytest.raises(AlreadyQueuedError):
        delay(it_app.port_once_slow_task, go["l"])
    # ... but with unlock_before_run / until_executing a new copy is queued once it started
    peer_u2 = delay(it_app.once_unlock_before_run, go["pu"])
    port_u2 = delay(it_app.port_once_unlock_before_run, go["lu"])
    assert peer_u2.id not in (None, peer_u.id) and port_u2.id not in (None, port_u.id)

    for key in go.values():
        push(key, 1, 1)  # every task above waits for one push of its go, at most twice
    for result in (peer, port, peer_u, port_u, peer_u2, port_u2):
        assert result.get(timeout=30) == "Done!"

    # a call made after the first one finished runs again
    for task, key in [(it_app.once_slow_task, go["p"]), (it_app.port_once_slow_task, go["l"])]:
        assert _again(delay, task, key).get(timeout=30) == "Done!"
    assert _runs(events, "once_slow_task") == _runs(events, "port_once_slow_task") == 2
    assert _runs(events, "once_unlock_before_run") == 2
    assert _runs(events, "port_once_unlock_before_run") == 2


def test_celery_once_keys(it_app, start_worker, publish_to, events, queue):  # noqa: F811
    """The default key (all arguments, bound to their names: ``unique_key="{a}:{b}"``),
    ``once={"keys": ["a"]}`` (``unique_key="{a}"``) and ``once={"keys": []}`` (one key for
    every call); PostgreSQL store."""
    env = publish_to("postgres")
    delay = _delayer(queue)
    # The README's keys are fixed (a=1; the task name alone): a lock an interrupted earlier run
    # of this test left in the shared Redis would refuse the first call.
    for task, a in [
        (it_app.once_slow_add, 1),
        (it_app.once_slow_add, 2),
        (it_app.once_slow_add_any, 1),
    ]:
        task.once_backend.clear_lock(task.get_key((a, 0, ""), {}))
    start_worker(env, queue=queue, pool="threads", concurrency=8)
    go = events.key_for(unique("go"))
    results = []
    for add, error in [
        ("once_slow_add_default", AlreadyQueued),
        ("port_once_slow_add_default", AlreadyQueuedError),  # unique_key="{a}:{b}"
    ]:
        task = getattr(it_app, add)
        results.append(delay(task, 1, 1, go))
        results.append(delay(task, 1, 2, go))  # different arguments, different locks
        with pytest.raises(error):  # arguments bound to their names: the key of (1, 1)
            delay(task, a=1, b=1, go=go)
    for add, error in [
        ("once_slow_add", AlreadyQueued),
        ("port_once_slow_add", AlreadyQueuedError),
    ]:
        task = getattr(it_app, add)
        results.append(delay(task, 1, 1, go))
        with pytest.raises(error):  # a task with a=1 is queued or running
            delay(task, 1, 2, go)
        results.append(delay(task, 2, 2, go))  # another a: queued
    for add, error in [
        ("once_slow_add_any", AlreadyQueued),
        ("port_once_slow_add_any", AlreadyQueuedError),
    ]:
        task = getattr(it_app, add)
        results.append(delay(task, 1, 1, go))
        with pytest.raises(error):  # whatever the arguments
            delay(task, 2, 2, go)
    events.client.rpush(go, *[1] * len(results))
    assert [r.get(timeout=30) for r in results] == [2, 3, 2, 3, 2, 4, 2, 4, 2, 2]
    for add in (
        "once_slow_add",
        "port_once_slow_add",
        "once_slow_add_any",
        "port_once_slow_add_any",
    ):
        events.client.rpush(go, 1)
        assert _again(delay, getattr(it_app, add), 1, 2, go).get(timeout=30) == 3


def test_celery_singleton_readme(it_app, start_worker, publish_to, events, queue):  # noqa: F811
    """Singleton (the existing AsyncResult), ``unique_on`` and ``raise_on_duplicate``; SQLite
    store."""
    env = publish_to("sqlite")
    delay = _delayer(queue)
    go = events.key_for(unique("go"))
    pairs = [("singleton_do_stuff", "port_singleton_do_stuff")]
    first = {}
    for name in pairs[0]:  # queued (no worker yet): the same task, not queued twice
        task = getattr(it_app, name)
        async_result = delay(task, 1, 2, 3, a="b", go=go)
        async_result2 = delay(task, 1, 2, 3, a="b", go=go)
        assert async_result == async_result2 and async_result.id == async_result2.id
        first[name] = async_result
    start_worker(env, queue=queue, pool="threads", concurrency=8)
    others = []
    for name, a in first.items():
        task = getattr(it_app, name)
        events.wait(ev="enter", res=name, task=a.id)
        assert delay(task, 1, 2, 3, a="b", go=go) == a  # running: still the same task
        c = delay(task, 4, 5, 6, go=go)
        assert a != c  # c has different arguments so it spawns a new task
        others.append(c)
    events.client.rpush(go, 1, 1, 1, 1)
    for result in [*first.values(), *others]:
        assert result.get(timeout=30) == "I just woke up"
    for name, a in first.items():  # after a finished: a duplicate of it is a new task
        events.client.rpush(go, 1)
        d = _again(delay, getattr(it_app, name), 1, 2, 3, a="b", go=go, not_id=a.id)
        assert a != d
        assert d.get(timeout=30) == "I just woke up"
        assert _runs(events, name) == 3  # a, c and d

    # unique_on=["username"]: only the username decides; raise_on_duplicate: the error names
    # the task that holds the lock
    for name, raising in [
        ("singleton_do_something", "singleton_raising"),
        ("port_singleton_do_something", "port_singleton_raising"),
    ]:
        task, user = getattr(it_app, name), unique("bob")
        task1 = delay(task, username=user, otherarg=99, go=go)
        task2 = delay(task, username=user, otherarg=100, go=go)  # a duplicate of task1
        assert task1 == task2
        task, user = getattr(it_app, raising), unique("bob")
        task3 = delay(task, user, go=go)
        with pytest.raises((DuplicateTaskError, AlreadyQueuedError)) as duplicate:
            delay(task, user, go=go)
        assert duplicate.value.task_id == task3.id
        expected = DuplicateTaskError if raising == "singleton_raising" else AlreadyQueuedError
        assert type(duplicate.value) is expected
        events.client.rpush(go, 1, 1)
        assert task1.get(timeout=30) is None and task3.get(timeout=30) is None

    # lock_expiry=2 / unique_ttl=2: once the lock expired, a new copy is queued while the
    # first still runs
    started, task1, gos = time.monotonic(), {}, {}
    for name in ("singleton_expiring", "port_singleton_expiring"):
        gos[name] = events.key_for(unique("go"))
        task1[name] = delay(getattr(it_app, name), gos[name])
        assert delay(getattr(it_app, name), gos[name]) == task1[name]
    task2 = {
        name: _again(delay, getattr(it_app, name), gos[name], not_id=task1[name].id)
        for name in task1
    }
    waited = time.monotonic() - started
    assert all(task2[name] != task1[name] for name in task1)
    assert 1.5 <= waited <= 2 + 5, waited
    # celery_lease's second copy waits for the resource; the first's end gives back only its
    # own lock, so the second's key stays held (celery-singleton's first deletes the key,
    # whoever holds it: not asserted)
    port = "port_singleton_expiring"
    events.client.rpush(gos[port], 1)
    assert task1[port].get(timeout=30) is None
    assert delay(it_app.port_singleton_expiring, gos[port]) == task2[port]
    for name in task1:
        events.client.rpush(gos[name], *[1] * (1 if name == port else 2))
        assert task1[name].get(timeout=30) is None and task2[name].get(timeout=30) is None
