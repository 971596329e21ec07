"""The SQL lease store: :class:`SQLLeaseStore` (PostgreSQL through psycopg 3, and SQLite).

The other names here are the ones ``celery_lease.stores.sql`` held when it was one module,
kept so that imports written against it still work; their homes are the modules named.
"""

from __future__ import annotations

from ..._clock import monotonic
from ..._codec import decode, from_micros
from ..._errors import (
    IdentityDoneError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseLostError,
    LeaseStoreError,
)
from ..._interrupt import shielded
from ..._lease import Lease, LeaseInfo, Owner
from ..._names import check_credentials, mask_url, validate_identifier, validate_resource
from .._connections import FreeList
from ..base import (
    DEFAULT_MAX_TTL,
    DEFAULT_RETENTION,
    BaseLeaseStore,
    LeasePage,
    Waiter,
    connection_refused,
    decode_cursor,
    encode_cursor,
)
from . import statements as stmts
from .ledger_statements import LedgerStatements
from .rows import recovered_from
from .store import SCHEMA_VERSION, TABLE_RIGHTS, SQLLeaseStore

__all__ = ["SCHEMA_VERSION", "TABLE_RIGHTS", "SQLLeaseStore"]

#: Names the one-module ``celery_lease.stores.sql`` had (a9e62af), importable still.
_FORMER_MODULE_NAMES = (
    BaseLeaseStore, DEFAULT_MAX_TTL, DEFAULT_RETENTION, FreeList, IdentityDoneError, Lease,
    LeaseBusyError, LeaseConfigError, LeaseInfo, LeaseLostError, LeasePage, LeaseStoreError,
    LedgerStatements, Owner, Waiter, check_credentials, connection_refused, decode, decode_cursor,
    encode_cursor, from_micros, mask_url, monotonic, recovered_from, shielded, stmts,
    validate_identifier, validate_resource,
)  # fmt: skip
