"""End-to-end walk through a lease store on the embedded default (SQLite, no servers).

Two owners contend for one resource; the loser is told who holds it; the holder crashes (stops
renewing); the next owner takes over with a greater fence and learns whom it replaced; the
stale owner can no longer renew or release.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from celery_lease import LeaseBusyError, LeaseLostError, Owner, store_from_url


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        store = store_from_url(f"sqlite:///{Path(tmp) / 'leases.db'}")
        first = store.acquire("invoice:17", Owner.new("worker-a"), ttl=0.5)
        print(f"worker-a claimed {first.resource} with fence {first.fence}")
        try:
            store.acquire("invoice:17", Owner.new("worker-b"), ttl=0.5)
        except LeaseBusyError as busy:
            print(f"worker-b: {busy}")
        deadline = time.monotonic() + 5
        while not store.get("invoice:17").expired:  # worker-a "crashed": nobody renews
            if time.monotonic() > deadline:
                raise SystemExit("the lease never expired")
            time.sleep(0.05)
        second = store.acquire("invoice:17", Owner.new("worker-b"), ttl=5)
        print(
            f"worker-b took over with fence {second.fence} from "
            f"{second.previous_owner_label} (fence {second.previous_fence})"
        )
        try:
            store.renew(first)
        except LeaseLostError as lost:
            print(f"worker-a: {lost}")
        assert store.release(first) is False
        assert store.release(second) is True
        store.close()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
