"""celery_lease: recoverable, fenced, renewing per-resource leases for Celery tasks."""

from __future__ import annotations

from . import (
    _pid,  # noqa: F401 - first: its fork hook runs before the others
    _routes,  # noqa: F401 - registers lease_routes with install()
)
from ._app import install
from ._errors import (
    AlreadyQueuedError,
    EffectUnresolvedError,
    IdentityDoneError,
    InvalidFenceTokenError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
    LeaseStoreError,
    StaleFenceError,
)
from ._interrupt import LeaseInterrupt, shielded
from ._lease import Lease, LeaseInfo, Owner
from ._ledger import REDO, Effect
from ._names import key_of
from ._release import force_release, release_lease
from ._sweeper import (
    ExpiredLease,
    SweepReport,
    lease_cleanup_failed,
    on_expired,
    run_sweep,
    sweep,
    sweep_schedule,
)
from ._task import LeaseTask, current_lease, lease_task
from .fencing import FenceGate
from .stores import LeaseStore, store_from_url

__version__ = "0.1.0.dev0"

__all__ = [
    "REDO",
    "AlreadyQueuedError",
    "Effect",
    "EffectUnresolvedError",
    "ExpiredLease",
    "FenceGate",
    "IdentityDoneError",
    "InvalidFenceTokenError",
    "Lease",
    "LeaseBusyError",
    "LeaseConfigError",
    "LeaseError",
    "LeaseInfo",
    "LeaseInterrupt",
    "LeaseLostError",
    "LeaseStore",
    "LeaseStoreError",
    "LeaseTask",
    "Owner",
    "StaleFenceError",
    "SweepReport",
    "__version__",
    "current_lease",
    "force_release",
    "install",
    "key_of",
    "lease_cleanup_failed",
    "lease_task",
    "on_expired",
    "release_lease",
    "run_sweep",
    "shielded",
    "store_from_url",
    "sweep",
    "sweep_schedule",
]
