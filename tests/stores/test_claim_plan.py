"""PostgreSQL: a claim, an identity claim and a release nobody waits for stay small plans.

PostgreSQL sets up every node of a statement's plan each time it runs it, executed or not.
With the wait list's steps inside the claim and release statements (0005529) a free claim
initialised ~50 plan nodes it never ran, and cost 1.5-2x the server CPU of the bare upsert.
The steps now live in the wait-list functions, called only when a claim is refused or a
released row has a list. These tests read the generic plan (the one a prepared statement runs
after five calls) and check its shape, not its speed: no step of the wait list in it (no
``jsonb_array_elements``, window, ``FOR UPDATE`` read or second ``UPDATE`` of the lease row)
and no more nodes than the statements of 8d709ef (before the wait list) plus the call.

Negative control: the one-statement forms (which a database without the functions still
runs) fail the same check.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from celery_lease import LeaseBusyError, Owner
from celery_lease.stores import store_from_url
from celery_lease.stores.sql import SQLLeaseStore
from tests.conftest import unique

pytestmark = pytest.mark.postgres

LONG = 30.0
#: The plan nodes of the statements of 8d709ef, counted the same way: claim 10, release 2,
#: identity claim 25, identity release 9. The bounds allow the settling call (a function scan
#: under its subquery scan) and the identity claim's snapshot read of the lease row with the
#: CTE scans that pass it on, and the two scans of the settling call's row that answer the
#: next waiter and the claimant's own place (invariant 15: the early wake).
MAX_NODES = {"claim": 11, "release": 2, "identity claim": 38, "identity release": 9}
#: Nodes that only the wait list needs.
WAIT_LIST_NODES = {"LockRows", "WindowAgg", "Function Scan(jsonb_array_elements)"}
PARAMS = {
    "r": "plan/r",
    "t": "0" * 32,
    "l": "label",
    "ttl": 60_000_000,
    "i": "job",
    "w": None,
    "wttl": 120_000_000,
    "cap": 100,
    "wbytes": 131_072,
    "grace": 2_000_000,
    "f": 1,
    "ret": 86_400_000_000,
    "nw": True,
    "ow": True,
    "o": "done",
    "res": None,
    "a": 0,
    "pn": "job",
    "since": None,
    "skew": 5_000_000,
}


@pytest.fixture
def pg(request: pytest.FixtureRequest) -> Any:
    url = request.getfixturevalue("postgres_server").url
    store = store_from_url(url, table_prefix=f"{unique('pl')}_")
    parts = make_url(url)
    conn = psycopg.connect(
        host=parts.host, port=parts.port, user=parts.username, dbname=parts.database,
        autocommit=True,
    )  # fmt: skip
    try:
        yield store, conn
    finally:
        conn.close()
        store.close()


def statements(store: SQLLeaseStore) -> dict[str, Any]:
    """The statements the store runs, by operation."""
    return {
        "claim": store.sql.acquire_raw,
        "release": store.sql.release_raw,
        "identity claim": store.ledger_sql.acquire_raw,
        "identity release": store.ledger_sql.release_outcome_raw,
    }


def generic_plan(conn: Any, statement: Any) -> list[str]:
    """The node types of ``statement``'s generic plan (function scans with their function)."""
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(f"PREPARE plan_probe AS {statement.dollar}")
    try:
        cursor = psycopg.ClientCursor(conn)
        marks = ", ".join(["%s"] * len(statement.names))
        cursor.execute(
            f"EXPLAIN (FORMAT JSON) EXECUTE plan_probe({marks})",
            [PARAMS[name] for name in statement.names],
        )
        row = cursor.fetchone()
        assert row is not None
        plan = row[0][0]["Plan"]
    finally:
        conn.execute("DEALLOCATE plan_probe")
        conn.execute("RESET plan_cache_mode")
    nodes: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        kind = node["Node Type"]
        if kind == "Function Scan":
            kind = f"Function Scan({node['Function Name']})"
        nodes.append(kind)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan)
    return nodes


def wait_list_steps(conn: Any, store: SQLLeaseStore) -> dict[str, str]:
    """What is wrong with each statement's plan (empty: nothing)."""
    wrong = {}
    for operation, statement in statements(store).items():
        nodes = generic_plan(conn, statement)
        kinds = Counter(nodes)
        steps = {kind: n for kind, n in kinds.items() if kind in WAIT_LIST_NODES}
        # the lease row is written once (the identity ones also write the identity row)
        updates = kinds["ModifyTable"] - (operation.startswith("identity"))
        if steps or updates > 1 or len(nodes) > MAX_NODES[operation]:
            wrong[operation] = f"{len(nodes)} nodes: {dict(kinds)}"
    return wrong


class TestPlansOfTheClaimNobodyWaitsFor:
    def test_no_wait_list_step_is_in_the_plans(self, pg):
        """With the functions, no plan holds a step of the wait list, and none is larger
        than before the wait list (plus the call)."""
        store, conn = pg
        assert store.sql.acquire_raw is store.sql.fast_raw[0]
        assert wait_list_steps(conn, store) == {}

    def test_negative_control_the_one_statement_forms_carry_the_wait_list(self, pg):
        """The same check fails on the statements with the whole wait list in them."""
        store, conn = pg
        store.sql.use_functions(False)
        store.ledger_sql.use_functions(False)
        wrong = wait_list_steps(conn, store)
        assert set(wrong) == {"claim", "release", "identity claim", "identity release"}, wrong
        assert "LockRows" in wrong["claim"] and "jsonb_array_elements" in wrong["release"]

    def test_the_functions_answer_as_the_statements_do(self, pg):
        """Through the functions a busy claim joins, the release wakes it, and it claims."""
        store, _ = pg
        holder = store.acquire("plan/w", Owner.new("a"), LONG)
        with pytest.raises(Exception) as busy:
            store.acquire("plan/w", Owner.new("b"), LONG, identity="job-b", wait="wake-b")
        assert getattr(busy.value, "position", None) == 1
        assert store.release(holder) and holder.handoff == "wake-b"
        lease = store.acquire("plan/w", Owner.new("b"), LONG, identity="job-b", wait="wake-b")
        assert lease.fence == holder.fence + 1 and store.waiters("plan/w") == []
        assert store.release(lease, outcome="done") and lease.handoff is None


class TestWithoutTheFunctions:
    def test_a_store_that_finds_them_missing_claims_with_the_whole_statement(self, pg):
        """Functions dropped (or never made: a role that may not): a store made without
        creating tables finds them missing and runs the one-statement forms, with the same
        answers; the owner's create_tables() makes them again and they are used."""
        store, conn = pg
        for signature in store.sql.functions.signatures:
            conn.execute(f"DROP FUNCTION {signature}")
        prefix = store.leases_table.name.removesuffix("leases")
        url = store.engine.url.render_as_string(hide_password=False)
        with store_from_url(url, table_prefix=prefix, create_tables=False) as other:
            holder = other.acquire("plan/x", Owner.new("a"), LONG)
            assert other.sql.acquire_raw is other.sql.inline_raw[0]
            with pytest.raises(Exception) as busy:
                other.acquire("plan/x", Owner.new("b"), LONG, identity="job-b", wait="wake-b")
            assert getattr(busy.value, "position", None) == 1
            assert other.release(holder) and holder.handoff == "wake-b"
            other.create_tables()
            assert other.sql.acquire_raw is other.sql.fast_raw[0]
            lease = other.acquire("plan/x", Owner.new("b"), LONG, identity="job-b", wait="w")
            assert other.release(lease, outcome="done")

    def test_a_version_that_changed_one_function_makes_only_that_one(self, pg):
        """Another version's settling SQL (a new name) next to the same hand-off function:
        the store makes the missing one and uses both (it failed on the one that existed)."""
        store, conn = pg
        conn.execute(f"DROP FUNCTION {store.sql.functions.signatures[0]}")
        prefix = store.leases_table.name.removesuffix("leases")
        url = store.engine.url.render_as_string(hide_password=False)
        with store_from_url(url, table_prefix=prefix) as other:
            assert other.sql.acquire_raw is other.sql.fast_raw[0]
            lease = other.acquire("plan/v", Owner.new("a"), LONG)
            assert other.release(lease)

    def test_functions_dropped_after_start_release_then_claim(self, pg, caplog):
        """The functions dropped after the store chose them (an owner cleaning up, a restore
        without them): the release of a row with a waiter and later refused claims fall back
        to the one-statement forms, with the same answers, and say so once. Seen failing
        before: the release raised UndefinedFunction (the outcome is unknown) forever."""
        store, conn = pg
        holder = store.acquire("plan/d", Owner.new("a"), LONG)
        with pytest.raises(LeaseBusyError) as busy:
            store.acquire("plan/d", Owner.new("b"), LONG, identity="job-b", wait="wake-b")
        assert busy.value.position == 1
        assert store.sql.acquire_raw is store.sql.fast_raw[0]
        for signature in store.sql.functions.signatures:
            conn.execute(f"DROP FUNCTION {signature}")
        with caplog.at_level(logging.WARNING, logger="celery_lease"):
            assert store.release(holder) and holder.handoff == "wake-b"
            assert store.sql.acquire_raw is store.sql.inline_raw[0]
            assert store.ledger_sql.acquire_raw is store.ledger_sql.inline_raw[0]
            lease = store.acquire("plan/d", Owner.new("b"), LONG, identity="job-b", wait="x")
            with pytest.raises(LeaseBusyError) as busy:
                store.acquire("plan/d", Owner.new("c"), LONG, identity="job-c", wait="wake-c")
            assert busy.value.position == 1
            assert store.release(lease, outcome="done") and lease.handoff == "wake-c"
        warned = [r for r in caplog.records if "init-schema" in r.getMessage()]
        assert len(warned) == 1 and store.sql.functions.hand_off in warned[0].getMessage()

    def test_functions_dropped_after_start_refused_claims(self, pg):
        """As above, the first call after the drop a refused claim (identity, then plain)."""
        store, conn = pg
        holder = store.acquire("plan/e", Owner.new("a"), LONG)
        for signature in store.sql.functions.signatures:
            conn.execute(f"DROP FUNCTION {signature}")
        with pytest.raises(LeaseBusyError) as busy:
            store.acquire("plan/e", Owner.new("b"), LONG, identity="job-b", wait="wake-b")
        assert busy.value.position == 1
        with pytest.raises(LeaseBusyError) as busy:
            store.acquire("plan/e", Owner.new("c"), LONG)
        assert busy.value.position is None
        with pytest.raises(LeaseBusyError) as busy:
            store.acquire("plan/e", Owner.new("c"), LONG, identity="job-c", wait="wake-c")
        assert busy.value.position == 2
        assert store.release(holder) and holder.handoff == "wake-b"


class TestFunctionsOfAnotherRole:
    def test_functions_planted_by_another_role_are_never_called(self, pg):
        """A role that may create in the tables' schema (PUBLIC could, before PostgreSQL 15)
        makes functions with the predictable names before the owner's store does. The owner's
        store must not run them (they would run with the owner's rights): it uses only
        functions the tables' owner owns, in the tables' schema, and else the one-statement
        forms. Seen failing before: the refused claim ran the planted settling function."""
        store, conn = pg
        url = store.engine.url.render_as_string(hide_password=False)
        prefix = f"{unique('pt')}_"
        role = unique("planter")
        with store_from_url(url, table_prefix=prefix, create_tables=False) as probe:
            functions = probe.sql.functions  # the names are computed, not looked up
        conn.execute(f"CREATE ROLE {role} NOLOGIN NOSUPERUSER")
        try:
            conn.execute(f"GRANT CREATE ON SCHEMA public TO {role}")
            conn.execute(f"SET ROLE {role}")
            args = ", ".join(
                kind for kind in functions.signatures[0].split("(", 1)[1][:-1].split(", ")
            )
            planted = "BEGIN RAISE EXCEPTION 'planted function ran'; END"
            conn.execute(
                f"CREATE FUNCTION public.{functions.settle}({args}) RETURNS SETOF record "
                f"LANGUAGE plpgsql AS $b${planted}$b$"
            )
            conn.execute(
                f"CREATE FUNCTION public.{functions.hand_off}(varchar, bigint) RETURNS text "
                f"LANGUAGE plpgsql AS $b${planted}$b$"
            )
            conn.execute("RESET ROLE")
            with store_from_url(url, table_prefix=prefix) as owner:
                holder = owner.acquire("plan/p", Owner.new("a"), LONG)
                with pytest.raises(Exception) as busy:
                    owner.acquire("plan/p", Owner.new("b"), LONG, identity="job-b", wait="w")
                assert "planted" not in str(busy.value)
                assert getattr(busy.value, "position", None) == 1
                assert owner.release(holder) and holder.handoff == "w"
                assert owner.sql.acquire_raw is owner.sql.inline_raw[0]
        finally:
            conn.execute("RESET ROLE")
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
