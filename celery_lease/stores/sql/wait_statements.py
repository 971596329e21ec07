"""PostgreSQL SQL of the wait list (see :mod:`.waits` for the columns and the rules).

The claim stays one statement. Its first step is the plain upsert, which takes a free row only
when nobody waits (``waits IS NULL``): the common claim never reads the list. When that refuses,
the statement's second half settles the claim on the newest committed row, read ``FOR UPDATE``
(in READ COMMITTED that read waits for a racing writer and returns the row it committed): it
takes a free row that no head waiter holds, or refuses and joins the list and wakes a head
nobody woke, writing the row back once. The release rewrites the list in the same ``UPDATE``
that frees the row (only when there is one) and returns the woken waiter's payload.

Parameters: ``r`` resource, ``t`` owner token, ``l`` label, ``ttl`` (us), ``i`` identity or
NULL, ``w`` wake payload or NULL, ``wttl`` how long a place is kept (us), ``cap`` wait list cap,
``grace`` hand-off grace (us). A waiter is ``[identity, since, expires, woken_until, payload]``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["claim_settle", "hand_off_columns", "release_columns", "release_wake"]


def claim_settle(t: str, p: Callable[[str], str], duplicate: str, not_done: str) -> str:
    """CTEs after ``clk`` and ``claim`` (the plain upsert) that settle a refused claim; they end
    with ``claimed`` (the new lease from either step) and ``nl`` (the decision, with the lease
    row as it stood: the holder when refused). ``duplicate`` is a condition on ``dec.fence``
    (the holder runs this identity); ``not_done`` a condition that the identity is not done."""
    i, w, grace = f"{p('i')}::varchar", f"{p('w')}::text", f"{p('grace')}::bigint"
    wttl, cap = f"{p('wttl')}::bigint", f"{p('cap')}::bigint"
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
        st AS (
            SELECT c.*, k.us AS now,
                c.owner_token IS NOT NULL AND c.expires_us > k.us AS live,
                greatest(coalesce(c.wait_slow_us, 0), coalesce((
                    SELECT max((wl.e->>3)::bigint) FROM wl
                    WHERE (wl.e->>3)::bigint BETWEEN 1 AND k.us) + 10 * {grace}, 0)) AS slow,
                (SELECT lw.e FROM lw WHERE lw.pos = 1) AS head,
                (SELECT count(*) FROM lw) AS cnt,
                (SELECT lw.pos FROM lw WHERE lw.e->>0 = {i}) AS mine
            FROM cur AS c, clk AS k),
        dec AS (
            SELECT st.*, CASE
                WHEN st.live AND st.owner_token <> {p("t")} THEN 'busy'
                WHEN st.live THEN 'mine'
                WHEN st.head IS NOT NULL AND st.head->>0 IS DISTINCT FROM {i}
                     AND st.slow <= st.now
                     AND ((st.head->>3)::bigint = 0 OR (st.head->>3)::bigint > st.now)
                     THEN 'held'
                ELSE 'claim' END AS verdict
            FROM st),
        act AS (
            SELECT dec.*,
                dec.verdict IN ('busy', 'held') AND {w} IS NOT NULL AND {i} IS NOT NULL
                    AND NOT (dec.verdict = 'busy' AND {duplicate}) AS joins,
                dec.verdict = 'held' AND (dec.head->>3)::bigint = 0 AS wakes
            FROM dec),
        nl AS (
            SELECT act.*, coalesce((
                SELECT jsonb_agg(CASE
                    WHEN act.wakes AND x.pos = 1 THEN jsonb_build_array(x.e->0, x.e->1,
                        greatest((x.e->>2)::bigint, act.now + {grace}), act.now + {grace},
                        x.e->4)
                    WHEN act.joins AND x.e->>0 = {i} THEN jsonb_build_array(x.e->0, x.e->1,
                        greatest((x.e->>2)::bigint, act.now + {wttl}), x.e->3, {w})
                    ELSE x.e END ORDER BY x.pos)
                FROM lw AS x
                WHERE act.verdict <> 'claim' OR x.e->>0 IS DISTINCT FROM {i}), '[]'::jsonb)
              || CASE WHEN act.joins AND act.mine IS NULL AND act.cnt < {cap}
                 THEN jsonb_build_array(
                     jsonb_build_array({i}, act.now, act.now + {wttl}, 0, {w}))
                 ELSE '[]'::jsonb END AS list
            FROM act),
        take AS (
            UPDATE {t} AS u SET owner_token = {p("t")}, owner_label = {p("l")},
                fence = u.fence + 1, acquired_us = n.now, expires_us = n.now + {p("ttl")},
                prev_label = CASE WHEN u.owner_token IS NULL THEN NULL ELSE u.owner_label END,
                prev_fence = CASE WHEN u.owner_token IS NULL THEN NULL ELSE u.fence END,{write}
            FROM nl AS n
            WHERE u.resource = {p("r")} AND (SELECT v.verdict FROM nl AS v) = 'claim'
            RETURNING u.fence, u.acquired_us, u.expires_us, u.prev_label, u.prev_fence),
        queue AS (
            UPDATE {t} AS u SET{write}
            FROM nl AS n
            WHERE u.resource = {p("r")}
              AND (SELECT v.joins OR v.wakes FROM nl AS v)
            RETURNING 1),
        claimed AS (SELECT * FROM claim UNION ALL SELECT * FROM take)"""


def hand_off_columns(p: Callable[[str], str]) -> str:
    """The claim's last columns, from ``nl`` as ``h``: its place in the wait list (0: not
    queued), the payload of a head this claim woke, and the head waiter (and until when it is
    held for) when refused for a hand-off."""
    return f"""
            CASE WHEN h.joins THEN coalesce(h.mine, CASE WHEN h.cnt < {p("cap")}::bigint
                 THEN h.cnt + 1 ELSE 0 END) ELSE 0 END,
            CASE WHEN h.wakes THEN h.head->>4 END,
            CASE WHEN h.verdict = 'held' THEN h.head->>0 END,
            CASE WHEN h.wakes THEN h.now + {p("grace")}::bigint
                 ELSE (h.head->>3)::bigint END"""


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
    woken = (
        f"jsonb_build_array(y.e->0, y.e->1, greatest((y.e->>2)::bigint, clk.us + {grace}), "
        f"clk.us + {grace}, y.e->4)"
    )
    return f"""
                waits = CASE WHEN u.waits IS NULL THEN NULL ELSE (
                    SELECT jsonb_agg(CASE WHEN y.n = y.target THEN {woken} ELSE y.e END
                                     ORDER BY y.n)
                    FROM {places}) END,
                waits_expire_us = CASE WHEN u.waits IS NULL THEN NULL ELSE (
                    SELECT max(CASE WHEN y.n = y.target
                                    THEN greatest((y.e->>2)::bigint, clk.us + {grace})
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
    return f"""(SELECT x.e->>4 FROM jsonb_array_elements(u.waits) AS x(e)
                    WHERE (x.e->>3)::bigint = clk.us + {p("grace")}::bigint LIMIT 1)"""
