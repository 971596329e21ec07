"""This process's id, without a system call per read.

The hot paths (a claim, each store round trip's connection free list) check that they still run
in the process that made their state, to never reuse a parent's connection or renewer in a
forked child. ``os.getpid()`` is a system call each time (glibc no longer caches it): about seven
per leased task. :func:`getpid` returns the id read at import, refreshed in a forked child by an
``os.register_at_fork`` hook, registered when the package is imported (before its other modules,
so it runs first among the package's own fork hooks).
"""

from __future__ import annotations

import os

__all__ = ["getpid"]

_pid = os.getpid()


def getpid() -> int:
    """This process's id (``os.getpid()``, kept up to date across ``fork()``)."""
    return _pid


def _after_fork_in_child() -> None:
    global _pid  # noqa: PLW0603 - one value per process
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):  # (no fork() without it, as on Windows: nothing to refresh)
    os.register_at_fork(after_in_child=_after_fork_in_child)
