"""Ownership negative tests: every mutation by a non-owner is refused and changes nothing.

For each store (Redis, PostgreSQL, SQLite) a lease holder ``A`` builds some state on its
resource under identity ``job-1``: a done effect, an open effect intent, a checkpoint, a fenced
resource write (``fenced_hset`` / ``fenced_update``) and a FenceGate admission. Then, under one
fault at a time, every operation is tried and must be refused -- the right error or a False
answer -- with the whole store (every key under its prefix, every row of its tables, the fenced
resource) byte-identical before and after:

* wrong owner: another owner token with A's fence, while A holds the lease;
* forged fence: A's token with a fence that was never issued (A's + 1000);
* expired owner: A after its lease expired, nobody having claimed it since;
* superseded fence: A after B took the expired lease over (same identity, so B also took A's
  open intent over), checkpointed and wrote the resource with its newer fence.

Also at the boundary of trust and of the broker:

* an HTTP tool gateway on loopback (WSGI, ``check_fencing_token`` with a ``FenceSigner``):
  a forged higher fence, a tampered token, an unsigned one, one for another resource, an expired
  one (403) and a stale owner's genuine token (409) change nothing; the negative control -- the
  same gateway without a signer -- admits a forged fence and locks the real owner out;
* a replayed old message: the exact bytes of a task message, pushed onto the queue again after
  the work completed, are consumed as a duplicate -- SUCCESS with the recorded result -- and the
  store and the sink stay byte-identical.

By design and documented, not refused (so not in the table): an expired owner that nobody
replaced may release its own lease and record its identity's outcome, and ``effect_done`` does
not need a live lease (the effect did happen).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
import redis
import sqlalchemy as sa

from celery_lease import (
    FenceGate,
    InvalidFenceTokenError,
    Lease,
    LeaseBusyError,
    LeaseLostError,
    Owner,
    StaleFenceError,
)
from celery_lease.fencing import FenceSigner, check_fencing_token, fenced_hset, fenced_update
from tests.conftest import make_store, unique
from tests.integration.harness import wait_queue_idle, wait_success, worker_store
from tests.tooling.servers import wait_for

pytestmark = [pytest.mark.integration]

IDENTITY = "job-1"
FAULTS = ("wrong_owner", "forged_fence", "expired", "superseded")


# -- the store's whole state --------------------------------------------------------------------
class World:
    """One store, one resource with state built by A, and a byte-level snapshot of it all."""

    def __init__(self, store: Any, kind: str) -> None:
        self.store = store
        self.kind = kind
        self.resource = unique("res")
        self.gate = FenceGate(store=store)
        if kind == "redis":
            self.client: redis.Redis = store.client
            self.target = f"{store.key_prefix}res:{self.resource}"
        else:
            meta = sa.MetaData()
            self.accounts = sa.Table(
                f"{unique('acct')}",
                meta,
                sa.Column("id", sa.Integer, primary_key=True),
                sa.Column("balance", sa.Integer, nullable=False),
                sa.Column("fence", sa.BigInteger, nullable=True),
            )
            meta.create_all(store.engine)
            with store.engine.begin() as conn:
                conn.execute(sa.insert(self.accounts).values(id=1, balance=100, fence=None))

    def snapshot(self) -> list[Any]:
        """Every key under the store's prefix (DUMP bytes and TTL), or every row of its tables."""
        if self.kind == "redis":
            keys = sorted(self.client.scan_iter(match=f"{self.store.key_prefix}*", count=1000))
            return [(k, self.client.dump(k), self.client.pttl(k)) for k in keys]
        rows = []
        with self.store.engine.connect() as conn:
            for table in [*self.store.tables.values(), self.accounts]:
                order = list(table.primary_key.columns) or list(table.columns)
                rows.append((table.name, conn.execute(sa.select(table).order_by(*order)).all()))
        return rows

    def write(self, fence: int | Lease, value: int) -> None:
        """The fenced resource write."""
        if self.kind == "redis":
            fenced_hset(self.client, self.target, {"balance": value}, fence)
            return
        with self.store.engine.begin() as conn:
            fenced_update(conn, self.accounts, self.accounts.c.id == 1, {"balance": value}, fence)

    def build(self, ttl: float) -> Lease:
        """A's state: effect e1 done, e2 begun, a checkpoint, a resource write, a gate admit."""
        lease = self.store.acquire(self.resource, Owner.new("owner-A"), ttl, identity=IDENTITY)
        assert self.store.effect_begin(lease, "e1") == ("new", None, None)
        assert self.store.effect_done(lease, "e1", '{"receipt": 1}')
        assert self.store.effect_begin(lease, "e2") == ("new", None, None)
        self.store.checkpoint(lease, '{"step": "A"}')
        self.write(lease, 1)
        self.gate.admit(self.resource, lease)
        return lease

    def wait_expired(self) -> None:
        wait_for(
            lambda: (info := self.store.get(self.resource)) is not None and info.expired,
            10,
            "the lease to expire",
            interval=0.01,
        )


def _as(lease: Lease, *, owner: Owner | None = None, fence: int | None = None) -> Lease:
    """A lease handle that claims to be ``lease`` with another owner or fence."""
    return Lease(
        resource=lease.resource,
        owner=owner or lease.owner,
        fence=lease.fence if fence is None else fence,
        acquired_at=lease.acquired_at,
        expires_at=lease.expires_at,
        ttl=lease.ttl,
        sent_monotonic=time.monotonic(),
        store=lease.store,
        identity=lease.identity,
    )


def operations(world: World, lease: Lease, fault: str) -> dict[str, Callable[[], Any]]:
    """The mutations to try as ``lease`` under ``fault``; each must raise or return False."""
    store = world.store
    ops: dict[str, Callable[[], Any]] = {
        "renew": lambda: store.renew(lease, 30.0),
        "verify": lambda: store.verify(lease),
        "effect_begin": lambda: store.effect_begin(lease, "e3"),
        "checkpoint": lambda: store.checkpoint(lease, '{"step": "intruder"}'),
    }
    if fault != "expired":  # an expired, unreplaced owner may release and record (by design)
        ops["release"] = lambda: store.release(lease)
    if fault in ("forged_fence", "superseded"):  # (wrong owner: a test of its own below)
        ops.update(ledger_commits(world, lease))
    if fault in ("wrong_owner", "superseded"):
        ops["claim"] = lambda: store.acquire(
            world.resource, Owner.new("intruder"), 5.0, identity="job-2"
        )
    if fault == "superseded":
        ops["fenced_write"] = lambda: world.write(lease, 666)
        ops["gate_admit"] = lambda: world.gate.admit(world.resource, lease)
    return ops


def ledger_commits(world: World, lease: Lease) -> dict[str, Callable[[], Any]]:
    """The two ledger commits: an identity's outcome (with release) and an effect's done."""
    store = world.store
    return {
        "release_done": lambda: store.release(lease, outcome="done", result='"forged"'),
        "effect_done": lambda: store.effect_done(lease, "e2", '{"receipt": "forged"}'),
    }


EXPECTED = {
    "renew": LeaseLostError,
    "verify": LeaseLostError,
    "effect_begin": LeaseLostError,
    "checkpoint": LeaseLostError,
    "release": False,
    "release_done": False,
    "effect_done": False,
    "claim": LeaseBusyError,
    "fenced_write": StaleFenceError,
    "gate_admit": StaleFenceError,
}


@pytest.fixture(params=["redis", "postgres", "sqlite"])
def world(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[World]:
    store = make_store(request.param, request, tmp_path)
    try:
        yield World(store, request.param)
    finally:
        store.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_every_mutation_under_a_fault_is_refused_and_changes_nothing(world, fault):
    """The ownership table for one fault: error type or False, and the store byte-identical."""
    a = world.build(ttl=30.0 if fault in ("wrong_owner", "forged_fence") else 0.3)
    if fault == "wrong_owner":
        actor = _as(a, owner=Owner.new("intruder"))
    elif fault == "forged_fence":
        actor = _as(a, fence=a.fence + 1000)
    else:
        world.wait_expired()
        actor = a
        if fault == "superseded":
            b = world.store.acquire(world.resource, Owner.new("owner-B"), 30.0, identity=IDENTITY)
            assert b.recovered and b.previous_fence == a.fence
            assert world.store.effect_begin(b, "e2") == ("intent", a.fence, None)
            world.store.checkpoint(b, '{"step": "B"}')
            world.write(b, 2)
            world.gate.admit(world.resource, b)
    refused = []
    for name, op in operations(world, actor, fault).items():
        before = world.snapshot()
        expected = EXPECTED[name]
        if isinstance(expected, bool):
            assert op() is expected, f"{fault}: {name} was not refused"
        else:
            with pytest.raises(expected):
                op()
        assert world.snapshot() == before, f"{fault}: a refused {name} changed the store"
        refused.append(name)
    print(f"store={world.kind} fault={fault}: refused, store unchanged: {', '.join(refused)}")
    assert len(refused) >= 4


@pytest.mark.parametrize("op", ["release_done", "effect_done"])
def test_ledger_commits_by_a_wrong_owner_are_refused(world, op):
    """A wrong owner (same fence) cannot record the identity's outcome or an effect done.

    Found by this table: both commits compared only the fence, so a caller with another owner
    token and the owner's fence (a number, not a secret) recorded the identity done with a
    forged result while the owner still held the lease (``release`` answering False all the
    same), or completed the owner's open intent with its own receipt. The stores now compare
    the owner token too.
    """
    a = world.build(ttl=30.0)
    intruder = _as(a, owner=Owner.new("intruder"))
    before = world.snapshot()
    answer = ledger_commits(world, intruder)[op]()
    changed = world.snapshot() != before
    info = world.store.identity_get(world.resource, IDENTITY)
    print(
        f"store={world.kind}: {op} by a wrong owner answered {answer}; store changed: "
        f"{changed}; identity now {info.state if info else None} "
        f"result {info.result if info else None} while A still holds the lease"
    )
    assert answer is False
    assert not changed


# -- an HTTP tool gateway --------------------------------------------------------------------------
class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return


class Gateway:
    """A WSGI tool gateway on 127.0.0.1 that admits a request's Fencing-Token, then acts."""

    def __init__(self, gate: FenceGate, resource: str, signer: FenceSigner | None) -> None:
        self.gate = gate
        self.resource = resource
        self.signer = signer
        self.actions: list[int] = []
        self.server = make_server("127.0.0.1", 0, self.app, handler_class=_Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}/act"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def app(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        try:
            fence = check_fencing_token(
                environ, self.gate, signer=self.signer, resource=self.resource
            )
        except StaleFenceError:
            start_response("409 Conflict", [("Content-Type", "text/plain")])
            return [b"stale"]
        except InvalidFenceTokenError:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"invalid"]
        self.actions.append(fence)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done"]

    def call(self, token: str | None) -> int:
        headers = {} if token is None else {"Fencing-Token": token}
        request = urllib.request.Request(self.url, data=b"{}", headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


SECRET = "s" * 40
OTHER_SECRET = "t" * 40


def test_the_signed_gateway_refuses_forged_tampered_and_stale_tokens(world):
    """Each bad token: 403/409, no action, gate and store byte-identical."""
    signer = FenceSigner({"k1": SECRET}, active="k1")
    gateway = Gateway(world.gate, world.resource, signer)
    try:
        a = world.build(ttl=0.3)
        genuine = signer.sign(world.resource, a.fence)
        assert gateway.call(genuine) == 200
        world.wait_expired()
        b = world.store.acquire(world.resource, Owner.new("owner-B"), 30.0, identity=IDENTITY)
        assert gateway.call(signer.sign(world.resource, b.fence)) == 200
        parts = genuine.split(".")
        tampered = ".".join([*parts[:3], str(b.fence + 10**6), *parts[4:]])
        bad = {
            "forged higher fence, unknown key": (
                FenceSigner({"k1": OTHER_SECRET}, active="k1").sign(
                    world.resource, b.fence + 10**6
                ),
                403,
            ),
            "tampered fence": (tampered, 403),
            "unsigned": (f"{world.resource};{b.fence + 10**6}", 403),
            "missing": (None, 403),
            "another resource": (signer.sign("other-resource", b.fence + 1), 403),
            "expired": (signer.sign(world.resource, b.fence + 1, expires_in=-5), 403),
            "stale owner's genuine token": (genuine, 409),
        }
        for what, (token, status) in bad.items():
            before, actions = world.snapshot(), list(gateway.actions)
            assert gateway.call(token) == status, what
            assert world.snapshot() == before, f"{what}: the store changed"
            assert gateway.actions == actions, f"{what}: the gateway acted"
        assert world.gate.highest(world.resource) == b.fence
        assert gateway.actions == [a.fence, b.fence]
        print(f"store={world.kind}: refused {', '.join(bad)}")
    finally:
        gateway.close()


def test_negative_control_an_unsigned_gateway_lets_a_forged_fence_lock_the_owner_out(world):
    """Without a signer a forged higher fence is admitted, and the real owner is refused."""
    gateway = Gateway(world.gate, world.resource, None)
    try:
        a = world.build(ttl=30.0)
        before = world.snapshot()
        assert gateway.call(f"{world.resource};{a.fence + 10**6}") == 200  # forged: admitted
        assert world.snapshot() != before
        assert gateway.call(f"{world.resource};{a.fence}") == 409  # the real owner: locked out
    finally:
        gateway.close()


# -- a replayed old message ------------------------------------------------------------------------
def test_a_replayed_old_message_is_a_duplicate_and_changes_nothing(
    it_app, make_sink, start_worker, store_env, events, coord, queue, request
):
    """The same message bytes pushed again after completion: SUCCESS, same result, no change."""
    env = {**store_env("redis"), "CL_SINK_NAME": unique("sink")}
    sink = make_sink(env)
    store = worker_store(env)
    request.addfinalizer(store.close)
    world = World(store, "redis")
    broker = redis.Redis.from_url(it_app.app.conf.broker_url)
    result = it_app.eo.dup_effect.apply_async(
        (0, 0.0), queue=queue, headers={"idempotency_key": "replay-0"}
    )
    raw = broker.lrange(queue, 0, -1)  # the message as published, before any worker took it
    assert len(raw) == 1
    start_worker(env, queue=queue)
    first = wait_success(it_app.app, [result.id], 30)[result.id]["result"]
    wait_queue_idle(broker, queue, timeout=30, settle=0.5)
    state = (world.snapshot(), coord.dump(sink.key("log")), coord.dump(sink.key("count")))
    deliveries = events.key_for("deliveries")
    assert int(coord.hget(deliveries, "total")) == 1
    for copy in (2, 3):  # replayed twice, after the work completed
        broker.lpush(queue, raw[0])
        wait_for(lambda c=copy: int(coord.hget(deliveries, "total")) == c, 30, "the replay")
        wait_queue_idle(broker, queue, timeout=30, settle=0.5)
        after = (world.snapshot(), coord.dump(sink.key("log")), coord.dump(sink.key("count")))
        assert after == state, "the replayed message changed the store or the sink"
        meta = wait_success(it_app.app, [result.id], 30)[result.id]
        assert meta["result"] == first
    info = store.identity_get("dup-0", "replay-0")
    assert info is not None and info.state == "done"
    assert sink.counts() == {"replay-0": 1}
    print(f"replayed twice: SUCCESS {first}, store ({len(state[0])} keys) and sink unchanged")
