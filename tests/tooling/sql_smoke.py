"""A short SQLite store smoke, run in a subprocess under another SQLAlchemy (the minimum).

``python -m tests.tooling.sql_smoke`` with that SQLAlchemy first on ``PYTHONPATH``: claims,
renews and releases a lease with an identity, writes a checkpoint and a ledger effect, and
passes a FenceGate a newer then an older fence. Prints ``ok sqlalchemy <version>``; any
failure is a traceback and a non-zero exit.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import sqlalchemy

from celery_lease import FenceGate, LeaseBusyError, Owner, StaleFenceError
from celery_lease.stores.sql import SQLLeaseStore


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLLeaseStore(url=f"sqlite:///{Path(tmp) / 'leases.db'}")
        try:
            first = store.acquire("invoice/17", Owner.new("a"), 30.0, identity="job-1")
            try:
                store.acquire("invoice/17", Owner.new("b"), 30.0)
            except LeaseBusyError:
                pass
            else:
                raise AssertionError("a second owner claimed a live lease")
            store.renew(first, 60.0)
            store.checkpoint(first, '{"step": 1}')
            store.effect_begin(first, "send")
            assert store.release(first, outcome="done", result='"sent"')
            second = store.acquire("invoice/17", Owner.new("b"), 30.0)
            assert second.fence > first.fence, (second.fence, first.fence)
            assert store.release(second)
            gate = FenceGate(store=store)
            gate.admit("invoice:17", second.fence)
            try:
                gate.admit("invoice:17", first.fence)
            except StaleFenceError:
                pass
            else:
                raise AssertionError("the gate admitted an older fence after a newer one")
        finally:
            store.close()
    print(f"ok sqlalchemy {sqlalchemy.__version__}")


if __name__ == "__main__":
    main()
    sys.exit(0)
