"""Leases in a real Flower process: each task page says whether the task holds its lease, waits
for it (at which place, behind whom) or ended (``celery_lease.contrib.flower``); the Leases page
lists the leases held and who waits for them; Flower counts the ``task-lease-*`` events.

Flower keeps only the fields it knows from an event and merges the events of every copy of a
task id: its JSON API, which does not run ``format_task``, is the negative control.

``CL_FLOWER_SCREENSHOTS=docs/img`` makes the tests also take the docs' screenshots with headless
Chromium (done by hand, not in CI).
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from celery_lease import Owner
from celery_lease._names import holder_task_id
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
    except urllib.error.HTTPError as exc:
        exc.close()  # (its socket, else a ResourceWarning fails a later test)
        return None
    except OSError:
        return None


def cl_env(env: dict[str, str]) -> dict[str, str]:
    """The CL_* variables of the test process and ``env``: what Flower needs to import the app."""
    return {k: v for k, v in {**os.environ, **env}.items() if k.startswith("CL_")}


def detail(page: str, name: str) -> str:
    """The text of the row ``name`` of Flower's task page (``Status``, ``Lease``, ...)."""
    found = re.search(rf"<dt>{name}</dt>\s*<dd>(.*?)</dd>", page, re.S)
    assert found, f"no {name} on the page"
    return html.unescape(re.sub(r"<[^>]+>", "", found.group(1))).strip()


def screenshot(port: int, path: str, name: str, height: int = 900) -> None:
    """Save Chromium's picture of Flower's ``path`` as ``name`` under $CL_FLOWER_SCREENSHOTS."""
    where = os.environ.get("CL_FLOWER_SCREENSHOTS")
    if not where:
        return
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "CL_FLOWER_SCREENSHOTS needs Debian's chromium"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={(Path(where) / name).resolve()}",
            f"--window-size=1280,{height}",
            f"http://127.0.0.1:{port}{path}",
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )


@pytest.fixture
def flower(tmp_path: Path) -> Any:
    """Start Flower on 127.0.0.1 with the lease hook in its flowerconfig.py; stop it by PID."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str], *args: str, prefix: str = "") -> int:
        port = free_port()
        conf = tmp_path / "flowerconfig.py"
        conf.write_text(
            "from celery_lease.contrib.flower import add_leases_page, format_task  # noqa: F401\n"
            "\n"
            "add_leases_page()\n"
        )
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
                    *args,
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
            return reachable(port, f"{prefix}/healthcheck") is not None

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
    finally:
        store.release(holder)
        store.close()
    assert result.get(timeout=60) > holder.fence  # claimed once the holder let go


def test_the_leases_page_asks_for_flowers_login_under_its_url_prefix(it_app, store_env, flower):
    """With --basic-auth and --url_prefix: /flower/leases is refused without the login and
    drawn with it, its links under the prefix; the page is not at /leases."""
    env = store_env("redis")
    port = flower(cl_env(env), "--basic-auth=ops:s3cret", "--url_prefix=flower", prefix="/flower")
    url = f"http://127.0.0.1:{port}/flower/leases"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    refused.value.close()
    assert refused.value.code == 401
    login = "Basic " + base64.b64encode(b"ops:s3cret").decode()
    request = urllib.request.Request(url, headers={"Authorization": login})
    with urllib.request.urlopen(request, timeout=10) as reply:
        page = reply.read().decode()
    assert "No leases are held." in page
    assert 'href="/flower/tasks"' in page and 'action="/flower/leases"' in page
    bare = urllib.request.Request(
        f"http://127.0.0.1:{port}/leases", headers={"Authorization": login}
    )
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(bare, timeout=10)
    missing.value.close()
    assert missing.value.code == 404


def test_flower_says_who_holds_who_waits_where_and_who_ended(
    it_app, start_worker, store_env, events, coord, queue, flower
):
    """A holder, two waiters, and a copy of the holder refused while it holds (as its back-stop
    copy or a redelivery is): the holder's page says STARTED and holds, though the copy's event
    is Flower's state for that id; each waiter's page gives its place and whom it waits behind;
    the Leases page shows the resource contended with its holder and wait list in order; once
    the holder ended, its page names the fence it ran with, not the next holder."""
    env = {**store_env("redis"), "CL_TTL": "3", "CL_BACKOFF_BASE": "0.3", "CL_BACKOFF_CAP": "1"}
    port = flower(cl_env(env))
    start_worker(env, queue=queue, pool="threads", concurrency=4, extra_args=("-E",))
    store = worker_store(env)
    keys = {role: f"{events.key}:go:{role}" for role in ("holder", "w0", "w1")}

    def held_by(task_id: str) -> Any:
        info = store.get("gate-1")
        return info if info is not None and holder_task_id(info.owner_label) == task_id else None

    def listed() -> list[str]:
        return [waiter.identity for waiter in store.waiters("gate-1")]

    def page_of(task_id: str, until: str) -> str:
        return wait_for(
            lambda: (text := reachable(port, f"/task/{task_id}")) and until in text and text,
            60,
            f"task {task_id}'s page to say {until!r}",
            interval=0.3,
        )

    try:
        holder = it_app.gated_hold.apply_async((1, keys["holder"]), queue=queue)
        first = wait_for(lambda: held_by(holder.id), 60, "the holder to claim")
        w0 = it_app.gated_hold.apply_async((1, keys["w0"]), queue=queue)
        wait_for(lambda: listed() == [w0.id], 60, "w0 to wait in the list")
        w1 = it_app.gated_hold.apply_async((1, keys["w1"]), queue=queue)
        wait_for(lambda: listed() == [w0.id, w1.id], 60, "w1 to wait behind w0")
        # A lease held outside any task (a script's): listed after the contended one, unlinked.
        script = store.acquire("gate-2", Owner.new("nightly-report@ops"), 60)

        # A copy of the running holder: refused (it holds), re-armed while it holds.
        it_app.gated_hold.apply_async((1, keys["holder"]), task_id=holder.id, queue=queue)
        # The control: Flower's own view of the holder is the copy's.
        raw = wait_for(
            lambda: (
                (state := json.loads(get(port, f"/api/task/info/{holder.id}"))["state"])
                in ("LEASE-BUSY", "RETRY")
                and state
            ),
            60,
            "Flower to take the copy's event for the holder's state",
            interval=0.1,
        )
        print(f"Flower's own state for the holder: {raw}")
        page = page_of(holder.id, "from another copy of it")
        assert detail(page, "Status") == "STARTED"
        lease = detail(page, "Lease")
        assert lease.startswith(f"holds gate-1 with fence {first.fence}, expires in "), lease
        assert re.search(r"said (LEASE-BUSY|RETRY|RECEIVED), from another copy of it\)$", lease)
        screenshot(port, f"/task/{holder.id}", "flower-task-holder.png", height=640)
        table = json.loads(
            get(
                port,
                "/tasks/datatable?draw=1&start=0&length=50&search%5Bvalue%5D="
                "&order%5B0%5D%5Bcolumn%5D=0&order%5B0%5D%5Bdir%5D=desc&columns%5B0%5D%5Bdata%5D=name",
            )
        )
        rows = {row["uuid"]: row for row in table["data"]}
        assert rows[holder.id]["state"] == "STARTED", rows[holder.id]
        assert rows[holder.id]["lease"].startswith(f"holds gate-1 with fence {first.fence}")

        w1_page = page_of(w1.id, "waits for gate-1")
        assert detail(w1_page, "Lease").startswith(
            f"waits for gate-1 at place 2 of 2, behind {w0.id} and the holder "
            f"{first.owner_label} (fence {first.fence}, expires in "
        ), detail(w1_page, "Lease")
        w0_lease = detail(page_of(w0.id, "waits for gate-1"), "Lease")
        assert w0_lease.startswith(
            f"waits for gate-1 at place 1 of 2, behind the holder {first.owner_label} "
        ), w0_lease

        leases = wait_for(
            lambda: (text := reachable(port, "/leases")) and w1.id in text and text,
            30,
            "the Leases page to list w1",
        )
        assert "2 leases held, 1 contended (2 tasks waiting)." in leases
        table_rows = re.findall(r"<tr>.*?</tr>", leases, re.S)[1:]  # (after the header)
        assert ["gate-1" in r for r in table_rows] == [True, False]
        assert ">nightly-report@ops</span>" in table_rows[1] and ">held</span>" in table_rows[1]
        assert script.owner.token not in leases
        row = table_rows[0]
        assert ">contended</span>" in row
        assert f'href="/task/{holder.id}">tests.integration.worker_app.gated_hold</a>' in row
        assert f">{first.fence}</td>" in row
        assert row.index(f'href="/task/{w0.id}"') < row.index(f'href="/task/{w1.id}"')
        screenshot(port, "/leases", "flower-leases.png", height=520)
        screenshot(port, f"/task/{w1.id}", "flower-task.png", height=640)

        coord.set(keys["holder"], 1)
        assert holder.get(timeout=60) == first.fence
        second = wait_for(lambda: held_by(w0.id), 60, "w0 to be handed the lease")
        ended = page_of(holder.id, "ended (SUCCESS)")
        assert detail(ended, "Lease") == f"ended (SUCCESS) with fence {first.fence} on gate-1"
        assert detail(ended, "Status") == "SUCCESS"
        assert w0.id not in ended and str(second.fence) not in detail(ended, "Lease")
        coord.set(keys["w0"], 1)
        coord.set(keys["w1"], 1)
        assert w0.get(timeout=60) == second.fence
        assert w1.get(timeout=60) > second.fence
    finally:
        for key in keys.values():
            coord.set(key, 1)
        store.close()
