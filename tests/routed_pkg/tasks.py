"""The package's tasks: plain ``@shared_task``s, no celery_lease import."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from tests.integration.routed_report import report


@shared_task(bind=True)
def sync_account(self: Any, account: str, hold: float = 0.05) -> Any:
    """Enters the account, holds it for ``hold`` seconds, exits."""
    lease = self.request.get("lease")
    fence = getattr(lease, "fence", None)
    report("enter", res=account, fence=fence, task=self.request.id)
    time.sleep(hold)
    report("exit", res=account, fence=fence, task=self.request.id)
    return fence
