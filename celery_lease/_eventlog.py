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

__all__ = ["LOGGER", "REPEAT_WINDOW", "SHORTEN_LOOKAHEAD", "lease_log", "redact", "shorten"]

LOGGER = "celery_lease.events"
log = logging.getLogger(LOGGER)

#: Seconds during which repeats of one event on one resource are counted, not logged.
REPEAT_WINDOW = 10.0
#: Repeat records kept at most (oldest dropped first): a bound on memory, not on correctness.
MAX_TRACKED = 4096

_TOKEN = re.compile(r"(?<![0-9A-Fa-f])([0-9a-f]{6})[0-9a-f]{26,58}(?![0-9A-Fa-f])")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")
#: How far past its cut :func:`shorten` reads: a token (at most 64 characters) that the cut
#: runs through is seen whole there, so it is redacted before the cut, never half shown.
SHORTEN_LOOKAHEAD = 64
_SPACE = re.compile(r"\s")
_lock = threading.Lock()
#: (event, resource, holder, task id) -> [logged at (monotonic), repeats left out since]
_seen: dict[tuple[str, str, str, str], list[float]] = {}
#: Events whose repeats across task executions are expected (see lease_log).
REPEATING = frozenset({"busy"})


#: Lowercase hex digits to ``h``, every other byte to ``.``: a text holds a run of 32 of them
#: (what _TOKEN needs) only if its translation holds 32 ``h`` in all, and ``h`` * 32 in a row.
#: C-speed looks first, because the regex costs microseconds even where it finds nothing, and
#: a holder label's arguments are redacted on every claim.
_HEX_MAP = bytes(ord("h") if chr(i) in "0123456789abcdef" else ord(".") for i in range(256))
_HEX_RUN = b"h" * 32
_H = ord("h")


def redact(value: object) -> str:
    """``value`` as text with owner-token-like hex runs cut and URL passwords masked."""
    text = str(value)
    # (mask_url changes only a URL with a password, before an '@', or a '?' query)
    if "://" in text and ("@" in text or "?" in text):
        text = _URL.sub(lambda m: mask_url(m.group(0)), text)
    if len(text) >= 32:
        marks = text.encode("latin-1", "replace").translate(_HEX_MAP)
        # (counting is a memchr; finding the 32-byte run costs more: only when it may be there)
        if marks.count(_H) >= 32 and _HEX_RUN in marks:
            text = _TOKEN.sub(r"\1...", text)
    return text


def shorten(value: str, limit: int) -> str:
    """``value`` redacted (see :func:`redact`) in at most ``limit`` characters.

    A longer value is cut and ends in ``...``. Only ``limit`` + 64 characters are read, so the
    cost does not grow with the value. The cut never shows part of a secret: a token it runs
    through is read whole and redacted first, and a URL it runs through keeps only its scheme
    (its password may lie past what was read, so it cannot be masked, only left out).
    """
    if limit < 4:
        return ""
    if len(value) <= limit:  # (the common case: one redact, nothing to cut)
        text = redact(value)
        if len(text) <= limit:
            return text
    else:
        text = redact(value[: limit + SHORTEN_LOOKAHEAD])
    cut = text[: limit - 3]
    scheme = cut.rfind("://")
    if scheme >= 0 and _SPACE.search(cut, scheme) is None:  # a URL runs into the cut
        cut = cut[: scheme + 3]
    return cut + "..."


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
