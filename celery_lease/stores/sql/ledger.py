"""Task identities, the effect ledger and checkpoints of the SQL lease store.

Plain functions over the connection layer (:class:`.connection.Connections`) and the statements
of :mod:`.ledger_statements`; :class:`SQLLeaseStore` checks the arguments (the rules every store
shares) and calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._codec import from_micros
from ..._errors import LeaseLostError, LeaseStoreError
from ..._lease import Lease
from ..base import EffectRecord, IdentityInfo, IdentityRecords
from . import wait_statements as wait_sql
from . import waits
from .rows import ClaimRow, identity_fields, recovery_facts, why_lost

if TYPE_CHECKING:
    from .connection import Connections
    from .ledger_statements import LedgerStatements
    from .statements import Statements

__all__ = [
    "checkpoint",
    "claim_identity",
    "effect_begin",
    "effect_done",
    "identity_get",
    "identity_records",
    "release_outcome",
    "sweep",
]


# -- claim and release with identity ---------------------------------------------------------
def claim_identity(
    db: Connections,
    sql: Statements,
    ledger: LedgerStatements,
    cursor: Any,
    params: dict[str, Any],
    retention_us: int,
) -> ClaimRow | None:
    """The claim with identity (``params`` as for the plain claim, plus ``i``), as a ClaimRow."""
    params = {**params, "ret": retention_us}
    if db.dialect == "postgresql":
        row = wait_sql.fetch(cursor, ledger.acquire_raw, params)
        return None if row is None else ClaimRow(*row)
    with db.immediate(cursor):
        cursor.execute(ledger.ident_read, params)
        ident = cursor.fetchone() or (None, None, None, None)
        if ident[0] == "done":
            return ClaimRow(0, 0, **identity_fields(ident))
        cursor.execute(sql.acquire, params)
        claim = cursor.fetchone()
        if claim is None:
            cursor.execute(sql.holder, params)
            holder = cursor.fetchone()
            if holder is None:
                return None
            duplicate = ident[0] == "running" and ident[1] == holder[1]
            claim, refused = waits.settle(cursor, sql, params, holder, duplicate=duplicate)
            if claim is None:
                ckpt = None
                if holder[6] == params["t"]:  # our own claim retried: it reports the checkpoints
                    cursor.execute(ledger.ckpt_read, params)
                    ckpt = cursor.fetchone()
                return ClaimRow(
                    0,
                    0,
                    **identity_fields(ident),
                    checkpoints=ckpt[0] if ckpt else None,
                    **refused,
                )
        fence, acquired, expires, prev_label, prev_fence = claim
        cursor.execute(ledger.mark, {**params, "f": fence, "facts": recovery_facts(ident)})
        cursor.execute(ledger.ckpt_read, params)
        ckpt = cursor.fetchone()
        return ClaimRow(
            1,
            1,
            fence=fence,
            acquired=acquired,
            expires=expires,
            prev_label=prev_label,
            prev_fence=prev_fence,
            **identity_fields(ident),
            checkpoints=ckpt[0] if ckpt else None,
            now=acquired,
        )


def release_outcome(
    db: Connections,
    sql: Statements,
    ledger: LedgerStatements,
    cursor: Any,
    params: dict[str, Any],
    retention_us: int,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[int, str | None]:
    """Release and record the identity's outcome in one step: the rows released (0 or 1) and
    the payload of the waiter it woke; PostgreSQL runs ``meanwhile`` once the statement is
    sent (see wait_statements.overlapped)."""
    params = {**params, "ret": retention_us}
    if db.dialect == "postgresql":
        return wait_sql.released(
            wait_sql.fetch(cursor, ledger.release_outcome_raw, params, meanwhile)
        )
    with db.immediate(cursor):
        cursor.execute(ledger.ident_outcome, params)
        return waits.release_sqlite(cursor, sql, params)


# -- the ledger ---------------------------------------------------------------------------
def effect_begin(
    db: Connections,
    ledger: LedgerStatements,
    lease: Lease,
    identity: str,
    key: str,
    retention_us: int,
) -> tuple[str, int | None, str | None]:
    """Record the intent of effect ``key`` (see :meth:`LeaseStore.effect_begin`)."""
    params = {
        "r": lease.resource,
        "t": lease.owner.token,
        "f": lease.fence,
        "i": identity,
        "k": key,
        "ret": retention_us,
    }

    def work(cursor: Any) -> tuple[Any, ...]:
        if db.dialect == "postgresql":
            cursor.execute(ledger.effect_begin, params)
            live, up, state, fence, receipt = cursor.fetchone()
            if not live:
                cursor.execute(ledger.lease_state, params)
                return ("lost", cursor.fetchone())
            return ("ok", up, state, fence, receipt)
        with db.immediate(cursor):
            cursor.execute(ledger.lease_state, params)
            current = cursor.fetchone()
            token, _, fence_now, expires, now, _ = current or (None, None, None, 0, 0, None)
            if token != lease.owner.token or fence_now != lease.fence or expires <= now:
                return ("lost", current)
            cursor.execute(ledger.ledger_read, params)
            old = cursor.fetchone() or (None, None, None)
            if old[0] != "done":
                cursor.execute(ledger.ledger_intent, params)
            return ("ok", int(old[0] != "done"), *old)

    for _ in range(3):
        answer = db.run(f"effect {key!r} of {lease.resource!r}", work)
        if answer[0] == "lost":
            current = answer[1] or (None, None, None, None, None, None)
            raise why_lost(lease, *current)
        _, up, state, fence, receipt = answer
        if up:
            if state == "intent" and fence != lease.fence:
                return "intent", int(fence), None
            return "new", None, None
        if state == "done":
            return "done", int(fence), receipt
        # not recorded, yet our snapshot did not see it done: a racing write; ask again
    raise LeaseStoreError(f"effect {key!r} of {lease.resource!r} kept racing another write")


def effect_done(
    db: Connections,
    ledger: LedgerStatements,
    lease: Lease,
    identity: str,
    key: str,
    receipt: str,
    retention_us: int,
) -> bool:
    """Complete the intent of effect ``key`` recorded with the lease's fence."""
    params = {
        "r": lease.resource,
        "i": identity,
        "k": key,
        "f": lease.fence,
        "t": lease.owner.token,
        "rc": receipt,
        "ret": retention_us,
    }

    def work(cursor: Any) -> int:
        cursor.execute(ledger.ledger_done, params)
        return int(cursor.rowcount)

    return bool(db.run(f"effect {key!r} done of {lease.resource!r}", work) == 1)


def checkpoint(
    db: Connections,
    ledger: LedgerStatements,
    lease: Lease,
    identity: str,
    data: str,
    retention_us: int,
) -> None:
    """Write a checkpoint, only as the live owner and never over a newer fence's."""
    params = {
        "r": lease.resource,
        "t": lease.owner.token,
        "f": lease.fence,
        "i": identity,
        "data": data,
        "ret": retention_us,
    }

    def work(cursor: Any) -> tuple[Any, ...]:
        if db.dialect == "postgresql":
            cursor.execute(ledger.checkpoint, params)
            live, up = cursor.fetchone()
        else:
            with db.immediate(cursor):
                cursor.execute(ledger.lease_state, params)
                state = cursor.fetchone() or (None, None, None, 0, 0, None)
                token, _, fence_now, expires, now, _ = state
                live = token == lease.owner.token and fence_now == lease.fence
                live = live and expires > now
                up = 0
                if live:
                    cursor.execute(ledger.ckpt_fence, params)
                    newer = cursor.fetchone()
                    if newer is None or newer[0] <= lease.fence:
                        cursor.execute(ledger.ckpt_write, params)
                        up = 1
        if live and up:
            return ("ok",)
        cursor.execute(ledger.lease_state, params)
        return ("lost", cursor.fetchone())

    answer = db.run(f"checkpoint of {lease.resource!r}", work)
    if answer[0] == "lost":
        current = answer[1] or (None, None, None, None, None, None)
        error = why_lost(lease, *current)
        if error.reason == "expired" and current[0] == lease.owner.token:
            error = LeaseLostError.lost(lease.resource, lease.fence, "taken_over")
            lease.mark_lost(error)
        raise error


# -- retention ----------------------------------------------------------------------------
def sweep(db: Connections, statements: list[str], limit: int) -> int:
    """Delete up to ``limit`` identity, checkpoint and ledger records past their retention, and
    wait lists whose every place lapsed (``statements``: one per kind, each answering or
    counting what it removed)."""

    def work(cursor: Any) -> int:
        removed = 0
        with db.immediate(cursor):
            for statement in statements:  # identities, checkpoints, the ledger
                if removed >= limit:
                    break
                cursor.execute(statement, {"n": limit - removed})
                if db.dialect == "postgresql":
                    removed += int(cursor.fetchone()[0])
                else:
                    removed += max(0, int(cursor.rowcount))
        return removed

    return int(db.run("sweep", work))


def identity_get(
    db: Connections, ledger: LedgerStatements, resource: str, ident: str
) -> IdentityInfo | None:
    """The identity record of ``ident`` on ``resource`` (names already checked), or None."""
    params = {"r": resource, "i": ident}

    def work(cursor: Any) -> tuple[Any, ...] | None:
        cursor.execute(ledger.ident_full, params)
        row = cursor.fetchone()
        return None if row is None else tuple(row)

    row = db.run(f"identity read of {resource!r}", work)
    if row is None:
        return None
    state, fence, label, result, expires = row
    if state == "running":
        result = None  # a running row keeps its claim's recovery facts there
    return IdentityInfo(resource, ident, state, int(fence), label, result, from_micros(expires))


def identity_records(
    db: Connections, ledger: LedgerStatements, resource: str, ident: str, limit: int
) -> IdentityRecords:
    """``ident``'s checkpoints and its ``limit`` most recent effects (names already checked)."""
    params = {"r": resource, "i": ident, "n": limit}

    def work(cursor: Any) -> tuple[Any, list[Any]]:
        cursor.execute(ledger.ckpt_show, params)
        ckpt = cursor.fetchone()
        cursor.execute(ledger.effects_read, params)
        return ckpt, cursor.fetchall()

    ckpt, rows = db.run(f"identity records read of {resource!r}", work)
    effects = [
        EffectRecord(key, state, int(fence), receipt, from_micros(expires))
        for key, state, fence, receipt, expires in rows
    ]
    if ckpt is None:
        return IdentityRecords(None, None, effects)
    return IdentityRecords(ckpt[1], int(ckpt[0]), effects)
