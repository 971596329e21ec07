"""Run the example end to end: a real worker on SQLite, tasks contending for accounts.

python -m example_project.run
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def wait(job: Any, worker: subprocess.Popen[bytes], timeout: float = 120.0) -> Any:
    """A task's result, failing at once (not after the timeout) if the worker died."""
    deadline = time.monotonic() + timeout
    while not job.ready():
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with status {worker.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"task {job.id} did not finish in {timeout:.0f}s")
        time.sleep(0.05)
    return job.get()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="celery-lease-example-") as tmp:
        os.environ["EXAMPLE_DATA"] = tmp
        from example_project.proj.tasks import refresh_dashboard, send_invoice

        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "--quiet",  # no banner (a global option: it goes before the subcommand)
                "-A",
                "example_project.proj",
                "worker",
                "-P",
                "threads",
                "-c",
                "4",
                "-l",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env={**os.environ, "EXAMPLE_DATA": tmp},
        )
        try:
            started = time.monotonic()
            jobs = [
                refresh_dashboard.delay(account, step) for step in range(4) for account in (1, 2, 3)
            ]
            invoices = [send_invoice.delay(17) for _ in range(2)]
            results = [wait(job, worker) for job in jobs]
            fences = [wait(job, worker) for job in invoices]
            elapsed = time.monotonic() - started
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
        by_account = defaultdict(list)
        for result in results:
            by_account[result["account"]].append(result["fence"])
        for account, account_fences in sorted(by_account.items()):
            print(f"account {account}: 4 exclusive runs, fences {sorted(account_fences)}")
        print(f"invoice 17 sent twice in sequence with fences {sorted(fences)}")
        inside: dict[str, str] = {}
        for line in (Path(tmp) / "browser.log").read_text().splitlines():
            event, account, fence, _pid = line.split()
            if event == "enter":
                assert account not in inside, f"two browsers on account {account} at once"
                inside[account] = fence
            else:
                assert inside.pop(account) == fence
        print(f"no two sessions overlapped on one account; {len(results)} tasks in {elapsed:.1f}s")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
