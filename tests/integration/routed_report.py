"""How the routed test tasks tell the test what they do: the coordination Redis's event list
(``CL_COORD``, ``CL_EVENTS``), as ``worker_app.report`` does, without importing celery_lease."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

_client: tuple[int, redis.Redis] | None = None


def _coord() -> redis.Redis:
    global _client  # noqa: PLW0603
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(os.environ["CL_COORD"], socket_timeout=10))
    return _client[1]


def report(kind: str, **fields: Any) -> None:
    fields.update(ev=kind, pid=os.getpid(), t=time.time())
    _coord().rpush(os.environ["CL_EVENTS"], json.dumps(fields, default=str))


def wait_for_key(key: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _coord().exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(key)
        time.sleep(0.002)
