"""The store protocols are the whole contract: no store capability lives outside them."""

from __future__ import annotations

import inspect
from typing import Any

from celery_lease.stores import FenceGateStore, LeaseStore, ReadableFenceGateStore
from celery_lease.stores.base import BaseLeaseStore

#: Public names a store class has that belong to no protocol, and why.
NOT_CONTRACT = {
    "renew",  # BaseLeaseStore's renew_many([lease]) wrapper; declared in LeaseStore
    "create_tables",  # SQL schema set-up, called by the constructor (or by hand)
    "grant_statements",  # SQL: the GRANTs a least-privilege role needs (init-schema --grant)
    "shard_of",  # Redis Cluster key placement
}


def _declared(protocol: type) -> set[str]:
    return {name for name in dir(protocol) if not name.startswith("_")}


def _public_methods(store: Any) -> set[str]:
    return {
        name
        for name, value in inspect.getmembers(type(store))
        if not name.startswith("_") and callable(value) and not inspect.isclass(value)
    }


class TestProtocol:
    def test_every_store_is_a_lease_store_and_a_fence_gate_store(self, store):
        """Each shipped store satisfies both protocols, so nothing probes for a method."""
        assert isinstance(store, LeaseStore)
        assert isinstance(store, FenceGateStore)
        assert isinstance(store, ReadableFenceGateStore)

    def test_every_public_method_is_declared_by_a_protocol(self, store):
        """warm_up and the fence-gate operations are declared, not found by hasattr."""
        declared = _declared(LeaseStore) | _declared(ReadableFenceGateStore)
        extra = _public_methods(store) - declared - NOT_CONTRACT
        assert not extra, f"{type(store).__name__} has methods outside the contract: {extra}"

    def test_the_base_store_warm_up_is_a_no_op(self):
        """A store with nothing to open inherits a warm_up that does nothing."""
        assert BaseLeaseStore.warm_up(object()) is None  # type: ignore[arg-type]
