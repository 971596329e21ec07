"""The Redis lease store: one Lua script per operation, timed by the server's ``TIME``.

See :mod:`celery_lease.stores.redis.scripts` for the key layout and the fence rule. Scripts are
registered per store instance; every key a script touches is passed in ``KEYS`` and every value
in ``ARGV``. Driver errors become :class:`LeaseStoreError` in :class:`.connection.Translate` only
(through :meth:`RedisLeaseStore._run`); :mod:`.connection` holds everything that touches redis-py.
"""

from __future__ import annotations

import builtins
import logging
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from ..._codec import decode, from_micros
from ..._errors import (
    IdentityDoneError,
    LeaseBusyError,
    LeaseConfigError,
    LeaseLostError,
    LeaseStoreError,
)
from ..._lease import Lease, LeaseInfo, Owner
from ..._names import mask_url, show_value, validate_fence, validate_resource
from ..base import (
    DEFAULT_MAX_TTL,
    DEFAULT_RETENTION,
    DEFAULT_WAKE_DUE_LIMIT,
    MARK_IDENTITY,
    RECENT_EFFECTS,
    BaseLeaseStore,
    DueWake,
    EffectRecord,
    IdentityInfo,
    IdentityRecords,
    LeasePage,
    Waiter,
    changed_hands,
    decode_cursor,
    encode_cursor,
    lease_info,
    log_force_release,
    monotonic,
    previous_owner,
)
from . import scripts as lua
from .connection import Connections, Script, Translate, connect, describe, redis

__all__ = ["RedisLeaseStore"]

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


def _acquire_order(fixed: tuple[Any, ...], own: tuple[Any, ...]) -> list[Any]:
    """ACQUIRE's seventeen arguments in its own order, from HEADED_CLAIM's ``fixed`` and
    ``own`` (for a stand-in a test swapped in for the claim's script)."""
    ttl, retention, cap, grace, cap_bytes, early, own_wake, skew = fixed
    resource, token, label, identity, payload, wait_ttl, attempt, name, since = own
    return [
        resource, token, label, ttl, identity, retention, payload, wait_ttl, cap, grace,
        cap_bytes, attempt, early, own_wake, name, since, skew,
    ]  # fmt: skip


class RedisLeaseStore(BaseLeaseStore):
    """Leases in Redis: a standalone server, or a Redis Cluster with ``cluster=True``.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` to use (not closed by
            :meth:`close`); or give ``url``.
        url: ``redis://``, ``rediss://`` or ``unix://`` URL; the store creates and owns a client.
        cluster: with ``url``, connect to a Redis Cluster (any node's address; the client
            discovers the rest). Every script touches the keys of one shard, which share a hash
            tag and so a slot; batched renewals and ``list()`` make one call per shard.
        key_prefix: prefix of every key, default ``celery_lease:``; the store adds a hash tag.
        shards: how many hash-tagged key groups resources spread over (Cluster slots); each
            ``list()`` touches all of them.
        max_ttl: the largest ttl accepted.
        socket_timeout: seconds a command may take before it fails as LeaseStoreError
            (only for a client the store creates).
        require_noeviction: make :meth:`check_health` refuse (raise) instead of warn when the
            server may evict keys (``maxmemory-policy`` other than ``noeviction``).
        require_persistence: likewise when the server persists nothing (no AOF, no RDB).
        password: with ``url``, the password to authenticate with when the URL carries none
            (a URL's own password wins). Keeps it out of ``lease_store_url``, which Celery's
            ``inspect conf`` and Flower show unmasked; ``lease_store_options={"password": ...}``
            is masked there.
    """

    supports_early_wake = True

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

    # -- operations ------------------------------------------------------------------------
    def acquire(
        self,
        resource: str,
        owner: Owner,
        ttl: float,
        *,
        identity: str | None = None,
        wait: str | None = None,
        wait_ttl: float = 120.0,
        attempt: int | None = None,
        waiter: str | None = None,
        since: int | None = None,
        early_wake: bool = False,
        own_wake: bool = False,
    ) -> Lease:
        ttl, identity, name, payload, attempt = self._claim_checks(
            resource, owner, ttl, identity, waiter, since, wait, wait_ttl, attempt
        )
        shard = self.shard_of(resource)
        keys = self._acquire_keys[shard]
        grace = max(1, round(self.handoff_grace * 1e6))
        ttl_us, early = max(1, round(ttl * 1e6)), "1" if early_wake else ""
        sent = monotonic()
        if (
            identity is None
            and name is None
            and not payload
            and attempt is None
            and since is None
            and not own_wake
        ):
            # The claim most tasks send (see lua.SHORT_CLAIM): three arguments of its own.
            base, short = self._short_claim
            if base is not self._acquire:  # (a test swapped the claim's script)
                short = self._remade("_short_claim", lua.SHORT_CLAIM, self._acquire)
            own: tuple[str | int, ...] = (resource, owner.token, owner.label)
            with self._run("acquire of %r", resource):
                if short is not None:
                    reply = short(keys=keys, args=own, fixed=(ttl_us, grace, early))
                else:
                    fixed = (ttl_us, 0, 0, grace, 0, early, "", 0)
                    reply = self._acquire(
                        keys=keys, args=_acquire_order(fixed, (*own, "", "", 0, "", "", ""))
                    )
        else:
            base, headed = self._headed_claim
            if base is not self._acquire:
                headed = self._remade("_headed_claim", lua.HEADED_CLAIM, self._acquire)
            fixed = (
                ttl_us,
                self._retention_us,
                self.wait_cap,
                grace,
                self.wait_bytes_cap,
                early,
                "1" if own_wake else "",
                self._since_skew_us,
            )
            own = (
                resource,
                owner.token,
                owner.label,
                identity or "",
                payload,
                max(1, round(wait_ttl * 1e6)),
                "" if attempt is None else attempt,
                name if name is not None and name != identity else "",
                "" if since is None else since,
            )
            with self._run("acquire of %r", resource):
                if headed is not None:
                    reply = headed(keys=keys, args=own, fixed=fixed)
                else:
                    reply = self._acquire(keys=keys, args=_acquire_order(fixed, own))
        if reply[0] == 2:
            assert identity is not None
            result = _text(reply[2]) if reply[2] else None
            label = _text(reply[3]) if len(reply) > 3 and reply[3] else None
            raise IdentityDoneError.completed(resource, identity, int(reply[1]), result, label)
        if reply[0] == 0:
            _, label, fence, expires, now, epoch, *more = reply
            more += [0, 0, None, 0][len(more) :]
            self._note_epoch(shard, epoch)
            raise LeaseBusyError.held(
                resource,
                _text(label),
                int(fence),
                (expires - now) / 1e6,
                duplicate=bool(more[0]),
                position=int(more[1]) or None,
                wake=None if more[2] is None else _text(more[2]),
                polling=bool(more[3]),
            )
        (
            _,
            fence,
            acquired,
            expires,
            epoch,
            prev_label,
            prev_fence,
            i_state,
            i_fence,
            i_label,
            ckpt,
            next_wake,
            own,
        ) = [*reply, None, None, None, None, None, None, None, None][:13]
        self._note_epoch(shard, epoch)
        prev_label, prev_fence = previous_owner(prev_label, prev_fence, i_label, i_fence)
        checkpoints = None
        if ckpt is not None:
            checkpoints = decode(_text(ckpt).split("\n", 1)[1])
        lease = Lease(
            resource=resource,
            owner=owner,
            fence=int(fence),
            acquired_at=int(acquired),  # (datetimes when first read)
            expires_at=int(expires),
            ttl=ttl,
            sent_monotonic=sent,
            store=self,
            previous_owner_label=None if prev_label is None else _text(prev_label),
            previous_fence=None if prev_fence is None else int(prev_fence),
            identity=identity,
            identity_state=None if i_state is None else _text(i_state),
            checkpoints=checkpoints,
            identity_owner_label=None if i_state is None or i_label is None else _text(i_label),
            identity_fence=None if i_state is None or not i_fence else int(i_fence),
        )
        if next_wake is not None:
            lease.next_wake = _text(next_wake)
        if own is not None:
            lease.own_wake = _text(own)
        return lease

    def _renew_call(
        self,
        leases: Sequence[Lease],
        ttls: Sequence[float],
        what: str,
        via: Connections | None = None,
    ) -> tuple[float, list[Any]]:
        """One call for all leases; on a cluster, one call per shard (a slot each).

        Returns the monotonic time the (first) call was sent and one reply item per lease.
        """
        groups: dict[int, list[int]] = {}
        for i, lease in enumerate(leases):
            shard = self.shard_of(lease.resource) if self.cluster else 0
            groups.setdefault(shard, []).append(i)
        items: list[Any] = [None] * len(leases)
        sent = monotonic()  # the earliest send time: the self-fence deadline stays conservative
        for indexes in groups.values():
            keys: list[str] = []
            args: list[Any] = []
            for i in indexes:
                lease, ttl = leases[i], ttls[i]
                keys += self._keys(self.shard_of(lease.resource), "leases", "expiry", "fences")
                args += [lease.resource, lease.owner.token, str(lease.fence), round(ttl * 1e6)]
            with self._run(what):
                reply = self._renew(keys=keys, args=args, via=via)
            for i, item in zip(indexes, reply[1:], strict=True):
                items[i] = item
        return sent, items

    def _lost_from(self, lease: Lease, item: Sequence[Any]) -> LeaseLostError:
        reason = _text(item[1])
        label = _text(item[2]) if len(item) > 2 and item[2] else None
        fence = int(item[3]) if len(item) > 3 and item[3] is not None else None
        expired = len(item) > 4 and bool(int(item[4]))  # (taken over, and expired since)
        return self._lost(lease, reason, label, fence, expired)

    def _renew_batch(
        self, leases: Sequence[Lease], ttl: float | None = None
    ) -> list[LeaseLostError | None]:
        if not leases:
            return []
        ttls = [self._renew_ttl(lease, ttl) for lease in leases]
        sent, items = self._renew_call(
            leases, [max(t, 1e-6) for t in ttls], "renewal", self._renewer_connections
        )
        results: list[LeaseLostError | None] = []
        for lease, lease_ttl, item in zip(leases, ttls, items, strict=True):
            if item[0] == 1:
                lease.renewed(sent, from_micros(item[1]), lease_ttl)
                results.append(None)
            else:
                results.append(self._lost_from(lease, item))
        return results

    def verify(self, lease: Lease) -> None:
        self._renew_ttl(lease, None)
        _, items = self._renew_call([lease], [0.0], f"verify of {lease.resource!r}")
        if items[0][0] != 1:
            raise self._lost_from(lease, items[0])

    def release(
        self,
        lease: Lease,
        *,
        outcome: str | None = None,
        result: str | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> bool:
        """See :meth:`LeaseStore.release`; ``meanwhile`` (called once, also when the call
        fails) runs while the release's reply is awaited: the command is on its way first
        (except when the server's script cache is cold, after a restart: the NOSCRIPT answer
        is read after ``meanwhile`` ran, and the release is sent again once loaded)."""
        self._release_checks(lease, outcome)
        shard = self.shard_of(lease.resource)
        grace = max(1, round(self.handoff_grace * 1e6))
        # (each script with its fixed arguments first: see lua.HEADED_RELEASE, unless a test
        # swapped it for a stand-in, which is sent its arguments in its own order)
        if outcome is None:
            keys = self._release_keys[shard]
            base, headed = self._headed_release
            if base is not self._release:
                headed = self._remade("_headed_release", lua.HEADED_RELEASE, self._release)
            fixed: tuple[str | int, ...] = (grace,)
            own: tuple[str | int, ...] = (lease.resource, lease.owner.token, lease.fence)
            script = self._release
        else:
            keys = self._outcome_keys[shard]
            base, headed = self._headed_release_outcome
            if base is not self._release_outcome:
                headed = self._remade(
                    "_headed_release_outcome", lua.HEADED_RELEASE_OUTCOME, self._release_outcome
                )
            fixed = (self._retention_us, grace)
            own = (
                lease.resource,
                lease.owner.token,
                lease.fence,
                lease.identity or "",
                outcome,
                result or "",
            )
            script = self._release_outcome
        with self._run("release of %r", lease.resource):
            if headed is not None:
                done = headed(keys=keys, args=own, meanwhile=meanwhile, fixed=fixed)
            else:
                done = script(keys=keys, args=[*own, *fixed], meanwhile=meanwhile)
        if isinstance(done, list):  # handed over to the head waiter
            lease.handoff = None if done[1] is None else _text(done[1])
            return True
        lease.handoff = None
        return bool(done)

    def waiters(self, resource: str) -> builtins.list[Waiter]:
        validate_resource(resource)
        with self._run("wait list read of %r", resource):
            now, *raw = self._waiters(
                keys=self._keys(self.shard_of(resource), "waits"), args=[resource]
            )
        out: builtins.list[Waiter] = []
        for line in _text(raw[0]).split("\n") if raw and raw[0] else ():
            # (and " <attempt>" after a retry: see scripts.py)
            identity, since, expires, woken = line.split(" ")[:4]
            if int(expires) <= now:
                continue
            out.append(
                Waiter(
                    len(out) + 1,
                    identity,
                    from_micros(int(since)),
                    from_micros(int(expires)),
                    int(woken) > now,
                )
            )
        return out

    def effect_begin(self, lease: Lease, key: str) -> tuple[str, int | None, str | None]:
        identity, key = self._ledger_args(lease, key)
        keys = self._keys(self.shard_of(lease.resource), "leases", "ledger", "ledger_exp", "fences")
        args: list[str | int] = [
            lease.resource,
            lease.owner.token,
            lease.fence,
            identity,
            key,
            self._retention_us,
        ]
        with self._run("effect %r of %r", (key, lease.resource)):
            reply = self._effect_begin(keys=keys, args=args)
        if reply[0] == 0:
            raise self._lost_from(lease, reply)
        state = _text(reply[1])
        if state == "done":
            return "done", int(reply[2]), _text(reply[3]) if len(reply) > 3 else None
        if state == "intent":
            return "intent", int(reply[2]), None
        return "new", None, None

    def effect_done(self, lease: Lease, key: str, receipt: str) -> bool:
        identity, key = self._ledger_args(lease, key)
        keys = self._keys(self.shard_of(lease.resource), "ledger", "ledger_exp")
        member = f"{lease.resource}|{identity}|{key}"
        with self._run("effect %r done of %r", (key, lease.resource)):
            done = self._effect_done(
                keys=keys,
                args=[member, lease.fence, receipt, self._retention_us, lease.owner.token],
            )
        return bool(done)

    def checkpoint(self, lease: Lease, data: str) -> None:
        identity, _ = self._ledger_args(lease, "checkpoint")
        keys = self._keys(self.shard_of(lease.resource), "leases", "ckpt", "fences")
        args: list[str | int] = [lease.resource, lease.owner.token, lease.fence, identity, data]
        with self._run("checkpoint of %r", lease.resource):
            reply = self._checkpoint(keys=keys, args=args)
        if reply[0] == 0:
            raise self._lost_from(lease, reply)

    def identity_get(self, resource: str, identity: str) -> IdentityInfo | None:
        validate_resource(resource)
        identity = self._identity_args(identity) or ""
        keys = self._keys(self.shard_of(resource), "ids", "ids_exp")
        with self._run("identity read of %r", resource):
            reply = self._identity_get(keys=keys, args=[f"{resource}|{identity}"])
        if not reply:
            return None
        record, expires = reply
        state, fence, _token, label, result = _text(record).split("\n", 4)
        return IdentityInfo(
            resource,
            identity,
            state,
            int(fence),
            label,
            result or None,
            from_micros(int(float(expires))),
        )

    def identity_records(
        self, resource: str, identity: str, *, limit: int = RECENT_EFFECTS
    ) -> IdentityRecords:
        resource, identity, limit = self._records_args(resource, identity, limit)
        shard = self.shard_of(resource)
        ids_exp, ckpt_key, ledger, ledger_exp = self._keys(
            shard, "ids_exp", "ckpt", "ledger", "ledger_exp"
        )
        member = f"{resource}|{identity}"
        # Names follow the resource rule (no * ? [ ] or backslash), so the pattern matches
        # only this identity's entries; the fields are compared exactly below all the same.
        pattern = f"{member}|*"
        with self._run("identity records read of %r", resource):
            seconds, micros = self.client.time()
            now = int(seconds) * 1_000_000 + int(micros)
            ckpt_exp = self.client.zscore(ids_exp, member)
            ckpt = self.client.hget(ckpt_key, member) if (ckpt_exp or 0) > now else None
            entries = {
                _text(field)[len(member) + 1 :]: _text(value)
                for field, value in self.client.hscan_iter(ledger, match=pattern, count=1000)
                if _text(field).startswith(pattern[:-1])
            }
            pipe = self.client.pipeline(transaction=False)
            for key in entries:
                pipe.zscore(ledger_exp, f"{member}|{key}")
            expiries = pipe.execute() if entries else []
        effects = []
        for (key, value), expires in zip(entries.items(), expiries, strict=True):
            if expires is None or expires <= now:
                continue
            state, fence, _token, receipt = value.split("\n", 3)
            effects.append(
                EffectRecord(key, state, int(fence), receipt or None, from_micros(int(expires)))
            )
        effects.sort(key=lambda e: (e.expires_at, e.key), reverse=True)
        if ckpt is None:
            return IdentityRecords(None, None, effects[:limit])
        fence, data = _text(ckpt).split("\n", 1)
        return IdentityRecords(data, int(fence), effects[:limit])

    def get(self, resource: str) -> LeaseInfo | None:
        validate_resource(resource)
        with self._run("get of %r", resource):
            reply = self._get(keys=self._keys(self.shard_of(resource), "leases"), args=[resource])
        now, record = reply[0], reply[1] if len(reply) > 1 else None
        return None if record is None else self._info(resource, record, now)

    def highest_fence(self, resource: str) -> int | None:
        fences = self._fences_key(resource)
        with self._run("fence read of %r", resource):
            found = self.client.hget(fences, resource)
        return None if found is None else int(found)

    def list(
        self,
        *,
        prefix: str = "",
        expired_only: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> LeasePage:
        limit = self._list_args(prefix, limit)
        after = decode_cursor(cursor)
        args = [
            "1" if expired_only else "0",
            "" if after is None else str(after[0]),
            "" if after is None else after[1],
            prefix,
            limit,
        ]
        # One call over every shard; on a cluster one per shard (a slot each), merged below.
        calls = [range(self.shards)] if not self.cluster else [[s] for s in range(self.shards)]
        now = 0
        more = False
        found: list[tuple[int, str, Any]] = []  # (expires_us, resource, record)
        for shards in calls:
            keys: list[str] = []
            for shard in shards:
                keys += self._keys(shard, "leases", "expiry")
            with self._run("list"):
                reply = self._list(keys=keys, args=args)
            now = max(now, int(reply[0]))
            more = more or bool(int(reply[1]))
            for i in range(2, len(reply), 2):
                if reply[i + 1]:  # an index entry whose record is gone (a racing release)
                    found.append((self._parse(reply[i + 1])[3], _text(reply[i]), reply[i + 1]))
        if len(calls) > 1:  # merge the shards' pages in (expiry, resource) order
            found.sort(key=lambda entry: (entry[0], entry[1]))
            more = more or len(found) > limit
            found = found[:limit]
        infos = [self._info(resource, record, now) for _, resource, record in found]
        next_cursor = None
        if more and found:
            next_cursor = encode_cursor(found[-1][0], found[-1][1])
        return LeasePage(infos, next_cursor)

    def force_release(self, resource: str, *, fence: int | None = None) -> LeaseInfo | None:
        validate_resource(resource)
        fence = self._fence_arg(fence)
        keys = self._keys(self.shard_of(resource), "leases", "expiry", "fences")
        with self._run("force_release of %r", resource):
            reply = self._force_release(keys=keys, args=[resource, "" if fence is None else fence])
        now, record = reply[0], reply[1] if len(reply) > 1 else None
        if len(reply) > 3 and reply[3]:  # the fence named is not the lease's: it changed hands
            assert fence is not None
            raise changed_hands(resource, fence, self._info(resource, reply[3], now))
        if not record:
            return None
        return log_force_release(self._info(resource, record, now), log)

    def wake_due(
        self, *, resources: Sequence[str] | None = None, limit: int = DEFAULT_WAKE_DUE_LIMIT
    ) -> builtins.list[DueWake]:
        names, limit = self._wake_due_args(resources, limit)
        grace = max(1, round(self.handoff_grace * 1e6))
        kinds = ("leases", "waits", "wpay", "waits_exp")
        calls: builtins.list[tuple[builtins.list[str], builtins.list[Any]]] = []
        if names is None:
            # Every shard in one call; on a cluster one per shard (a slot each).
            groups = [range(self.shards)] if not self.cluster else [[s] for s in range(self.shards)]
            for shards in groups:
                keys: builtins.list[str] = []
                for shard in shards:
                    keys += self._keys(shard, *kinds)
                calls.append((keys, [grace, limit]))
        else:
            by_shard: dict[int, builtins.list[str]] = {}
            for resource in names:
                by_shard.setdefault(self.shard_of(resource), []).append(resource)
            for shard, members in by_shard.items():
                calls.append((self._keys(shard, *kinds), [grace, limit, *members]))
        out: builtins.list[DueWake] = []
        for keys, args in calls:
            with self._run("wake_due"):
                reply = self._wake_due(keys=keys, args=args)
            for i in range(0, len(reply), 3):
                out.append(DueWake(_text(reply[i]), _text(reply[i + 1]), bool(int(reply[i + 2]))))
        return out

    def sweep_expired(self, *, limit: int = 1000) -> int:
        limit = self._sweep_args(limit)
        start, self._sweep_start = self._sweep_start, (self._sweep_start + 1) % self.shards
        order = [(start + i) % self.shards for i in range(self.shards)]
        # One call over every shard; on a cluster one per shard (a slot each) until the limit.
        calls = [order] if not self.cluster else [[s] for s in order]
        removed = 0
        for shards in calls:
            keys: builtins.list[str] = []
            for shard in shards:
                keys += self._keys(
                    shard, "ids", "ids_exp", "ckpt", "ledger", "ledger_exp", "waits", "wpay",
                    "waits_exp",
                )  # fmt: skip
            with self._run("sweep"):
                removed += int(self._sweep(keys=keys, args=[limit - removed]))
            if removed >= limit:
                break
        return removed

    # -- fence gate support (used by celery_lease.FenceGate) --------------------------------------
    def _gate_key(self, key: str) -> str:
        """The key's gate string of the earlier layout (read only: see scripts.py)."""
        return f"{self.key_prefix}gate:{key}"

    def _gate_keys(self, key: str) -> builtins.list[str]:
        """The gate script's KEYS for a validated ``key``: the gates and fences hashes of its
        shard (the resource of the same name's), and on a single server its earlier string."""
        keys = self._keys(self.shard_of(key), "gates", "fences")
        if not self.cluster:  # (on a cluster the string is in another slot: read apart)
            keys.append(self._gate_key(key))
        return keys

    def gate_admit(self, key: str, fence: int) -> tuple[bool, int]:
        """Admit ``fence`` for ``key`` if it is >= the highest admitted and >= the newest fence
        granted for ``key`` as a resource; one round trip (on a cluster two, the first time a
        key is admitted: the earlier layout's string is read from its own slot)."""
        key = validate_resource(key)
        fence = validate_fence(fence)  # (Lua compares doubles: exact up to 2**53 only)
        keys = self._gate_keys(key)
        args: list[Any] = [key, fence, ""]
        with self._run("fence gate admit of %r", key):
            reply = self._gate_admit(keys=keys, args=args)
            if int(reply[0]) == 2:
                earlier = self.client.get(self._gate_key(key))
                args[2] = "-" if earlier is None else int(earlier)
                reply = self._gate_admit(keys=keys, args=args)
        return bool(int(reply[0])), int(reply[1])

    def gate_highest(self, key: str) -> int | None:
        """The highest fence admitted for ``key`` (in either layout), or None."""
        key = validate_resource(key)
        gates = self._keys(self.shard_of(key), "gates")[0]
        with self._run("fence gate read of %r", key):
            found = [self.client.hget(gates, key), self.client.get(self._gate_key(key))]
        return max((int(value) for value in found if value is not None), default=None)

    def mark_once(self, key: str, token: str, ttl: float) -> bool:
        """Record ``key`` for ``ttl`` seconds unless a live record of another ``token`` has it:
        whether this caller holds it now (so a call repeated after a lost reply still finds
        its own). One round trip, on an entry of the identities hash of the key's shard
        (swept once expired)."""
        key = validate_resource(key)
        keys = self._keys(self.shard_of(key), "ids", "ids_exp")
        args = [f"{key}|{MARK_IDENTITY}", token, max(1, round(ttl * 1e6))]
        with self._run("mark of %r", key):
            return bool(int(self._mark_once(keys=keys, args=args)))

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
