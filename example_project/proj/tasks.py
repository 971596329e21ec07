"""Four kinds of exclusive agent work, each acting on the outside world through the gateway.

* ``research``: an agent calling a slow model (seconds per call, sometimes longer than the
  lease's ttl) on ``agent/{job_id}``, checkpointing between steps;
* ``browse``: a logged-in browser session on ``browser/account-{account_id}`` that two workers
  must never drive at once;
* ``send_invoice``: a charge through the payments gateway, at most once per invoice (identity,
  effect ledger, reconciliation, fence);
* ``deploy``: releases to ``deploy/production``, one at a time, in order.
"""

from __future__ import annotations

import time
from typing import Any

from celery_lease import REDO, Lease, current_lease, lease_task, shielded

from .celery import DATA, NS, app
from .gateway import Gateway

_gateway: Gateway | None = None


def gateway() -> Gateway:
    global _gateway  # noqa: PLW0603 - one per process
    if _gateway is None:
        _gateway = Gateway(DATA / "world.db")
    return _gateway


@lease_task(app=app, resource=NS + "agent/{job_id}", bind=True)
def research(self: Any, job_id: str, model_seconds: list[float]) -> dict[str, Any]:
    """Steps of slow model calls; each finished step is a checkpoint a new owner resumes from."""
    lease = current_lease()
    gateway().event("claimed", job_id, lease.fence, lease.previous_fence)  # None: no takeover
    done = dict(lease.checkpoints)
    for step, seconds in enumerate(model_seconds):
        name = f"step-{step}"
        if name in done:
            continue
        gateway().event("model-call", job_id, lease.fence, seconds)
        time.sleep(seconds)  # the model thinks; the lease is renewed meanwhile
        lease.check()
        lease.checkpoint(name, {"answer": f"result of {name}"})
    gateway().event("finished", job_id, lease.fence)
    return {"job": job_id, "fence": lease.fence, "steps": len(model_seconds)}


@lease_task(app=app, resource=NS + "browser/account-{account_id}", bind=True)
def browse(self: Any, account_id: int, job: str, pages: int) -> int:
    """Click through pages of one account's logged-in browser."""
    lease = current_lease()
    resource = lease.resource
    for page in range(pages):
        # A click is a request already on its way when a pause can hit: nothing can stop it
        # (shielded holds back the lease interrupt), so a worker frozen here sends it late,
        # with its old fence, and only the gateway's fence check keeps it out.
        with shielded():
            gateway().event("page", job, lease.fence, page)
            time.sleep(0.4)  # the page loads
            gateway().write(resource, lease.fence, f"{job} page {page}")  # refused if stale
    gateway().event("finished", job, lease.fence)
    return lease.fence


def reconcile_charge(key: str, lease: Lease) -> Any:
    """An earlier owner began this charge and never recorded it done: ask the gateway."""
    invoice = key.split(":")[1]
    receipt = gateway().find_charge(f"invoice-{invoice}")
    gateway().event("reconciled", f"invoice-{invoice}", lease.fence, receipt is not None)
    return REDO if receipt is None else receipt


@lease_task(
    app=app,
    resource=NS + "invoice:{invoice_id}",
    identity=NS + "invoice:{invoice_id}",
    reconcile_effect=reconcile_charge,
)
def send_invoice(invoice_id: int, bank_seconds: float = 0.0) -> dict[str, Any]:
    """Charge the invoice through the gateway: at most once, whatever is delivered or crashes."""
    lease = current_lease()
    job = f"invoice-{invoice_id}"

    def charge() -> dict[str, Any]:
        receipt = gateway().charge(invoice_id, lease.fence, idempotency_key=job)
        gateway().event("charged", job, lease.fence)
        time.sleep(bank_seconds)  # waiting for the bank's confirmation
        return receipt

    receipt = lease.effect(f"charge:{invoice_id}")(charge)
    gateway().event("finished", job, lease.fence)
    return receipt


@lease_task(app=app, resource=NS + "deploy/production")
def deploy(release: int) -> int:
    """One release to production: never two at once, each with a greater fence."""
    lease = current_lease()
    gateway().write("deploy/production", lease.fence, f"release {release} start")
    gateway().event("deploy", f"release-{release}", lease.fence, "start")
    time.sleep(0.25)
    gateway().event("deploy", f"release-{release}", lease.fence, "end")
    return lease.fence
