"""The SQL statements of the SQL lease store, per dialect.

Table ``leases``: one row per resource ever claimed. A released lease keeps its row (owner_token
NULL) so the fence sequence survives; ``fence`` only ever grows. A release leaves ``expires_us``
as it was (a released row is recognised by its NULL token): the release then changes no
indexed column, which lets PostgreSQL update the row in place (HOT) without touching the expiry
index. Times are microseconds since the epoch on the database clock. Every statement takes
bound parameters only; the table name is quoted by SQLAlchemy's dialect before it is put in.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from . import wait_statements as wait_sql

__all__ = ["Statements"]

_NOW = {
    "postgresql": "(extract(epoch from clock_timestamp()) * 1000000)::bigint",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
}


class Statements:
    """SQL text for one dialect and table, built once per store."""

    def __init__(
        self,
        dialect: str,
        table: str,
        paramstyle: str,
        gate_table: str,
        prefix: str = "celery_lease_",
        quote: Callable[[str], str] = lambda name: f'"{name}"',
    ) -> None:
        self.dialect = dialect
        self.table = table
        now = _NOW[dialect]
        self.now = now

        def p(name: str) -> str:
            return f"%({name})s" if paramstyle == "pyformat" else f":{name}"

        self._p = p
        t = table
        # The claim: insert, or take over a released or expired row, bumping the fence. The
        # previous owner is recorded in the same row (prev_*) when the row was never released;
        # the holder's prev_* tell a claim retried after a lost reply what the first found.
        # Only a row nobody waits for is taken here: the wait list decides the others (see
        # .waits), so the common claim never reads the list.
        upsert = f"""
            INSERT INTO {t} AS l
                (resource, owner_token, owner_label, fence, acquired_us, expires_us)
            {{source}}
            ON CONFLICT (resource) DO UPDATE SET
                owner_token = excluded.owner_token,
                owner_label = excluded.owner_label,
                fence = l.fence + 1,
                acquired_us = excluded.acquired_us,
                expires_us = excluded.expires_us,
                prev_label = CASE WHEN l.owner_token IS NULL THEN NULL ELSE l.owner_label END,
                prev_fence = CASE WHEN l.owner_token IS NULL THEN NULL ELSE l.fence END
            WHERE (l.owner_token IS NULL OR l.expires_us <= excluded.acquired_us)
              AND l.waits IS NULL
            RETURNING fence, acquired_us, expires_us, prev_label, prev_fence"""
        self.claim_upsert = upsert
        if dialect == "postgresql":
            # One statement answers both ways: the claim, or (when held) who holds it.
            claim = upsert.format(
                source=f"SELECT {p('r')}, {p('t')}, {p('l')}, 1, clk.us, clk.us + {p('ttl')} "
                "FROM clk"
            )
            self.acquire = f"""
                WITH clk AS (SELECT {now} AS us),
                claim AS ({claim}),{wait_sql.claim_settle(t, p, "false", "true")}
                SELECT (SELECT count(*) FROM claimed), (SELECT count(*) FROM claimed),
                       c.fence, c.acquired_us, c.expires_us, c.prev_label, c.prev_fence,
                       h.owner_token, h.owner_label, h.fence, h.acquired_us, h.expires_us,
                       NULL, NULL, NULL, NULL, NULL, (SELECT us FROM clk), h.prev_label,
                       h.prev_fence,{wait_sql.hand_off_columns(p)},
                       {wait_sql.claim_wake_columns(p)},{wait_sql.polling_column(p)}
                FROM (SELECT 1) AS one
                LEFT JOIN claimed AS c ON true
                LEFT JOIN nl AS h ON h.verdict <> 'claim'"""
            # The release also hands the resource over to the first waiter never woken.
            self.release_wake = f"""
                WITH clk AS (SELECT {now} AS us),
                rel AS (
                    UPDATE {t} AS u SET owner_token = NULL, prev_label = NULL,
                        prev_fence = NULL,{wait_sql.release_columns(p)}
                    FROM clk
                    WHERE u.resource = {p("r")} AND u.owner_token = {p("t")}
                      AND u.fence = {p("f")}
                    RETURNING {wait_sql.release_wake(p)} AS wake)
                SELECT count(*), max(wake) FROM rel"""
            # The same with the settling steps in functions (see .wait_statements): the claim
            # is the bare upsert plus a call made only when it refused, the release the bare
            # UPDATE plus a call made only when somebody waits (one row when it released).
            fn = self.functions = wait_sql.functions(t, prefix, now, quote)
            settle = wait_sql.settle_call(fn.settle, p, "NULL", ("NULL", "NULL", "false"))
            self.acquire_fast = f"""
                WITH clk AS (SELECT {now} AS us),
                claim AS ({claim})
                SELECT 1, 1, fence, acquired_us, expires_us, prev_label, prev_fence,
                       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                       acquired_us, NULL, NULL, 0, NULL, NULL, NULL, NULL, NULL, false
                FROM claim
                UNION ALL
                SELECT s.o_took::int, s.o_took::int, s.o_fence, s.o_acquired, s.o_expires,
                       s.o_prev_label, s.o_prev_fence, s.o_token, s.o_label, s.o_hfence,
                       s.o_hacquired, s.o_hexpires, NULL, NULL, NULL, NULL, NULL,
                       (SELECT us FROM clk), s.o_hprev_label, s.o_hprev_fence, s.o_position,
                       s.o_wake, s.o_hold, s.o_hold_until, s.o_next_wake, s.o_own_wake,
                       s.o_polling
                FROM {settle}
                WHERE NOT EXISTS (SELECT 1 FROM claim)"""
            self.release_fast = wait_sql.release_calling(t, fn.hand_off, p)
            # A claim whose snapshot went stale again and again takes the row first (see
            # SQLLeaseStore.acquire): its statement then starts with the row as it will find it.
            self.lock_row = f"SELECT 1 FROM {t} WHERE resource = {p('r')} FOR UPDATE"
            self.inline_raw = (wait_sql.raw(self.acquire), wait_sql.raw(self.release_wake))
            self.fast_raw = (wait_sql.raw(self.acquire_fast), wait_sql.raw(self.release_fast))
            self.use_functions(False)
        else:
            self.acquire = upsert.format(
                source=f"SELECT {p('r')}, {p('t')}, {p('l')}, 1, n.us, n.us + {p('ttl')} "
                f"FROM (SELECT {now} AS us) AS n WHERE true"
            )
            self.holder = f"""
                SELECT 0, fence, acquired_us, expires_us, owner_label, NULL, owner_token, {now},
                       prev_label, prev_fence, waits, wait_slow_us
                FROM {t} WHERE resource = {p("r")}"""
            # A claim the wait list decided (see .waits): take the row, writing the list.
            self.take = f"""
                UPDATE {t} SET owner_token = {p("t")}, owner_label = {p("l")},
                    fence = fence + 1, acquired_us = {p("now")},
                    expires_us = {p("now")} + {p("ttl")},
                    prev_label = CASE WHEN owner_token IS NULL THEN NULL ELSE owner_label END,
                    prev_fence = CASE WHEN owner_token IS NULL THEN NULL ELSE fence END,
                    waits = {p("waits")}, wait_slow_us = {p("slow")},
                    waits_expire_us = {p("wexp")}
                WHERE resource = {p("r")}
                RETURNING fence, acquired_us, expires_us, prev_label, prev_fence"""
            self.waits_write = f"""
                UPDATE {t} SET waits = {p("waits")}, wait_slow_us = {p("slow")},
                    waits_expire_us = {p("wexp")}
                WHERE resource = {p("r")}"""
            self.release_wake = f"""
                UPDATE {t} SET owner_token = NULL, prev_label = NULL, prev_fence = NULL
                WHERE resource = {p("r")} AND owner_token = {p("t")} AND fence = {p("f")}
                RETURNING waits, wait_slow_us, {now}"""
        self.renew_one = f"""
            UPDATE {t} SET expires_us = {now} + {p("ttl")}
            WHERE resource = {p("r")} AND owner_token = {p("t")} AND fence = {p("f")}
              AND expires_us > {now}
            RETURNING expires_us"""
        # prev_fence of a released row (NULL token) names a lease force_release evicted.
        self.state = f"""
            SELECT owner_token, owner_label, fence, expires_us, {now}, prev_fence
            FROM {t} WHERE resource = {p("r")}"""
        self.release = f"""
            UPDATE {t} SET owner_token = NULL, prev_label = NULL,
                prev_fence = NULL
            WHERE resource = {p("r")} AND owner_token = {p("t")} AND fence = {p("f")}"""
        self.waiters = f"SELECT waits, {now} FROM {t} WHERE resource = {p('r')}"
        # wake_due (invariant 16): free resources with a live wait list, through the list index
        # (a held one, or one whose places all lapsed, does not count against the limit; the
        # clock read once, so that the lapse bound is an index condition); then each one's list,
        # and its rewrite (PostgreSQL: only if nothing changed the row since it was read;
        # SQLite: both in one BEGIN IMMEDIATE).
        self.due_candidates = f"""
            WITH clk AS (SELECT {now} AS us)
            SELECT resource FROM {t}
            WHERE waits_expire_us IS NOT NULL AND waits_expire_us > (SELECT us FROM clk)
              AND (owner_token IS NULL OR expires_us <= (SELECT us FROM clk))
            ORDER BY waits_expire_us LIMIT {p("n")}"""
        self.due_read = f"""
            SELECT waits, wait_slow_us, owner_token, expires_us, fence, {now}
            FROM {t} WHERE resource = {p("r")} AND waits IS NOT NULL"""
        if dialect == "postgresql":
            self.due_write = f"""
                UPDATE {t} SET waits = CAST({p("waits")} AS jsonb), wait_slow_us = {p("slow")},
                    waits_expire_us = {p("wexp")}
                WHERE resource = {p("r")} AND fence = {p("f")}
                  AND (owner_token IS NULL OR expires_us <= {now})
                  AND waits = CAST({p("old")} AS jsonb)
                  AND wait_slow_us IS NOT DISTINCT FROM {p("oslow")}"""
        # Wait lists whose every place lapsed (nobody came back), through their index.
        if dialect == "postgresql":
            self.sweep_waits = f"""
                WITH clk AS (SELECT {now} AS us),
                gone AS (
                    UPDATE {t} SET waits = NULL, wait_slow_us = NULL, waits_expire_us = NULL
                    WHERE resource IN (
                        SELECT resource FROM {t}
                        WHERE waits_expire_us <= (SELECT us FROM clk)
                        ORDER BY waits_expire_us LIMIT {p("n")} FOR UPDATE SKIP LOCKED)
                      AND waits_expire_us <= (SELECT us FROM clk)
                    RETURNING 1)
                SELECT count(*) FROM gone"""
        else:
            self.sweep_waits = f"""
                UPDATE {t} SET waits = NULL, wait_slow_us = NULL, waits_expire_us = NULL
                WHERE rowid IN (
                    SELECT rowid FROM {t} WHERE waits_expire_us <= {now}
                    ORDER BY waits_expire_us LIMIT {p("n")})"""
        self.get = f"""
            SELECT owner_label, fence, acquired_us, expires_us, {now}
            FROM {t} WHERE resource = {p("r")} AND owner_token IS NOT NULL"""
        # list(): by the expiry index (expires_us, resource), in its order, from the cursor on.
        # Every bound on expires_us is a range of the index: the cursor's (>=, then the tie on
        # resource), and for the expired listing the clock, read once as a scalar sub-query (a
        # clock expression or a join to it is no index bound: that listing read and sorted
        # every live lease). The expired listing reads only rows expired by now: O(expired).
        listing = f"""
            WITH clk AS (SELECT {now} AS us)
            SELECT resource, owner_label, fence, acquired_us, expires_us, (SELECT us FROM clk)
            FROM {t}
            WHERE expires_us >= {p("after_e")}{{bound}}
              AND (expires_us > {p("after_e")} OR resource > {p("after_r")})
              AND owner_token IS NOT NULL
              AND substr(resource, 1, {p("plen")}) = {p("prefix")}
            ORDER BY expires_us, resource
            LIMIT {p("n")}"""
        self.list = listing.format(bound="")
        self.list_expired = listing.format(bound=" AND expires_us <= (SELECT us FROM clk)")
        if dialect == "postgresql":
            # Old values come back through the locked sub-select joined to the update.
            # With a fence (f): only the lease with that fence (nothing when it changed hands).
            self.force_release = f"""
                UPDATE {t} AS l SET owner_token = NULL, fence = l.fence + 1, prev_label = NULL,
                    prev_fence = CASE WHEN old.owner_token IS NULL THEN NULL ELSE old.fence END
                FROM (SELECT resource, owner_token, owner_label, fence, acquired_us, expires_us
                      FROM {t} WHERE resource = {p("r")} FOR UPDATE) AS old
                WHERE l.resource = old.resource
                  AND ({p("f")}::bigint IS NULL
                       OR (old.owner_token IS NOT NULL AND old.fence = {p("f")}::bigint))
                RETURNING CASE WHEN old.owner_token IS NULL THEN NULL ELSE old.owner_label END,
                    old.fence, old.acquired_us, old.expires_us, {now}"""
        else:
            self.force_release = f"""
                UPDATE {t} SET owner_token = NULL, fence = fence + 1, prev_label = NULL,
                    prev_fence = CASE WHEN owner_token IS NULL THEN NULL ELSE fence END
                WHERE resource = {p("r")}"""

        # The fence gate: a key's highest admitted fence in the gate table, and for a key that
        # is a lease resource also the fence of its row here (the newest the store granted,
        # force-release bumps included). Both are read by the one statement that admits, so a
        # grant committed before it began refuses every older fence, whether or not the new
        # holder has written yet (a grant committing while it runs is ordered after it).
        g = gate_table
        k, f = p("k"), p("f")
        gate_upsert = f"""
            INSERT INTO {g} AS t (key, fence)
            SELECT CAST({k} AS VARCHAR(200)), CAST({f} AS BIGINT)
            WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE resource = {k} AND fence > {f})
            ON CONFLICT (key) DO UPDATE SET fence = excluded.fence
            WHERE t.fence <= excluded.fence
            RETURNING fence"""
        #: The fence that refused an admit: the higher of the admitted and the granted one.
        self.gate_refused = f"""
            SELECT max(fence) FROM (
                SELECT fence FROM {g} WHERE key = {k}
                UNION ALL
                SELECT fence FROM {t} WHERE resource = {k}) AS known"""
        self.gate_read = f"SELECT fence FROM {g} WHERE key = {k}"
        if dialect == "postgresql":
            self.gate_admit = f"""
                WITH up AS ({gate_upsert})
                SELECT 1, fence FROM up
                UNION ALL
                SELECT 0, ({self.gate_refused}) WHERE NOT EXISTS (SELECT 1 FROM up)"""
        else:
            self.gate_admit = gate_upsert

    def use_functions(self, available: bool) -> None:
        """PostgreSQL: claim and release through the wait-list functions (when the database
        has them), or with the whole settling in each statement."""
        self.acquire_raw, self.release_raw = self.fast_raw if available else self.inline_raw

    @lru_cache(maxsize=64)  # noqa: B019 - one Statements per store, a handful of batch sizes
    def renew_many(self, count: int) -> str:
        """PostgreSQL: renew ``count`` leases in one statement and report every one's state.

        Parameters, per lease: its index, resource, owner token, fence, ttl (us). Rows: index,
        new expires_us (NULL when not renewed), then the row's owner_token, owner_label, fence,
        expires_us, the clock and prev_fence as they were before the update.
        """
        t = self.table
        values = ", ".join(["(%s::int, %s, %s, %s::bigint, %s::bigint)"] * count)
        return f"""
            WITH clk AS (SELECT {self.now} AS us),
            req (i, resource, token, fence, ttl) AS (VALUES {values}),
            upd AS (
                UPDATE {t} AS l SET expires_us = clk.us + req.ttl
                FROM req, clk
                WHERE l.resource = req.resource AND l.owner_token = req.token
                  AND l.fence = req.fence AND l.expires_us > clk.us
                RETURNING req.i, l.expires_us)
            SELECT req.i, upd.expires_us, l.owner_token, l.owner_label, l.fence,
                   l.expires_us, clk.us, l.prev_fence
            FROM req CROSS JOIN clk
            LEFT JOIN upd ON upd.i = req.i
            LEFT JOIN {t} AS l ON l.resource = req.resource"""
