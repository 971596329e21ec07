"""Leases in a real Flower process: the task page says which lease a task waits for and who holds
it (``celery_lease.contrib.flower``), and Flower counts the ``task-lease-*`` events.

Flower keeps only the fields it knows from an event: without the hook (its JSON API, which does
not run ``format_task``) the same task says nothing of the holder, which is the negative control.

``CL_FLOWER_SCREENSHOT=docs/img/flower-task.png`` makes the test also take the docs' screenshot
of the task page with headless Chromium (done once by hand, not in CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from celery_lease import Owner
from tests.integration.harness import ROOT, worker_store
from tests.tooling.servers import _stop_popen, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.redis]
pytest.importorskip("flower")


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.read().decode()


def reachable(port: int, path: str) -> str | None:
    try:
        return get(port, path)
    except OSError:
        return None


@pytest.fixture
def flower(tmp_path: Path) -> Any:
    """Start Flower on 127.0.0.1 with the lease hook in its flowerconfig.py; stop it by PID."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> int:
        port = free_port()
        conf = tmp_path / "flowerconfig.py"
        conf.write_text("from celery_lease.contrib.flower import format_task  # noqa: F401\n")
        log = tmp_path / "flower.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tests.integration.worker_app",
                    "flower",
                    "--address=127.0.0.1",
                    f"--port={port}",
                    f"--conf={conf}",
                ],
                cwd=ROOT,
                # (On 127.0.0.1 only: Flower's JSON API wants auth unless told otherwise.)
                env={
                    **os.environ,
                    **env,
                    "PYTHONPATH": str(ROOT),
                    "FLOWER_UNAUTHENTICATED_API": "true",
                },
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append(proc)

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"flower exited:\n{log.read_text()[-3000:]}")
            return reachable(port, "/healthcheck") is not None

        wait_for(up, 60, "flower to answer", interval=0.2)
        return port

    yield start
    for proc in started:
        _stop_popen(proc)


def test_the_task_page_names_the_lease_and_its_holder(
    it_app, start_worker, store_env, events, queue, flower
):
    """A task waiting for a busy resource: Flower's page shows resource, holder and fence, never
    the holder's token; Flower's /metrics counts task-lease-busy events."""
    env = {**store_env("redis"), "CL_TTL": "5", "CL_BACKOFF_BASE": "0.5", "CL_BACKOFF_CAP": "1"}
    port = flower({k: v for k, v in {**os.environ, **env}.items() if k.startswith("CL_")})
    start_worker(env, queue=queue, extra_args=("-E",))
    store = worker_store(env)
    holder = store.acquire("res-31", Owner.new("flower-test-holder"), 120)
    try:
        result = it_app.exclusive.apply_async((31, 0.0), queue=queue)
        page = wait_for(
            lambda: (
                (text := reachable(port, f"/task/{result.id}"))
                and "flower-test-holder" in text
                and text
            ),
            60,
            "the task page to name the holder",
            interval=0.3,
        )
        annotation = page[page.find("res-31") :][:400]
        assert "waits for res-31 at place 1 of 1, behind the holder flower-test-holder" in page, (
            annotation
        )
        assert f"fence {holder.fence}" in page
        assert holder.owner.token not in page
        # The tasks table (JSON, drawn through the same hook) carries the annotation too.
        table = json.loads(
            get(
                port,
                "/tasks/datatable?draw=1&start=0&length=50&search%5Bvalue%5D="
                "&order%5B0%5D%5Bcolumn%5D=0&order%5B0%5D%5Bdir%5D=desc&columns%5B0%5D%5Bdata%5D=name",
            )
        )
        row = next(r for r in table["data"] if r["uuid"] == result.id)
        assert "behind the holder flower-test-holder" in row["lease"]
        # Negative control: Flower's own API (no format_task) has dropped the event's fields.
        info = json.loads(get(port, f"/api/task/info/{result.id}"))
        assert "lease" not in info
        # Already true without the hook: a RETRY's exception names resource, holder and fence.
        retried = wait_for(
            lambda: (
                (info := json.loads(get(port, f"/api/task/info/{result.id}")))["exception"] and info
            ),
            30,
            "a RETRY with its exception",
            interval=0.3,
        )
        assert "LeaseBusyError" in retried["exception"]
        for part in ("'res-31'", "'flower-test-holder'", f"fence {holder.fence}"):
            assert part in retried["exception"]
        assert holder.owner.token not in json.dumps(retried)
        metrics = wait_for(
            lambda: (text := get(port, "/metrics")) and 'type="task-lease-busy"' in text and text,
            30,
            "flower to count task-lease-busy",
        )
        busy = [
            line
            for line in metrics.splitlines()
            if line.startswith("flower_events_total{") and 'type="task-lease-busy"' in line
        ]
        assert busy and float(busy[0].rsplit(" ", 1)[1]) >= 1
        shot = os.environ.get("CL_FLOWER_SCREENSHOT")
        if shot:
            browser = shutil.which("chromium") or shutil.which("chromium-browser")
            assert browser, "CL_FLOWER_SCREENSHOT needs Debian's chromium"
            subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    f"--screenshot={Path(shot).resolve()}",
                    "--window-size=1280,900",
                    f"http://127.0.0.1:{port}/task/{result.id}",
                ],
                check=True,
                timeout=120,
                capture_output=True,
            )
    finally:
        store.release(holder)
        store.close()
    assert result.get(timeout=60) > holder.fence  # claimed once the holder let go
