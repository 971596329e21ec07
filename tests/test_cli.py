"""``celery -A app lease ...`` against real stores, errors included.

Most tests run the command group in-process (``Target.run``, see tests/cli_helpers.py); the
ones that call ``run_lease`` or ``Target.run_subprocess`` run the real ``python -m celery``
entry point, so its exit statuses, stderr and stdin prompt are proven end to end too.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from celery_lease import LeaseBusyError, Owner, _sweeper
from celery_lease.cli import holder_task_id, prefix_of
from tests.cli_helpers import ROOT, Target, lease_here, make_target, one_line_error, run_lease


@pytest.fixture(params=["redis", "sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """A store of each kind with its own prefix, as the CLI's app sees it."""
    made = make_target(request.param, request, tmp_path)
    try:
        yield made
    finally:
        made.store.close()


@pytest.fixture
def sqlite_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """A SQLite store: the cheapest real store, for the paths that do not differ by store."""
    made = make_target("sqlite", request, tmp_path)
    try:
        yield made
    finally:
        made.store.close()


def expire(store: object, resource: str, label: str) -> None:
    """Claim ``resource`` for a moment and wait (bounded) until the store calls it expired."""
    store.acquire(resource, Owner.new(label), 0.05)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while not store.get(resource).expired:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.02)


class TestHelpers:
    def test_task_id_comes_from_the_holder_label(self) -> None:
        """A worker's label host:pid:task-id gives the task id; other labels give none."""
        assert holder_task_id("celery@web-1:4242:6f1c-aa") == "6f1c-aa"
        assert holder_task_id("web-1:4242:direct") is None
        assert holder_task_id("web-1:4242") is None
        assert holder_task_id("custom") is None

    def test_the_task_id_ends_where_the_task_name_begins(self) -> None:
        """A label with the task's name and arguments after the task id (colons and spaces in
        the arguments too) gives the task id alone; an encoded one is decoded."""
        assert holder_task_id("celery@w1:12:t-1 proj.fetch ('http://x:8080/a b',)") == "t-1"
        assert holder_task_id("celery@w1:12:t-1 proj.fetch") == "t-1"
        assert holder_task_id("celery@w1:12:a:b proj.fetch (1,)") == "a:b"
        assert holder_task_id("celery@w1:12:a%20b%25 proj.fetch (1,)") == "a b%"
        assert holder_task_id("celery@w1:12:direct proj.fetch (1,)") is None

    def test_stats_groups_by_first_separator(self) -> None:
        """Resources are grouped up to their first / or :."""
        assert prefix_of("browser/a/b") == "browser/"
        assert prefix_of("db:x/y") == "db:"
        assert prefix_of("plain") == "plain"

    def test_the_entry_point_is_registered(self) -> None:
        """Celery finds the group through celery.commands (else: pip install -e . again)."""
        found = [ep for ep in entry_points(group="celery.commands") if ep.name == "lease"]
        assert [ep.value for ep in found] == ["celery_lease.cli:lease"]


class TestEveryStore:
    def test_ls_show_release_stats_check(self, target: Target) -> None:
        """Each command reads and changes the real store as it says, in JSON."""
        store = target.store
        live = store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60, identity="job-1")
        store.acquire("db:x", Owner.new("custom label"), 60)
        expire(store, "browser/b", "celery@w1:13:task-bbb")
        with pytest.raises(LeaseBusyError):  # joins the wait list
            store.acquire("browser/a", Owner.new("w2"), 60, identity="job-2", wait="wake-2")
        queued = 1

        listed = {row["resource"]: row for row in target.json("ls", "--waiters")}
        assert listed["browser/a"]["waiters"] == queued
        assert set(listed) == {"browser/a", "browser/b", "db:x"}
        assert listed["browser/a"]["task_id"] == "task-aaa"
        assert listed["browser/a"]["fence"] == live.fence
        assert listed["browser/a"]["holder"] == "celery@w1:12:task-aaa"
        assert not listed["browser/a"]["expired"]
        assert listed["browser/b"]["expired"]
        assert listed["db:x"]["task_id"] is None

        shown = target.json("show", "browser/a", "--identity", "job-1")
        assert shown["lease"]["fence"] == live.fence
        assert shown["identity"]["state"] == "running"
        assert shown["identity"]["fence"] == live.fence
        assert [w["identity"] for w in shown["waiters"]] == ["job-2"] * queued

        done = target.run("release", "browser/a", "--force", "--yes")
        assert done.returncode == 0, done.stderr
        assert store.get("browser/a") is None
        again = store.acquire("browser/a", Owner.new("next"), 60, identity="job-2")
        assert again.fence > live.fence + 1  # the eviction bumped the fence

        checked = target.json("check")
        assert abs(checked["probe"]["clock_skew"]) < 1.0
        if target.url.startswith("postgresql"):
            facts = checked["postgresql"]
            assert facts["statement_timeout"] not in ("0", None)
            assert set(facts["table_rights"].values()) == {"SELECT,INSERT,UPDATE,DELETE"}


class TestHolderTask:
    LABEL = "celery@w1:12:task-aaa proj.drive_browser (42,) {'mode': 'fast'}"

    def test_ls_and_show_name_the_task_and_its_arguments(self, target: Target) -> None:
        """ls and show give the holder's task name and recorded arguments (from its label, as
        `celery inspect active` shows them) next to its task id, in JSON and text; a label
        without them (an older worker's, Owner.new()'s) gives null. Failed before: no task
        name nor arguments, and a task id read from the arguments' colons."""
        store = target.store
        store.acquire("browser/a", Owner.new(self.LABEL), 60)
        store.acquire("browser/b", Owner.new("celery@w1:13:task-bbb"), 60)
        store.acquire("browser/c", Owner.new("celery@w1:14:task-ccc proj.fetch ('x:1',)"), 60)
        rows = {row["resource"]: row for row in target.json("ls")}
        got = {r: (row["task_id"], row["task"], row["args"]) for r, row in rows.items()}
        assert got == {
            "browser/a": ("task-aaa", "proj.drive_browser", "(42,) {'mode': 'fast'}"),
            "browser/b": ("task-bbb", None, None),
            "browser/c": ("task-ccc", "proj.fetch", "('x:1',)"),
        }
        assert rows["browser/a"]["holder"] == self.LABEL  # the label as stored

        shown = target.json("show", "browser/a")["lease"]
        assert (shown["task_id"], shown["task"], shown["args"]) == got["browser/a"]

        text = target.run("show", "browser/a")
        assert text.returncode == 0, text.stderr
        assert f"holder:      {self.LABEL}\n" in text.stdout
        assert "task id:     task-aaa\n" in text.stdout
        assert "task:        proj.drive_browser\n" in text.stdout
        assert "args:        (42,) {'mode': 'fast'}\n" in text.stdout
        listed = target.run("ls").stdout.splitlines()
        (row,) = [line for line in listed if line.startswith("browser/a ")]
        assert self.LABEL in row and row.split()[-1] == "task-aaa"


class TestShowIdentityRecords:
    def test_show_lists_checkpoints_and_recent_effects(self, target: Target) -> None:
        """show prints the identity's checkpoints and effects, newest first: of --identity, or
        by default of the holder's task id (a lease task's identity)."""
        store = target.store
        lease = store.acquire("pay/a", Owner.new("celery@w1:12:task-aaa"), 60, identity="job-1")
        store.effect_begin(lease, "charge")
        store.effect_done(lease, "charge", '{"id": 7}')
        store.checkpoint(lease, '{"page": 3}')
        held = store.acquire("pay/b", Owner.new("celery@w1:14:task-ccc"), 60, identity="task-ccc")
        store.effect_begin(held, "mail")

        shown = target.json("show", "pay/a", "--identity", "job-1")["identity"]
        assert shown["checkpoints"] == {"page": 3} and shown["checkpoint_fence"] == lease.fence
        assert [(e["key"], e["state"], e["receipt"], e["fence"]) for e in shown["effects"]] == [
            ("charge", "done", {"id": 7}, lease.fence)
        ]
        holder = target.json("show", "pay/b")["identity"]  # no --identity: the holder's
        assert holder["identity"] == "task-ccc" and holder["checkpoints"] is None
        assert [(e["key"], e["state"], e["receipt"]) for e in holder["effects"]] == [
            ("mail", "intent", None)
        ]
        assert "identity" not in target.json("show", "pay/a")  # task-aaa has no record

        human = target.run("show", "pay/a", "--identity", "job-1")
        assert human.returncode == 0, human.stderr
        assert 'checkpoints: {"page": 3}' in human.stdout
        assert "effects:     1 (most recent first)" in human.stdout
        (line,) = [x for x in human.stdout.splitlines() if x.strip().startswith("charge")]
        assert "done" in line and '{"id": 7}' in line and str(lease.fence) in line


class TestShowCustomIdentity:
    def test_show_says_to_pass_identity_for_a_custom_identity(self, target: Target) -> None:
        """A holder whose task sets identity= keeps its record under that identity, which the
        lease does not carry: show without --identity says so, and --identity shows it."""
        store = target.store
        lease = store.acquire("slow/3", Owner.new("celery@w1:15:task-ddd"), 60, identity="slowid:3")
        store.checkpoint(lease, '{"step": 1}')

        human = target.run("show", "slow/3")
        assert human.returncode == 0, human.stderr
        assert "task id:     task-ddd" in human.stdout
        (line,) = [x for x in human.stdout.splitlines() if x.startswith("identity:")]
        assert "'task-ddd'" in line and "pass --identity ID" in line, human.stdout
        assert "--identity ID" in target.json("show", "slow/3")["note"]

        shown = target.json("show", "slow/3", "--identity", "slowid:3")
        assert "note" not in shown
        assert shown["identity"]["state"] == "running"
        assert shown["identity"]["fence"] == lease.fence
        assert shown["identity"]["checkpoints"] == {"step": 1}
        human = target.run("show", "slow/3", "--identity", "slowid:3")
        assert 'checkpoints: {"step": 1}' in human.stdout, human.stdout


class TestFilters:
    def test_expired_prefix_and_stats(self, sqlite_target: Target) -> None:
        """--expired and --prefix filter ls; stats counts live and expired by prefix."""
        store = sqlite_target.store
        store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        store.acquire("db:x", Owner.new("custom label"), 60)
        expire(store, "browser/b", "celery@w1:13:task-bbb")
        assert [r["resource"] for r in sqlite_target.json("ls", "--expired")] == ["browser/b"]
        assert [r["resource"] for r in sqlite_target.json("ls", "--prefix", "db:")] == ["db:x"]
        assert sqlite_target.json("stats") == {
            "prefixes": {"browser/": {"live": 1, "expired": 1}, "db:": {"live": 1, "expired": 0}},
            "total": {"live": 2, "expired": 1},
        }


class TestHumanOutput:
    def test_tables_and_records(self, sqlite_target: Target) -> None:
        """Without --json the commands print aligned tables and key: value records."""
        store = sqlite_target.store
        store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        done = sqlite_target.run("ls")
        assert done.returncode == 0, done.stderr
        header, row = done.stdout.splitlines()
        assert header.split() == ["RESOURCE", "HOLDER", "FENCE", "EXPIRES", "IN", "TASK", "ID"]
        assert row.split()[:2] == ["browser/a", "celery@w1:12:task-aaa"]
        assert row.split()[-1] == "task-aaa"

        done = sqlite_target.run("show", "browser/a")
        assert "holder:      celery@w1:12:task-aaa" in done.stdout
        assert "state:       live" in done.stdout

        done = sqlite_target.run("stats")
        assert done.stdout.splitlines()[1].split() == ["browser/", "1", "0"]

        done = sqlite_target.run("check", "--strict")  # SQLite warns: one host only
        assert done.returncode == 1
        assert "write probe: ok" in done.stdout
        assert "WARNING: SQLite lease store" in done.stdout
        assert "1 warning(s)" in one_line_error(done)


class TestCheckVerdict:
    def test_json_ok_agrees_with_the_exit_status(self, sqlite_target: Target) -> None:
        """check --json says ok exactly when the command exits 0: warnings alone do not fail
        it (the text form says "OK, 1 warning(s)"), --strict makes them fail both forms.
        Failed before: "ok": false with exit status 0."""
        plain = sqlite_target.run("check", "--json")
        assert plain.returncode == 0, plain.stderr
        report = json.loads(plain.stdout)
        assert report["warnings"] and "SQLite lease store" in report["warnings"][0]
        assert report["ok"] is True and report["strict"] is False

        text = sqlite_target.run("check")
        assert text.returncode == 0, text.stderr
        assert text.stdout.splitlines()[-1] == "OK, 1 warning(s)"

        strict = sqlite_target.run("check", "--json", "--strict")
        assert strict.returncode == 1
        report = json.loads(strict.stdout)
        assert report["ok"] is False and report["strict"] is True
        assert "1 warning(s)" in one_line_error(strict)

        text = sqlite_target.run("check", "--strict")
        assert text.returncode == 1
        assert text.stdout.splitlines()[-1] == "FAILED: 1 warning(s) under --strict"


class TestCheckHumanOutput:
    def test_postgres_report_lines_are_label_space_value(
        self, request: pytest.FixtureRequest, tmp_path: Path
    ) -> None:
        """check on PostgreSQL prints every fact as `label: value` (long labels too) and the
        table rights one `  table  RIGHTS` line per table, never a Python dict."""
        made = make_target("postgres", request, tmp_path)
        try:
            done = made.run("check")
            assert done.returncode == 0, done.stderr
            tables = {table.name for table in made.store.tables.values()}
        finally:
            made.store.close()
        lines = done.stdout.splitlines()
        assert "{'" not in done.stdout, done.stdout
        assert lines[-1] == "OK" or lines[-1].endswith("warning(s)"), done.stdout
        rights = lines.index("table_rights:")
        per_table = lines[rights + 1 : rights + 1 + len(tables)]
        assert {line.split()[0] for line in per_table} == tables, done.stdout
        for line in per_table:
            assert line.startswith("  ") and len(line.split()) == 2, line
            assert set(line.split()[1].split(",")) <= {"SELECT", "INSERT", "UPDATE", "DELETE"}
        tasks = next(i for i, line in enumerate(lines) if line.startswith("leased tasks: "))
        facts = [
            line for line in lines[:tasks] if line not in per_table and line != "table_rights:"
        ]
        assert any(line.startswith("idle_in_transaction_session_timeout: ") for line in facts)
        for line in facts:
            assert re.match(r"[A-Za-z_ ]+: +\S", line), line
        columns = set()
        for line in facts:
            if not line.startswith("WARNING: "):
                label, rest = line.split(":", 1)
                columns.add(len(label) + 1 + len(rest) - len(rest.lstrip()))
        assert len(columns) == 1, done.stdout  # every value starts in the same column


class TestErrors:
    def test_no_lease_settings(self) -> None:
        """An app without lease_store_url fails with one line saying what to set."""
        done = run_lease("ls", env={"CLI_STORE": ""})
        assert done.returncode == 2
        assert "no lease settings: set lease_store_url" in one_line_error(done)

    def test_bad_resource_name(self, sqlite_target: Target) -> None:
        """A resource name outside the rule is refused before the store is touched."""
        done = sqlite_target.run("show", "no spaces allowed")
        assert done.returncode == 2
        assert "invalid lease resource 'no spaces allowed'" in one_line_error(done)

    def test_store_down(self) -> None:
        """An unreachable store fails with one line naming it (password masked)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # closed again below: nothing listens there
        url = f"redis://:s3cret@127.0.0.1:{port}/0"
        done = run_lease("ls", env={"CLI_STORE": url})
        assert done.returncode == 1
        line = one_line_error(done)
        assert f"127.0.0.1:{port}" in line
        assert "s3cret" not in done.stderr + done.stdout

    @pytest.mark.parametrize("hooked", [False, True])
    @pytest.mark.parametrize("as_json", [False, True])
    def test_sweep_dry_run_fails_on_a_store_down(
        self, monkeypatch: pytest.MonkeyPatch, hooked: bool, as_json: bool
    ) -> None:
        """sweep --dry-run against an unreachable store fails like every other command (exit
        1, one line naming the store, password masked), with or without on_expired hooks.
        Failed before without hooks: "0 expired lease(s)" (or its JSON) and exit 0."""
        hooks = [("disposable/", lambda expired: None)] if hooked else []
        monkeypatch.setattr(_sweeper, "_hooks", hooks)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # closed again below: nothing listens there
        url = f"redis://:s3cret@127.0.0.1:{port}/0"
        done = lease_here("sweep", "--dry-run", *(["--json"] if as_json else []), env={
            "CLI_STORE": url
        })  # fmt: skip
        assert done.returncode == 1, done.stdout
        line = one_line_error(done)
        assert f"127.0.0.1:{port}" in line and "refused the connection" in line
        assert "s3cret" not in done.stderr + done.stdout
        assert "expired" not in done.stdout

    def test_release_needs_force_and_confirmation(self, sqlite_target: Target) -> None:
        """release refuses without --force, asks without --yes, and a 'no' changes nothing."""
        store = sqlite_target.store
        held = store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        done = sqlite_target.run("release", "browser/a")
        assert done.returncode == 2
        assert "pass --force" in one_line_error(done)

        done = sqlite_target.run_subprocess("release", "browser/a", "--force", stdin="n\n")
        assert done.returncode == 1
        assert "Evict 'celery@w1:12:task-aaa'" in done.stderr
        assert store.get("browser/a").fence == held.fence

        done = sqlite_target.run("release", "browser/a", "--force", stdin="y\n")
        assert done.returncode == 0, done.stderr
        assert store.get("browser/a") is None


class TestReleaseIsBoundToWhatWasShown:
    """release --force evicts only the lease its prompt showed, or the one --fence names
    (issue 27, item 2). Before: a holder that released and was replaced while the prompt
    waited was evicted, and the command exited 0."""

    def test_a_resource_that_changed_hands_at_the_prompt_is_refused(
        self, sqlite_target: Target
    ) -> None:
        store = sqlite_target.store
        shown = store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.cli_app", "lease", "release",
             "browser/a", "--force"],
            cwd=ROOT,
            env={**os.environ, **sqlite_target.env(), "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            prompt = ""
            deadline = time.monotonic() + 60
            while "Evict" not in prompt:  # the prompt names the holder A and its fence
                assert time.monotonic() < deadline, "no prompt"
                assert proc.stderr is not None
                prompt += proc.stderr.read(1)
            assert proc.stderr is not None
            while not prompt.endswith("[y/N]: "):
                prompt += proc.stderr.read(1)
            assert f"fence {shown.fence}" in prompt
            store.release(shown)  # meanwhile A ends and B claims
            now = store.acquire("browser/a", Owner.new("celery@w2:13:task-bbb"), 60)
            out, err = proc.communicate("y\n", timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 1, out + err
        assert "changed hands" in err and "task-bbb" in err, err
        assert store.get("browser/a").fence == now.fence  # B is still the holder
        store.renew(now)

    def test_yes_with_a_stale_fence_is_refused(self, sqlite_target: Target) -> None:
        store = sqlite_target.store
        old = store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        store.release(old)
        now = store.acquire("browser/a", Owner.new("celery@w2:13:task-bbb"), 60)
        done = sqlite_target.run(
            "release", "browser/a", "--force", "--yes", "--fence", str(old.fence)
        )
        assert done.returncode == 1
        assert f"fence {now.fence}" in one_line_error(done)
        assert store.get("browser/a").fence == now.fence

    def test_yes_with_the_current_fence_evicts(self, sqlite_target: Target) -> None:
        store = sqlite_target.store
        held = store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        done = sqlite_target.run(
            "release", "browser/a", "--force", "--yes", "--fence", str(held.fence)
        )
        assert done.returncode == 0, done.stderr
        assert store.get("browser/a") is None
        assert "runs again from the start" in done.stdout


class TestReleaseChecksTheTurn:
    """release --force wakes the next waiting task; before the command ends it checks that the
    woken task took its turn (else the one behind it is woken), as a worker would: the check
    must not die with the command's process. Silent unless it has to wait."""

    @staticmethod
    def _wake(queue: str, who: str) -> str:
        options = {"task_id": f"id-{who}", "queue": queue}
        return json.dumps({"task": "cli.wait", "args": [who], "kwargs": {}, "options": options})

    def test_a_woken_task_that_never_claims_passes_the_turn_on(
        self, sqlite_target: Target, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """W1's woken copy never claims (no worker here): the command waits about a grace,
        wakes W2, and says so in one line on stderr."""
        from celery_lease import _wakes
        from celery_lease.stores import base

        monkeypatch.setattr(_wakes, "_waker", _wakes.Waker())  # (this test's checks only)
        grace = 2.0
        monkeypatch.setattr(base, "DEFAULT_HANDOFF_GRACE", grace)  # (the command's store)
        drain, drained = _wakes.drain_turns, []

        def timed_drain(*args: Any, **kwargs: Any) -> Any:  # how long the exit check waited
            began = time.monotonic()
            try:
                return drain(*args, **kwargs)
            finally:
                drained.append(time.monotonic() - began)

        monkeypatch.setattr(_wakes, "drain_turns", timed_drain)
        store = sqlite_target.store
        store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        for who in ("w1", "w2"):
            with pytest.raises(LeaseBusyError):
                store.acquire(
                    "browser/a", Owner.new(who), 60, identity=who, wait=self._wake("q", who)
                )
        started = time.monotonic()
        done = sqlite_target.run("release", "browser/a", "--force", "--yes")
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - started < grace + 5
        waiting = [line for line in done.stderr.splitlines() if "take its turn" in line]
        # One line when its exit check waited. A command whose own work after the wake outlasted
        # the grace (a loaded box: seen with a grace of 0.5 s) finds the check due, waits for
        # nothing and says nothing.
        assert len(drained) == 1, drained
        assert len(waiting) == (drained[0] > 0.2), (drained, done.stderr)
        assert [w.identity for w in store.waiters("browser/a") if w.woken] == ["w2"]

    def test_nothing_woken_nothing_said(self, sqlite_target: Target) -> None:
        """An eviction that wakes nobody ends at once, with no line about turns."""
        store = sqlite_target.store
        store.acquire("browser/a", Owner.new("celery@w1:12:task-aaa"), 60)
        done = sqlite_target.run("release", "browser/a", "--force", "--yes")
        assert done.returncode == 0, done.stderr
        assert "turn" not in done.stderr + done.stdout


class TestInitSchemaByKind:
    def test_a_memory_store_has_no_schema_or_acl(self):
        """init-schema on memory:// says there is nothing to set up (it printed a Redis ACL)."""
        done = run_lease("init-schema", "--url", "memory://", env={"CLI_STORE": "memory://"})
        assert done.returncode == 0, done.stderr
        assert "no schema" in done.stdout and "no ACL" in done.stdout
        assert "ACL SETUSER" not in done.stdout and "Redis" not in done.stdout

    def test_redis_gets_the_acl_of_its_prefix(self, request, tmp_path):
        """The Redis store still gets its least-privilege ACL, limited to its key prefix."""
        target = make_target("redis", request, tmp_path)
        done = target.run("init-schema")
        assert done.returncode == 0, done.stderr
        assert "ACL SETUSER <user>" in done.stdout
        assert f"~{target.store.key_prefix}*" in done.stdout
