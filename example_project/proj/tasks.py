"""Exclusive agent work: one browser session per account, invoices sent at most once per fence."""

from __future__ import annotations

import os
import time

from celery_lease import FenceGate, current_lease, lease_task

from .celery import DATA, app

_gate: FenceGate | None = None


def gate() -> FenceGate:
    """The fence gate in front of the "invoice sender" (a SQLite table here)."""
    global _gate  # noqa: PLW0603 - one per process
    if _gate is None:
        _gate = FenceGate(f"sqlite:///{DATA}/side_effects.db")
    return _gate


@lease_task(app=app, resource="browser/account-{account_id}", ttl=10, bind=True)
def refresh_dashboard(self, account_id: int, step: int) -> dict[str, object]:
    """Drive the (pretend) logged-in browser of one account: never two at once."""
    lease = current_lease()
    with open(DATA / "browser.log", "a") as log:
        log.write(f"enter {account_id} {lease.fence} {os.getpid()}\n")
    time.sleep(0.05)  # the slow part: a page load, a model call
    with open(DATA / "browser.log", "a") as log:
        log.write(f"exit {account_id} {lease.fence} {os.getpid()}\n")
    return {"account": account_id, "step": step, "fence": lease.fence}


@lease_task(app=app, resource="invoice:{invoice_id}", ttl=10)
def send_invoice(invoice_id: int) -> int:
    """Send an invoice: the side effect admits only the newest owner's fence."""
    lease = current_lease()
    lease.guard()  # one round trip: still ours right before the irreversible part
    gate().admit(f"invoice:{invoice_id}", lease.fence)  # StaleFenceError for a stale owner
    return lease.fence
