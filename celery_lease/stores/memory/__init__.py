"""The in-process lease store for users' unit tests: :class:`MemoryLeaseStore`.

It was one module, ``stores/memory.py``; its parts are the modules of this package.
"""

from __future__ import annotations

from .store import MemoryLeaseStore

__all__ = ["MemoryLeaseStore"]
