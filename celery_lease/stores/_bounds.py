"""Numbers the wait list's bounds share across the store contract and the Lua and SQL text."""

from __future__ import annotations

__all__ = [
    "POLL",
    "POLL_HOLD",
    "POLL_PLACES",
    "REARM_GROWTH",
    "RENEW_BATCH",
    "SINCE_SKEW",
    "WAKE_DUE_SKIP",
]

#: The wake payload of a polling place: a waiter nobody sends a message to (it has no identity
#: to deduplicate two copies of it, its message is over its task's bound, or the list had no
#: room for it); its own back-off copy comes back to claim. Not JSON, so no task's message.
POLL = "-"
#: The free resource is held this many graces for a polling waiter whose turn came (it polls
#: once a grace, so one of its polls lands while the resource is held for it).
POLL_HOLD = 2
#: A wait list holds at most this many times ``wait_cap`` places in all, polling ones included
#: (a polling place costs a line, not a message).
POLL_PLACES = 4

#: How many bytes a re-armed waiter's new wake payload may outgrow the one it replaces
#: whatever the list's bytes (invariant 12 of stores/protocol.py): its waits count gains a digit
#: now and then, its woken copy's message carries the lineage header its first listing did
#: not. A kept old payload would count fewer waits than the waiter's copies do (its woken copy
#: would then skip the result-backend read of its last allowed wait), so such growth may pass
#: the bytes cap by this much per listed waiter; the list stays bounded, and a bigger change is
#: not taken past the cap.
REARM_GROWTH = 64

#: How far (seconds) a claim's ``since=`` (when its message was published, by the publishing
#: process's clock: ``order="publish"``) may lie ahead of the store's clock and still place it
#: as it is (invariant 12); a later one counts as this far ahead. Publish order compares stamps
#: from the publishers' clocks with the store's: a publisher a little fast (20 ms) used to have
#: its stamps counted as "now", which let a message published after it but claiming first go
#: ahead. NTP keeps hosts within milliseconds of each other, a host that lost its time source
#: or a VM resumed from a pause drifts by seconds; past a few seconds the clock is wrong rather
#: than skewed. The cap keeps what it is for: a stamp far in the future would let every claim
#: arriving until then go ahead of its place (a place is not reordered, and a re-arm keeps it
#: alive); now such a place is overtaken for at most this long. Not 2 s or a multiple of it:
#: tests/stores/test_lockstep.py runs its steps in 2 s periods and needs every time a step sets
#: to fall between them.
SINCE_SKEW = 5.0

#: The most resources held by a live lease that ``wake_due`` without ``resources=`` reads past
#: in one shard per call on Redis (invariant 16): a held resource does not count against the
#: limit, so the script reads on through the shard's list index, and this bounds what a call
#: can cost (one field of a batched HMGET each: 1,000 took 3.7 ms of server time on a loaded
#: 2-core box; the script blocks the server meanwhile, and a single server's call covers every
#: shard). A resource with waiters is held by a running task (or one that died, until its
#: ttl): a shard passes this only when that many contended resources are worked on at once in
#: it (16 shards by default). A free resource further on is then left for its waiters' own
#: copies (a back-stop copy claims it, or wakes the head) or a later pass. Memory and SQL read
#: on without a bound (SQL through its list index, outside the server's one thread).
WAKE_DUE_SKIP = 1000

#: Most leases one round trip of ``renew_many`` renews; more go in batches of this many, one
#: after another. PostgreSQL takes at most 65,535 parameters per statement (its renewal sends 5
#: per lease: 13,107 leases at most), and a Redis script blocks the server while it runs (about
#: 17 us per lease: 100k leases in one script blocked it 1.7 s, and past ``busy-reply-threshold``
#: other clients get BUSY). A batch of 1,000 blocks Redis for about 20 ms and costs little more
#: per lease than one call for all (docs/performance.md, "At scale").
RENEW_BATCH = 1000
