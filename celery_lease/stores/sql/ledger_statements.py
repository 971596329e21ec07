"""SQL statements for task identities, the effect ledger and checkpoints.

Tables (names prefixed like the lease table, all keyed by resource first):

* ``identities (resource, identity)``: state running / retry / failed / done, the fence of the
  run that wrote it, its owner label, the JSON result of a done run, and ``expires_us``
  (retention). A running row's ``result`` holds what its claim recovered instead,
  ``"<state>\\n<fence>\\n<label>"`` of the earlier attempt (or NULL), so that the same claim
  retried after a lost reply reports it again; ``identity_get`` does not show it.
* ``ledger (resource, identity, key)``: state intent / done, fence, JSON receipt, expires_us.
* ``checkpoints (resource, identity)``: fence and JSON of all steps, expires_us.

On PostgreSQL each operation is one statement. Reads of "the state before" come from the
statement's snapshot; every decision that must see the newest committed row is made by an
``ON CONFLICT ... DO UPDATE ... WHERE`` (which does), and the caller re-asks in the rare case
the snapshot disagrees. On SQLite the same steps run inside one ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

from . import wait_statements as wait_sql

__all__ = ["LedgerStatements"]


class LedgerStatements:
    """SQL text for one dialect and set of tables, built once per store."""

    def __init__(
        self,
        dialect: str,
        now: str,
        paramstyle: str,
        tables: dict[str, str],
        claim_upsert: str,
        functions: wait_sql.Functions | None = None,
    ) -> None:
        def p(name: str) -> str:
            return f"%({name})s" if paramstyle == "pyformat" else f":{name}"

        t, ids, ledger, ckpt = tables["leases"], tables["ids"], tables["ledger"], tables["ckpt"]
        alive = f"expires_us > {now}"
        self.ident_read = f"""
            SELECT state, fence, owner_label, result FROM {ids}
            WHERE resource = {p("r")} AND identity = {p("i")} AND {alive}"""
        self.ckpt_show = f"""
            SELECT fence, data FROM {ckpt}
            WHERE resource = {p("r")} AND identity = {p("i")} AND {alive}"""
        self.effects_read = f"""
            SELECT key, state, fence, receipt, expires_us FROM {ledger}
            WHERE resource = {p("r")} AND identity = {p("i")} AND {alive}
            ORDER BY expires_us DESC, key DESC LIMIT {p("n")}"""
        self.ident_full = f"""
            SELECT state, fence, owner_label, result, expires_us FROM {ids}
            WHERE resource = {p("r")} AND identity = {p("i")} AND {alive}"""
        mark = f"""
            INSERT INTO {ids} AS d (resource, identity, state, fence, owner_token, owner_label,
                                   result, expires_us)
            {{source}}
            ON CONFLICT (resource, identity) DO UPDATE SET state = 'running',
                fence = excluded.fence, owner_token = excluded.owner_token,
                owner_label = excluded.owner_label, result = excluded.result,
                expires_us = excluded.expires_us
            WHERE d.state <> 'done' OR d.expires_us <= excluded.expires_us - {p("ret")}"""
        self.ckpt_read = f"""
            SELECT data FROM {ckpt}
            WHERE resource = {p("r")} AND identity = {p("i")} AND {alive}"""
        self.lease_state = f"""
            SELECT owner_token, owner_label, fence, expires_us, {now}, prev_fence
            FROM {t} WHERE resource = {p("r")}"""
        ledger_upsert = f"""
            INSERT INTO {ledger} AS x (resource, identity, key, state, fence, owner_token,
                                      receipt, expires_us)
            {{source}}
            ON CONFLICT (resource, identity, key) DO UPDATE SET state = 'intent',
                fence = excluded.fence, owner_token = excluded.owner_token, receipt = NULL,
                expires_us = excluded.expires_us
            WHERE x.state <> 'done' OR x.expires_us <= excluded.expires_us - {p("ret")}"""
        ckpt_upsert = f"""
            INSERT INTO {ckpt} AS c (resource, identity, fence, data, expires_us)
            {{source}}
            ON CONFLICT (resource, identity) DO UPDATE SET fence = excluded.fence,
                data = excluded.data, expires_us = excluded.expires_us
            WHERE c.fence <= excluded.fence"""
        self.ident_outcome = f"""
            UPDATE {ids} SET state = {p("o")}, result = {p("res")},
                expires_us = {now} + {p("ret")}
            WHERE resource = {p("r")} AND identity = {p("i")} AND fence = {p("f")}
              AND owner_token = {p("t")} AND state <> 'done'"""
        self.ledger_done = f"""
            UPDATE {ledger} SET state = 'done', receipt = {p("rc")},
                expires_us = {now} + {p("ret")}
            WHERE resource = {p("r")} AND identity = {p("i")} AND key = {p("k")}
              AND fence = {p("f")} AND owner_token = {p("t")} AND state = 'intent'"""
        self.ledger_read = f"""
            SELECT state, fence, receipt FROM {ledger}
            WHERE resource = {p("r")} AND identity = {p("i")} AND key = {p("k")} AND {alive}"""
        self.ckpt_fence = f"""
            SELECT fence FROM {ckpt} WHERE resource = {p("r")} AND identity = {p("i")}"""
        # Retention sweep, one statement per table, each through the table's expiry index. On
        # PostgreSQL the clock is read once per statement (a volatile clock_timestamp() per row
        # would also keep the planner off the index), rows a claim has locked are skipped, and
        # the outer WHERE re-checks the expiry of a row that a concurrent write refreshed.
        keys = {ids: "resource, identity", ckpt: "resource, identity",
                ledger: "resource, identity, key"}  # fmt: skip
        if dialect == "sqlite":
            self.sweep = [
                f"""DELETE FROM {table} WHERE rowid IN (
                    SELECT rowid FROM {table} WHERE expires_us <= {now}
                    ORDER BY expires_us LIMIT {p("n")})"""
                for table in keys
            ]
        else:
            self.sweep = [
                f"""
                WITH clk AS (SELECT {now} AS us),
                gone AS (
                    DELETE FROM {table} WHERE ({cols}) IN (
                        SELECT {cols} FROM {table} WHERE expires_us <= (SELECT us FROM clk)
                        ORDER BY expires_us LIMIT {p("n")} FOR UPDATE SKIP LOCKED)
                      AND expires_us <= (SELECT us FROM clk)
                    RETURNING 1)
                SELECT count(*) FROM gone"""
                for table, cols in keys.items()
            ]
        # mark_once: a row of its own (resource: the mark's key) with the marker's token,
        # taken over only once it expired; the retention sweep removes it.
        self.mark_once = f"""
            INSERT INTO {ids} AS d (resource, identity, state, fence, owner_token, owner_label,
                                   result, expires_us)
            VALUES ({p("r")}, {p("i")}, 'mark', 0, {p("t")}, '', NULL, {now} + {p("ttl")})
            ON CONFLICT (resource, identity) DO UPDATE SET owner_token = excluded.owner_token,
                expires_us = excluded.expires_us
            WHERE d.expires_us <= {now} OR d.owner_token = excluded.owner_token
            RETURNING 1"""
        live = f"""
            SELECT 1 FROM {t}
            WHERE resource = {p("r")} AND owner_token = {p("t")} AND fence = {p("f")}
              AND expires_us > {now}"""
        if dialect == "sqlite":
            self.mark = mark.format(
                source=f"VALUES ({p('r')}, {p('i')}, 'running', {p('f')}, {p('t')}, {p('l')}, "
                f"{p('facts')}, {now} + {p('ret')})"
            )
            self.ledger_intent = ledger_upsert.format(
                source=f"VALUES ({p('r')}, {p('i')}, {p('k')}, 'intent', {p('f')}, {p('t')}, "
                f"NULL, {now} + {p('ret')})"
            )
            self.ckpt_write = ckpt_upsert.format(
                source=f"VALUES ({p('r')}, {p('i')}, {p('f')}, {p('data')}, {now} + {p('ret')})"
            )
            return
        # PostgreSQL: one statement per operation.
        assert functions is not None
        claim = claim_upsert.format(
            source=f"""SELECT {p("r")}, {p("t")}, {p("l")}, 1, clk.us, clk.us + {p("ttl")}
                FROM clk WHERE NOT EXISTS (SELECT 1 FROM old_ident WHERE state = 'done')"""
        )
        duplicate = (
            "EXISTS (SELECT 1 FROM old_ident AS o WHERE o.state = 'running' "
            "AND o.fence = dec.fence)"
        )
        # The refused claim's FOR UPDATE read returns the newest lease row, but old_ident is of
        # the statement's snapshot: if a claim or release committed on the row since (its fence
        # or holder differs from the snapshot's), the identity state may be stale too, so the
        # settling read takes no row and the caller asks again with a fresh snapshot.
        not_done = (
            "NOT EXISTS (SELECT 1 FROM old_ident WHERE state = 'done') "
            "AND fence = (SELECT w.fence FROM was AS w) "
            "AND owner_token IS NOT DISTINCT FROM (SELECT w.owner_token FROM was AS w)"
        )
        # the identity's row marked running under the fence just claimed (both claim forms)
        mark_claimed = mark.format(
            source=f"""
                SELECT {p("r")}, {p("i")}, 'running', claimed.fence, {p("t")}, {p("l")},
                       (SELECT o.state || chr(10) || o.fence || chr(10) || o.owner_label
                        FROM old_ident AS o),
                       clk.us + {p("ret")}
                FROM claimed, clk"""
        )
        self.acquire = f"""
            WITH clk AS (SELECT {now} AS us),
            old_ident AS ({self.ident_read}),
            was AS (SELECT fence, owner_token FROM {t} WHERE resource = {p("r")}),
            claim AS ({claim}),{wait_sql.claim_settle(t, p, duplicate, not_done)},
            mark AS ({mark_claimed} RETURNING 1)
            SELECT (SELECT count(*) FROM claimed), (SELECT count(*) FROM mark),
                   c.fence, c.acquired_us, c.expires_us, c.prev_label, c.prev_fence,
                   h.owner_token, h.owner_label, h.fence, h.acquired_us, h.expires_us,
                   o.state, o.fence, o.owner_label, o.result,
                   ({self.ckpt_read}), (SELECT us FROM clk), h.prev_label, h.prev_fence,
                   {wait_sql.hand_off_columns(p)},{wait_sql.claim_wake_columns(p)},
                   {wait_sql.polling_column(p)}
            FROM (SELECT 1) AS one
            LEFT JOIN claimed AS c ON true
            LEFT JOIN nl AS h ON h.verdict <> 'claim'
            LEFT JOIN old_ident AS o ON true"""
        self.release_outcome = f"""
            WITH clk AS (SELECT {now} AS us),
            upd AS ({self.ident_outcome} RETURNING 1),
            rel AS (
                UPDATE {t} AS u SET owner_token = NULL, prev_label = NULL,
                    prev_fence = NULL,{wait_sql.release_columns(p)}
                FROM clk
                WHERE u.resource = {p("r")} AND u.owner_token = {p("t")} AND u.fence = {p("f")}
                RETURNING {wait_sql.release_wake(p)} AS wake)
            SELECT (SELECT count(*) FROM rel), (SELECT count(*) FROM upd),
                   (SELECT max(wake) FROM rel)"""
        # The same through the wait-list functions (see Statements.acquire_fast): the settling
        # read still takes the row only as the snapshot saw it (the function checks ``was``).
        settle = wait_sql.settle_call(
            functions.settle,
            p,
            "(SELECT o.fence FROM old_ident AS o WHERE o.state = 'running')",
            ("(SELECT w.fence FROM was AS w)", "(SELECT w.owner_token FROM was AS w)", "true"),
        )
        self.acquire_fast = f"""
            WITH clk AS (SELECT {now} AS us),
            old_ident AS ({self.ident_read}),
            was AS (SELECT fence, owner_token FROM {t} WHERE resource = {p("r")}),
            claim AS ({claim}),
            s AS (
                SELECT * FROM {settle}
                WHERE NOT EXISTS (SELECT 1 FROM claim)
                  AND NOT EXISTS (SELECT 1 FROM old_ident WHERE state = 'done')),
            claimed AS (
                SELECT * FROM claim
                UNION ALL
                SELECT o_fence, o_acquired, o_expires, o_prev_label, o_prev_fence
                FROM s WHERE o_took),
            mark AS ({mark_claimed} RETURNING 1)
            SELECT (SELECT count(*) FROM claimed), (SELECT count(*) FROM mark),
                   c.fence, c.acquired_us, c.expires_us, c.prev_label, c.prev_fence,
                   h.o_token, h.o_label, h.o_hfence, h.o_hacquired, h.o_hexpires,
                   o.state, o.fence, o.owner_label, o.result,
                   ({self.ckpt_read}), (SELECT us FROM clk), h.o_hprev_label, h.o_hprev_fence,
                   coalesce(h.o_position, 0), h.o_wake, h.o_hold, h.o_hold_until,
                   (SELECT g.o_next_wake FROM s AS g),
                   (SELECT g.o_own_wake FROM s AS g WHERE g.o_took),
                   coalesce(h.o_polling, false)
            FROM (SELECT 1) AS one
            LEFT JOIN claimed AS c ON true
            LEFT JOIN s AS h ON NOT h.o_took
            LEFT JOIN old_ident AS o ON true"""
        release = wait_sql.release_calling(t, functions.hand_off, p)
        self.release_outcome_fast = f"WITH upd AS ({self.ident_outcome}){release}"
        self.inline_raw = (wait_sql.raw(self.acquire), wait_sql.raw(self.release_outcome))
        self.fast_raw = (wait_sql.raw(self.acquire_fast), wait_sql.raw(self.release_outcome_fast))
        self.use_functions(False)
        self.effect_begin = f"""
            WITH clk AS (SELECT {now} AS us),
            live AS ({live}),
            old AS ({self.ledger_read}),
            up AS ({
            ledger_upsert.format(
                source=f'''
                SELECT {p("r")}, {p("i")}, {p("k")}, 'intent', {p("f")}, {p("t")}, NULL,
                       clk.us + {p("ret")}
                FROM clk WHERE EXISTS (SELECT 1 FROM live)'''
            )
        } RETURNING 1)
            SELECT (SELECT count(*) FROM live), (SELECT count(*) FROM up),
                   o.state, o.fence, o.receipt
            FROM (SELECT 1) AS one LEFT JOIN old AS o ON true"""
        self.checkpoint = f"""
            WITH clk AS (SELECT {now} AS us),
            live AS ({live}),
            up AS ({
            ckpt_upsert.format(
                source=f'''
                SELECT {p("r")}, {p("i")}, {p("f")}, {p("data")}, clk.us + {p("ret")}
                FROM clk WHERE EXISTS (SELECT 1 FROM live)'''
            )
        } RETURNING 1)
            SELECT (SELECT count(*) FROM live), (SELECT count(*) FROM up)"""

    def use_functions(self, available: bool) -> None:
        """PostgreSQL: as :meth:`.Statements.use_functions`."""
        self.acquire_raw, self.release_outcome_raw = self.fast_raw if available else self.inline_raw
