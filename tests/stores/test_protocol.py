"""The store protocols are the whole contract: no store capability lives outside them."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from celery_lease.stores import (
    FenceGateStore,
    LeaseStore,
    MarkOnceStore,
    ReadableFenceGateStore,
)
from celery_lease.stores.base import BaseLeaseStore

#: Public names a store class has that belong to no protocol, and why.
NOT_CONTRACT = {
    "renew",  # BaseLeaseStore's renew_many([lease]) wrapper; declared in LeaseStore
    "create_tables",  # SQL schema set-up, called by the constructor (or by hand)
    "grant_statements",  # SQL: the GRANTs a least-privilege role needs (init-schema --grant)
    "shard_of",  # Redis Cluster key placement
    "hash_tag",  # Redis Cluster key placement: a user's key in a resource's slot (fenced_hset)
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
        assert isinstance(store, MarkOnceStore)

    def test_every_public_method_is_declared_by_a_protocol(self, store):
        """warm_up and the fence-gate operations are declared, not found by hasattr."""
        declared = (
            _declared(LeaseStore) | _declared(ReadableFenceGateStore) | _declared(MarkOnceStore)
        )
        extra = _public_methods(store) - declared - NOT_CONTRACT
        assert not extra, f"{type(store).__name__} has methods outside the contract: {extra}"

    def test_the_base_store_warm_up_is_a_no_op(self):
        """A store with nothing to open inherits a warm_up that does nothing."""
        assert BaseLeaseStore.warm_up(object()) is None  # type: ignore[arg-type]


#: The names ``celery_lease.stores.redis`` / ``.sql`` held as single modules (a9e62af) that came
#: from this project. Not kept: the stdlib, typing and driver names they happened to import
#: (import those from where they live) and ``SQLLedgerMixin`` (the ledger is plain functions).
FORMER_NAMES = {
    "redis": (
        "BaseLeaseStore DEFAULT_MAX_TTL DEFAULT_RETENTION FreeList IdentityDoneError IdentityInfo "
        "Lease LeaseBusyError LeaseConfigError LeaseInfo LeaseLostError LeasePage LeaseStoreError "
        "Owner RedisLeaseStore Waiter connection_refused decode decode_cursor encode_cursor "
        "from_micros lua mask_url monotonic shielded show_value validate_resource"
    ),
    "sql": (
        "BaseLeaseStore DEFAULT_MAX_TTL DEFAULT_RETENTION FreeList IdentityDoneError Lease "
        "LeaseBusyError LeaseConfigError LeaseInfo LeaseLostError LeasePage LeaseStoreError "
        "LedgerStatements Owner SCHEMA_VERSION SQLLeaseStore Waiter check_credentials "
        "connection_refused decode decode_cursor encode_cursor from_micros mask_url monotonic "
        "recovered_from shielded stmts validate_identifier validate_resource"
    ),
}


class TestFormerModuleNames:
    @pytest.mark.parametrize("backend", sorted(FORMER_NAMES))
    def test_imports_from_the_former_single_modules_still_work(self, backend):
        """``from celery_lease.stores.<backend> import NAME`` works for each name it had."""
        module = importlib.import_module(f"celery_lease.stores.{backend}")
        missing = [name for name in FORMER_NAMES[backend].split() if not hasattr(module, name)]
        assert missing == []

    def test_the_defaults_are_the_same_objects(self):
        """A re-exported name is the library's one value, not a copy."""
        base, redis, sql = (
            importlib.import_module(f"celery_lease.stores.{name}")
            for name in ("base", "redis", "sql")
        )
        assert redis.DEFAULT_MAX_TTL == sql.DEFAULT_MAX_TTL == base.DEFAULT_MAX_TTL
        assert redis.DEFAULT_RETENTION is sql.DEFAULT_RETENTION is base.DEFAULT_RETENTION
