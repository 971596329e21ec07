"""The SQL lease store: claims and releases (the per-task path), one statement each.

:class:`SQLLeaseStore` is made of one class per job: :mod:`.core` (set-up: engine, tables,
statements, the wait-list functions, health), :mod:`.upkeep` (renewal, reads, listing,
eviction, sweeping), :mod:`.identity` (identity records, effects, checkpoints: the store's side
of :mod:`.ledger`), :mod:`.gates` (fence gates and once-marks), :mod:`.wait_lists` (wait-list
reads and the wakes ``wake_due`` passes on). Claims and releases stay here, on the class
itself, with the two constants they read (``CLAIM_TRIES``, ``LOCK_AFTER_STALE``).

The hot path sends hand-written statements (built once per store with the dialect's quoting)
straight through the pooled DBAPI connection: a claim or a release is one statement in
autocommit mode. Going through SQLAlchemy's execution layer with a
transaction per call cost more than half the throughput of raw psycopg in our benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._codec import decode, from_micros
from ..._errors import IdentityDoneError, LeaseBusyError
from ..._lease import Lease, Owner
from .._connections import Once
from ..base import monotonic, previous_owner
from . import ledger, waits
from . import wait_statements as wait_sql
from .connection import fetch, one
from .gates import SQLGates
from .identity import SQLIdentity
from .rows import NO_ROW, ClaimRow, recovered_from, why_lost
from .schema import SCHEMA_VERSION, TABLE_RIGHTS
from .upkeep import SQLUpkeep
from .wait_lists import SQLWaitLists

__all__ = ["SCHEMA_VERSION", "TABLE_RIGHTS", "SQLLeaseStore"]

#: How many times a claim asks again when its snapshot went stale (PostgreSQL: it waited for the
#: lease row while a claim or release committed on it, see fbfe5cf). Each stale answer means a
#: hand-over committed meanwhile, so a claim racing a fast hand-off may need several; giving up
#: refuses it without a place in the wait list (it then waits with the back-off and joins at the
#: tail later: overtaken by every later arrival). 3 was seen to give up for 14-29 % of refused
#: claims racing hand-overs every few ms.
CLAIM_TRIES = 50
#: After this many stale answers a PostgreSQL claim takes the lease row first (``SELECT ... FOR
#: UPDATE``, then the claim, in one transaction: one more round trip), so its statement's
#: snapshot is taken with the row locked and cannot go stale. Asking again alone was not
#: enough: with hand-overs committing back to back on a loaded box a claim's every snapshot
#: could be stale, and after CLAIM_TRIES it was refused without a place (seen once in CI: a
#: joiner of test_claim_races not queued). None: never (the tests' control).
LOCK_AFTER_STALE: int | None = 2


class SQLLeaseStore(SQLWaitLists, SQLIdentity, SQLGates, SQLUpkeep):
    """Leases in a SQL table (PostgreSQL through psycopg 3, or SQLite).

    Args:
        engine: a SQLAlchemy ``Engine`` to use (not disposed by :meth:`close`); or give ``url``.
        url: ``postgresql+psycopg://user:pw@host:port/db`` or ``sqlite:///path.db`` (or
            ``sqlite://`` for a private in-memory database); the store owns that engine.
        table_prefix: prefix of the table names, default ``celery_lease_``.
        create_tables: create the tables (idempotently) when the store is made.
        max_ttl: the largest ttl accepted.
        statement_timeout: PostgreSQL statement and lock timeout in seconds, so a stuck
            statement cannot pin a row lock; also the client's connect timeout and TCP user
            timeout, with keepalive probes on idle connections, so a dead peer cannot block
            a call until TCP gives up (only for an engine the store creates).
        engine_options: extra keyword arguments for ``sqlalchemy.create_engine``.
    """

    # -- claims and releases --------------------------------------------------------------
    def acquire(
        self,
        resource: str,
        owner: Owner,
        ttl: float,
        *,
        identity: str | None = None,
        wait: str | None = None,
        wait_ttl: float = 120.0,
        attempt: int | None = None,
        waiter: str | None = None,
        since: int | None = None,
        early_wake: bool = False,
        own_wake: bool = False,
    ) -> Lease:
        ttl, identity, name, payload, attempt = self._claim_checks(
            resource, owner, ttl, identity, waiter, since, wait, wait_ttl, attempt
        )
        ttl_us = max(1, round(ttl * 1e6))
        params = {
            "r": resource,
            "t": owner.token,
            "l": owner.label,
            "ttl": ttl_us,
            "i": identity,
            "w": payload or None,
            "wttl": max(1, round(wait_ttl * 1e6)),
            "cap": self.wait_cap,
            "wbytes": self.wait_bytes_cap,
            "grace": max(1, round(self.handoff_grace * 1e6)),
            "a": attempt,
            # (invariant 15, PostgreSQL: SQLite's statements do not name them)
            "nw": early_wake,
            "ow": own_wake,
            "pn": name,
            "since": since,
            "skew": self._since_skew_us,
        }
        claim = self._claim if identity is None else self._claim_identity
        if not self._functions_known:
            self._use_functions(create=False)
        lock_from = CLAIM_TRIES  # (the try from which the claim takes the row first)
        if self.dialect == "postgresql" and LOCK_AFTER_STALE is not None:
            lock_from = LOCK_AFTER_STALE
        for tries in range(CLAIM_TRIES):
            sent = monotonic()
            if tries < lock_from:
                row = self._run_waits(f"acquire of {resource!r}", lambda c: claim(c, params))
            else:
                row = self._run_waits(
                    f"acquire of {resource!r}", lambda c: self._locked_claim(c, claim, params)
                )
            if row is None:  # a racing first claim is not visible to our snapshot yet: ask again
                continue
            (claimed, marked, fence, acquired, expires, prev_label, prev_fence, h_token, h_label,
             h_fence, h_acquired, h_expires, i_state, i_fence, i_label, i_result, ckpt,
             now, h_prev_label, h_prev_fence) = row[:20]  # ClaimRow fields, in order  # fmt: skip
            if identity is not None and not claimed and i_state == "done":
                raise IdentityDoneError.completed(resource, identity, i_fence, i_result, i_label)
            if claimed and not marked:
                # The identity was completed by a run that committed after our snapshot: give
                # the lease back and report the duplicate.
                assert identity is not None
                return self._completed_meanwhile(resource, owner, identity, fence, acquired, ttl)
            if not claimed:
                if row.hold is not None:  # free, and held for the head waiter: wait behind it
                    raise LeaseBusyError.held(
                        resource,
                        f"the waiting task {row.hold} (hand-off)",
                        int(h_fence or 0),
                        (row.hold_until - now) / 1e6,
                        position=row.position,
                        wake=row.wake,
                        polling=bool(row.polling),
                    )
                if h_token is None or h_expires <= now:
                    # Our snapshot shows the lease free (released or expired), but a claim
                    # racing ours committed first: held by an owner we cannot see yet. (Also
                    # an identity claim whose lease row was claimed or released while it
                    # waited for the row lock: its snapshot's identity state may be stale.)
                    continue
                if h_token != owner.token:
                    raise LeaseBusyError.held(
                        resource,
                        h_label,
                        int(h_fence),
                        (h_expires - now) / 1e6,
                        # the holder runs this very identity: a duplicate of running work
                        duplicate=i_state == "running" and i_fence == h_fence,
                        position=row.position,
                        polling=bool(row.polling),
                    )
                # The same claim retried after a lost reply: the same lease, and what the first
                # attempt recovered (the lease row's prev_*, the identity row's hidden facts).
                fence, acquired, expires = h_fence, h_acquired, h_expires
                prev_label, prev_fence = h_prev_label, h_prev_fence
                ours = i_state == "running" and i_fence == h_fence
                i_state, i_fence, i_label = recovered_from(i_result if ours else None)
            if i_fence == fence:
                i_state = None  # the identity row is this claim's own mark, not an earlier run
            prev_label, prev_fence = previous_owner(
                prev_label, prev_fence, i_label, i_fence if i_state is not None else None
            )
            lease = Lease(
                resource=resource,
                owner=owner,
                fence=int(fence),
                acquired_at=int(acquired),  # (datetimes when first read)
                expires_at=int(expires),
                ttl=ttl,
                sent_monotonic=sent,
                store=self,
                previous_owner_label=prev_label if prev_fence is not None else None,
                previous_fence=int(prev_fence) if prev_fence is not None else None,
                identity=identity,
                identity_state=i_state,
                checkpoints=decode(ckpt) if ckpt and prev_fence is not None else None,
                identity_owner_label=i_label if i_state is not None else None,
                identity_fence=int(i_fence) if i_state is not None and i_fence else None,
            )
            lease.next_wake = row.next_wake  # (also for the same claim sent again)
            if claimed:  # (sent again, it has no place: the first run took it)
                lease.own_wake = row.own_wake
            return lease
        raise LeaseBusyError.held(resource, None, None, None)

    def _locked_claim(
        self,
        cursor: Any,
        claim: Callable[[Any, dict[str, Any]], ClaimRow | None],
        params: dict[str, Any],
    ) -> ClaimRow | None:
        """``claim`` in a transaction that first takes the lease row (PostgreSQL): its statement
        then sees the row as it stands and nobody changes it before the claim commits."""
        with cursor.connection.transaction():
            cursor.execute(self.sql.lock_row, {"r": params["r"]})
            return claim(cursor, params)

    def _completed_meanwhile(
        self, resource: str, owner: Owner, identity: str, fence: int, acquired: int, ttl: float
    ) -> Lease:
        lease = Lease(
            resource=resource,
            owner=owner,
            fence=int(fence),
            acquired_at=from_micros(acquired),
            expires_at=from_micros(acquired),
            ttl=ttl,
            sent_monotonic=monotonic(),
            store=self,
        )
        self.release(lease)
        info = self.identity_get(resource, identity)
        raise IdentityDoneError.completed(
            resource,
            identity,
            None if info is None else info.fence,
            None if info is None else info.result,
            None if info is None else info.owner_label,
        )

    def _claim(self, cursor: Any, params: dict[str, Any]) -> ClaimRow | None:
        """The claim without identity, answered as a ClaimRow."""
        if self.dialect == "postgresql":
            row = wait_sql.fetch(cursor, self.sql.acquire_raw, params)
            return None if row is None else ClaimRow(*row)
        with self._connections.immediate(cursor):
            cursor.execute(self.sql.acquire, params)
            claim = cursor.fetchone()
            if claim is None:
                cursor.execute(self.sql.holder, params)
                holder = one(cursor)
                if holder is None:
                    return None
                claim, refused = waits.settle(cursor, self.sql, params, holder, duplicate=False)
                if claim is None:
                    return ClaimRow(0, 0, **refused)
        fence, acquired, expires, prev_label, prev_fence = claim
        return ClaimRow(
            1,
            1,
            fence=fence,
            acquired=acquired,
            expires=expires,
            prev_label=prev_label,
            prev_fence=prev_fence,
            now=acquired,
        )

    def verify(self, lease: Lease) -> None:
        self._renew_ttl(lease, None)
        params = {"r": lease.resource}
        row = self._connections.run(
            f"verify of {lease.resource!r}",
            lambda c: fetch(c, self.sql.state, params),
        )
        token, label, fence, expires, now, forced = row or NO_ROW
        if token == lease.owner.token and fence == lease.fence and expires > now:
            return
        raise why_lost(lease, token, label, fence, expires, now, forced)

    def release(
        self,
        lease: Lease,
        *,
        outcome: str | None = None,
        result: str | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> bool:
        """See :meth:`LeaseStore.release`; ``meanwhile`` (called once, also when the call
        fails) runs while the release's answer is awaited on PostgreSQL (the statement is on
        its way first), after the release on SQLite (whose release is not sent anywhere)."""
        if meanwhile is not None:
            meanwhile = Once(meanwhile)
            if self.dialect != "postgresql":
                try:
                    return self.release(lease, outcome=outcome, result=result)
                finally:
                    meanwhile()
        self._release_checks(lease, outcome)
        params = {"r": lease.resource, "t": lease.owner.token, "f": lease.fence}

        params["grace"] = max(1, round(self.handoff_grace * 1e6))
        lease.handoff = None
        if not self._functions_known:
            self._use_functions(create=False)

        def work(cursor: Any) -> tuple[int, str | None]:
            if outcome is not None:
                return ledger.release_outcome(
                    self._connections,
                    self.sql,
                    self.ledger_sql,
                    cursor,
                    {
                        **params,
                        "i": lease.identity,
                        "o": outcome,
                        "res": result if outcome == "done" else None,
                    },
                    self._retention_us,
                    meanwhile,
                )
            if self.dialect == "postgresql":
                return wait_sql.released(
                    wait_sql.fetch(cursor, self.sql.release_raw, params, meanwhile)
                )
            with self._connections.immediate(cursor):
                return waits.release_sqlite(cursor, self.sql, params)

        try:
            released, lease.handoff = self._run_waits(f"release of {lease.resource!r}", work)
        finally:
            if meanwhile is not None:
                meanwhile()  # (once: not again when the statement ran it)
        return released == 1

    def _claim_identity(self, cursor: Any, params: dict[str, Any]) -> ClaimRow | None:
        return ledger.claim_identity(
            self._connections, self.sql, self.ledger_sql, cursor, params, self._retention_us
        )
