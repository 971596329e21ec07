"""The Redis store's set-up and shared plumbing: client, scripts, shards and keys, health.

What every operation of the store shares: the client and its connections, the scripts
registered per instance, shards and key names, reading lease records, the health check.

See :mod:`celery_lease.stores.redis.scripts` for the key layout and the fence rule. Driver
errors become :class:`LeaseStoreError` in :class:`.connection.Translate` only (through
:meth:`RedisStoreCore._run`); :mod:`.connection` holds everything that touches redis-py. The
operations are in the modules :class:`~.store.RedisLeaseStore` is made of.
"""

from __future__ import annotations

import builtins
import logging
import re
import zlib
from collections.abc import Sequence
from typing import Any

from ..._errors import LeaseConfigError, LeaseLostError, LeaseStoreError
from ..._lease import Lease, LeaseInfo
from ..._names import mask_url, show_value, validate_resource
from ..base import DEFAULT_MAX_TTL, DEFAULT_RETENTION, BaseLeaseStore, lease_info
from . import scripts as lua
from .connection import Connections, Script, Translate, connect, describe, redis

__all__ = ["RedisStoreCore"]

_KEY_KINDS = (
    "leases", "expiry", "fences", "ids", "ids_exp", "ckpt", "ledger", "ledger_exp", "waits", "wpay",
    "waits_exp", "gates",
)  # fmt: skip


# The keys of the claim, the plain release and the release with an outcome, in KEYS order.
_ACQUIRE_KEYS = (
    "leases", "expiry", "fences", "ids", "ids_exp", "ckpt", "waits", "wpay", "waits_exp",
)  # fmt: skip
_RELEASE_KEYS = ("leases", "expiry", "waits", "wpay", "waits_exp")
_OUTCOME_KEYS = ("leases", "expiry", "ids", "ids_exp", "waits", "wpay", "waits_exp")


# The backend's logger name from before the stores became packages, so that logging set up for
# it keeps seeing this store's lines (the force-release warning above all).
log = logging.getLogger("celery_lease.stores.redis")

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")
# token, fence, acquired, expires, label; then maybe the recovery facts (see scripts.py)
_RECORD_RE = re.compile(r"([0-9a-f]+) (\d+) (\d+) (\d+) ([^\n]*)(?:\n.*)?", re.DOTALL)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStoreCore(BaseLeaseStore):
    """A Redis store's set-up, keys and plumbing (see :class:`~.store.RedisLeaseStore` for the
    arguments)."""

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster | None = None,
        *,
        url: str | None = None,
        key_prefix: str = "celery_lease:",
        shards: int = 16,
        max_ttl: float = DEFAULT_MAX_TTL,
        retention: float = DEFAULT_RETENTION,
        socket_timeout: float = 5.0,
        require_noeviction: bool = False,
        require_persistence: bool = False,
        cluster: bool = False,
        password: str | None = None,
    ) -> None:
        super().__init__(max_ttl=max_ttl, retention=retention)
        if not isinstance(key_prefix, str) or not _PREFIX_RE.fullmatch(key_prefix):
            raise LeaseConfigError(
                f"key_prefix={show_value(key_prefix)} is not allowed: use 1..64 characters of "
                "A-Z a-z 0-9 _ . : - (no braces: the store adds the hash tag itself)"
            )
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 1024:
            raise LeaseConfigError(f"shards must be an integer 1..1024, got {shards!r}")
        if (client is None) == (url is None):
            raise LeaseConfigError("RedisLeaseStore needs exactly one of client= or url=")
        if not isinstance(cluster, bool):
            raise LeaseConfigError(f"cluster must be True or False, got {show_value(cluster)}")
        if password is not None and (client is not None or not isinstance(password, str)):
            raise LeaseConfigError("password= is a string, and only for a store given a url=")
        self._owns_client = client is None
        if client is None:
            assert url is not None
            client = connect(url, cluster=cluster, socket_timeout=socket_timeout, password=password)
            self.url = mask_url(url)
        else:
            self.url = describe(client)
        #: True for a Redis Cluster client: a call may only touch one shard's keys.
        self.cluster = isinstance(client, redis.cluster.RedisCluster)
        self.client: Any = client
        self.key_prefix = key_prefix
        self.shards = shards
        self.require_noeviction = require_noeviction
        self.require_persistence = require_persistence
        self._connections = Connections(client)
        # The renewer's calls (renew_many, warm_up) keep their own connections: the one its
        # warm-up opened is still there for the first renewal, whatever the tasks took meanwhile.
        self._renewer_connections = Connections(client)
        scripts = {
            name: Script(self._connections, getattr(lua, name.upper()))
            for name in (
                "acquire", "renew", "release", "release_outcome", "get", "force_release",
                "list", "gate_admit", "effect_begin", "effect_done", "checkpoint",
                "identity_get", "sweep", "waiters", "wake_due", "mark_once",
            )
        }  # fmt: skip
        self._waiters = scripts["waiters"]
        self._acquire = scripts["acquire"]
        self._renew = scripts["renew"]
        self._release = scripts["release"]
        self._release_outcome = scripts["release_outcome"]
        # (the script each is made of, and it): remade when a test swaps that script
        self._short_claim = self._headed_claim = self._headed_release = (None, None)
        self._headed_release_outcome: tuple[Any, Script | None] = (None, None)
        self._remade("_short_claim", lua.SHORT_CLAIM, self._acquire)
        self._remade("_headed_claim", lua.HEADED_CLAIM, self._acquire)
        self._remade("_headed_release", lua.HEADED_RELEASE, self._release)
        self._remade("_headed_release_outcome", lua.HEADED_RELEASE_OUTCOME, self._release_outcome)
        self._get = scripts["get"]
        self._force_release = scripts["force_release"]
        self._list = scripts["list"]
        self._gate_admit = scripts["gate_admit"]
        self._effect_begin = scripts["effect_begin"]
        self._effect_done = scripts["effect_done"]
        self._checkpoint = scripts["checkpoint"]
        self._identity_get = scripts["identity_get"]
        self._mark_once = scripts["mark_once"]
        self._sweep = scripts["sweep"]
        self._wake_due = scripts["wake_due"]
        self._sweep_start = 0  # the shard a sweep starts at, rotated so none waits behind others
        # Every key name, built once: the hot path only indexes these.
        self._key_names = [
            {name: f"{key_prefix}{{{shard:02x}}}:{name}" for name in _KEY_KINDS}
            for shard in range(shards)
        ]
        # ... and the key lists of the claim and the releases, per shard.
        self._acquire_keys = [self._keys(shard, *_ACQUIRE_KEYS) for shard in range(shards)]
        self._release_keys = [self._keys(shard, *_RELEASE_KEYS) for shard in range(shards)]
        self._outcome_keys = [self._keys(shard, *_OUTCOME_KEYS) for shard in range(shards)]
        self._epochs: dict[int, str] = {}
        #: How many times this store saw a shard's epoch change: the server lost its data.
        self.data_loss_detected = 0

    # -- keys ------------------------------------------------------------------------------
    def shard_of(self, resource: str) -> int:
        return zlib.crc32(resource.encode()) % self.shards

    def _keys(self, shard: int, *names: str) -> list[str]:
        kinds = self._key_names[shard]
        return [kinds[name] for name in names]

    def hash_tag(self, resource: str) -> str:
        """The Redis Cluster hash tag of ``resource``'s keys, e.g. ``{0a}``.

        A key of your own whose name contains it is in the same slot as the resource's lease
        keys, so a script may touch both: :func:`~celery_lease.fencing.fenced_hset` with
        ``store=`` needs that on a cluster (``f"app:{store.hash_tag(resource)}:doc"``). The tag
        is built by the store from the resource's shard, never from the name itself.
        """
        return f"{{{self.shard_of(validate_resource(resource)):02x}}}"

    def _fences_key(self, resource: str) -> str:
        """The fences hash of ``resource``'s shard (field ``resource``: its newest fence)."""
        return self._keys(self.shard_of(validate_resource(resource)), "fences")[0]

    # -- plumbing --------------------------------------------------------------------------
    def _remade(self, attr: str, prelude: str, base: Any) -> Script | None:
        """The claim's or a release's script ``base`` with ``prelude`` before it (its fixed
        arguments sent first, see scripts.py), kept with ``base`` in ``attr``; None when a
        test swapped ``base`` for a stand-in that is no Script (it is then sent its arguments
        in its own order)."""
        script = None
        if isinstance(base, Script):
            script = Script(self._connections, prelude + base.source)
        setattr(self, attr, (base, script))
        return script

    def _run(self, what: str, subject: object = None) -> Translate:
        """Translate driver errors: the single place where redis exceptions are caught.

        ``what % subject`` names the operation in the error (formatted only on failure).
        """
        return Translate(self.url, what, subject)

    def _note_epoch(self, shard: int, epoch: Any) -> None:
        epoch = _text(epoch)
        seen = self._epochs.get(shard)
        if seen is not None and seen != epoch:
            self.data_loss_detected += 1
            log.error(
                "Redis lease store %s lost its data (shard %d epoch %s -> %s): the server "
                "restarted without persistence, was flushed or evicted keys. Leases held "
                "before are gone; "
                "fences stay increasing (they are floored at the server time). Enable AOF.",
                self.url,
                shard,
                seen,
                epoch,
            )
        self._epochs[shard] = epoch

    @staticmethod
    def _parse(record: Any) -> tuple[str, int, int, int, str]:
        match = _RECORD_RE.fullmatch(_text(record))
        if match is None:
            raise LeaseStoreError(f"unreadable lease record {show_value(record)} in Redis")
        token, fence, acquired, expires, label = match.groups()
        return token, int(fence), int(acquired), int(expires), label

    def _info(self, resource: str, record: Any, now: int) -> LeaseInfo:
        _, fence, acquired, expires, label = self._parse(record)
        return lease_info(resource, label, fence, acquired, expires, now)

    def _lost_from(self, lease: Lease, item: Sequence[Any]) -> LeaseLostError:
        reason = _text(item[1])
        label = _text(item[2]) if len(item) > 2 and item[2] else None
        fence = int(item[3]) if len(item) > 3 and item[3] is not None else None
        expired = len(item) > 4 and bool(int(item[4]))  # (taken over, and expired since)
        return self._lost(lease, reason, label, fence, expired)

    # -- health and lifetime --------------------------------------------------------------
    def check_health(self) -> builtins.list[str]:
        warnings: builtins.list[str] = []
        # Every primary of a cluster holds some shards: each must be safe.
        nodes: builtins.list[Any] = self.client.get_primaries() if self.cluster else [None]
        with self._run("health check"):
            self.client.ping()  # reachable, even where CONFIG is refused
        for node in nodes:
            where = self.url if node is None else f"redis://{node.host}:{node.port} (cluster)"
            with self._run("health check"):
                try:
                    config: dict[Any, Any] = {}
                    for name in ("maxmemory-policy", "appendonly", "save"):
                        if node is None:
                            config.update(self.client.config_get(name))
                        else:
                            config.update(self.client.config_get(name, target_nodes=node))
                except redis.ResponseError as exc:  # CONFIG is often disabled on managed Redis
                    warnings.append(
                        f"could not read the Redis configuration at {where} ({exc}); make "
                        "sure maxmemory-policy is noeviction and AOF persistence is on"
                    )
                    continue
            warnings += self._check_config({_text(k): _text(v) for k, v in config.items()}, where)
        return warnings

    def _check_config(self, config: dict[str, str], where: str) -> builtins.list[str]:
        warnings: builtins.list[str] = []
        policy = config.get("maxmemory-policy", "")
        if policy != "noeviction":
            message = (
                f"Redis at {where} has maxmemory-policy={policy!r}: under memory pressure it "
                "can silently evict lease keys and let two owners in; set noeviction"
            )
            if self.require_noeviction:
                raise LeaseStoreError(message)
            warnings.append(message)
        if config.get("appendonly") != "yes":
            message = (
                f"Redis at {where} has appendonly={config.get('appendonly')!r} and "
                f"save={config.get('save')!r}: a restart can lose live leases (fences stay "
                "increasing, floored at the server clock); enable AOF (appendonly yes)"
            )
            if self.require_persistence and not config.get("save"):
                raise LeaseStoreError(message)
            warnings.append(message)
        return warnings

    def warm_up(self) -> None:
        # Opens a connection for the renewer and loads the renewal script: the renewer's first
        # call then costs one round trip, also on a server that has not seen the script yet.
        with self._run("warm-up"):
            self._renew.load(self._renewer_connections)

    def close(self) -> None:
        self._connections.close()
        self._renewer_connections.close()
        if self._owns_client:
            self.client.close()
