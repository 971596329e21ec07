"""PostgreSQL SQL of the wait list (see :mod:`.waits` for the columns and the rules).

The claim stays one statement. Its first step is the plain upsert, which takes a free row only
when nobody waits (``waits IS NULL``): the common claim never reads the list. When that refuses,
the statement's second half settles the claim on the newest committed row, read ``FOR UPDATE``
(in READ COMMITTED that read waits for a racing writer and returns the row it committed): it
takes a free row that no waiter holds (the waiter whose wake is in flight, else the first never
woken, holds it against claims listed behind it), or refuses and joins the list and wakes the
waiter held for if nobody woke it, writing the row back once. The release rewrites the list in
the same ``UPDATE`` that frees the row (only when there is one) and returns the woken waiter's
payload.

PostgreSQL sets up every node of a statement's plan before it runs any (the settling CTEs of a
claim nobody waits for are never executed, but were initialised on every call: about half the
server CPU of a free claim). So where the store may, those steps live in two PL/pgSQL functions
(:func:`functions`) that a claim calls only when its upsert refused and a release only when
the row has a list: the common claim and release are then the bare upsert and ``UPDATE`` again.
The functions run the same SQL as the one-statement forms (same snapshot rules: the settling
read is ``FOR UPDATE``), which stay as the fallback for a database without them.

Parameters: ``r`` resource, ``t`` owner token, ``l`` label, ``ttl`` (us), ``i`` identity or
NULL, ``w`` wake payload or NULL, ``wttl`` how long a place is kept (us), ``cap`` wait list cap,
``grace`` hand-off grace (us), ``wbytes`` the most bytes of payloads a list holds (a join
that would pass it, or ``cap``, is refused unlisted), ``a`` the claim's attempt or NULL,
``since`` when its message was published (us) or NULL, ``skew`` how far ahead of the clock
that may lie (us; later counts as that far ahead). A waiter is ``[identity, since, expires,
woken_until, payload, attempt]`` (no attempt in a place an earlier version wrote; a NULL or
missing one is never older, see :func:`.waits.older`).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

from .._bounds import POLL, POLL_HOLD, POLL_PLACES, REARM_GROWTH

__all__ = [
    "SETTLE_ARGS",
    "Functions",
    "Raw",
    "claim_settle",
    "claim_wake_columns",
    "fetch",
    "functions",
    "hand_off_columns",
    "polling_column",
    "raw",
    "release_columns",
    "release_wake",
    "released",
    "settle_call",
]


def claim_settle(t: str, p: Callable[[str], str], duplicate: str, not_done: str) -> str:
    """CTEs after ``clk`` and ``claim`` (the plain upsert) that settle a refused claim; they end
    with ``claimed`` (the new lease from either step) and ``nl`` (the decision, with the lease
    row as it stood: the holder when refused). ``duplicate`` is a condition on ``dec.fence``
    (the holder runs this identity); ``not_done`` a condition that the identity is not done."""
    # (i: the name of the claim's place: its identity, or its waiter name)
    i, w, grace = f"{p('pn')}::varchar", f"{p('w')}::text", f"{p('grace')}::bigint"
    wttl, cap = f"{p('wttl')}::bigint", f"{p('cap')}::bigint"
    wbytes, a = f"{p('wbytes')}::bigint", f"{p('a')}::bigint"
    since = f"{p('since')}::bigint"
    # (a publish time counts as at most skew us ahead of the statement's clock, SINCE_SKEW)
    at = f"least(k.us + {p('skew')}::bigint, coalesce({since}, k.us))"
    # a woken waiter's grace: POLL_HOLD graces for a polling one (it polls once a grace)
    held = f"CASE WHEN x.e->>4 = '{POLL}' THEN {POLL_HOLD} * {grace} ELSE {grace} END"
    # a re-armed place takes its new payload within the bytes bound (base.rearm_fits)
    # (a polling place's payload counts no bytes)
    grew = (
        f"(CASE WHEN {w} = '{POLL}' THEN 0 ELSE octet_length({w}) END"
        f" - CASE WHEN x.e->>4 = '{POLL}' THEN 0 ELSE octet_length(x.e->>4) END)"
    )
    refits = (
        f"({grew} <= 0 OR act.bytes + {grew} <= {wbytes}"
        f" + CASE WHEN {grew} <= {REARM_GROWTH} THEN {REARM_GROWTH} * act.cnt ELSE 0 END)"
    )
    write = """
            waits = CASE WHEN n.list = '[]'::jsonb THEN NULL ELSE n.list END,
            wait_slow_us = CASE WHEN n.list = '[]'::jsonb OR n.slow = 0 THEN NULL
                                ELSE n.slow END,
            waits_expire_us = (SELECT max((x.e->>2)::bigint)
                               FROM jsonb_array_elements(n.list) AS x(e))"""
    return f"""
        cur AS (
            SELECT owner_token, owner_label, fence, acquired_us, expires_us, prev_label,
                   prev_fence, waits, wait_slow_us
            FROM {t}
            WHERE resource = {p("r")} AND NOT EXISTS (SELECT 1 FROM claim) AND {not_done}
            FOR UPDATE),
        wl AS (
            SELECT w.e, w.n
            FROM cur, jsonb_array_elements(coalesce(cur.waits, '[]'::jsonb))
                 WITH ORDINALITY AS w(e, n)),
        lw AS (
            SELECT wl.e, row_number() OVER (ORDER BY wl.n) AS pos
            FROM wl, clk WHERE (wl.e->>2)::bigint > clk.us),
        st AS MATERIALIZED (
            SELECT c.*, k.us AS now,
                c.owner_token IS NOT NULL AND c.expires_us > k.us AS live,
                CASE WHEN NOT EXISTS (SELECT 1 FROM lw) THEN 0
                ELSE greatest(coalesce(c.wait_slow_us, 0), coalesce((
                    SELECT max((wl.e->>3)::bigint) FROM wl
                    WHERE (wl.e->>3)::bigint BETWEEN 1 AND k.us) + 10 * {grace}, 0)) END AS slow,
                h.e AS head, h.pos AS hpos,
                (SELECT count(*) FROM lw) AS cnt,
                (SELECT count(*) FROM lw WHERE lw.e->>4 <> '{POLL}') AS mcnt,
                {at} AS at,
                (SELECT count(*) FROM lw WHERE (lw.e->>1)::bigint <= {at}) AS before,
                (SELECT coalesce(sum(octet_length(lw.e->>4)), 0) FROM lw
                 WHERE lw.e->>4 <> '{POLL}') AS bytes,
                (SELECT lw.pos FROM lw WHERE lw.e->>0 = {i}) AS mine,
                coalesce((SELECT {a} < (lw.e->>5)::bigint FROM lw WHERE lw.e->>0 = {i}),
                         false) AS stale
            FROM cur AS c CROSS JOIN clk AS k
            LEFT JOIN LATERAL (
                SELECT lw.e, lw.pos FROM lw
                WHERE (lw.e->>3)::bigint = 0 OR (lw.e->>3)::bigint > k.us
                ORDER BY (lw.e->>3)::bigint > k.us DESC, lw.pos LIMIT 1) AS h ON true),
        dec AS MATERIALIZED (
            SELECT st.*, CASE
                WHEN st.live AND st.owner_token <> {p("t")} THEN 'busy'
                WHEN st.live THEN 'mine'
                WHEN st.head IS NOT NULL AND st.slow <= st.now
                     AND (st.mine IS NULL OR st.stale OR st.mine > st.hpos)
                     THEN 'held'
                ELSE 'claim' END AS verdict
            FROM st),
        act AS MATERIALIZED (
            SELECT dec.*,
                dec.verdict IN ('busy', 'held') AND {w} IS NOT NULL AND {i} IS NOT NULL
                    AND NOT (dec.verdict = 'busy' AND {duplicate}) AS joins,
                dec.verdict = 'held' AND (dec.head->>3)::bigint = 0 AS wakes,
                {w} <> '{POLL}' AND dec.mcnt < {cap}
                    AND dec.bytes + coalesce(octet_length({w}), 0) <= {wbytes} AS asmsg,
                dec.cnt < {POLL_PLACES} * {cap} AS fits
            FROM dec),
        nl AS (
            SELECT act.*, coalesce((
                SELECT jsonb_agg(y.e ORDER BY y.k) FROM (
                    SELECT CASE
                        WHEN act.wakes AND x.pos = act.hpos THEN jsonb_build_array(x.e->0,
                            x.e->1, greatest((x.e->>2)::bigint, act.now + {held}),
                            act.now + {held}, x.e->4, x.e->5)
                        WHEN act.joins AND NOT act.stale AND x.e->>0 = {i}
                        THEN jsonb_build_array(x.e->0, x.e->1,
                            greatest((x.e->>2)::bigint, act.now + {wttl}), 0,
                            CASE WHEN {refits} THEN to_jsonb({w}) ELSE x.e->4 END,
                            CASE WHEN {refits} THEN to_jsonb({a}) ELSE x.e->5 END)
                        ELSE x.e END AS e, x.pos::numeric AS k
                    FROM lw AS x
                    WHERE act.verdict <> 'claim' OR act.stale OR x.e->>0 IS DISTINCT FROM {i}
                    UNION ALL
                    SELECT jsonb_build_array({i}, act.at, act.now + {wttl}, 0,
                               CASE WHEN act.asmsg THEN {w} ELSE '{POLL}' END, {a}),
                           act.before + 0.5
                    WHERE act.joins AND act.mine IS NULL AND act.fits) AS y),
                '[]'::jsonb) AS list,
              CASE WHEN act.verdict = 'claim' AND NOT act.stale AND {p("ow")}::boolean
                   THEN (SELECT x.e->>4 FROM lw AS x WHERE x.e->>0 = {i} LIMIT 1) END AS own
            FROM act),
        take AS (
            UPDATE {t} AS u SET
                owner_token = CASE WHEN n.took THEN {p("t")} ELSE u.owner_token END,
                owner_label = CASE WHEN n.took THEN {p("l")} ELSE u.owner_label END,
                fence = CASE WHEN n.took THEN u.fence + 1 ELSE u.fence END,
                acquired_us = CASE WHEN n.took THEN n.now ELSE u.acquired_us END,
                expires_us = CASE WHEN n.took THEN n.now + {p("ttl")} ELSE u.expires_us END,
                prev_label = CASE WHEN NOT n.took THEN u.prev_label
                    WHEN u.owner_token IS NULL THEN NULL ELSE u.owner_label END,
                prev_fence = CASE WHEN NOT n.took THEN u.prev_fence
                    WHEN u.owner_token IS NULL THEN NULL ELSE u.fence END,{write}
            FROM (SELECT nl.*, nl.verdict = 'claim' AS took FROM nl) AS n
            WHERE u.resource = {p("r")}
              AND (SELECT v.verdict = 'claim' OR v.wakes
                          OR (v.joins AND NOT v.stale AND (v.mine IS NOT NULL OR v.fits))
                   FROM nl AS v)
            RETURNING n.took, u.fence, u.acquired_us, u.expires_us, u.prev_label,
                      u.prev_fence),
        claimed AS (
            SELECT * FROM claim
            UNION ALL
            SELECT fence, acquired_us, expires_us, prev_label, prev_fence FROM take WHERE took)"""


def hand_off_columns(p: Callable[[str], str]) -> str:
    """The claim's last columns, from ``nl`` as ``h``: its place in the wait list (0: not
    queued), the payload of the waiter this claim woke, and the waiter held for (and until
    when) when refused for a hand-off."""
    grace = f"{p('grace')}::bigint"
    return f"""
            CASE WHEN h.joins THEN coalesce(h.mine, CASE WHEN h.fits THEN h.before + 1 ELSE 0 END)
                 ELSE 0 END,
            CASE WHEN h.wakes THEN h.head->>4 END,
            CASE WHEN h.verdict = 'held' THEN h.head->>0 END,
            CASE WHEN h.wakes THEN h.now + CASE WHEN h.head->>4 = '{POLL}'
                                              THEN {POLL_HOLD} * {grace} ELSE {grace} END
                 ELSE (h.head->>3)::bigint END"""


def polling_column(p: Callable[[str], str]) -> str:
    """One more column of a refused claim, from ``nl`` as ``h``: whether its place is a polling
    one (nobody sends its message; invariant 12)."""
    return f"""
            CASE WHEN h.joins THEN coalesce((
                SELECT y.e->>4 = '{POLL}' FROM jsonb_array_elements(h.list) AS y(e)
                WHERE y.e->>0 = {p("pn")}::varchar LIMIT 1), false) ELSE false END"""


def claim_wake_columns(p: Callable[[str], str], nl: str = "nl") -> str:
    """Two more columns of a claim, from ``nl``: the payload a release would wake if it ran
    now (the first live waiter never woken, none while a wake is in flight; only when asked,
    ``nw``), for a claim that took the lease or holds it already (the same claim sent again),
    and the payload of the claimant's own place as the claim took it off the list (``ow``);
    NULL when refused. Invariant 15.
    Scalar subqueries, not joins: one more join of a set-returning function's rows made the
    planner's estimate big enough for PostgreSQL's JIT, 0.5 s of compiling per claim."""
    return f"""
            (SELECT CASE WHEN {p("nw")}::boolean AND NOT EXISTS (
                        SELECT 1 FROM jsonb_array_elements(g.list) AS y(e)
                        WHERE (y.e->>3)::bigint > g.now)
                    THEN (SELECT x.e->>4
                          FROM jsonb_array_elements(g.list) WITH ORDINALITY AS x(e, n)
                          WHERE (x.e->>3)::bigint = 0 ORDER BY x.n LIMIT 1) END
             FROM {nl} AS g WHERE g.verdict IN ('claim', 'mine')),
            (SELECT g.own FROM {nl} AS g WHERE g.verdict = 'claim')"""


def _release_places() -> str:
    """The live places after a release, ``target`` the first never woken if no wake is in
    flight (the one to wake)."""
    return """(
                SELECT x.e, x.n, CASE WHEN bool_or((x.e->>3)::bigint > clk.us) OVER ()
                    THEN NULL
                    ELSE min(x.n) FILTER (WHERE (x.e->>3)::bigint = 0) OVER () END AS target
                FROM jsonb_array_elements(u.waits) WITH ORDINALITY AS x(e, n)
                WHERE (x.e->>2)::bigint > clk.us) AS y"""


def release_columns(p: Callable[[str], str]) -> str:
    """The SET items of a release ``UPDATE {t} AS u ... FROM clk`` that hand over to the
    first waiter never woken (the list columns stay NULL when nobody waits)."""
    grace = f"{p('grace')}::bigint"
    places = _release_places()
    held = f"(CASE WHEN y.e->>4 = '{POLL}' THEN {POLL_HOLD} * {grace} ELSE {grace} END)"
    woken = (
        f"jsonb_build_array(y.e->0, y.e->1, greatest((y.e->>2)::bigint, clk.us + {held}), "
        f"clk.us + {held}, y.e->4, y.e->5)"
    )
    return f"""
                waits = CASE WHEN u.waits IS NULL THEN NULL ELSE (
                    SELECT jsonb_agg(CASE WHEN y.n = y.target THEN {woken} ELSE y.e END
                                     ORDER BY y.n)
                    FROM {places}) END,
                waits_expire_us = CASE WHEN u.waits IS NULL THEN NULL ELSE (
                    SELECT max(CASE WHEN y.n = y.target
                                    THEN greatest((y.e->>2)::bigint, clk.us + {held})
                                    ELSE (y.e->>2)::bigint END)
                    FROM {places}) END,
                wait_slow_us = CASE WHEN u.waits IS NULL OR NOT EXISTS (
                        SELECT 1 FROM jsonb_array_elements(u.waits) AS x(e)
                        WHERE (x.e->>2)::bigint > clk.us) THEN NULL
                    ELSE nullif(greatest(coalesce(u.wait_slow_us, 0), coalesce((
                        SELECT max((x.e->>3)::bigint)
                        FROM jsonb_array_elements(u.waits) AS x(e)
                        WHERE (x.e->>3)::bigint BETWEEN 1 AND clk.us) + 10 * {grace}, 0)), 0)
                    END"""


def release_wake(p: Callable[[str], str]) -> str:
    """The RETURNING item of that release: the payload of the waiter it woke, or NULL."""
    grace = f"{p('grace')}::bigint"
    return f"""(SELECT x.e->>4 FROM jsonb_array_elements(u.waits) AS x(e)
                    WHERE (x.e->>3)::bigint = clk.us + CASE WHEN x.e->>4 = '{POLL}'
                        THEN {POLL_HOLD} * {grace} ELSE {grace} END LIMIT 1)"""


#: The settling function's parameters, in order (``p_<name>`` in its body): the claim's
#: parameters, the statement's clock, the fence of this identity's running record (NULL: none),
#: and the lease row's fence and holder as the claim's snapshot saw them, which the settling
#: read must find unchanged when ``check_was`` (the identity claim, see fbfe5cf).
SETTLE_ARGS = (
    ("r", "varchar"),
    ("t", "varchar"),
    ("l", "varchar"),
    ("ttl", "bigint"),
    ("i", "varchar"),
    ("w", "text"),
    ("wttl", "bigint"),
    ("cap", "bigint"),
    ("wbytes", "bigint"),
    ("grace", "bigint"),
    ("a", "bigint"),
    ("nw", "boolean"),
    ("ow", "boolean"),
    ("pn", "varchar"),
    ("since", "bigint"),
    ("skew", "bigint"),
    ("now", "bigint"),
    ("running", "bigint"),
    ("was_fence", "bigint"),
    ("was_token", "varchar"),
    ("check_was", "boolean"),
)
#: How many of SETTLE_ARGS are the claim's own parameters (the rest come from the statement).
CLAIM_ARGS = [name for name, _ in SETTLE_ARGS].index("now")
#: What the settling function returns (as ``SETOF record``, shaped by :func:`settle_call`): the
#: new lease (``took``), then the lease row as it stood, then :func:`hand_off_columns` and
#: :func:`claim_wake_columns`.
SETTLE_COLUMNS = (
    "o_took boolean, o_fence bigint, o_acquired bigint, o_expires bigint, "
    "o_prev_label varchar, o_prev_fence bigint, o_token varchar, o_label varchar, "
    "o_hfence bigint, o_hacquired bigint, o_hexpires bigint, o_hprev_label varchar, "
    "o_hprev_fence bigint, o_position bigint, o_wake text, o_hold text, o_hold_until bigint, "
    "o_next_wake text, o_own_wake text, o_polling boolean"
)


class Functions(NamedTuple):
    """The two PL/pgSQL functions of one lease table (names quoted, with their DDL)."""

    settle: str  # settle(SETTLE_ARGS): a refused claim, settled on the locked row
    hand_off: str  # hand_off(resource, grace): the list rewrite of a release, the woken payload
    signatures: tuple[str, ...]  # for to_regprocedure(), one per function
    ddl: tuple[str, ...]  # CREATE FUNCTION statements


def functions(t: str, prefix: str, now: str, quote: Callable[[str], str]) -> Functions:
    """The functions for table ``t`` (quoted), named ``<prefix>settle_<crc>`` and
    ``<prefix>hand_off_<crc>``, ``<crc>`` a checksum of their body: a version whose SQL differs
    uses (and creates) its own, and never runs another version's."""

    def v(name: str) -> str:
        return f"p_{name}"

    settle_body = f"""
        BEGIN
          RETURN QUERY
            WITH clk AS (SELECT p_now AS us),
            claim AS (SELECT NULL::bigint AS fence, NULL::bigint AS acquired_us,
                NULL::bigint AS expires_us, NULL::varchar AS prev_label,
                NULL::bigint AS prev_fence WHERE false),{
        claim_settle(
            t,
            v,
            "dec.fence IS NOT DISTINCT FROM p_running",
            "(NOT p_check_was OR (fence = p_was_fence "
            "AND owner_token IS NOT DISTINCT FROM p_was_token))",
        )
    }
            SELECT coalesce(k.took, false), k.fence, k.acquired_us, k.expires_us,
                   k.prev_label, k.prev_fence, h.owner_token, h.owner_label, h.fence,
                   h.acquired_us, h.expires_us, h.prev_label, h.prev_fence,{hand_off_columns(v)},
                   {claim_wake_columns(v)},{polling_column(v)}
            FROM nl AS h LEFT JOIN take AS k ON true;
        END"""
    hand_off_body = f"""
        DECLARE
          v_wake text;
        BEGIN
          WITH clk AS (SELECT {now} AS us)
          UPDATE {t} AS u SET{release_columns(v)}
          FROM clk WHERE u.resource = p_r
          RETURNING {release_wake(v)} INTO v_wake;
          RETURN v_wake;
        END"""
    settle_body = " ".join(settle_body.split())
    hand_off_body = " ".join(hand_off_body.split())
    settle_args = ", ".join(f"p_{name} {kind}" for name, kind in SETTLE_ARGS)
    settle_rest = (
        f"({settle_args}) RETURNS SETOF record LANGUAGE plpgsql VOLATILE "
        f"AS $body${settle_body}$body$"
    )
    hand_off_rest = (
        "(p_r varchar, p_grace bigint) RETURNS text LANGUAGE plpgsql VOLATILE "
        f"AS $body${hand_off_body}$body$"
    )
    settle = quote(f"{prefix}settle_{zlib.crc32(settle_rest.encode()):08x}")
    hand_off = quote(f"{prefix}hand_off_{zlib.crc32(hand_off_rest.encode()):08x}")
    return Functions(
        settle,
        hand_off,
        (
            f"{settle}({', '.join(kind for _, kind in SETTLE_ARGS)})",
            f"{hand_off}(varchar, bigint)",
        ),
        (f"CREATE FUNCTION {settle}{settle_rest}", f"CREATE FUNCTION {hand_off}{hand_off_rest}"),
    )


def settle_call(fn: str, p: Callable[[str], str], running: str, was: tuple[str, str, str]) -> str:
    """The call of the settling function ``fn`` in a claim statement, its clock from ``clk``;
    ``running`` and ``was`` (fence, holder, check) are SQL for the last four arguments."""
    claim_args = ", ".join(f"{p(name)}::{kind}" for name, kind in SETTLE_ARGS[:CLAIM_ARGS])
    # (its rows' shape is given here, not by the function: PostgreSQL would otherwise rebuild
    # it from the catalog on every claim, called or not)
    return (
        f"{fn}({claim_args}, (SELECT us FROM clk), {running}, {', '.join(was)}) "
        f"AS s({SETTLE_COLUMNS})"
    )


def release_calling(t: str, fn: str, p: Callable[[str], str]) -> str:
    """The release of the row held under ``(r, t, f)``: the hand-off function ``fn`` is called
    (from RETURNING) only when the row has a wait list, and answers the woken payload."""
    return f"""
        UPDATE {t} SET owner_token = NULL, prev_label = NULL, prev_fence = NULL
        WHERE resource = {p("r")} AND owner_token = {p("t")} AND fence = {p("f")}
        RETURNING CASE WHEN waits IS NULL THEN NULL
            ELSE {fn}(resource, {p("grace")}::bigint) END"""


def released(row: Any) -> tuple[int, str | None]:
    """A PostgreSQL release's answer as (rows released, payload of the waiter it woke): the
    one-statement forms answer (count, [outcome count,] payload), the function forms one row
    (the payload) when they released and none when not."""
    if row is None:
        return 0, None
    if len(row) == 1:
        return 1, row[0]
    return int(row[0]), row[-1]


class Raw(NamedTuple):
    """A PostgreSQL statement also written with native ``$n`` placeholders (see :func:`fetch`)."""

    text: str  # with %(name)s placeholders
    dollar: str  # the same with $1, $2, ... (each name numbered once)
    names: tuple[str, ...]  # the parameter of each $n, in order
    #: ``dollar`` as sent: bytes made once when it is ASCII (what psycopg's encoding of it gives
    #: in every client encoding), so psycopg neither encodes it nor hashes a new copy of a
    #: statement of several KB for its prepared-statement lookup on every call.
    query: str | bytes


def raw(text: str) -> Raw:
    """``text`` with its ``%(name)s`` placeholders numbered as ``$n``, whitespace collapsed."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    text = " ".join(text.split())  # (no literal in these statements holds a space)
    dollar = re.sub(r"%\((\w+)\)s", number, text)
    return Raw(text, dollar, tuple(names), dollar.encode() if dollar.isascii() else dollar)


def fetch(
    cursor: Any,
    statement: Raw,
    params: dict[str, Any],
    meanwhile: Callable[[], None] | None = None,
) -> Any:
    """Run a long statement and return its one row; ``meanwhile`` (see :func:`overlapped`)
    runs once the statement is sent, before its answer is read.

    psycopg converts ``%(name)s`` placeholders on every call for a statement longer than 4 KB
    (it caches shorter ones): for the claim with its wait list that was 150-200 us of client
    CPU per claim. A raw cursor (psycopg 3.2+) sends the ``$n`` text as it is; older psycopg
    takes the converting path.
    """
    import psycopg  # (only PostgreSQL stores call this)

    raw_cursor = getattr(psycopg, "RawCursor", None)
    if raw_cursor is None:  # pragma: no cover - psycopg 3.1
        cursor.execute(statement.text, params)
        return cursor.fetchone()
    values = [params[name] for name in statement.names]
    kept: Any = getattr(cursor, "raw", False)  # the store's cursors keep theirs (None: not yet)
    if meanwhile is not None and not any(isinstance(v, str) and "\x00" in v for v in values):
        # (a NUL would cut libpq's text parameter short: such a call takes the cursor, which
        # refuses it, as it always did; the store runs meanwhile after it)
        conn = cursor.connection
        prepare = kept is not False and conn.prepare_threshold is not None
        return overlapped(conn, statement, values, meanwhile, prepare)
    if kept is False:
        # The user's cursor_factory (ClientCursor behind PgBouncer's transaction pooling):
        # nothing is prepared on the server, which another client's session may get next.
        with raw_cursor(cursor.connection) as rc:
            rc.execute(statement.query, values, prepare=False)
            return rc.fetchone()
    if kept is None:
        kept = cursor.raw = raw_cursor(cursor.connection)
    kept.execute(statement.query, values)
    return kept.fetchone()


#: How often psycopg's wait for a socket wakes to look for an interrupt, in seconds, as
#: psycopg's own connections do (0, its default for a bare wait, polls the socket in a loop).
_WAIT_INTERVAL = 0.1

#: Result column types an overlapped statement answers as int (int8, int2, int4); the rest as text.
_INT_TYPES = frozenset((20, 21, 23))


def overlapped(
    conn: Any,
    statement: Raw,
    values: list[Any],
    meanwhile: Callable[[], None],
    prepare: bool = True,
) -> Any:
    """Send ``statement`` on psycopg connection ``conn`` (autocommit), run ``meanwhile``, then
    read the statement's one row (None when it has none): a release whose wake goes out while
    the release is on its way (early wake). psycopg's cursors send and read in one call, so
    this goes through libpq (psycopg's ``pgconn``) with text parameters, typed by the server
    from the statement, prepared once per connection (unless not ``prepare``: the user's
    ``cursor_factory``, or psycopg's ``prepare_threshold`` None, as behind PgBouncer). Errors
    are psycopg's, as from a cursor (a broken connection makes ``conn.closed`` true, which
    SQLAlchemy reads as a disconnect). ``meanwhile`` runs when the statement is on its way,
    or when sending it failed."""
    from psycopg import errors, generators, pq, waiting  # (only PostgreSQL stores call this)

    pgconn = conn.pgconn
    encoding = conn.info.encoding
    text = [None if v is None else _text_param(v, encoding) for v in values]
    query = statement.query
    if not isinstance(query, bytes):
        query = statement.dollar.encode(encoding)
    prepared: dict[bytes, bytes] | None = getattr(conn, "celery_lease_prepared", None)
    if prepared is None:
        prepared = conn.celery_lease_prepared = {}
    try:
        if prepare:
            name = prepared.get(query) or _prepare(conn, query, prepared)
            pgconn.send_query_prepared(name, text)
        else:
            pgconn.send_query_params(query, text)
        waiting.wait(generators.send(pgconn), pgconn.socket, _WAIT_INTERVAL)
    except BaseException:
        meanwhile()
        raise
    meanwhile()
    results = waiting.wait(generators.fetch_many(pgconn), pgconn.socket, _WAIT_INTERVAL)
    row = None
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            # (prepared again next time, under a new name: the error may be the plan's,
            # a function it calls dropped and made again)
            prepared.pop(query, None)
            raise errors.error_from_result(result, encoding=encoding)
        if result.ntuples and row is None:
            row = tuple(
                _column(result.get_value(0, i), result.ftype(i), encoding)
                for i in range(result.nfields)
            )
    return row


def _prepare(conn: Any, query: bytes, prepared: dict[bytes, bytes]) -> bytes:
    """Prepare ``query`` on ``conn`` (as psycopg's cursors do with a statement they run often:
    planning the release again on every call cost about 0.2 ms); its name."""
    from psycopg import errors, generators, pq, waiting

    made = getattr(conn, "celery_lease_prepares", 0)  # (a name is never used twice)
    conn.celery_lease_prepares = made + 1
    name = b"celery_lease_%d" % made
    pgconn = conn.pgconn
    pgconn.send_prepare(name, query)
    for result in waiting.wait(generators.fetch_many(pgconn), pgconn.socket, _WAIT_INTERVAL):
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(result, encoding=conn.info.encoding)
    prepared[query] = name
    return name


def _text_param(value: Any, encoding: str) -> bytes:
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):
        return str(value).encode()
    return str(value).encode(encoding)


def _column(value: bytes | None, oid: int, encoding: str) -> Any:
    if value is None:
        return None
    if oid in _INT_TYPES:
        return int(value)
    return bytes(value).decode(encoding)
