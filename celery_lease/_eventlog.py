"""One structured log line per lease event, rate-limited on repeats, secrets redacted.

Every line goes to the ``celery_lease.events`` logger and reads:

```text
task proj.charge[3f2c...] busy: resource=inv:7 fence=41 holder=w1@host:311:9b1e... action=wait
```

``key=value`` pairs after the task name and id (values with spaces or quotes are quoted), and
the same fields on the log record as ``record.lease`` (a dict) for JSON formatters.

Repeats are counted, not logged: within :data:`REPEAT_WINDOW` seconds per process, a busy wait
on the same resource and holder (a waiting task comes back every backoff; many tasks may wait
for one holder), or any other event of the same task execution, is left out; the next line
that goes out says how many were (``repeats=37``).

No line ever carries an owner token or a password in full: owner tokens are not passed here,
and as a second line of defence any run of 32..64 hex digits is cut to its first 6 and any URL
password is masked.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from ._clock import monotonic
from ._names import mask_url

__all__ = ["LOGGER", "REPEAT_WINDOW", "lease_log", "redact"]

LOGGER = "celery_lease.events"
log = logging.getLogger(LOGGER)

#: Seconds during which repeats of one event on one resource are counted, not logged.
REPEAT_WINDOW = 10.0
#: Repeat records kept at most (oldest dropped first): a bound on memory, not on correctness.
MAX_TRACKED = 4096

_TOKEN = re.compile(r"(?<![0-9A-Fa-f])([0-9a-f]{6})[0-9a-f]{26,58}(?![0-9A-Fa-f])")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")
_lock = threading.Lock()
#: (event, resource, holder, task id) -> [logged at (monotonic), repeats left out since]
_seen: dict[tuple[str, str, str, str], list[float]] = {}
#: Events whose repeats across task executions are expected (see lease_log).
REPEATING = frozenset({"busy"})


def redact(value: object) -> str:
    """``value`` as text with owner-token-like hex runs cut and URL passwords masked."""
    text = str(value)
    if "://" in text:
        text = _URL.sub(lambda m: mask_url(m.group(0)), text)
    return _TOKEN.sub(r"\1...", text)


_VERBATIM = frozenset({"resource", "task_id"})


def _quote(text: str) -> str:
    if not text or any(c in text for c in " \"'=\n\t"):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def lease_log(
    event: str,
    level: int,
    *,
    resource: str | None,
    fence: int | None,
    holder: str | None,
    task_id: str | None,
    task: str | None = None,
    **fields: Any,
) -> bool:
    """Log one lease event (``busy``, ``lost``, ``recovered``, ``duplicate``, ...).

    Args:
        event: what happened.
        level: the logging level.
        resource, fence, holder, task_id, task: who and what; holder is an owner *label*.
        **fields: more ``key=value`` pairs (a reason, a wait, an error message).

    Returns:
        True if the line went out, False if it was a repeat within the window.
    """
    if not log.isEnabledFor(level):
        return False
    # A busy wait repeats by nature (a waiting task comes back every backoff, and many tasks
    # wait for one holder): its repeats are the same resource and holder. Any other event is a
    # repeat only for the same task execution and effect or gate key (one execution may spare
    # several effects).
    execution = "" if event in REPEATING else f"{task_id or ''}|{fields.get('key') or ''}"
    key = (event, resource or "", holder or "", execution)
    now = monotonic()
    with _lock:
        seen = _seen.get(key)
        if seen is not None and now - seen[0] < REPEAT_WINDOW:
            seen[1] += 1
            return False
        repeats = 0 if seen is None else int(seen[1])
        if seen is None and len(_seen) >= MAX_TRACKED:
            # Drop the oldest records (dicts keep insertion order).
            for old in list(_seen)[: MAX_TRACKED // 4]:
                del _seen[old]
        _seen.pop(key, None)
        _seen[key] = [now, 0]
    record: dict[str, Any] = {
        "event": event,
        "task": task,
        "task_id": task_id,
        "resource": resource,
        "fence": fence,
        "holder": holder,
    }
    record.update(fields)
    if repeats:
        record["repeats"] = repeats
    # Resource and task id are shown as they are (a resource may well contain a hex digest);
    # every other value is redacted.
    safe = {
        k: (mask_url(v) if k in _VERBATIM else redact(v)) if isinstance(v, str) else v
        for k, v in record.items()
    }
    pairs = " ".join(
        f"{k}={_quote(str(v))}"
        for k, v in safe.items()
        if v is not None and k not in ("event", "task", "task_id")
    )
    if task is not None or task_id is not None:
        log.log(
            level,
            "task %s[%s] %s: %s",
            safe["task"],
            safe["task_id"],
            event,
            pairs,
            extra={"lease": safe},
        )
    else:
        log.log(level, "lease %s: %s", event, pairs, extra={"lease": safe})
    return True


def reset() -> None:
    """Forget the repeat records (for tests)."""
    with _lock:
        _seen.clear()
