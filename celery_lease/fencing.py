"""Fenced side effects: a gate, SQL rows, Redis keys, HTTP gateways that reject stale owners.

A lease alone cannot give mutual exclusion: an owner paused past its ttl wakes up believing it
still holds the lease. The fence makes that safe only if the side effect checks it, atomically
with the write:

* :class:`FenceGate` - keeps, per key, the highest fence it admitted, and admits a write only if
  its fence is at least that high (a Redis script or one SQL statement, in any lease store). A
  gate on the lease store itself (``store=`` the lease store, or its URL and prefix) also
  refuses, for a key that is a lease resource, every fence older than the newest the store
  granted, whether or not its holder has written yet.
* :func:`fenced_update` - a SQLAlchemy ``UPDATE ... SET ..., fence = :fence WHERE ... AND
  fence <= :fence`` for Core tables and ORM models (``store=``: also checks the grants of a SQL
  lease store in the same database, in the same statement).
* :func:`fenced_set`, :func:`fenced_hset` - Redis writes by script that keep the highest fence
  next to the data (``store=``: also check the grants of the Redis lease store, same script).
* :func:`fencing_headers` and :func:`check_fencing_token` - an HTTP header (``Fencing-Token``)
  that a client sets and any WSGI/ASGI gateway checks, optionally signed with HMAC-SHA256
  (:class:`FenceSigner`, key ids for rotation, an expiry) so that a caller cannot forge a
  higher fence.
* :func:`fenced_request` (:func:`fenced_request_async`) and :func:`raise_for_fence` - the
  client side, for ``requests`` and ``httpx``: sends the token and turns the gateway's 409 into
  :class:`~celery_lease.StaleFenceError` and its 403 into
  :class:`~celery_lease.InvalidFenceTokenError`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import weakref
from collections.abc import Mapping
from typing import Any

from . import _clock
from . import _events as events
from ._errors import InvalidFenceTokenError, LeaseConfigError, StaleFenceError
from ._fence_client import (
    FENCING_HEADER,
    _lifetime,
    fenced_request,
    fenced_request_async,
    fencing_headers,
    raise_for_fence,
)
from ._interrupt import raise_if_interrupted, shielded
from ._lease import Lease
from ._names import (
    MAX_FENCE,
    RESOURCE_PATTERN,
    RESOURCE_RULE,
    mask_url,
    show_value,
    validate_fence,
    validate_resource,
)
from .stores import LeaseStore, store_from_url
from .stores.base import FenceGateStore, ReadableFenceGateStore

__all__ = [
    "FENCING_HEADER",
    "FenceSigner",
    "check_fencing_token",
    "fenced_get",
    "fenced_hset",
    "fenced_request",
    "fenced_request_async",
    "fenced_set",
    "fenced_update",
    "fencing_headers",
    "raise_for_fence",
    "token_from_request",
]

_KID = re.compile(r"[A-Za-z0-9_-]{1,32}")
#: No store takes a larger fence (Redis compares fences as doubles; see _names.MAX_FENCE): a
#: token carrying one is refused as invalid, the same bound as FenceGate.admit's.
_MAX_FENCE = MAX_FENCE
# Every part of a token is checked against an ASCII-only pattern before it is converted or
# compared: int() accepts '²'-like digits and raises past 4300 digits, hmac.compare_digest
# raises TypeError on non-ASCII text, b64decode and .decode() raise on junk. A gateway must
# answer such input with InvalidFenceTokenError (403), not a crash (500).
_MAX_TOKEN = 1024  # a signed token of a 200-character resource is about 400 characters
_DIGITS = re.compile(r"[0-9]{1,19}")
_B64 = re.compile(r"[A-Za-z0-9_-]{2,270}")
_MAC = re.compile(r"[A-Za-z0-9_-]{43}")  # unpadded urlsafe base64 of a SHA-256 digest


def _fence_of(fence: int | Lease) -> int:
    return validate_fence(fence.fence if isinstance(fence, Lease) else fence, fence)


def _resource_of(helper: str, fence: int | Lease, resource: str | None) -> str:
    """The lease resource whose granted fences a helper given ``store=`` checks."""
    if resource is None:
        if not isinstance(fence, Lease):
            raise LeaseConfigError(
                f"{helper}(store=...) checks the fences the store granted for a resource: pass "
                "the lease itself as the fence, or name its resource with resource="
            )
        return fence.resource
    validate_resource(resource)
    if isinstance(fence, Lease) and fence.resource != resource:
        raise LeaseConfigError(
            f"{helper}: resource={resource!r} is not the lease's resource "
            f"{fence.resource!r}; a fence orders the holders of its own resource only"
        )
    return resource


# -- the gate -------------------------------------------------------------------------------------
class FenceGate:
    """Admits a fence for a key only if it is >= every fence admitted for that key before.

    A gate that shares the lease store (``store=`` the lease store, or the lease store's URL
    and ``key_prefix`` / ``table_prefix``; Redis: and ``shards``) knows every fence the store
    granted: for a key that is a lease resource, it also refuses every fence older than the
    newest granted for that resource, from the moment the newer claim returned (its holder may
    not have written yet) and after a force-release, in the same atomic step as the admit. Use
    the resource as the key to get this. A gate on a store of its own knows only the fences it
    admitted: an old owner can still write until the newer one first passes the gate.

    Args:
        url: the same URLs as the lease stores (``redis://``, ``postgresql+psycopg://``,
            ``sqlite:///``, ``memory://``); the gate can live next to the side effect rather
            than next to the leases.
        store: or an existing lease store to share connections with (not closed by close()).
        **options: store options (``key_prefix``, ``table_prefix``, ...) for a URL.

    Check the fence right before the write, in the task body:

    <!-- test: typecheck, needs a PostgreSQL server -->
    ```python
    from celery_lease import FenceGate, current_lease, lease_task

    gate = FenceGate("postgresql+psycopg://app@db/app")  # the lease store's URL

    @lease_task(resource="invoice/{invoice_id}")
    def send_invoice(invoice_id: int) -> None:
        gate.admit(f"invoice/{invoice_id}", current_lease())  # or StaleFenceError
        ...  # the write, only once admit() returned
    ```
    """

    def __init__(
        self, url: str | None = None, *, store: LeaseStore | None = None, **options: Any
    ) -> None:
        if (url is None) == (store is None):
            raise LeaseConfigError("FenceGate needs exactly one of url= or store=")
        backend = store if store is not None else store_from_url(url or "", **options)
        if not isinstance(backend, FenceGateStore):  # url and gate_admit: all admit() needs
            raise LeaseConfigError(f"{show_value(backend)} cannot serve as a fence gate")
        self._backend: FenceGateStore = backend
        self._owned: LeaseStore | None = None if store is not None else backend  # ours to close
        self.url = backend.url

    def admit(self, key: str, fence: int | Lease) -> int:
        """Admit ``fence`` (or a lease's fence) for ``key``; atomically record it.

        Returns:
            The admitted fence.

        Raises:
            StaleFenceError: a newer fence was admitted for ``key`` before, or (a gate sharing
                the lease store) granted for the resource ``key``; nothing changed.
            LeaseConfigError: ``key`` is not a valid name or ``fence`` not an integer.
            LeaseStoreError: the gate's store failed; treat the write as not admitted.
        """
        raise_if_interrupted()  # (also with a store that makes no shielded call: memory)
        value = _fence_of(fence)
        admitted, highest = self._backend.gate_admit(key, value)
        if not admitted:
            events.count("celery_lease_stale_fence_rejections_total")
            raise StaleFenceError.rejected(key, value, highest)
        return value

    def highest(self, key: str) -> int | None:
        """The highest fence admitted for ``key`` so far, or None."""
        if not isinstance(self._backend, ReadableFenceGateStore):
            raise LeaseConfigError(
                f"the fence gate's store {self.url} has no gate_highest: it can admit fences "
                "but not say the highest one"
            )
        return self._backend.gate_highest(key)

    def close(self) -> None:
        if self._owned is not None:
            self._owned.close()

    def __repr__(self) -> str:
        return f"<FenceGate {self.url}>"


# -- SQL ------------------------------------------------------------------------------------------
def fenced_update(
    connection: Any,
    target: Any,
    where: Any,
    values: Mapping[str, Any],
    fence: int | Lease,
    *,
    fence_column: str = "fence",
    store: LeaseStore | None = None,
    resource: str | None = None,
) -> int:
    """Update the rows ``where`` matches, all of them or none: none if any carries a newer fence.

    One statement, so it is all-or-nothing on its own, also on an autocommit connection:

    ```sql
    WITH locked AS MATERIALIZED (SELECT fence FROM t WHERE <where> FOR UPDATE)
    UPDATE t SET <values>, fence = :fence
    WHERE <where> AND NOT EXISTS (SELECT 1 FROM locked WHERE locked.fence > :fence)
    ```

    On PostgreSQL the CTE locks every matched row and reads its newest committed fence before
    any row is written, so a newer owner committing while this statement runs makes it write
    nothing (a plain ``UPDATE ... WHERE fence <= :fence`` would re-check only the rows it
    waited for and write the others). SQLite runs one writer at a time; there the check is a
    ``NOT EXISTS`` subquery over the same rows. A NULL fence counts as older than any. Works
    with a Core ``Table`` or an ORM model, on a ``Connection`` or a ``Session``.

    The rows only know the fences that wrote them. Given the SQL lease store (``store=``) whose
    tables are in this connection's database, the same statement also refuses a fence older
    than the newest the store granted for the lease's resource (``AND NOT EXISTS (SELECT 1 FROM
    <leases> WHERE resource = :resource AND fence > :fence)``): from the moment a newer claim
    returned, also while its holder has not written yet, and after a force-release.

    Args:
        connection: a SQLAlchemy ``Connection`` or ``Session``.
        target: a Core ``Table`` or an ORM model with a nullable BIGINT fence column.
        where: the condition of the rows to update.
        values: the new values (SQL expressions allowed).
        fence: the writer's fence, or its :class:`Lease`.
        fence_column: the name of the table's fence column.
        store: the :class:`~celery_lease.stores.SQLLeaseStore` that granted the lease, whose
            tables this connection reaches (same database; checked by dialect and database
            name). A lease store elsewhere (Redis, another database) cannot be read in the same
            statement: admit through ``FenceGate(store=lease_store)`` right before instead.
        resource: the lease's resource, when ``fence`` is a number (a Lease names its own).

    Returns:
        the number of rows updated (>= 1).

    Raises:
        StaleFenceError: a matching row carries a newer fence, or the store granted a newer
            one for the resource; no row was written.
        LookupError: no row matches ``where``.
        LeaseConfigError: the table has no ``fence_column``; ``store`` is no SQL lease store of
            this database, or the resource is unknown or not the lease's.
    """
    import sqlalchemy as sa

    value = _fence_of(fence)
    table = target.__table__ if hasattr(target, "__table__") else target
    if fence_column not in table.c:
        raise LeaseConfigError(
            f"fenced_update: table {table.name!r} has no column {fence_column!r}; add a nullable "
            f"BIGINT column {fence_column!r} to it (or name the table's fence column with "
            "fence_column=)"
        )
    column = table.c[fence_column]
    bind = connection.get_bind() if hasattr(connection, "get_bind") else connection
    granted = None  # the store's grant check, when store= is given
    if store is not None:
        named = _resource_of("fenced_update", fence, resource)
        leases = _sql_leases(store, bind)
        granted = (
            sa.select(leases.c.fence)
            .where(leases.c.resource == named)
            .where(leases.c.fence > value)
            .correlate(None)
        )
    if bind.dialect.name == "postgresql":
        locked = (
            sa.select(column.label("fence"))
            .where(where)
            .with_for_update()  # every matched row, not only the newer ones: see above
            .cte("celery_lease_fenced")
            .prefix_with("MATERIALIZED")  # evaluated before the update, never folded into it
        )
        newer = sa.exists().where(locked.c.fence > value)
    else:
        # One writer at a time (SQLite): the statement's own snapshot is the newest state. A
        # subquery, not a CTE: Python's sqlite3 reports no rowcount for a WITH statement.
        newer = sa.exists(
            sa.select(sa.literal(1))
            .select_from(table)
            .where(where)
            .where(column > value)
            .correlate(None)  # over all matched rows, not the row being updated
        )
    statement = (
        sa.update(table)
        .where(where)
        .where(~newer)
        .where(sa.or_(column.is_(None), column <= value))  # (each row's own check, kept)
        .values({**values, fence_column: value})
    )
    if granted is not None:
        # Read in the statement's snapshot: every claim committed before it began counts (on
        # PostgreSQL under READ COMMITTED, the default; see docs/fencing.md).
        statement = statement.where(~granted.exists())
    # Shielded: a lease interrupt waits until the driver call returns (a connection cut off
    # mid-command would fail the transaction's rollback and hide the LeaseLostError).
    with shielded():
        result = connection.execute(statement)
        if result.rowcount:
            return int(result.rowcount)
        newest = connection.execute(sa.select(sa.func.max(column)).where(where)).scalar()
        exists = connection.execute(sa.select(sa.func.count()).select_from(table).where(where))
        found = exists.scalar()
        if granted is not None and found:
            newest = max(
                (f for f in (newest, connection.execute(granted).scalar()) if f is not None),
                default=None,
            )
    if not found:
        raise LookupError(f"no row of {table.name} matches the fenced update's condition")
    events.count("celery_lease_stale_fence_rejections_total")
    raise StaleFenceError.rejected(f"{table.name} row", value, newest)


def _sql_leases(store: LeaseStore, bind: Any) -> Any:
    """The leases table of ``store``, a SQL lease store of the database ``bind`` reaches."""
    from .stores.sql import SQLLeaseStore

    if not isinstance(store, SQLLeaseStore):
        raise LeaseConfigError(
            f"fenced_update(store={show_value(store)}): the store's grants are read in the same "
            "SQL statement, so store= takes the SQLLeaseStore whose tables are in this "
            "connection's database; for a lease store elsewhere, admit the fence with "
            "FenceGate(store=lease_store).admit(...) right before the write"
        )
    here, there = bind.engine.url, store.engine.url
    if bind.engine is not store.engine and not _same_database(here, there):
        raise LeaseConfigError(
            f"fenced_update: the lease store {store.url} is not in this connection's "
            f"database ({mask_url(here.render_as_string(hide_password=True))}); pass a "
            "connection to the lease store's database, or admit the fence with "
            "FenceGate(store=lease_store).admit(...) right before the write"
        )
    return store.leases_table


def _same_database(here: Any, there: Any) -> bool:
    """Whether two SQLAlchemy URLs name one database (dialect and database name; SQLite: the
    same file). Hosts are not compared: one server has many names."""
    import os.path

    if here.get_backend_name() != there.get_backend_name():
        return False
    if here.get_backend_name() == "sqlite":
        files = [url.database or "" for url in (here, there)]
        return (
            "" not in files
            and ":memory:" not in files
            and (os.path.realpath(files[0]) == os.path.realpath(files[1]))
        )
    return bool(here.database == there.database)


# -- Redis ----------------------------------------------------------------------------------------
_SET_SCRIPT = """
-- KEYS[1] the hash that holds the value and its fence; KEYS[2], when given, the lease store's
-- fences hash of the resource's shard (in KEYS[1]'s slot on a cluster)
-- ARGV[1] fence, ARGV[2] fence field, ARGV[3] the lease resource ('' without KEYS[2]), then
-- field/value pairs
-- writes the pairs and the fence unless the stored fence, or the newest fence the lease store
-- granted for the resource, is newer
-- returns {1, fence} when written, {0, newer fence} when refused
local fence = tonumber(ARGV[1])
local stored = redis.call('HGET', KEYS[1], ARGV[2])
if stored and tonumber(stored) > fence then return {0, stored} end
if KEYS[2] then
  local granted = redis.call('HGET', KEYS[2], ARGV[3])
  if granted and tonumber(granted) > fence then return {0, granted} end
end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[1])
return {1, ARGV[1]}
"""
_scripts: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def fenced_hset(
    client: Any,
    key: str,
    mapping: Mapping[str, Any],
    fence: int | Lease,
    *,
    fence_field: str = "fence",
    store: LeaseStore | None = None,
    resource: str | None = None,
) -> int:
    """Write ``mapping`` into the Redis hash ``key`` unless it carries a newer fence.

    One script call; the hash keeps the highest fence in ``fence_field``. The hash only knows
    the fences that wrote it. Given the Redis lease store (``store=``) that granted the lease,
    on the server (or cluster) ``client`` talks to, the same script also refuses a fence older
    than the newest the store granted for the lease's resource: from the moment a newer claim
    returned, also while its holder has not written yet, and after a force-release.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster``.
        key: the hash to write.
        mapping: the fields to write (not the fence field).
        fence: the writer's fence, or its :class:`Lease`.
        fence_field: the hash field that keeps the fence.
        store: the :class:`~celery_lease.stores.RedisLeaseStore` that granted the lease, on
            ``client``'s server and database (a client elsewhere is refused: the script would
            find no grants there). On a cluster ``key`` must be in the slot of the resource's
            keys: put the store's hash tag for the resource in it,
            ``f"app:{store.hash_tag(lease.resource)}:doc"``. A lease store elsewhere (SQL,
            another server) cannot be read in the same script: admit through
            ``FenceGate(store=lease_store)`` right before instead.
        resource: the lease's resource, when ``fence`` is a number (a Lease names its own).

    Raises:
        StaleFenceError: the hash carries a newer fence, or the store granted a newer one;
            nothing was written.
        LeaseConfigError: ``mapping`` holds the fence field; ``store`` is no Redis lease store
            or is on another server, database or cluster than ``client``, the resource is
            unknown or not the lease's, or (cluster) ``key`` is in another slot.
    """
    value = _fence_of(fence)
    if fence_field in mapping:
        raise LeaseConfigError(f"mapping must not contain the fence field {fence_field!r}")
    keys = [key]
    named = ""
    if store is not None:
        named = _resource_of("fenced_hset", fence, resource)
        keys.append(_redis_fences_key(store, client, key, named))
    script = _scripts.get(client)
    if script is None:
        script = _scripts[client] = client.register_script(_SET_SCRIPT)
    args: list[Any] = [value, fence_field, named]
    for field, item in mapping.items():
        args += [field, item]
    with shielded():  # a lease interrupt waits until the reply is read
        ok, stored = script(keys=keys, args=args)
    if not ok:
        events.count("celery_lease_stale_fence_rejections_total")
        raise StaleFenceError.rejected(key, value, int(stored))
    return value


def _redis_fences_key(store: LeaseStore, client: Any, key: str, resource: str) -> str:
    """The fences hash of ``resource``'s shard in ``store``, a Redis lease store whose slot
    ``key`` shares when ``client`` is a cluster's."""
    from .stores.redis import RedisLeaseStore

    if not isinstance(store, RedisLeaseStore):
        raise LeaseConfigError(
            f"fenced_hset(store={show_value(store)}): the store's grants are read in the same "
            "script, so store= takes the RedisLeaseStore on this client's server; for a lease "
            "store elsewhere, admit the fence with FenceGate(store=lease_store).admit(...) "
            "right before the write"
        )
    _check_same_redis(store, client)
    fences = store._fences_key(resource)
    keyslot = getattr(client, "keyslot", None)  # (a cluster client's; one slot per script)
    if keyslot is not None and keyslot(key) != keyslot(fences):
        raise LeaseConfigError(
            f"fenced_hset: on a Redis Cluster the key {key!r} must share the slot of the lease "
            f"store's keys of {resource!r}: put its hash tag in the key name, e.g. "
            f"'app:{store.hash_tag(resource)}:...' (store.hash_tag(resource))"
        )
    return fences


#: run_id of the server each client talks to (asked only when two clients name their server
#: differently: one server may have many names).
_run_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _redis_where(client: Any) -> tuple[str, tuple[Any, ...] | None, int | None]:
    """How a message names ``client``'s server, its address (None when the client names none:
    a Sentinel pool) and its database (None on a cluster)."""
    nodes = getattr(client, "get_nodes", None)
    if nodes is not None:  # a cluster: its nodes, no database
        found = tuple(sorted((str(n.host), int(n.port)) for n in nodes()))
        return "Redis Cluster " + ",".join(f"{h}:{p}" for h, p in found), found, None
    options = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    db = int(options.get("db") or 0)
    if options.get("path"):
        return f"unix://{options['path']} db {db}", ("unix", options["path"]), db
    if options.get("host") is not None:
        host, port = str(options["host"]), int(options.get("port") or 6379)
        return f"{host}:{port} db {db}", (host, port), db
    return f"{type(client).__name__} db {db}", None, db


def _run_id(client: Any) -> str:
    found = _run_ids.get(client)
    if found is None:
        with shielded():
            found = _run_ids[client] = str(client.info("server").get("run_id", ""))
    return found


def _check_same_redis(store: Any, client: Any) -> None:
    """Refuse a data client on another server, cluster or database than the lease store's:
    the script would read a fences hash that is not there and skip the grant check."""
    if client is store.client:
        return
    mine, mine_at, mine_db = _redis_where(client)
    theirs, theirs_at, theirs_db = _redis_where(store.client)
    if store.cluster != hasattr(client, "get_nodes"):
        same = False
    elif store.cluster:  # one cluster: a node in common
        same = bool(set(mine_at or ()) & set(theirs_at or ()))
    else:
        same = mine_db == theirs_db and (
            (mine_at is not None and mine_at == theirs_at)
            or _run_id(client) == _run_id(store.client)
        )
    if not same:
        raise LeaseConfigError(
            f"fenced_hset(store=...): the data client is on {mine}, the lease store {store.url} "
            f"on {theirs}; the script reads the store's grants next to the data, so it would "
            "find none there and let a stale fence through. Pass a client on the lease store's "
            "server and database (e.g. the store's own, store.client), or admit the fence with "
            "FenceGate(store=lease_store).admit(...) right before the write"
        )


def fenced_set(
    client: Any,
    key: str,
    value: Any,
    fence: int | Lease,
    *,
    store: LeaseStore | None = None,
    resource: str | None = None,
) -> int:
    """Fenced SET: stores ``value`` in the hash ``key`` (field ``value``) with its fence.

    ``store`` and ``resource`` as for :func:`fenced_hset`.
    """
    return fenced_hset(client, key, {"value": value}, fence, store=store, resource=resource)


def fenced_get(client: Any, key: str) -> tuple[Any, int | None]:
    """Read what :func:`fenced_set` wrote: ``(value, fence)`` (``(None, None)`` if absent)."""
    value, fence = client.hmget(key, ["value", "fence"])
    return value, None if fence is None else int(fence)


# -- HTTP -----------------------------------------------------------------------------------------
class FenceSigner:
    """HMAC-SHA256 signatures for fencing tokens that leave the process.

    Args:
        keys: key id -> secret (bytes or str, at least 32 bytes). Keep old keys here while
            tokens signed with them may still be in flight; sign with ``active``.
        active: the key id new tokens are signed with.
    """

    def __init__(self, keys: Mapping[str, bytes | str], active: str) -> None:
        self._keys: dict[str, bytes] = {}
        for kid, secret in keys.items():
            if not _KID.fullmatch(kid):
                raise LeaseConfigError(f"key id {kid!r} must be 1..32 of A-Z a-z 0-9 _ -")
            raw = secret.encode() if isinstance(secret, str) else bytes(secret)
            if len(raw) < 32:
                raise LeaseConfigError(f"the secret of key {kid!r} must be at least 32 bytes")
            self._keys[kid] = raw
        if active not in self._keys:
            raise LeaseConfigError(f"active key {active!r} is not among the keys")
        self.active = active

    def _mac(self, kid: str, payload: str) -> str:
        digest = hmac.new(self._keys[kid], payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def sign(self, resource: str, fence: int, *, expires_in: float | None = None) -> str:
        """A token ``v1.<kid>.<resource b64>.<fence>.<expiry or 0>.<mac>``.

        Args:
            resource: the lease's resource.
            fence: the lease's fence.
            expires_in: seconds from now after which :meth:`verify` refuses the token. The
                expiry is a Unix time in whole seconds (rounded down) from this machine's wall
                clock, and the verifier compares it with its own: leave room for the clocks'
                difference. None (0 in the token): it never expires. An expiry bounds how long a
                copied token (a log, a proxy) can be replayed; the fence order alone already
                refuses it once a newer owner's fence reached the gateway.
        """
        validate_resource(resource)
        fence = validate_fence(fence)  # (verify() refuses a larger one)
        lifetime = _lifetime(expires_in, ended_ok=True)
        # (never 0, which means "no expiry": a lifetime that already ended stays ended)
        expiry = 0 if lifetime is None else max(1, int(_clock.wall() + lifetime))
        encoded = base64.urlsafe_b64encode(resource.encode()).decode().rstrip("=")
        payload = f"v1.{self.active}.{encoded}.{int(fence)}.{expiry}"
        return f"{payload}.{self._mac(self.active, payload)}"

    def verify(self, token: str) -> tuple[str, int]:
        """Check a token's signature and expiry; return ``(resource, fence)``.

        Raises:
            InvalidFenceTokenError: malformed, unknown key, bad signature or expired.
        """
        malformed = InvalidFenceTokenError(
            f"malformed signed fencing token {show_value(token)}; expected "
            "v1.<key id>.<resource>.<fence>.<expiry>.<signature>"
        )
        if not isinstance(token, str) or len(token) > _MAX_TOKEN:
            raise malformed
        parts = token.split(".")
        if len(parts) != 6 or parts[0] != "v1":
            raise malformed
        _, kid, encoded, fence, expiry, mac = parts
        if not (
            _KID.fullmatch(kid)
            and _B64.fullmatch(encoded)
            and _DIGITS.fullmatch(fence)
            and _DIGITS.fullmatch(expiry)
            and _MAC.fullmatch(mac)
        ):
            raise malformed
        if kid not in self._keys:
            raise InvalidFenceTokenError(f"fencing token signed with unknown key {kid!r}")
        expected = self._mac(kid, ".".join(parts[:5]))
        if not hmac.compare_digest(expected.encode(), mac.encode()):
            raise InvalidFenceTokenError("fencing token signature does not match (forged?)")
        value = _parse_fence(fence, token)
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            resource = _parse_resource(raw.decode(), token)
        except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
            raise malformed from None
        deadline = int(expiry)
        if deadline and _clock.wall() > deadline:
            raise InvalidFenceTokenError("fencing token expired")
        return resource, value


def token_from_request(request: Any) -> str | None:
    """The Fencing-Token header from a WSGI environ, an ASGI scope, a headers mapping, or any
    headers object with a ``get(name)`` method (``http.server``'s ``self.headers``, an
    ``email.message.Message``: case-insensitive)."""
    if not isinstance(request, Mapping):  # (an HTTPMessage is no Mapping)
        get = getattr(request, "get", None)
        value = get(FENCING_HEADER) if callable(get) else None
        return None if value is None else str(value)
    if "HTTP_FENCING_TOKEN" in request:  # WSGI environ
        return str(request["HTTP_FENCING_TOKEN"])
    if request.get("type") in ("http", "websocket") and "headers" in request:  # ASGI scope
        for name, value in request["headers"]:
            if name.decode("latin-1").lower() == FENCING_HEADER.lower():
                return str(value.decode("latin-1"))
        return None
    for name, value in request.items():  # plain headers
        if str(name).lower() == FENCING_HEADER.lower():
            return str(value)
    return None


def check_fencing_token(
    request: Any,
    gate: FenceGate,
    *,
    key: str | None = None,
    resource: str | None = None,
    signer: FenceSigner | None = None,
) -> int:
    """Admit the request's fencing token through ``gate``; usable in any WSGI/ASGI app.

    Args:
        request: a WSGI environ, an ASGI scope, a headers mapping, any headers object with a
            case-insensitive ``get`` (``http.server``'s ``self.headers``), or the header's
            value.
        gate: where the highest admitted fence per key lives.
        key: the gate key (default: the token's resource).
        resource: when given, the token must name this resource.
        signer: require a valid signature (rejects forged and tampered tokens).

    Returns:
        the admitted fence.

    Raises:
        InvalidFenceTokenError: missing, malformed, unsigned when a signature is required,
            forged, tampered with, expired, or naming another resource (answer 403).
        StaleFenceError: a newer fence was admitted for the key (answer 409).
    """
    token = request if isinstance(request, str) else token_from_request(request)
    if not token:
        raise InvalidFenceTokenError(f"the request carries no {FENCING_HEADER} header")
    if signer is not None:
        named, fence = signer.verify(token)
    else:
        named, sep, raw = token.rpartition(";")
        if not sep or len(token) > _MAX_TOKEN:
            raise InvalidFenceTokenError(
                f"malformed {FENCING_HEADER} header {show_value(token)}; expected "
                "<resource>;<fence>"
            )
        fence = _parse_fence(raw, token)
        named = _parse_resource(named, token)
    if resource is not None and named != resource:
        raise InvalidFenceTokenError(
            f"fencing token names {named!r}, not {resource!r}: refusing a token for another "
            "resource"
        )
    return gate.admit(key or named, fence)


def _parse_fence(raw: str, token: str) -> int:
    """ASCII digits only, at most a 64-bit fence; else InvalidFenceTokenError."""
    if not _DIGITS.fullmatch(raw) or int(raw) > _MAX_FENCE:
        raise InvalidFenceTokenError(
            f"fencing token {show_value(token)} carries no valid fence: expected 0..{_MAX_FENCE} "
            "in ASCII digits"
        )
    return int(raw)


def _parse_resource(named: str, token: str) -> str:
    """A valid resource name (what fencing_headers and sign() write); else
    InvalidFenceTokenError, not the LeaseConfigError validate_resource raises for our callers."""
    if not RESOURCE_PATTERN.fullmatch(named):
        raise InvalidFenceTokenError(
            f"fencing token {show_value(token)} names no valid resource: a resource name is "
            f"{RESOURCE_RULE}"
        )
    return named
