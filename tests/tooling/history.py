"""A history of what every process did, and a checker for the safety properties.

Processes append JSON lines to files in one directory (``record``), one ``write`` per event with
``O_APPEND`` so lines from concurrent writers never interleave. Each event carries ``mono_ns``
(``time.monotonic_ns()``, one clock for every process on the machine) so the history can be put
in real-time order. After the run :func:`check` verifies:

1. acquisitions of each resource carry strictly increasing fences (in time order);
2. writes *accepted* by a fenced side effect carry non-decreasing fences per key, in the order
   the side effect accepted them (``seq`` when the side effect numbers them, else time);
3. each idempotency key took effect at most once (``effect`` events with ``result == "ok"``).

Event shapes: ``{"op": "acquire", "resource", "fence"}``, ``{"op": "write", "key", "fence",
"result": "ok" | "rejected", "seq"?}``, ``{"op": "effect", "idem", "result": "ok"}``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report", "check", "load", "record"]


def record(directory: str | os.PathLike[str], **event: Any) -> None:
    """Append one event to this process's history file in ``directory``."""
    event.setdefault("mono_ns", time.monotonic_ns())
    event.setdefault("pid", os.getpid())
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    path = Path(directory) / f"history-{os.getpid()}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def load(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of all processes, in time order."""
    events = []
    for path in sorted(Path(directory).glob("history-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    events.sort(key=lambda e: (e["mono_ns"], e.get("seq", 0)))
    return events


@dataclass
class Report:
    """What the checker found; ``violations`` is empty for a clean history."""

    events: int
    violations: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def clean(self) -> bool:
        return not self.violations

    def assert_clean(self) -> None:
        if self.violations:
            shown = "\n  ".join(self.violations[:20])
            more = len(self.violations) - 20
            raise AssertionError(
                f"history of {self.events} events has {len(self.violations)} violations:\n  "
                f"{shown}" + (f"\n  ... and {more} more" if more > 0 else "")
            )


def check(events: list[dict[str, Any]]) -> Report:
    """Check the three safety properties over an ordered history (see module docstring)."""
    report = Report(events=len(events))
    last_acquire: dict[str, int] = {}
    writes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    effects: Counter[str] = Counter()
    for event in events:
        op = event.get("op")
        report.counts[str(op)] += 1
        if op == "acquire":
            resource, fence = event["resource"], int(event["fence"])
            previous = last_acquire.get(resource)
            if previous is not None and fence <= previous:
                report.violations.append(
                    f"fence did not increase on {resource}: {fence} after {previous}"
                )
            last_acquire[resource] = max(fence, previous or fence)
        elif op == "write" and event.get("result") == "ok":
            writes[event["key"]].append(event)
        elif op == "effect" and event.get("result") == "ok":
            effects[event["idem"]] += 1
    for key, accepted in writes.items():
        accepted.sort(key=lambda e: (e.get("seq", 0), e["mono_ns"]))
        highest = None
        for event in accepted:
            fence = int(event["fence"])
            if highest is not None and fence < highest:
                report.violations.append(
                    f"stale write accepted on {key}: fence {fence} after {highest} "
                    f"(pid {event.get('pid')})"
                )
            highest = fence if highest is None else max(highest, fence)
    for idem, times in effects.items():
        if times > 1:
            report.violations.append(f"idempotency key {idem} took effect {times} times")
    return report
