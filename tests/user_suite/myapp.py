"""A user's app as a user writes it: lease tasks, no lease_store_url in the test settings."""

from __future__ import annotations

from celery import Celery

from celery_lease import FenceGate, current_lease, lease_task

app = Celery("myapp", broker="memory://", backend="cache+memory://")
app.conf.lease_ttl = 1.0  # short, so a paused-renewals test runs out in about a second

SENT: list[tuple[int, int]] = []  # (invoice, fence) as the payment gateway accepted them
STEPS: list[tuple[str, bool]] = []  # (step, done by a takeover)


GATE = FenceGate("memory://")  # the payment gateway's fence check (a real app: next to it)


def gateway() -> FenceGate:
    return GATE


@lease_task(app=app, resource="invoice:{invoice_id}")
def send_invoice(invoice_id: int) -> int:
    lease = current_lease()
    gateway().admit(f"invoice:{invoice_id}", lease.fence)
    SENT.append((invoice_id, lease.fence))
    return lease.fence


@lease_task(app=app, resource="agent/{job_id}")
def research(job_id: str) -> list[str]:
    lease = current_lease()
    done = list(lease.checkpoints)
    for step in ("plan", "search", "write"):
        if step in done:
            continue
        STEPS.append((step, lease.recovered))
        lease.checkpoint(step)
    return done


@lease_task(app=app, resource="browser/account-{account_id}", max_retries=0)
def drive_browser(account_id: int, seconds: float) -> str:
    import time

    lease = current_lease()
    for _ in range(round(seconds / 0.02)):  # counted, not timed: a test may freeze the clocks
        lease.check()
        time.sleep(0.02)
    return "done"
