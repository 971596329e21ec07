"""The interrupter under gevent: delivered through the hub, absorbed by ``disarm()``.

``interrupt()`` used to schedule ``greenlet.kill(LeaseInterrupt)`` at once. When the body
finished and disarmed before the hub ran that kill, ``disarm()`` could not take it back: it
landed at the body greenlet's next switch, inside the release's network I/O, so the release
was skipped along with the ``done`` outcome. Now the hub runs a callback that throws the
interrupt only if the interrupter is still armed (and defers it while a store call is shielded).

Each case runs in a fresh interpreter with gevent's monkey-patching (it cannot be undone in
the test process).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("gevent")

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
from gevent import monkey

monkey.patch_all()

import gevent

from celery_lease._interrupt import Interrupter, LeaseInterrupt, shielded


def run(body):
    outcome = []

    def wrapper():
        interrupter = Interrupter()
        assert interrupter.mode == "gevent", interrupter.mode
        interrupter.arm()
        try:
            outcome.append(body(interrupter))
        except LeaseInterrupt as exc:
            outcome.append(f"interrupted: {exc}")

    gevent.spawn(wrapper).join(10)
    print(outcome[0] if outcome else "did not end")
"""


def run_case(body: str) -> str:
    source = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", source],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


class TestGeventInterrupter:
    def test_disarm_absorbs_an_interrupt_already_scheduled(self):
        """Sent, then the body ends and disarms before the hub delivers it: the release's
        I/O after it (a switch to the hub) is not interrupted."""
        outcome = run_case(
            """
            def body(interrupter):
                assert interrupter.interrupt()  # the renewer found the lease lost just now
                interrupter.disarm()  # the body returned before the hub ran the delivery
                gevent.sleep(0.05)  # the release: network I/O switches to the hub
                return "released"

            run(body)
            """
        )
        assert outcome == "released"

    def test_an_armed_body_is_still_interrupted(self):
        """Control: without disarm() the interrupt lands at the body's next switch."""
        outcome = run_case(
            """
            def body(interrupter):
                assert interrupter.interrupt()
                gevent.sleep(5)
                return "ran on"

            run(body)
            """
        )
        assert outcome.startswith("interrupted")

    def test_from_a_native_thread(self):
        """The renewer may run in a real OS thread: delivery goes through the body's hub."""
        outcome = run_case(
            """
            def body(interrupter):
                gevent.get_hub().threadpool.spawn(interrupter.interrupt)
                gevent.sleep(5)
                return "ran on"

            run(body)
            """
        )
        assert outcome.startswith("interrupted")

    def test_never_inside_a_shielded_store_call(self):
        """Sent before a store call begins: raised before the call (the body is known to be
        interrupted), never inside it."""
        outcome = run_case(
            """
            def body(interrupter):
                assert interrupter.interrupt()
                steps = []
                try:
                    with shielded():
                        steps.append("call started")
                        gevent.sleep(0.05)  # the driver waits on its socket
                        steps.append("call finished")
                except LeaseInterrupt:
                    return f"raised: {steps}"
                return "not raised"

            run(body)
            """
        )
        assert outcome == "raised: []"

    def test_sent_during_a_shielded_store_call_it_is_raised_when_the_call_returns(self):
        """Sent (by another greenlet) while the body waits inside a store call."""
        outcome = run_case(
            """
            def body(interrupter):
                steps = []
                try:
                    with shielded():
                        steps.append("call started")
                        gevent.spawn(interrupter.interrupt)
                        gevent.sleep(0.1)  # the driver waits on its socket
                        steps.append("call finished")
                except LeaseInterrupt:
                    return f"raised: {steps}"
                return "not raised"

            run(body)
            """
        )
        assert outcome == "raised: ['call started', 'call finished']"
