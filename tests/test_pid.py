"""The package's process id: read once, and right again in a forked child."""

from __future__ import annotations

import os

import pytest

from celery_lease import _pid


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_reads_its_own_id():
    """The hot paths compare it with the id their state was made in: a child that read its
    parent's id would reuse the parent's connections and renewer."""
    assert _pid.getpid() == os.getpid()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.write(write, f"{_pid.getpid()} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        seen, real = os.read(read, 100).decode().split()
    finally:
        os.close(read)
        os.waitpid(child, 0)
    assert int(seen) == int(real) == child != os.getpid()
    assert _pid.getpid() == os.getpid()  # the parent's is unchanged
