"""Hostile resource names are refused before any I/O or round-trip intact, on every store; the
Redis store runs under a least-privilege ACL.

A seeded generator makes a few thousand hostile resource names (globs, hash-tag braces, ``:``
and ``/``, unicode look-alikes, NUL, whitespace, SQL quotes and comments, LIKE wildcards, 64 KiB
strings). Each name is judged by an oracle written from the documented rule (1..200 characters
of ``A-Z a-z 0-9 _ . : / -``), independent of the library's own regex:

* an invalid name is refused with LeaseConfigError by every operation, also by a store whose
  server does not exist, which proves the check runs before any I/O;
* a valid name is claimed, read, listed, renewed, verified and released (or force-released)
  without a single LeaseStoreError.

Afterwards the Redis keyspace holds only the store's fixed ``<prefix>{NN}:<kind>`` keys (the
fuzzing store runs as an ACL user that may touch nothing else), and ``list(prefix=...)`` agrees
with a plain ``str.startswith`` over many overlapping names (LIKE escaping, case sensitivity).

Set ``CELERY_LEASE_FUZZ_SEED`` to replay a run; the seed is printed.
"""

from __future__ import annotations

import decimal
import os
import random
import re
import string
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import redis
import sqlalchemy as sa

from celery_lease import LeaseConfigError, LeaseLostError, LeaseStoreError, Owner
from celery_lease._names import clean_label
from celery_lease.stores import MemoryLeaseStore
from celery_lease.stores.redis import RedisLeaseStore
from celery_lease.stores.sql import SQLLeaseStore
from tests.conftest import make_store, missing, unique
from tests.tooling.servers import RedisServer, free_port

LONG = 30.0
N_NAMES = 2000  # per store (the CI size)
SEED = int(os.environ.get("CELERY_LEASE_FUZZ_SEED", "0") or 0) or 20240517
OK_CHARS = string.ascii_letters + string.digits + "_.:/-"
NASTY = [
    *"*?[]{}\\'\";%_!|@#$&()=+,<>^`~ \t\n\r\x0b\x0c\x00",
    "{00}",
    "{0a}",
    "}{",
    "{",
    "--",
    "/*",
    "*/",
    "' OR '1'='1",
    "'; DROP TABLE x; --",
    '"quoted"',
    "%_%",
    "\\_",
    "!_",
    "\\x00",
    "é",
    "☃",
    "😀",
    "\u200b",  # zero-width space
    "\u202e",  # right-to-left override
    "\ufeff",  # byte order mark
    "\u0130",  # I with dot: lowercases to two characters
    "ß",
    "\uff21",  # fullwidth A
    "\uff11",  # fullwidth 1
    "\u0663",  # Arabic-Indic digit three (a \d digit, not [0-9])
    "\u212a",  # Kelvin sign (case-folds to k)
    "\u2044",  # fraction slash
    "\u2215",  # division slash
    "\ud800",  # lone surrogate: cannot even be encoded to UTF-8
    "\U0010ffff",
    "\x7f",
    "\x85",  # NEL
    "\u2028",  # line separator
]
# Valid names the store might mistake for something else: key suffixes, paths, separators.
TRICKY_VALID = [
    "a",
    "0",
    "_",
    "-",
    ".",
    "..",
    "/",
    ":",
    "::",
    "a_b",
    "A_B",
    "a.b",
    "leases",
    "expiry",
    "fences",
    "epoch",
    ":leases",
    "celery_lease:",
    "cl:00:leases",
    "../../etc/passwd",
    "-rf",
    "--",
    "__proto__",
    "x" * 200,
    "_" * 200,
]


def is_valid(name: object) -> bool:
    """The documented rule, written out by hand (not the library's regex)."""
    return isinstance(name, str) and 1 <= len(name) <= 200 and all(c in OK_CHARS for c in name)


def fuzz_names(rng: random.Random, count: int) -> Iterator[str]:
    """``count`` names: roughly a third valid, the rest invalid in every way we could think of."""
    yield from TRICKY_VALID
    yield from ["", "x" * 201, "a" * 1000, "b" * 65536, "é" * 65536, "ok/" + "\x00" * 65533]
    yield from NASTY
    for _ in range(count - len(TRICKY_VALID) - 6 - len(NASTY)):
        kind = rng.random()
        length = rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 200), 199, 200, 201])
        base = "".join(rng.choice(OK_CHARS) for _ in range(length))
        if kind < 0.35:  # valid
            yield base
        elif kind < 0.75:  # valid but for one or more hostile pieces
            pieces = list(base)
            for _ in range(rng.randint(1, 3)):
                pieces.insert(rng.randint(0, len(pieces)), rng.choice(NASTY))
            yield "".join(pieces)
        elif kind < 0.95:  # a random mix
            pool = [*OK_CHARS, *NASTY]
            yield "".join(rng.choice(pool) for _ in range(rng.randint(1, 60)))
        else:  # long
            yield base * rng.randint(2, 330)


def fuzz_labels(rng: random.Random) -> str:
    """Owner labels are free text; they are cleaned, never refused."""
    pool = [*OK_CHARS, *NASTY, " "]
    return "".join(rng.choice(pool) for _ in range(rng.choice([0, 1, 10, 199, 200, 300])))


def test_clean_label_fast_path_changes_nothing() -> None:
    """clean_label skips its regex for printable ASCII only, which the regex would leave as it
    is: over fuzzed labels (NUL, DEL, tabs, unicode look-alikes) it gives what the regex gives."""
    rng = random.Random(27)
    extra = ["\x7f", "\t", "\n", "\x1f", "~", " ", "é"]
    for _ in range(3000):
        label = fuzz_labels(rng) + "".join(rng.choice(extra) for _ in range(rng.randint(0, 3)))
        expected = re.sub(r"[^\x21-\x7e ]", "?", label)[:200] or "?"
        assert clean_label(label) == expected, repr(label)


def refused_everywhere(store: Any, name: str) -> None:
    """Every operation that takes a name refuses an invalid one with LeaseConfigError."""
    with pytest.raises(LeaseConfigError, match="resource"):
        store.acquire(name, Owner.new(), LONG)
    with pytest.raises(LeaseConfigError, match="resource"):
        store.get(name)
    with pytest.raises(LeaseConfigError, match="resource"):
        store.force_release(name)
    if name:  # the empty prefix lists everything
        with pytest.raises(LeaseConfigError, match="prefix"):
            store.list(prefix=name)


def round_trip(store: Any, name: str, label: str, i: int, last_fence: dict[str, int]) -> None:
    """A valid name goes through every operation; nothing may fail."""
    owner = Owner.new(label)
    lease = store.acquire(name, owner, LONG)
    assert lease.fence > last_fence.get(name, 0)
    last_fence[name] = lease.fence
    info = store.get(name)
    assert (info.resource, info.fence, info.owner_label) == (name, lease.fence, owner.label)
    if i % 7 == 0:
        assert [x.resource for x in store.list(prefix=name).leases] == [name]
    if i % 5 == 0:
        store.renew(lease)
        store.verify(lease)
    if i % 11 == 0:
        assert store.force_release(name).fence == lease.fence
        with pytest.raises(LeaseLostError):
            store.verify(lease)
    else:
        assert store.release(lease) is True
    assert store.get(name) is None


def fuzz(store: Any, dead: Any | None, count: int, seed: int) -> tuple[int, int]:
    """Run the fuzz on ``store``; ``dead`` is the same kind of store with no server behind."""
    rng = random.Random(seed)
    if dead is not None:  # the control: a valid name really does reach the (absent) server
        with pytest.raises(LeaseStoreError):
            dead.get("valid/name")
    last_fence: dict[str, int] = {}
    valid = invalid = 0
    for i, name in enumerate(fuzz_names(rng, count)):
        label = fuzz_labels(rng)
        try:
            if is_valid(name):
                valid += 1
                round_trip(store, name, label, i, last_fence)
            else:
                invalid += 1
                refused_everywhere(store, name)
                if dead is not None:
                    refused_everywhere(dead, name)
        except LeaseStoreError as exc:  # the failure this test looks for: say which name
            pytest.fail(f"name #{i} {name[:80]!r} (seed {seed}) hit the store: {exc}")
    return valid, invalid


def prefix_agreement(store: Any, rng: random.Random, alphabet: str) -> int:
    """Hold many overlapping names; list(prefix=p) must equal str.startswith(p) for each p."""
    held: dict[str, Any] = {}
    while len(held) < 150:
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
        if name not in held:
            held[name] = store.acquire(name, Owner.new(), LONG)
    prefixes = {name[: rng.randint(1, len(name))] for name in held}
    prefixes |= {
        p
        for p in ("a_", "a", "A", "_", ".", "-", "/", ":", "aa", "a_b", "ab")
        if all(c in alphabet for c in p)
    }
    mismatches = []
    for prefix in sorted(prefixes):
        listed = [x.resource for x in store.list(prefix=prefix, limit=10_000).leases]
        expected = {name for name in held if name.startswith(prefix)}
        assert len(listed) == len(set(listed))
        if set(listed) != expected:
            mismatches.append(
                f"list(prefix={prefix!r}) returned {sorted(set(listed) - expected)} too many, "
                f"{sorted(expected - set(listed))} too few"
            )
    for lease in held.values():
        assert store.release(lease)
    assert not mismatches, f"{len(mismatches)} of {len(prefixes)} prefixes: {mismatches[:5]}"
    return len(prefixes)


# -- servers and stores ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def own_redis(tmp_path_factory) -> Iterator[RedisServer]:
    """A private redis-server, so its whole keyspace can be checked."""
    try:
        server = RedisServer(tmp_path_factory.mktemp("names-redis"), appendonly=True)
    except FileNotFoundError as exc:
        missing(str(exc))
    with server:
        yield server


# What the store needs, found by removing each entry in turn (every one is needed by some
# operation): the scripts run by EVALSHA (SCRIPT LOAD when not cached), the commands the scripts
# call, and PING for the health check. AUTH needs no grant; CLIENT SETINFO is refused and
# ignored by redis-py.
ACL_COMMANDS = [
    "+evalsha",
    "+script|load",
    "+ping",
    "+time",
    "+hmget",
    "+hget",
    "+hset",
    "+hdel",
    "+zadd",
    "+zrem",
    "+zrangebyscore",
]
SECRET = "s3cr3t-Pa55w0rd"


def acl_user(server: RedisServer, prefix: str, *extra: str, drop: str = "") -> str:
    """Create a user limited to ``~<prefix>*`` and the commands above; return its URL."""
    user = unique("lease")
    commands = [c for c in ACL_COMMANDS if c != drop]
    admin = redis.Redis.from_url(server.url)
    admin.execute_command(
        "ACL",
        "SETUSER",
        user,
        "reset",
        "on",
        f">{SECRET}",
        f"~{prefix}*",
        "-@all",
        *commands,
        *extra,
    )
    admin.close()
    return f"redis://{user}:{SECRET}@127.0.0.1:{server.port}/0"


KEY_KINDS = ("leases", "expiry", "fences", "ids", "ids_exp", "ckpt", "ledger", "ledger_exp")


def assert_keyspace_is_only(server: RedisServer, prefix: str, shards: int) -> set[str]:
    """Every key on the server is one of the store's fixed keys; return them."""
    raw = redis.Redis.from_url(server.url, decode_responses=True)
    layout = re.compile(re.escape(prefix) + r"\{([0-9a-f]{2,3})\}:(" + "|".join(KEY_KINDS) + ")")
    keys = set(raw.scan_iter(count=1000))
    for key in keys:
        match = layout.fullmatch(key)
        assert match, f"key {key!r} is outside the store's fixed layout {prefix}{{NN}}:<kind>"
        assert int(match[1], 16) < shards
    fields = set()
    for key in keys:
        if key.endswith((":fences", ":leases")):
            for field in set(raw.hkeys(key)) - {"!epoch"}:  # the store's own shard epoch field
                # a force-release mark names its resource after the store's own "!forced:"
                fields.add(field.removeprefix("!forced:") if key.endswith(":fences") else field)
        elif key.endswith(":expiry"):
            fields |= set(raw.zrange(key, 0, -1))
    raw.close()
    assert all(is_valid(field) for field in fields), "an invalid name reached a hash or zset"
    return keys


STORE_KINDS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
]


def build(kind: str, request, tmp_path) -> tuple[Any, Any | None]:
    """The store to fuzz and the same kind of store pointed at nothing (None for memory)."""
    if kind == "memory":
        return MemoryLeaseStore(), None
    if kind == "redis":
        server = request.getfixturevalue("own_redis")
        with redis.Redis.from_url(server.url) as admin:
            admin.flushall()  # a private server: start from an empty keyspace
        prefix = unique("fz") + ":"
        store = RedisLeaseStore(url=acl_user(server, prefix), key_prefix=prefix)
        dead = RedisLeaseStore(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.2)
        return store, dead
    if kind == "sqlite":
        missing_dir = tmp_path / "no" / "such" / "dir"
        dead = SQLLeaseStore(url=f"sqlite:///{missing_dir}/x.db", create_tables=False)
        return make_store("sqlite", request, tmp_path), dead
    dead_url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres"
    dead = SQLLeaseStore(url=dead_url, create_tables=False, statement_timeout=1.0)
    return make_store("postgres", request, tmp_path), dead


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_fuzzed_names_are_refused_before_io_or_round_trip(kind, request, tmp_path):
    """Every name is refused (LeaseConfigError, no I/O) or works; never a store error."""
    store, dead = build(kind, request, tmp_path)
    started = time.monotonic()
    try:
        valid, invalid = fuzz(store, dead, N_NAMES, SEED)
        print(f"name fuzz {kind}: seed={SEED} N={N_NAMES} valid={valid} invalid={invalid} ")
        assert valid > N_NAMES // 4 and invalid > N_NAMES // 2
        print(f"  {time.monotonic() - started:.2f}s")
        if kind == "redis":
            server = request.getfixturevalue("own_redis")
            keys = assert_keyspace_is_only(server, store.key_prefix, store.shards)
            assert keys  # the fuzz did write
        if isinstance(store, SQLLeaseStore):
            with store.engine.connect() as conn:
                stored = conn.execute(sa.select(store.leases_table.c.resource)).scalars().all()
            assert stored and all(is_valid(name) for name in stored)
    finally:
        store.close()
        if dead is not None:
            dead.close()


CASE_KINDS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    "sqlite",  # SQLite's LIKE ignores case; list(prefix=) must not use it
    pytest.param("postgres", marks=pytest.mark.postgres),
]


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_list_prefix_agrees_with_startswith_on_overlapping_names(kind, request, tmp_path):
    """150 held names over ``a _ b . - / :``: list(prefix) is exactly str.startswith (LIKE)."""
    store, dead = build(kind, request, tmp_path)
    try:
        prefix_agreement(store, random.Random(SEED + 1), "a_b.-/:")
    finally:
        store.close()
        if dead is not None:
            dead.close()


@pytest.mark.parametrize("kind", CASE_KINDS)
def test_list_prefix_is_case_sensitive_on_overlapping_names(kind, request, tmp_path):
    """The same with upper and lower case letters: names are case-sensitive everywhere."""
    store, dead = build(kind, request, tmp_path)
    try:
        prefix_agreement(store, random.Random(SEED + 2), "aA_bB.-/:")
    finally:
        store.close()
        if dead is not None:
            dead.close()


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_list_prefix_wildcards_are_literal(kind, request, tmp_path, names):
    """``_`` in a list prefix matches only ``_`` (SQL LIKE escaping), ``%`` is refused."""
    store, dead = build(kind, request, tmp_path)
    try:
        for name in ("a_b/1", "axb/1", "a_bc/1", "a.b/1", "aqb/2", "a-b/1"):
            store.acquire(names + name, Owner.new(), LONG)

        def listed(prefix: str) -> list[str]:
            found = store.list(prefix=names + prefix).leases
            return sorted(x.resource[len(names) :] for x in found)

        assert listed("a_b/") == ["a_b/1"]
        assert listed("a_") == ["a_b/1", "a_bc/1"]
        assert listed("a.") == ["a.b/1"]
        assert listed("ax") == ["axb/1"]
        assert listed("a-") == ["a-b/1"]
        for bad in ("a%", "a*", "a!", "a[", "a\\"):
            with pytest.raises(LeaseConfigError):
                store.list(prefix=names + bad)
    finally:
        store.close()
        if dead is not None:
            dead.close()


@pytest.mark.parametrize("kind", CASE_KINDS)
def test_list_prefix_is_case_sensitive(kind, request, tmp_path, names):
    """``list(prefix='Case/')`` does not return ``case/...`` (the minimal reproduction)."""
    store, dead = build(kind, request, tmp_path)
    try:
        for name in ("Case/1", "case/1", "CASE/1"):
            store.acquire(names + name, Owner.new(), LONG)
        found = store.list(prefix=names + "Case/").leases
        assert [x.resource for x in found] == [names + "Case/1"]
    finally:
        store.close()
        if dead is not None:
            dead.close()


@pytest.mark.redis
class TestRedisAcl:
    def test_store_works_as_a_user_limited_to_its_prefix(self, own_redis):
        """Every operation works for a user with ``~<prefix>*`` and the minimal commands."""
        prefix = unique("acl") + ":"
        url = acl_user(own_redis, prefix)
        with RedisLeaseStore(url=url, key_prefix=prefix) as store:
            lease = store.acquire("acl/a", Owner.new("acl-owner"), LONG)
            store.renew(lease, LONG)
            store.verify(lease)
            assert store.get("acl/a").fence == lease.fence
            assert [x.resource for x in store.list(prefix="acl/").leases] == ["acl/a"]
            assert store.release(lease) is True
            held = store.acquire("acl/b", Owner.new("stuck"), LONG)
            assert store.force_release("acl/b").fence == held.fence
            with pytest.raises(LeaseLostError):
                store.renew(held)
            assert store.acquire("acl/b", Owner.new(), LONG).fence > held.fence
            warnings = store.check_health()  # CONFIG GET is not granted
            assert len(warnings) == 1 and "could not read the Redis configuration" in warnings[0]

            user = redis.Redis.from_url(url)
            for command in (("SET", "other:x", "1"), ("GET", "other:x"), ("KEYS", "*")):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    user.execute_command(*command)
            for command in (
                ("FLUSHALL",),
                ("DEL", f"{prefix}{{00}}:fences"),
                ("CONFIG", "SET", "appendonly", "no"),
                ("EVAL", "return redis.call('TIME')", "0"),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    user.execute_command(*command)
            user.close()
        with redis.Redis.from_url(own_redis.url) as admin:
            assert admin.exists("other:x") == 0

    def test_health_check_reads_the_config_when_granted(self, own_redis):
        """With CONFIG GET granted the real settings are checked (AOF on, noeviction: clean)."""
        prefix = unique("acl") + ":"
        with RedisLeaseStore(
            url=acl_user(own_redis, prefix, "+config|get"), key_prefix=prefix
        ) as s:
            assert s.check_health() == []

    @pytest.mark.parametrize("command", ACL_COMMANDS)
    def test_every_granted_command_is_needed(self, own_redis, command):
        """Without any one of the commands some operation fails (the list is minimal).

        Only a LeaseStoreError is allowed, from the script refused by the ACL: the user's
        denial never turns into a wrong answer.
        """
        with redis.Redis.from_url(own_redis.url) as admin:
            admin.script_flush()  # SCRIPT LOAD is needed when the cache is cold
        prefix = unique("acl") + ":"
        failed = []
        with RedisLeaseStore(url=acl_user(own_redis, prefix, drop=command), key_prefix=prefix) as s:
            steps = {
                "acquire": lambda: s.acquire("n/a", Owner.new(), LONG),
                "get": lambda: s.get("n/a"),
                "list": s.list,
                "force_release": lambda: s.force_release("n/a"),
                "health": s.check_health,
            }
            for step, run in steps.items():
                try:
                    result = run()
                except LeaseStoreError:
                    failed.append(step)
                    continue
                if step == "health" and result and "could not read" not in result[0]:
                    failed.append(step)
            if "acquire" not in failed:
                try:
                    lease = s.acquire("n/b", Owner.new(), LONG)
                    s.renew(lease)
                    s.release(lease)
                    with pytest.raises(LeaseLostError):  # tells "released" from "store reset"
                        s.renew(lease)
                except LeaseStoreError:
                    failed.append("renew/release")
        assert failed, f"the store worked without {command}: drop it from the recommended ACL"

    def test_the_password_is_masked(self, own_redis):
        """``url``, ``repr`` and store errors never show the password."""
        prefix = unique("acl") + ":"
        url = acl_user(own_redis, prefix)
        with RedisLeaseStore(url=url, key_prefix=prefix) as store:
            assert SECRET not in store.url and SECRET not in repr(store)
            assert ":***@" in store.url and ":***@" in repr(store)
        wrong = url.replace(SECRET, "wrong-" + SECRET)
        with RedisLeaseStore(url=wrong, key_prefix=prefix) as bad:
            with pytest.raises(LeaseStoreError) as caught:
                bad.acquire("n/a", Owner.new(), LONG)
            assert SECRET not in str(caught.value) and SECRET not in repr(bad)
        dead_url = f"redis://someone:{SECRET}@127.0.0.1:{free_port()}/0"
        with RedisLeaseStore(url=dead_url, key_prefix=prefix, socket_timeout=0.5) as dead:
            with pytest.raises(LeaseStoreError) as caught:
                dead.get("n/a")
            assert SECRET not in str(caught.value)


class TestOnePassChecks:
    """A claim's and a release's arguments are checked in one pass when they are the common
    ones (BaseLeaseStore._claim_checks, _release_checks): it accepts exactly what the checks
    one by one accept, returns what they return, and refuses nothing by itself."""

    OWNER = Owner.new("host:1:t")
    VALUES: ClassVar[dict[str, list[Any]]] = {
        "resource": ["r-1", "a" * 200, "a" * 201, "", "r 1", "r\x00", 7, None],
        "owner": [OWNER, "token"],
        "ttl": [30.0, 30, 1e-9, 0.0, -1.0, float("nan"), float("inf"), 10**9, True, "30"],
        "identity": [None, "i-1", "i 1", "", 5],
        "waiter": [None, "w-1"],
        "since": [None, 5],
        "wait": [None, '{"task":"x"}', "", "a\x00b", "\u00e9", "\ud800", 5],
        "wait_ttl": [120.0, 120, 0.0, float("nan"), 365 * 86400.0 + 1],
        "attempt": [None, 0, 3, -1, True, "1"],
    }

    @staticmethod
    def one_by_one(store: Any, a: dict[str, Any]) -> tuple[Any, ...]:
        ttl = store._claim_args(a["resource"], a["owner"], a["ttl"])
        identity = store._identity_args(a["identity"])
        name = store._waiter_args(identity, a["waiter"], a["since"])
        payload = store._wait_args(name, a["wait"], a["wait_ttl"])
        return ttl, identity, name, payload, store._attempt_args(a["attempt"])

    @staticmethod
    def outcome(call: Any) -> Any:
        try:
            got = call()
        except (LeaseConfigError, TypeError) as exc:  # (a release's outcome 3: as before)
            return ("refused", type(exc), str(exc))
        return ("ok", got, [type(v) for v in got])

    def test_a_claim_is_accepted_and_refused_as_check_by_check(self):
        store = MemoryLeaseStore()
        rng = random.Random(1)
        base = {name: values[0] for name, values in self.VALUES.items()}
        cases = [dict(base)]
        for name, values in self.VALUES.items():  # every value of one argument at a time
            cases += [{**base, name: value} for value in values[1:]]
        for _ in range(3000):  # and random mixes
            cases.append({name: rng.choice(values) for name, values in self.VALUES.items()})
        accepted = 0
        for a in cases:
            want = self.outcome(lambda a=a: self.one_by_one(store, a))
            got = self.outcome(lambda a=a: store._claim_checks(**a))
            assert got == want, a
            accepted += want[0] == "ok"
        assert accepted > 10  # (the fast path itself ran: most mixes hold a bad value)

    def test_a_release_is_checked_as_check_by_check(self):
        store = MemoryLeaseStore()
        lease = store.acquire("r-rel", self.OWNER, 30, identity="i-1")
        plain = store.acquire("r-rel2", self.OWNER, 30)
        for target in (lease, plain, "lease"):
            for outcome in (None, "done", "failed", "retry", "retry:2", "done:1", "nope", 3):

                def one_by_one(target=target, outcome=outcome):
                    store._renew_ttl(target, None)
                    store._outcome_args(target, outcome)
                    return ()

                want = self.outcome(one_by_one)
                got = self.outcome(lambda t=target, o=outcome: store._release_checks(t, o) or ())
                assert got == want, (target, outcome)
        lease.ttl = float("nan")  # (a ttl no claim gives: refused as before)
        with pytest.raises(LeaseConfigError):
            store._release_checks(lease, None)

    def test_a_release_with_an_odd_resource_or_outcome_is_refused_as_check_by_check(self):
        """A review's reproduction: a Lease whose resource was changed to a non-string, or an
        outcome object equal to every string, passed the one-pass check (memory released it;
        PostgreSQL sent it and answered "outcome unknown"); the checks one by one refuse both
        before any I/O. Now the one pass takes only what they take."""

        class EqualsAll:
            def __eq__(self, other: object) -> bool:
                return True

            __hash__ = object.__hash__

        store = MemoryLeaseStore()
        lease = store.acquire("r-odd", self.OWNER, 30, identity="i-1")
        for resource in (None, 123, b"r-odd"):
            lease.resource = resource  # type: ignore[assignment]
            with pytest.raises((LeaseConfigError, TypeError, AttributeError)):
                store._renew_ttl(lease, None)  # (the checks one by one)
            with pytest.raises((LeaseConfigError, TypeError, AttributeError)):
                store._release_checks(lease, None)
        lease.resource = "r-odd"
        with pytest.raises((LeaseConfigError, TypeError)):
            store._release_checks(lease, EqualsAll())  # type: ignore[arg-type]
        assert store.get("r-odd") is not None  # nothing was released
        assert store.release(lease, outcome="done")


class TestWaitCaps:
    """``wait_cap`` and ``wait_bytes_cap`` are ints >= 1. A review's reproduction: the Redis
    store keeps its claim's fixed arguments packed with the keys, and ``wait_cap = True`` found
    the head packed for 1 (``True == 1``): it claimed where a fresh store raised TypeError."""

    @pytest.mark.parametrize("bad", [True, 0, -1, 1.0, "2", None, decimal.Decimal(1)])
    @pytest.mark.parametrize("name", ["wait_cap", "wait_bytes_cap"])
    def test_a_bad_cap_is_refused_naming_it(self, name, bad):
        store = MemoryLeaseStore()
        with pytest.raises(LeaseConfigError, match=name):
            setattr(store, name, bad)
        setattr(store, name, 3)
        assert getattr(store, name) == 3
