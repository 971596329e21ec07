"""Numbers the wait list's bounds share across the store contract and the Lua and SQL text."""

from __future__ import annotations

__all__ = ["REARM_GROWTH"]

#: How many bytes a re-armed waiter's new wake payload may outgrow the one it replaces
#: whatever the list's bytes (invariant 12 of stores/base.py): its waits count gains a digit
#: now and then, its woken copy's message carries the lineage header its first listing did
#: not. A kept old payload would count fewer waits than the waiter's copies do (its woken copy
#: would then skip the result-backend read of its last allowed wait), so such growth may pass
#: the bytes cap by this much per listed waiter; the list stays bounded, and a bigger change is
#: not taken past the cap.
REARM_GROWTH = 64
