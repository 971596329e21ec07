"""Redis Cluster: the hash-tagged layout on a real 3-master cluster (loopback, started here).

Every script touches the keys of one shard, which share a hash tag and so a slot. The calls
that span shards (a process's batched renewal, ``list()``) are split per shard on a cluster;
the negative controls show the same calls fail with a cross-slot error when they are not.
(The whole store contract also runs on the cluster: the ``redis_cluster`` store kind.)
"""

from __future__ import annotations

import random

import pytest

from celery_lease import LeaseStoreError, Owner
from tests.conftest import make_store

LONG = 30.0


@pytest.fixture
def cluster_store(request, tmp_path):
    store = make_store("redis_cluster", request, tmp_path)
    try:
        yield store
    finally:
        store.close()


def _spread(store, names, count):
    """``count`` resource names covering every shard of the store."""
    found = [f"{names}{i}" for i in range(count)]
    assert {store.shard_of(name) for name in found} == set(range(store.shards))
    return found


def test_shards_live_on_several_nodes(cluster_store):
    """The 16 shards' hash tags map to slots served by more than one primary."""
    client = cluster_store.client
    nodes = {
        client.get_node_from_key(cluster_store._keys(shard, "leases")[0]).name
        for shard in range(cluster_store.shards)
    }
    assert len(nodes) > 1, nodes
    # One shard's keys share one slot.
    for shard in range(cluster_store.shards):
        slots = {client.keyslot(key) for key in cluster_store._key_names[shard].values()}
        assert len(slots) == 1


def test_batched_renewal_across_every_shard(cluster_store, names):
    """One renew_many over leases on every shard: all renewed, losses aligned by index."""
    resources = _spread(cluster_store, names, 64)
    leases = [cluster_store.acquire(r, Owner.new(), 1.0) for r in resources]
    gone = random.Random(7).sample(range(len(leases)), 5)
    for i in gone:
        cluster_store.release(leases[i])
    results = cluster_store.renew_many(leases, LONG)
    for i, result in enumerate(results):
        if i in gone:
            assert result is not None and result.reason == "released"
        else:
            assert result is None
            assert (leases[i].expires_at - leases[i].acquired_at).total_seconds() > LONG - 1


def test_list_merges_every_shard_in_expiry_order(cluster_store, names):
    """list() pages through leases on every shard, by (expiry, name), each exactly once."""
    resources = _spread(cluster_store, names, 50)
    rng = random.Random(11)
    for resource in resources:
        cluster_store.acquire(resource, Owner.new(), 10.0 + rng.randrange(5))
    seen, cursor = [], None
    while True:
        page = cluster_store.list(prefix=names, limit=7, cursor=cursor)
        assert len(page.leases) <= 7
        seen += page.leases
        cursor = page.cursor
        if cursor is None:
            break
    assert sorted(info.resource for info in seen) == sorted(resources)
    order = [(info.expires_at, info.resource) for info in seen]
    assert order == sorted(order)


def test_negative_control_unsplit_calls_cross_slots(cluster_store, names):
    """Without the per-shard split, the same calls fail on a cluster (cross-slot)."""
    resources = _spread(cluster_store, names, 40)
    leases = [cluster_store.acquire(r, Owner.new(), LONG) for r in resources]
    cluster_store.cluster = False  # the layout alone, as a single-node store would call it
    try:
        with pytest.raises(LeaseStoreError, match=r"(?i)slot"):
            cluster_store.renew_many(leases, LONG)
        with pytest.raises(LeaseStoreError, match=r"(?i)slot"):
            cluster_store.list(prefix=names)
    finally:
        cluster_store.cluster = True
    assert all(result is None for result in cluster_store.renew_many(leases, LONG))


def test_health_check_covers_every_primary(cluster_store):
    """Each primary's configuration is checked (AOF on, noeviction: no warnings)."""
    assert cluster_store.check_health() == []
    primary = cluster_store.client.get_primaries()[1]
    cluster_store.client.config_set("maxmemory-policy", "allkeys-lru", target_nodes=primary)
    try:
        warnings = cluster_store.check_health()
        assert len(warnings) == 1 and f":{primary.port}" in warnings[0], warnings
    finally:
        cluster_store.client.config_set("maxmemory-policy", "noeviction", target_nodes=primary)


def test_a_lease_task_runs_on_a_cluster_store(redis_cluster, names):
    """lease_store_options={"cluster": True}: a task claims, runs and releases on the cluster."""
    from celery import Celery

    from celery_lease import current_lease, lease_task
    from celery_lease._app import get_store

    app = Celery("cluster_app", broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = redis_cluster.url
    app.conf.lease_store_options = {"cluster": True}
    app.conf.lease_key_prefix = names.replace("/", ":")

    @lease_task(app=app, resource="acct-{n}")
    def task(n):
        return current_lease().fence

    fences = [task.apply((n,)).get() for n in range(20)]
    assert all(isinstance(f, int) and f > 0 for f in fences)
    store = get_store(app)
    assert store.cluster and store.list().leases == []  # all released
