"""The Redis lease store: :class:`RedisLeaseStore` (one Lua script per operation).

The other names here are the ones ``celery_lease.stores.redis`` held when it was one module,
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
from ..._names import mask_url, show_value, validate_resource
from .._connections import FreeList
from ..base import (
    DEFAULT_MAX_TTL,
    DEFAULT_RETENTION,
    BaseLeaseStore,
    IdentityInfo,
    LeasePage,
    Waiter,
    connection_refused,
    decode_cursor,
    encode_cursor,
)
from . import scripts as lua
from .store import RedisLeaseStore

__all__ = ["RedisLeaseStore"]

#: Names the one-module ``celery_lease.stores.redis`` had (a9e62af), importable still.
_FORMER_MODULE_NAMES = (
    BaseLeaseStore, DEFAULT_MAX_TTL, DEFAULT_RETENTION, FreeList, IdentityDoneError, IdentityInfo,
    Lease, LeaseBusyError, LeaseConfigError, LeaseInfo, LeaseLostError, LeasePage, LeaseStoreError,
    Owner, Waiter, connection_refused, decode, decode_cursor, encode_cursor, from_micros, lua,
    mask_url, monotonic, shielded, show_value, validate_resource,
)  # fmt: skip
