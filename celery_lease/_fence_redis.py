"""The fenced Redis writes (fenced_hset, fenced_set, fenced_get), re-exported by ``fencing``.

One script call that keeps the highest fence next to the data and, given the Redis lease store
(``store=``), checks its grants in the same script; the data client must be on that store's
server and database (checked here).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from . import _events as events
from ._errors import LeaseConfigError, StaleFenceError
from ._fence_args import fence_of, resource_of
from ._interrupt import shielded
from ._lease import Lease
from ._names import show_value
from .stores import LeaseStore

__all__ = ["fenced_get", "fenced_hset", "fenced_set"]

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
    value = fence_of(fence)
    if fence_field in mapping:
        raise LeaseConfigError(f"mapping must not contain the fence field {fence_field!r}")
    keys = [key]
    named = ""
    if store is not None:
        named = resource_of("fenced_hset", fence, resource)
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
