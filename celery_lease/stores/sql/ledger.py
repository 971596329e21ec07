"""Task identities, the effect ledger and checkpoints for the SQL lease store (a mixin).

Kept apart from ``store.py`` so each module stays readable; it uses the store's connection
plumbing (``_run``, ``_immediate``) and the statements of ``ledger_statements``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._errors import LeaseLostError, LeaseStoreError
from ..._lease import Lease, from_micros
from ..._names import validate_resource
from ..base import IdentityInfo

if TYPE_CHECKING:
    from .ledger_statements import LedgerStatements

__all__ = ["ClaimRow", "SQLLedgerMixin"]

#: Normalised answer of a claim (with or without identity):
#: (claimed, marked, fence, acquired, expires, prev_label, prev_fence,
#:  holder_token, holder_label, holder_fence, holder_acquired, holder_expires,
#:  ident_state, ident_fence, ident_label, ident_result, checkpoints, now,
#:  holder_prev_label, holder_prev_fence)
ClaimRow = tuple[Any, ...]


def recovery_facts(ident: tuple[Any, ...]) -> str | None:
    """What a claim recovers from the identity row it found (state, fence, owner_label, ...),
    kept in its running row's result so that the same claim retried can report it again."""
    state, fence, label = ident[:3]
    return None if state is None else f"{state}\n{fence}\n{label}"


def recovered_from(facts: str | None) -> tuple[str | None, int | None, str | None]:
    """(state, fence, label) of the earlier attempt, from :func:`recovery_facts`."""
    if not facts:
        return None, None, None
    state, fence, label = facts.split("\n", 2)
    return state, int(fence), label


class SQLLedgerMixin:
    """Identity, ledger and checkpoint operations of :class:`SQLLeaseStore`."""

    dialect: str
    retention: float
    ledger_sql: LedgerStatements
    sql: Any

    if TYPE_CHECKING:

        def _run(self, what: str, work: Any) -> Any: ...
        def _immediate(self, cursor: Any) -> Any: ...
        def _why_lost(
            self,
            lease: Lease,
            token: Any,
            label: Any,
            fence: Any,
            expires: Any,
            now: Any,
            forced: Any = None,
        ) -> LeaseLostError: ...
        def _ledger_args(self, lease: Lease, key: str) -> tuple[str, str]: ...
        def _sweep_args(self, limit: int) -> int: ...
        def _identity_args(self, identity: str | None) -> str | None: ...

    @property
    def _ret_us(self) -> int:
        return round(self.retention * 1e6)

    # -- claim and release with identity --------------------------------------------------------
    def _claim_identity(self, cursor: Any, params: dict[str, Any]) -> ClaimRow | None:
        params = {**params, "ret": self._ret_us}
        if self.dialect == "postgresql":
            cursor.execute(self.ledger_sql.acquire, params)
            row = cursor.fetchone()
            return None if row is None else tuple(row)
        sql = self.ledger_sql
        with self._immediate(cursor):
            cursor.execute(sql.ident_read, params)
            ident = cursor.fetchone() or (None, None, None, None)
            if ident[0] == "done":
                return (0, 0, *([None] * 10), *ident, None, None, None, None)
            cursor.execute(self.sql.acquire, params)
            claim = cursor.fetchone()
            if claim is None:
                cursor.execute(self.sql.holder, params)
                holder = cursor.fetchone()
                if holder is None:
                    return None
                _, fence, acquired, expires, label, _, token, now, h_prev_label, h_prev_fence = (
                    holder
                )
                ckpt = None
                if token == params["t"]:  # our own claim retried: it reports the checkpoints
                    cursor.execute(sql.ckpt_read, params)
                    ckpt = cursor.fetchone()
                return (
                    0, 0, *([None] * 5), token, label, fence, acquired, expires, *ident,
                    ckpt[0] if ckpt else None, now, h_prev_label, h_prev_fence,
                )  # fmt: skip
            fence, acquired, expires, prev_label, prev_fence = claim
            cursor.execute(sql.mark, {**params, "f": fence, "facts": recovery_facts(ident)})
            cursor.execute(sql.ckpt_read, params)
            ckpt = cursor.fetchone()
            return (
                1, 1, fence, acquired, expires, prev_label, prev_fence,
                None, None, None, None, None, *ident, ckpt[0] if ckpt else None, acquired,
                None, None,
            )  # fmt: skip

    def _release_outcome(self, cursor: Any, params: dict[str, Any]) -> int:
        params = {**params, "ret": self._ret_us}
        if self.dialect == "postgresql":
            cursor.execute(self.ledger_sql.release_outcome, params)
            return int(cursor.fetchone()[0])
        with self._immediate(cursor):
            cursor.execute(self.ledger_sql.ident_outcome, params)
            cursor.execute(self.sql.release, params)
            return int(cursor.rowcount)

    # -- the ledger ---------------------------------------------------------------------------
    def effect_begin(self, lease: Lease, key: str) -> tuple[str, int | None, str | None]:
        identity, key = self._ledger_args(lease, key)
        params = {
            "r": lease.resource,
            "t": lease.owner.token,
            "f": lease.fence,
            "i": identity,
            "k": key,
            "ret": self._ret_us,
        }
        sql = self.ledger_sql

        def work(cursor: Any) -> tuple[Any, ...]:
            if self.dialect == "postgresql":
                cursor.execute(sql.effect_begin, params)
                live, up, state, fence, receipt = cursor.fetchone()
                if not live:
                    cursor.execute(sql.lease_state, params)
                    return ("lost", cursor.fetchone())
                return ("ok", up, state, fence, receipt)
            with self._immediate(cursor):
                cursor.execute(sql.lease_state, params)
                current = cursor.fetchone()
                token, _, fence_now, expires, now, _ = current or (None, None, None, 0, 0, None)
                if token != lease.owner.token or fence_now != lease.fence or expires <= now:
                    return ("lost", current)
                cursor.execute(sql.ledger_read, params)
                old = cursor.fetchone() or (None, None, None)
                if old[0] != "done":
                    cursor.execute(sql.ledger_intent, params)
                return ("ok", int(old[0] != "done"), *old)

        for _ in range(3):
            answer = self._run(f"effect {key!r} of {lease.resource!r}", work)
            if answer[0] == "lost":
                current = answer[1] or (None, None, None, None, None, None)
                raise self._why_lost(lease, *current)
            _, up, state, fence, receipt = answer
            if up:
                if state == "intent" and fence != lease.fence:
                    return "intent", int(fence), None
                return "new", None, None
            if state == "done":
                return "done", int(fence), receipt
            # not recorded, yet our snapshot did not see it done: a racing write; ask again
        raise LeaseStoreError(f"effect {key!r} of {lease.resource!r} kept racing another write")

    def effect_done(self, lease: Lease, key: str, receipt: str) -> bool:
        identity, key = self._ledger_args(lease, key)
        params = {
            "r": lease.resource,
            "i": identity,
            "k": key,
            "f": lease.fence,
            "t": lease.owner.token,
            "rc": receipt,
            "ret": self._ret_us,
        }

        def work(cursor: Any) -> int:
            cursor.execute(self.ledger_sql.ledger_done, params)
            return int(cursor.rowcount)

        return bool(self._run(f"effect {key!r} done of {lease.resource!r}", work) == 1)

    def checkpoint(self, lease: Lease, data: str) -> None:
        identity, _ = self._ledger_args(lease, "checkpoint")
        params = {
            "r": lease.resource,
            "t": lease.owner.token,
            "f": lease.fence,
            "i": identity,
            "data": data,
            "ret": self._ret_us,
        }
        sql = self.ledger_sql

        def work(cursor: Any) -> tuple[Any, ...]:
            if self.dialect == "postgresql":
                cursor.execute(sql.checkpoint, params)
                live, up = cursor.fetchone()
            else:
                with self._immediate(cursor):
                    cursor.execute(sql.lease_state, params)
                    state = cursor.fetchone() or (None, None, None, 0, 0, None)
                    token, _, fence_now, expires, now, _ = state
                    live = token == lease.owner.token and fence_now == lease.fence
                    live = live and expires > now
                    up = 0
                    if live:
                        cursor.execute(sql.ckpt_fence, params)
                        newer = cursor.fetchone()
                        if newer is None or newer[0] <= lease.fence:
                            cursor.execute(sql.ckpt_write, params)
                            up = 1
            if live and up:
                return ("ok",)
            cursor.execute(sql.lease_state, params)
            return ("lost", cursor.fetchone())

        answer = self._run(f"checkpoint of {lease.resource!r}", work)
        if answer[0] == "lost":
            current = answer[1] or (None, None, None, None, None, None)
            error = self._why_lost(lease, *current)
            if error.reason == "expired" and current[0] == lease.owner.token:
                error = LeaseLostError.lost(lease.resource, lease.fence, "taken_over")
                lease.mark_lost(error)
            raise error

    # -- retention ----------------------------------------------------------------------------
    def sweep_expired(self, *, limit: int = 1000) -> int:
        limit = self._sweep_args(limit)
        statements = self.ledger_sql.sweep

        def work(cursor: Any) -> int:
            removed = 0
            with self._immediate(cursor):
                for statement in statements:  # identities, checkpoints, the ledger
                    if removed >= limit:
                        break
                    cursor.execute(statement, {"n": limit - removed})
                    if self.dialect == "postgresql":
                        removed += int(cursor.fetchone()[0])
                    else:
                        removed += max(0, int(cursor.rowcount))
            return removed

        return int(self._run("sweep", work))

    def identity_get(self, resource: str, identity: str) -> IdentityInfo | None:
        validate_resource(resource)
        ident = self._identity_args(identity) or ""
        params = {"r": resource, "i": ident}

        def work(cursor: Any) -> tuple[Any, ...] | None:
            cursor.execute(self.ledger_sql.ident_full, params)
            row = cursor.fetchone()
            return None if row is None else tuple(row)

        row = self._run(f"identity read of {resource!r}", work)
        if row is None:
            return None
        state, fence, label, result, expires = row
        if state == "running":
            result = None  # a running row keeps its claim's recovery facts there
        return IdentityInfo(resource, ident, state, int(fence), label, result, from_micros(expires))
