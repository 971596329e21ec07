"""Named failpoints for crash testing, driven by one environment variable.

``CELERY_LEASE_FAILPOINTS="after_acquire=kill,inside_release=raise"`` makes the named sites
act: ``kill`` (SIGKILL this process), ``raise`` (raise FailpointError), ``sleep:<seconds>``,
``pause`` (SIGSTOP this process). A site may be limited to the first N hits with ``*N``
(``after_acquire=kill*1``) and, across processes, by a marker file: with
``CELERY_LEASE_FAILPOINTS_ONCE=/path``, a site fires only if it can create ``/path.<site>``.

Without the variable, :func:`hit` is a single global flag test: nothing else runs.

Sites: ``after_acquire``, ``after_effect_before_ledger``, ``after_ledger_before_ack``,
``inside_renew``, ``inside_release``, ``inside_reconcile``, ``before_wake`` (the release
handed the resource over and the head waiter's message is not sent yet), ``after_wake`` (it
is sent), ``after_early_wake`` (the release is sent and the next waiter's message went out
while its reply is awaited; see ``lease_handoff_early_wake``), ``before_give_up`` (a copy
refused at its last allowed wait read no final state of its task and is about to give up).
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["ENABLED", "SITES", "FailpointError", "hit"]

SITES = (
    "after_acquire",
    "after_effect_before_ledger",
    "after_ledger_before_ack",
    "inside_renew",
    "inside_release",
    "inside_reconcile",
    "before_wake",
    "after_wake",
    "after_early_wake",
    "before_give_up",
)


class FailpointError(RuntimeError):
    """Raised by a failpoint set to ``raise``."""


def _parse(spec: str) -> dict[str, tuple[str, int]]:
    actions: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        site, _, action = item.partition("=")
        action, _, times = action.partition("*")
        if site not in SITES:
            raise ValueError(f"unknown failpoint {site!r}; known: {', '.join(SITES)}")
        actions[site] = (action or "raise", int(times) if times else -1)
    return actions


_SPEC = os.environ.get("CELERY_LEASE_FAILPOINTS", "")
ENABLED = bool(_SPEC)
_ACTIONS = _parse(_SPEC) if ENABLED else {}


def hit(site: str) -> None:
    """Act on the failpoint ``site`` if it is armed (no-op otherwise)."""
    if not ENABLED:
        return
    action = _ACTIONS.get(site)
    if action is None:
        return
    kind, times = action
    if times == 0:
        return
    once = os.environ.get("CELERY_LEASE_FAILPOINTS_ONCE")
    if once:
        try:
            fd = os.open(f"{once}.{site}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
    if times > 0:
        _ACTIONS[site] = (kind, times - 1)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "pause":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind.startswith("sleep:"):
        time.sleep(float(kind.split(":", 1)[1]))
    else:
        raise FailpointError(f"failpoint {site} fired")
