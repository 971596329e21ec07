"""The SQL store's identity records, ledger effects and checkpoints (its side of :mod:`.ledger`)."""

from __future__ import annotations

from ..._lease import Lease
from ..._names import validate_resource
from ..base import RECENT_EFFECTS, IdentityInfo, IdentityRecords
from . import ledger
from .core import SQLStoreCore

__all__ = ["SQLIdentity"]


class SQLIdentity(SQLStoreCore):
    """Identity records, ledger effects and checkpoints of the SQL store."""

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
