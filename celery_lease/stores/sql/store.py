"""The SQL lease store: PostgreSQL (psycopg 3) and SQLite, timed by the database clock.

SQLAlchemy 2 Core defines the tables, creates them idempotently, quotes the configurable table
names and owns the connection pool. The hot path sends hand-written statements (built once per
store with the dialect's quoting) straight through the pooled DBAPI connection: a claim or a
release is one statement in autocommit mode. Going through SQLAlchemy's execution layer with a
transaction per call cost more than half the throughput of raw psycopg in our benchmark.

Time is the database's: ``clock_timestamp()`` on PostgreSQL (``now()`` would be the transaction
start), ``julianday('now')`` on SQLite. Times are stored as microseconds since the epoch so both
dialects share one schema. On SQLite every operation runs in a ``BEGIN IMMEDIATE`` transaction
(WAL journal), which takes the write lock up front instead of failing on lock upgrade.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from ..._codec import decode, from_micros
from ..._errors import (
    IdentityDoneError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseLostError,
    LeaseStoreError,
)
from ..._lease import Lease, LeaseInfo, Owner
from ..._names import mask_url, validate_fence, validate_identifier, validate_resource
from .._connections import Once
from ..base import (
    DEFAULT_MAX_TTL,
    DEFAULT_RETENTION,
    DEFAULT_WAKE_DUE_LIMIT,
    MARK_IDENTITY,
    RECENT_EFFECTS,
    BaseLeaseStore,
    DueWake,
    IdentityInfo,
    IdentityRecords,
    LeasePage,
    Waiter,
    changed_hands,
    decode_cursor,
    encode_cursor,
    lease_info,
    log_force_release,
    monotonic,
    previous_owner,
)
from . import ledger, schema, waits
from . import statements as stmts
from . import wait_statements as wait_sql
from .connection import Connections, create_engine, fetch, first_line, one, sqlstate
from .ledger_statements import LedgerStatements
from .rows import NO_ROW, ClaimRow, recovered_from, why_lost
from .schema import SCHEMA_VERSION, TABLE_RIGHTS

__all__ = ["SCHEMA_VERSION", "TABLE_RIGHTS", "SQLLeaseStore"]

# The backend's logger name from before the stores became packages, so that logging set up for
# it keeps seeing this store's lines (the force-release warning above all).
log = logging.getLogger("celery_lease.stores.sql")
T = TypeVar("T")

_SQLITE_MIN = (3, 35, 0)  # RETURNING
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


class SQLLeaseStore(BaseLeaseStore):
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

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        url: str | None = None,
        table_prefix: str = "celery_lease_",
        create_tables: bool = True,
        max_ttl: float = DEFAULT_MAX_TTL,
        retention: float = DEFAULT_RETENTION,
        statement_timeout: float = 5.0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(max_ttl=max_ttl, retention=retention)
        validate_identifier(table_prefix, "table_prefix")
        if (engine is None) == (url is None):
            raise LeaseConfigError("SQLLeaseStore needs exactly one of engine= or url=")
        self._owns_engine = engine is None
        if engine is None:
            assert url is not None
            engine = create_engine(url, statement_timeout, engine_options or {})
        self.engine = engine
        self.url = mask_url(engine.url.render_as_string(hide_password=True))
        self.dialect = engine.dialect.name
        #: PostgreSQL: claims name the next waiter and releases run ``meanwhile`` while their
        #: statement is on its way (invariant 15). SQLite's release is not sent anywhere: a
        #: wake sent before it would only find the resource still held.
        self.supports_early_wake = self.dialect == "postgresql"
        if self.dialect not in ("postgresql", "sqlite"):
            raise LeaseConfigError(
                f"SQLLeaseStore supports PostgreSQL and SQLite, not {self.dialect!r} ({self.url})"
            )
        if self.dialect == "postgresql" and engine.dialect.driver != "psycopg":
            raise LeaseConfigError(
                f"SQLLeaseStore needs the psycopg 3 driver (postgresql+psycopg://), got "
                f"{engine.dialect.driver!r} in {self.url}"
            )
        if self.dialect == "sqlite":
            version = engine.dialect.loaded_dbapi.sqlite_version_info
            if version < _SQLITE_MIN:
                raise LeaseConfigError(
                    f"SQLite {version} is too old for SQLLeaseStore: 3.35 or newer is needed "
                    "(for RETURNING); upgrade Python or use PostgreSQL/Redis"
                )
        self._connections = Connections(engine, self.url)
        self.metadata, self.tables = schema.tables(table_prefix)
        self.leases_table, self.meta_table = self.tables["leases"], self.tables["meta"]
        quote = engine.dialect.identifier_preparer.quote
        names = {kind: quote(table.name) for kind, table in self.tables.items()}
        self.sql = stmts.Statements(
            self.dialect, names["leases"], self._paramstyle(), names["gate"], table_prefix, quote
        )
        self.ledger_sql = LedgerStatements(
            self.dialect,
            self.sql.now,
            self._paramstyle(),
            names,
            self.sql.claim_upsert,
            getattr(self.sql, "functions", None),
        )
        self._connections.grant_advice = lambda exc: schema.grant_advice(
            quote, self.tables, engine.url.username, exc
        )
        self._connections.schema_problem = lambda: schema.schema_problem(
            self._connections, self.tables
        )
        # PostgreSQL: whether the wait-list functions are there is found out by create_tables,
        # else before the first claim or release (a store makes no I/O when it is built).
        self._functions_known = self.dialect != "postgresql"
        self._fallback_lock = threading.Lock()
        if create_tables:
            try:
                self.create_tables()
            except BaseException:
                self.close()  # (the engine this store made would keep its pool otherwise)
                raise

    def _paramstyle(self) -> str:
        return "pyformat" if self.dialect == "postgresql" else "named"

    def create_tables(self) -> None:
        """Create the tables and the schema version row if missing; check the version.

        On PostgreSQL also create the wait-list functions of this version when missing and this
        role may (see :mod:`.wait_statements`); without them claims and releases still work,
        each carrying the whole wait-list logic (more server CPU per call).
        """
        schema.create_tables(self._connections, self.metadata, self.tables)
        self._use_functions(create=True)

    def _use_functions(self, *, create: bool) -> None:
        if self.dialect != "postgresql":
            return
        available = schema.wait_functions(
            self._connections,
            self.sql.functions,
            self.leases_table.name,
            create=create,
            table=self._quote(self.leases_table.name),
        )
        self.sql.use_functions(available)
        self.ledger_sql.use_functions(available)
        self._functions_known = True

    def _run_waits(self, what: str, work: Callable[[Any], T]) -> T:
        """Run a claim or release that may call the wait-list functions.

        Functions dropped, or their EXECUTE revoked, after this store chose them fail the one
        statement (autocommit: nothing was written): switch to the one-statement forms, warn
        once, and run the operation again.
        """
        try:
            return self._connections.run(what, work)
        except LeaseStoreError as exc:
            if not self._functions_failed(exc.__cause__):
                raise
        return self._connections.run(what, work)

    def _functions_failed(self, exc: BaseException | None) -> bool:
        if self.dialect != "postgresql" or exc is None:
            return False
        if sqlstate(exc) not in ("42883", "42501"):  # undefined_function, insufficient_privilege
            return False
        orig = getattr(exc, "orig", exc)
        functions = self.sql.functions
        names = [name.strip('"') for name in (functions.settle, functions.hand_off)]
        if not any(name in str(orig) for name in names):
            return False
        with self._fallback_lock:
            if self.sql.acquire_raw is self.sql.fast_raw[0]:
                self.sql.use_functions(False)
                self.ledger_sql.use_functions(False)
                log.warning(
                    "PostgreSQL lease store %s: the wait-list functions %s and %s failed (%s): "
                    "using the one-statement forms from now on (more server CPU per call); as "
                    "the tables' owner run `celery -A proj lease init-schema --url OWNER_URL` "
                    "to create them again",
                    self.url,
                    functions.settle,
                    functions.hand_off,
                    first_line(exc),
                )
        return True

    def grant_statements(self, role: str) -> builtins.list[str]:
        """The ``GRANT`` statements that give ``role`` what the store needs, and no more.

        Run them as the tables' owner after :meth:`create_tables` (``celery -A proj lease
        init-schema --grant ROLE`` does both); the role then needs no right to create anything.
        """
        return schema.grant_statements(self._quote, self.tables, role)

    def _grant(self, kind: str, role: str) -> str:
        return schema.grant_statements(self._quote, self.tables, role, kind)[0]

    def _quote(self, name: str) -> str:
        return str(self.engine.dialect.identifier_preparer.quote(name))

    # -- operations ------------------------------------------------------------------------
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

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        if not leases:
            return []
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent = monotonic()
        rows = self._connections.run(
            "renewal", lambda c: self._renew_rows(c, leases, ttls), self._connections.renewer_free
        )
        results: list[LeaseLostError | None] = []
        for lease, lease_ttl, row in zip(leases, ttls, rows, strict=True):
            new_expires, *state = row
            if new_expires is not None:
                lease.renewed(sent, from_micros(new_expires), lease_ttl)
                results.append(None)
            else:
                results.append(why_lost(lease, *state))
        return results

    def _renew_rows(
        self, cursor: Any, leases: Sequence[Lease], ttls: Sequence[float]
    ) -> list[tuple[Any, ...]]:
        requests = [
            (lease.resource, lease.owner.token, lease.fence, max(1, round(t * 1e6)))
            for lease, t in zip(leases, ttls, strict=True)
        ]
        if self.dialect == "postgresql":
            flat = [v for i, r in enumerate(requests) for v in (i, *r)]
            cursor.execute(self.sql.renew_many(len(requests)), flat)
            by_index = {row[0]: tuple(row[1:]) for row in cursor.fetchall()}
            return [by_index[i] for i in range(len(requests))]
        rows: list[tuple[Any, ...]] = []
        with self._connections.immediate(cursor):
            for resource, token, fence, ttl_us in requests:
                params = {"r": resource, "t": token, "f": fence, "ttl": ttl_us}
                cursor.execute(self.sql.renew_one, params)
                renewed = cursor.fetchone()
                if renewed is not None:
                    rows.append((renewed[0], *NO_ROW))
                    continue
                cursor.execute(self.sql.state, params)
                rows.append((None, *(cursor.fetchone() or NO_ROW)))
        return rows

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

    # -- identities, the ledger, checkpoints (see .ledger) ---------------------------------
    def effect_begin(self, lease: Lease, key: str) -> tuple[str, int | None, str | None]:
        identity, key = self._ledger_args(lease, key)
        return ledger.effect_begin(
            self._connections, self.ledger_sql, lease, identity, key, self._retention_us
        )

    def effect_done(self, lease: Lease, key: str, receipt: str) -> bool:
        identity, key = self._ledger_args(lease, key)
        return ledger.effect_done(
            self._connections, self.ledger_sql, lease, identity, key, receipt, self._retention_us
        )

    def checkpoint(self, lease: Lease, data: str) -> None:
        identity, _ = self._ledger_args(lease, "checkpoint")
        ledger.checkpoint(
            self._connections, self.ledger_sql, lease, identity, data, self._retention_us
        )

    def identity_get(self, resource: str, identity: str) -> IdentityInfo | None:
        validate_resource(resource)
        ident = self._identity_args(identity) or ""
        return ledger.identity_get(self._connections, self.ledger_sql, resource, ident)

    def identity_records(
        self, resource: str, identity: str, *, limit: int = RECENT_EFFECTS
    ) -> IdentityRecords:
        resource, ident, limit = self._records_args(resource, identity, limit)
        return ledger.identity_records(self._connections, self.ledger_sql, resource, ident, limit)

    def sweep_expired(self, *, limit: int = 1000) -> int:
        statements = [*self.ledger_sql.sweep, self.sql.sweep_waits]
        return ledger.sweep(self._connections, statements, self._sweep_args(limit))

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        validate_resource(resource)
        params = {"r": resource}
        row = self._connections.run(
            f"wait list read of {resource!r}", lambda c: fetch(c, self.sql.waiters, params)
        )
        if row is None:
            return []
        raw, now = row
        return [
            Waiter(place, w[0], from_micros(w[1]), from_micros(w[2]), int(w[3]) > now)
            for place, w in enumerate(waits.Waits.read(raw, 0, now, 0).places, 1)
        ]

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        names, limit = self._wake_due_args(resources, limit)
        if names is None:
            query = {"n": limit}

            def candidates(cursor: Any) -> builtins.list[str]:
                cursor.execute(self.sql.due_candidates, query)
                return [row[0] for row in cursor.fetchall()]

            names = self._connections.run("wake_due scan", candidates)
        out: builtins.list[DueWake] = []
        for resource in names:
            out += self._wake_due_one(resource)
        return out

    def _wake_due_one(self, resource: str) -> builtins.list[DueWake]:
        """wake_due of one resource: decided in Python on its row (see waits.due), written
        back in the same BEGIN IMMEDIATE (SQLite) or only if the row is as it was read
        (PostgreSQL: a claim, release or another pass since then writes nothing here, and
        the next pass looks again)."""
        grace = max(1, round(self.handoff_grace * 1e6))
        params = {"r": resource}

        def work(cursor: Any) -> builtins.list[tuple[str, bool]]:
            with self._connections.immediate(cursor):
                cursor.execute(self.sql.due_read, params)
                row = cursor.fetchone()
                if row is None:
                    return []
                raw, slow, token, expires, fence, now = row
                if token is not None and expires > now:
                    return []  # held: its holder's release wakes the next waiter
                # (as read: waits.due changes the places it is given)
                old = raw if isinstance(raw, str) else json.dumps(raw)
                listed, sent = waits.due(raw, slow, now, grace)
                if not sent:
                    return []
                columns = waits.stored(listed)
                if self.dialect != "postgresql":
                    cursor.execute(self.sql.waits_write, {"r": resource, **columns})
                    return sent
                cursor.execute(
                    self.sql.due_write,
                    {
                        "r": resource,
                        "f": fence,
                        "old": old,
                        "oslow": slow,
                        **columns,
                    },
                )
                return sent if cursor.rowcount == 1 else []

        sent = self._connections.run(f"wake_due of {resource!r}", work)
        return [DueWake(resource, payload, again) for payload, again in sent]

    def get(self, resource: str) -> LeaseInfo | None:
        validate_resource(resource)
        params = {"r": resource}
        row = self._connections.run(
            f"get of {resource!r}", lambda c: fetch(c, self.sql.get, params)
        )
        return None if row is None else lease_info(resource, *row)

    def highest_fence(self, resource: str) -> int | None:
        validate_resource(resource)
        params = {"r": resource}
        # (a released row keeps its fence: the state statement reads it, held or not)
        row = self._connections.run(
            f"fence read of {resource!r}", lambda c: fetch(c, self.sql.state, params)
        )
        return None if row is None else int(row[2])

    def list(
        self,
        *,
        prefix: str = "",
        expired_only: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> LeasePage:
        limit = self._list_args(prefix, limit)
        after = decode_cursor(cursor)
        query = {
            # substr, not LIKE: LIKE treats _ as a wildcard and ignores case on SQLite.
            "prefix": prefix,
            "plen": len(prefix),
            "after_e": -(2**62) if after is None else after[0],
            "after_r": "" if after is None else after[1],
            "n": limit + 1,
        }
        statement = self.sql.list_expired if expired_only else self.sql.list

        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(statement, query)
            return list(cur.fetchall())

        rows = self._connections.run("list", work)
        infos = [lease_info(*row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = encode_cursor(last[4], last[0])
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        validate_resource(resource)
        fence = self._fence_arg(fence)
        params = {"r": resource, "f": fence}
        shown: builtins.list[LeaseInfo] = []  # (SQLite: the lease that was not evicted)

        def work(cursor: Any) -> tuple[Any, ...] | None:
            if self.dialect == "postgresql":
                cursor.execute(self.sql.force_release, params)
                return one(cursor)
            with self._connections.immediate(cursor):
                cursor.execute(self.sql.get, params)
                row = cursor.fetchone()
                if fence is not None and (row is None or row[1] != fence):
                    if row is not None:
                        shown.append(lease_info(resource, *row))
                    return None
                cursor.execute(self.sql.force_release, params)
                return None if row is None else tuple(row)

        row = self._connections.run(f"force_release of {resource!r}", work)
        if row is not None and row[0] is not None:
            return log_force_release(lease_info(resource, *row), log)
        if fence is None:
            return None
        # Nothing evicted: no lease, or it changed hands (PostgreSQL reads which, after).
        current = shown[0] if shown else None
        if current is None and self.dialect == "postgresql":
            current = self.get(resource)
        if current is not None and current.fence != fence:
            raise changed_hands(resource, fence, current)
        return None

    # -- fence gate support (used by celery_lease.FenceGate) --------------------------------------
    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted and >= the fence this
        store granted ``key`` as a resource (its lease row's); one statement."""
        params = {"k": validate_resource(key), "f": validate_fence(fence)}

        def work(cursor: Any) -> tuple[Any, ...] | None:
            if self.dialect == "postgresql":
                return fetch(cursor, self.sql.gate_admit, params)
            with self._connections.immediate(cursor):  # (one writer: nothing runs in between)
                row = fetch(cursor, self.sql.gate_admit, params)
                if row is not None:
                    return (1, row[0])
                highest = fetch(cursor, self.sql.gate_refused, params)
                return None if highest is None or highest[0] is None else (0, highest[0])

        for _ in range(3):
            row = self._connections.run(f"fence gate admit of {key!r}", work)
            # None, or a refusal citing no fence or one our snapshot saw as lower than ours: a
            # racing admit committed a higher fence after our snapshot; ask again to report it.
            if row is not None and (row[0] or (row[1] is not None and int(row[1]) > int(fence))):
                return bool(row[0]), int(row[1])
        raise LeaseStoreError(f"fence gate admit of {key!r} kept racing a concurrent insert")

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Record ``key`` for ``ttl`` seconds unless a live record of another ``token`` has it:
        whether this caller holds it now (so a call repeated after a lost reply still finds
        its own). One statement, on a row of the identities table (swept once expired)."""
        params = {
            "r": validate_resource(key),
            "i": MARK_IDENTITY,
            "t": token,
            "ttl": max(1, round(ttl * 1e6)),
        }

        def work(cursor: Any) -> bool:
            with self._connections.immediate(cursor):
                return fetch(cursor, self.ledger_sql.mark_once, params) is not None

        return self._connections.run(f"mark of {key!r}", work)

    def gate_highest(self, key: str) -> int | None:
        params = {"k": validate_resource(key)}
        row = self._connections.run(
            f"fence gate read of {key!r}", lambda c: fetch(c, self.sql.gate_read, params)
        )
        return None if row is None else int(row[0])

    def check_health(self) -> builtins.list[str]:
        self._connections.run("health check", lambda c: fetch(c, "SELECT 1", {}))
        # Tables of an earlier version (a store made with create_tables=False, or a role that
        # may not alter them, before their owner upgraded them) fail every claim: say so now.
        problem = schema.schema_problem(self._connections, self.tables)
        if problem is not None:
            raise LeaseConfigError(f"SQL lease store {self.url}: {problem}")
        warnings = []
        if self.dialect == "postgresql":
            self._use_functions(create=False)
            if self.sql.acquire_raw is not self.sql.fast_raw[0]:
                warnings.append(
                    f"PostgreSQL lease store {self.url}: the wait-list functions of this version "
                    "are missing (or not executable by this role): claims and releases work but "
                    "cost the server more; as the tables' owner run `celery -A proj lease "
                    "init-schema --url OWNER_URL` to create them"
                )
        if self.dialect == "sqlite":
            warnings.append(
                f"SQLite lease store {self.url}: exclusion only among processes on this host "
                "sharing the file; use PostgreSQL or Redis across hosts"
            )
        return warnings

    def warm_up(self) -> None:
        self._connections.run("warm-up", lambda cursor: None, self._connections.renewer_free)

    def reset_after_fork(self) -> None:
        self._connections.reset_after_fork()
        self._fallback_lock = threading.Lock()

    def close(self) -> None:
        self._connections.close()
        if self._owns_engine:
            self.engine.dispose()
