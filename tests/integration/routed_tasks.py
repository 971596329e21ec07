"""Plain Celery tasks that import nothing from celery_lease: leased, or not, by
``lease_routes`` alone (``routes_app``; the tests never change this module)."""

from __future__ import annotations

import time
from typing import Any

from tests.integration.routed_report import report, wait_for_key
from tests.integration.routes_app import app, fenced_write


@app.task(bind=True)
def hold(self: Any, n: int, hold: float = 0.05, go: str | None = None, tag: str = "") -> Any:
    """Enters resource ``n``, waits (``hold`` seconds, or for key ``go``), writes, exits."""
    lease = self.request.get("lease")  # (Celery's request; a lease sets it, nothing else)
    fence = getattr(lease, "fence", None)
    report("enter", res=n, fence=fence, task=self.request.id, tag=tag)
    if go is not None:
        wait_for_key(go)
    else:
        time.sleep(hold)
    written = fenced_write(f"res-{n}")
    report("write", res=n, fence=written, task=self.request.id, tag=tag)
    report("exit", res=n, fence=fence, task=self.request.id, tag=tag)
    return fence
