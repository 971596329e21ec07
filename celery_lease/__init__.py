"""celery_lease: recoverable, fenced, renewing per-resource leases for Celery tasks."""

from __future__ import annotations

from ._errors import (
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
    LeaseStoreError,
    StaleFenceError,
)
from ._lease import Lease, LeaseInfo, Owner
from .stores import LeaseStore, store_from_url

__version__ = "0.1.0.dev0"

__all__ = [
    "Lease",
    "LeaseBusyError",
    "LeaseConfigError",
    "LeaseError",
    "LeaseInfo",
    "LeaseLostError",
    "LeaseStore",
    "LeaseStoreError",
    "Owner",
    "StaleFenceError",
    "__version__",
    "store_from_url",
]
