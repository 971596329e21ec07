"""The secure deployment: Redis over TLS as an ACL user held to its key prefix, PostgreSQL as a
least-privilege role, and ``celery lease init-schema`` / ``check`` for it.

The store contract suites already run against both (the ``redis_secure`` and ``postgres_role``
kinds of the ``store`` fixture, see tests/tooling/secure.py). The tests here show that those
runs can fail: a key outside the prefix is refused (and is not, with the ACL widened), a role
without one of its rights is refused with a message that names the GRANT to run, and the role
can create nothing.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_lease import LeaseBusyError, LeaseConfigError, LeaseStoreError, Owner
from celery_lease.stores import store_from_url
from celery_lease.stores.redis import RedisLeaseStore
from celery_lease.stores.sql import TABLE_RIGHTS
from tests.cli_helpers import lease_here, one_line_error
from tests.conftest import make_store, redis_admin, unique
from tests.tooling.secure import (
    REDIS_ACL_COMMANDS,
    REDIS_ADMIN_PASSWORD,
    REDIS_USER_PASSWORD,
    redis_acl_user,
)

LONG = 30.0
DENIED = r"permission denied|must be owner"


class LeakyRedisStore(RedisLeaseStore):
    """A store with a bug: its fence gates land outside its key prefix."""

    def _gate_keys(self, key: str) -> list[str]:
        return ["elsewhere:gates", *super()._gate_keys(key)[1:]]


@pytest.mark.redis
class TestRedisOverTlsAsAclUser:
    def test_the_store_talks_tls_to_a_server_without_plaintext(self, request, tmp_path, names):
        """The secure store's URL is rediss:// and the server has no plaintext listener."""
        store = make_store("redis_secure", request, tmp_path)
        server = request.getfixturevalue("redis_secure_server")
        try:
            assert store.url.startswith("rediss://") and ":***@" in store.url
            lease = store.acquire(names + "a", Owner.new("tls"), LONG)
            assert store.release(lease)
            with redis_admin(store) as admin:
                port = {str(k, "ascii") if isinstance(k, bytes) else k: str(int(v))
                        for k, v in admin.config_get("port").items()}  # fmt: skip
                assert port == {"port": "0"}
                users = {client["user"] for client in admin.client_list()}
            assert any(user.startswith("lease") for user in users), users
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as plain:
                plain.sendall(b"PING\r\n")
                try:
                    reply = plain.recv(64)
                except ConnectionResetError:
                    reply = b""
                assert not reply.startswith(b"+PONG")
        finally:
            store.close()

    def test_a_key_outside_the_prefix_is_refused(self, request, tmp_path):
        """Through the store's own connection, any key outside its prefix gets NOPERM."""
        store = make_store("redis_secure", request, tmp_path)
        try:
            client = store.client
            assert store.gate_admit("probe", 1) == (True, 1)  # (loads the script)
            for command in (
                ("SET", "elsewhere:x", "1"),
                ("GET", "celery_lease:x"),
                ("EVALSHA", store._gate_admit.sha, 1, "elsewhere:gate:x", 1),
                ("KEYS", "*"),
                ("FLUSHALL",),
                ("CONFIG", "GET", "requirepass"),
                ("PUBLISH", f"{store.key_prefix}ch", "x"),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
        finally:
            store.close()

    def test_negative_control_a_leaky_store_fails_only_under_the_acl(self, request):
        """A store that writes outside its prefix passes with the ACL widened to ``~*`` and
        fails as the user held to its prefix: the secure run is what catches the leak."""
        server = request.getfixturevalue("redis_secure_server")
        prefix = unique("leak") + ":"
        widened = LeakyRedisStore(url=redis_acl_user(server, prefix, keys="*"), key_prefix=prefix)
        held = LeakyRedisStore(url=redis_acl_user(server, prefix), key_prefix=prefix)
        try:
            assert widened.gate_admit("k", 5) == (True, 5)  # the leak goes unnoticed
            with pytest.raises(LeaseStoreError, match=r"(?i)no permissions|noperm"):
                held.gate_admit("k", 6)
            with redis.Redis.from_url(server.url_for(password=REDIS_ADMIN_PASSWORD)) as admin:
                assert admin.hget("elsewhere:gates", "k") == b"5"
                admin.delete("elsewhere:gates")
        finally:
            widened.close()
            held.close()

    @pytest.mark.parametrize("command", REDIS_ACL_COMMANDS)
    def test_every_command_of_the_documented_acl_is_needed(self, request, command):
        """Without any one command of the ACL line some store operation is refused (as a
        LeaseStoreError, never a wrong answer): the line is no wider than the store needs."""
        server = request.getfixturevalue("redis_secure_server")
        with redis.Redis.from_url(server.url_for(password=REDIS_ADMIN_PASSWORD)) as admin:
            admin.script_flush()  # SCRIPT LOAD is needed when the cache is cold
        prefix = unique("need") + ":"
        url = redis_acl_user(server, prefix, drop=command)
        failed = []
        with RedisLeaseStore(url=url, key_prefix=prefix) as store:
            steps: list[Any] = [
                store.check_health,
                lambda: store.gate_admit("g", 1),
                lambda: store.gate_highest("g"),
                store.list,
                lambda: store.get("n/a"),
                lambda: store.identity_records("n/a", "job-1"),
            ]
            for step in steps:
                try:
                    step()
                except LeaseStoreError:
                    failed.append(step)
            try:
                lease = store.acquire("n/a", Owner.new(), LONG, identity="job-1")
                store.renew(lease)
                store.effect_begin(lease, "k")
                store.checkpoint(lease, "{}")
                store.release(lease, outcome="done", result="1")
                store.identity_get("n/a", "job-1")
                store.sweep_expired()
                store.force_release("n/a")
            except LeaseStoreError:
                failed.append("lease operations")
        assert failed, f"the store worked without {command}: drop it from the documented ACL"

    def test_negative_control_a_store_outside_its_users_keys_fails_every_operation(self, request):
        """A user held to another prefix can run none of the store's operations."""
        server = request.getfixturevalue("redis_secure_server")
        prefix = unique("acl") + ":"
        url = redis_acl_user(server, prefix, keys=unique("other") + ":*")
        with RedisLeaseStore(url=url, key_prefix=prefix) as store:
            for operation in (
                lambda: store.acquire("n/a", Owner.new(), LONG),
                lambda: store.get("n/a"),
                store.list,
            ):
                with pytest.raises(LeaseStoreError, match=r"(?i)no permissions|noperm"):
                    operation()


def owner_store(role: Any, table_prefix: str) -> Any:
    """The admin's store on ``table_prefix``: it creates the tables and owns them."""
    return store_from_url(role.admin_url, table_prefix=table_prefix)


def run_as(url: str, *statements: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()


def _tables_before_the_wait_list(role: Any) -> tuple[str, str]:
    """Tables the owner made and granted to ``role``, then stripped of the wait-list columns
    (as made by a version before the wait list): their prefix and the lease table's name."""
    table_prefix = unique("up") + "_"
    with owner_store(role, table_prefix) as owner:
        role.grant(owner)
        leases = owner.leases_table.name
    run_as(
        role.admin_url,
        f"DROP INDEX {leases}_waits",
        *(f"ALTER TABLE {leases} DROP COLUMN {c}"
          for c in ("waits", "wait_slow_us", "waits_expire_us")),
    )  # fmt: skip
    return table_prefix, leases


def exercise(role: Any, table_prefix: str) -> None:
    """Every operation of the store, as the role: each needs some right on some table."""
    with store_from_url(role.url, table_prefix=table_prefix) as store:
        lease = store.acquire("r/a", Owner.new("role"), LONG, identity="job-1")
        store.renew(lease, LONG)
        assert store.get("r/a").fence == lease.fence
        assert store.effect_begin(lease, "charge")[0] == "new"
        assert store.effect_done(lease, "charge", '"ok"')
        store.checkpoint(lease, '{"page": 1}')
        store.release(lease, outcome="done", result='"r"')
        assert store.identity_get("r/a", "job-1").state == "done"
        assert store.gate_admit("g", lease.fence) == (True, lease.fence)
        assert store.gate_highest("g") == lease.fence
        holder = store.acquire("r/w", Owner.new("role"), LONG, identity="job-2")
        with pytest.raises(LeaseBusyError) as busy:  # joins the wait list
            store.acquire("r/w", Owner.new("role"), LONG, identity="job-3", wait="wake-3")
        assert busy.value.position == 1
        assert [w.identity for w in store.waiters("r/w")] == ["job-3"]
        assert store.release(holder) and holder.handoff == "wake-3"
        store.sweep_expired()
        store.list()


@pytest.mark.postgres
class TestPostgresLeastPrivilegeRole:
    def test_the_role_can_create_nothing_and_owns_nothing(self, request, tmp_path, names):
        """The contract suite's role is no superuser, owns no table and may create none."""
        role = request.getfixturevalue("postgres_role")
        store = make_store("postgres_role", request, tmp_path)
        try:
            lease = store.acquire(names + "a", Owner.new(), LONG)
            assert store.release(lease)
            with store.engine.connect() as conn:
                attrs = conn.execute(
                    sa.text(
                        "SELECT current_user, rolsuper, rolcreaterole, rolcreatedb, "
                        "has_schema_privilege(current_schema(), 'CREATE') "
                        "FROM pg_roles WHERE rolname = current_user"
                    )
                ).one()
                owners = conn.execute(
                    sa.text("SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class "
                            "WHERE relname LIKE :p"),
                    {"p": store.leases_table.name.removesuffix("leases") + "%"},
                ).scalars().all()  # fmt: skip
            assert tuple(attrs) == (role.name, False, False, False, False)
            assert owners and role.name not in owners
            for statement in (
                "CREATE TABLE celery_lease_probe (i int)",
                f"CREATE ROLE {role.name}_x",
                f"DROP TABLE {store.leases_table.name}",
                f"DELETE FROM {store.leases_table.name}",  # the lease rows keep the fences
                f"TRUNCATE {store.tables['ledger'].name}",
            ):
                with pytest.raises(sa.exc.ProgrammingError, match=DENIED):
                    run_as(role.url, statement)
        finally:
            store.close()

    def test_without_the_tables_the_role_is_told_how_to_make_them(self, request):
        """A role that may not create the tables fails at once, naming init-schema."""
        role = request.getfixturevalue("postgres_role")
        with pytest.raises(LeaseConfigError) as caught:
            store_from_url(role.url, table_prefix=unique("none") + "_")
        message = str(caught.value)
        assert f"role {role.name!r}" in message and "may not create the lease tables" in message
        assert f"init-schema --url OWNER_URL --grant {role.name}" in message
        assert role.password not in message

    def test_tables_of_an_earlier_version_are_upgraded_by_init_schema(self, request):
        """Tables made before the wait list: the role may not add it and is told which
        columns are missing and to run init-schema as the owner, which adds them (and nothing
        else is needed); not that it "may not create the lease tables", which are there."""
        role = request.getfixturevalue("postgres_role")
        table_prefix, leases = _tables_before_the_wait_list(role)
        with pytest.raises(LeaseConfigError) as caught:
            store_from_url(role.url, table_prefix=table_prefix)
        message = str(caught.value)
        assert f"{leases} was made by an earlier celery_lease" in message
        assert "lacks the columns waits, wait_slow_us, waits_expire_us" in message
        assert f"the role {role.name!r} may not add them (must be owner of table" in message
        assert "as the tables' owner run `celery -A proj lease init-schema --url OWNER_URL`" in (
            message
        )
        assert "may not create the lease tables" not in message
        assert role.password not in message
        with owner_store(role, table_prefix):  # what init-schema does first
            pass
        exercise(role, table_prefix)

    def test_with_create_tables_off_tables_of_an_earlier_version_fail_the_health_check(
        self, request
    ):
        """The role's store made with create_tables=False on tables made before the wait
        list: check_health() names the missing columns and init-schema (it found nothing
        wrong, and every claim then failed with a raw "column does not exist")."""
        role = request.getfixturevalue("postgres_role")
        table_prefix, _ = _tables_before_the_wait_list(role)
        with store_from_url(role.url, table_prefix=table_prefix, create_tables=False) as store:
            with pytest.raises(LeaseConfigError) as caught:
                store.check_health()
            message = str(caught.value)
            assert "lacks the columns waits, wait_slow_us, waits_expire_us" in message
            assert "init-schema --url OWNER_URL" in message and role.password not in message
            with pytest.raises(LeaseConfigError, match="lacks the columns waits"):
                store.acquire("r/a", Owner.new("role"), LONG)
        with owner_store(role, table_prefix):
            pass
        with store_from_url(role.url, table_prefix=table_prefix, create_tables=False) as store:
            assert store.check_health() == []

    def test_without_the_wait_list_functions_the_role_still_runs(self, request):
        """The role may not create the wait-list functions: while they are missing (tables
        of an earlier version) it claims with the one-statement forms, needing no new right;
        once init-schema (the owner's store) made them, the role's store calls them."""
        role = request.getfixturevalue("postgres_role")
        table_prefix = unique("fn") + "_"
        with owner_store(role, table_prefix) as owner:
            role.grant(owner)
            signatures = owner.sql.functions.signatures
        run_as(role.admin_url, *(f"DROP FUNCTION {signature}" for signature in signatures))
        with store_from_url(role.url, table_prefix=table_prefix) as store:
            assert store.sql.acquire_raw is store.sql.inline_raw[0]  # (it could not make them)
            (warning,) = store.check_health()
            assert "wait-list functions" in warning and "init-schema --url OWNER_URL" in warning
        exercise(role, table_prefix)
        with owner_store(role, table_prefix):  # what init-schema does first
            pass
        with store_from_url(role.url, table_prefix=table_prefix) as store:
            assert store.sql.acquire_raw is store.sql.fast_raw[0]
            assert store.check_health() == []
            holder = store.acquire("r/f", Owner.new("role"), LONG, identity="job-4")
            with pytest.raises(LeaseBusyError) as busy:  # joins, through the function
                store.acquire("r/f", Owner.new("role"), LONG, identity="job-5", wait="wake-5")
            assert busy.value.position == 1
            assert store.release(holder, outcome="done") and holder.handoff == "wake-5"

    def test_execute_revoked_after_the_store_started_falls_back(self, request):
        """A DBA revokes EXECUTE on the wait-list functions from PUBLIC after the role's store
        chose them: a refused claim and the release of a row with a waiter run the
        one-statement forms (the tables' rights suffice). Seen failing before: "permission
        denied for function ..._settle_..." with advice to GRANT rights the role has."""
        role = request.getfixturevalue("postgres_role")
        table_prefix = unique("rv") + "_"
        with owner_store(role, table_prefix) as owner:
            role.grant(owner)
            signatures = owner.sql.functions.signatures
        with store_from_url(role.url, table_prefix=table_prefix) as store:
            holder = store.acquire("r/v", Owner.new("role"), LONG, identity="job-1")
            with pytest.raises(LeaseBusyError) as busy:
                store.acquire("r/v", Owner.new("role"), LONG, identity="job-2", wait="wake-2")
            assert busy.value.position == 1 and store.sql.acquire_raw is store.sql.fast_raw[0]
            run_as(
                role.admin_url,
                *(
                    f"REVOKE EXECUTE ON FUNCTION {signature} FROM PUBLIC"
                    for signature in signatures
                ),
            )
            with pytest.raises(LeaseBusyError) as busy:
                store.acquire("r/v", Owner.new("role"), LONG, identity="job-3", wait="wake-3")
            assert busy.value.position == 2
            assert store.release(holder, outcome="done") and holder.handoff == "wake-2"

    @pytest.mark.parametrize(
        ("kind", "right"),
        [(kind, right) for kind, rights in TABLE_RIGHTS.items() for right in rights],
    )
    def test_negative_control_every_granted_right_is_needed(self, request, kind, right):
        """Without any one right of TABLE_RIGHTS some operation is refused, and the error
        names the GRANT that fixes it: the role's rights are no wider than the store needs."""
        role = request.getfixturevalue("postgres_role")
        table_prefix = unique("rt") + "_"
        with owner_store(role, table_prefix) as owner:
            role.grant(owner)
            table = owner.tables[kind].name
            grant = owner._grant(kind, role.name)
        run_as(role.admin_url, f"REVOKE {right} ON {table} FROM {role.name}")
        with pytest.raises(LeaseStoreError) as caught:
            exercise(role, table_prefix)
        message = str(caught.value)
        assert f"permission denied for table {table}" in message
        assert grant in message and role.password not in message

    def test_with_its_grants_the_role_runs_every_operation(self, request):
        """The positive twin of the control above: all rights granted, nothing refused."""
        role = request.getfixturevalue("postgres_role")
        table_prefix = unique("rt") + "_"
        with owner_store(role, table_prefix) as owner:
            role.grant(owner)
        exercise(role, table_prefix)


@pytest.mark.postgres
class TestInitSchemaAndCheck:
    def test_init_schema_then_check_as_the_least_privilege_role(self, request):
        """The app runs as the role: init-schema as the owner makes and grants the tables,
        check then finds exactly the rights the store needs; a revoked right is reported."""
        role = request.getfixturevalue("postgres_role")
        prefix = unique("cli")
        env = {"CLI_STORE": role.url, "CLI_PREFIX": prefix}

        refused = lease_here("init-schema", env=env)  # as the role itself: may not create
        assert refused.returncode == 2
        assert "may not create the lease tables" in one_line_error(refused)

        made = lease_here("init-schema", "--url", role.admin_url, "--grant", role.name, env=env)
        assert made.returncode == 0, made.stderr
        assert f"GRANT SELECT, INSERT, UPDATE ON {prefix}_leases TO {role.name}" in made.stdout
        again = lease_here("init-schema", "--url", role.admin_url, "--grant", role.name, env=env)
        assert again.returncode == 0, again.stderr  # idempotent

        done = lease_here("check", "--json", "--strict", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        checked = json.loads(done.stdout)
        facts = checked["postgresql"]
        assert checked["warnings"] == [] and checked["ok"]
        assert facts["role"] == role.name and facts["owns_tables"] == []
        assert not (facts["superuser"] or facts["create_in_schema"] or facts["create_role"])
        assert facts["table_rights"][f"{prefix}_leases"] == "SELECT,INSERT,UPDATE"
        assert facts["table_rights"][f"{prefix}_meta"] == "SELECT"
        assert facts["table_rights"][f"{prefix}_ledger"] == "SELECT,INSERT,UPDATE,DELETE"

        run_as(role.admin_url, f"REVOKE DELETE ON {prefix}_ledger FROM {role.name}")
        warned = lease_here("check", "--json", env=env)
        assert warned.returncode == 0, warned.stderr
        (warning,) = json.loads(warned.stdout)["warnings"]
        assert f"lacks DELETE on {prefix}_ledger" in warning
        assert f"GRANT SELECT, INSERT, UPDATE, DELETE ON {prefix}_ledger TO {role.name}" in warning
        strict = lease_here("check", "--strict", env=env)
        assert strict.returncode == 1

        # Without UPDATE on the lease table the write probe fails; the report still comes,
        # and names the right and the GRANT.
        run_as(role.admin_url, f"REVOKE UPDATE ON {prefix}_leases FROM {role.name}")
        failed = lease_here("check", "--json", env=env)
        assert failed.returncode == 1
        assert "write probe failed" in one_line_error(failed)
        report = json.loads(failed.stdout)
        grant = f"GRANT SELECT, INSERT, UPDATE ON {prefix}_leases TO {role.name}"
        assert not report["ok"] and grant in report["probe"]["failed"]
        assert any(f"UPDATE on {prefix}_leases" in w and grant in w for w in report["warnings"])

        as_owner = lease_here("check", "--json", env={"CLI_STORE": role.admin_url,
                                                    "CLI_PREFIX": prefix})  # fmt: skip
        assert any("superuser" in w for w in json.loads(as_owner.stdout)["warnings"])

    def test_init_schema_on_redis_prints_the_acl_line(self, request):
        """Redis has no schema: init-schema prints the ACL line for the app's key prefix."""
        server = request.getfixturevalue("redis_server")
        prefix = unique("cli")
        done = lease_here("init-schema", env={"CLI_STORE": server.url, "CLI_PREFIX": prefix})
        assert done.returncode == 0, done.stderr
        assert f"resetkeys ~{prefix}:* resetchannels -@all +evalsha" in done.stdout


class TestDocsAgree:
    def test_the_documented_acl_and_grants_are_the_tested_ones(self, tmp_path):
        """docs/stores.md shows the ACL the suite runs with and the GRANTs the store makes."""
        from celery_lease.cli import REDIS_ACL
        from tests.tooling.secure import REDIS_ACL_COMMANDS

        text = (Path(__file__).resolve().parents[1] / "docs" / "stores.md").read_text()
        acl = next(line for line in text.splitlines() if line.startswith("ACL SETUSER lease"))
        commands = [word for word in acl.split() if word.startswith("+")]
        assert commands == list(REDIS_ACL_COMMANDS)
        assert acl.replace("lease on >PASSWORD", "<user> on ><password>") == REDIS_ACL.format(
            prefix="celery_lease:"
        )
        with store_from_url(f"sqlite:///{tmp_path}/x.db") as store:
            for grant in store.grant_statements("lease_app"):
                assert f"\n{grant}\n" in text, grant

    @pytest.mark.redis
    def test_a_password_from_the_options_logs_in_the_urls_user(self, request):
        """The documented rediss:// URL with the user only and the password in the options."""
        server = request.getfixturevalue("redis_secure_server")
        prefix = unique("pw") + ":"
        url = redis_acl_user(server, prefix).replace(f":{REDIS_USER_PASSWORD}@", "@")
        with RedisLeaseStore(url=url, key_prefix=prefix, password=REDIS_USER_PASSWORD) as store:
            lease = store.acquire("p/a", Owner.new(), LONG)
            assert store.release(lease)
