"""The client side of an HTTP gate, against a real WSGI gateway on 127.0.0.1, with requests and
with httpx (sync and async).

The gateway is the documented one: ``check_fencing_token`` through a gate on the lease store,
409 for a stale fence, 403 for a bad token. Leases come from a real lease task (eager, its store
a SQLite file the gateway's gate shares) or from the store directly. Each refusal has a negative
control: the same call made without the helper's check gets the same status back and the body
goes on acting (and the task ends in SUCCESS).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from celery import Celery

from celery_lease import (
    FenceGate,
    InvalidFenceTokenError,
    LeaseConfigError,
    LeaseError,
    LeaseLostError,
    Owner,
    StaleFenceError,
    current_lease,
    lease_task,
)
from celery_lease._app import get_store
from celery_lease.fencing import (
    FENCING_HEADER,
    FenceSigner,
    check_fencing_token,
    fenced_request,
    fenced_request_async,
    fencing_headers,
    raise_for_fence,
)
from tests.conftest import unique

SECRET = b"k" * 32
SIGNER = FenceSigner({"k1": SECRET}, active="k1")


@pytest.fixture(params=["requests", "httpx"])
def client(request) -> Iterator[Any]:
    """A client of each library (skipped when it is not installed)."""
    library = pytest.importorskip(request.param)
    made = library.Session() if request.param == "requests" else library.Client()
    with made:
        yield made


@pytest.fixture
def app(tmp_path) -> Celery:
    """An eager app whose leases live in a SQLite file (the gateway's gate shares it)."""
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
    app.conf.lease_store_url = f"sqlite:///{tmp_path}/leases.db"
    app.conf.lease_ttl = 30
    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def gateway(app) -> Iterator[SimpleNamespace]:
    """A tool gateway on loopback checking tokens through a gate on the app's lease store.

    ``signed`` (a mutable flag) makes it require signed tokens; ``actions`` lists the fences of
    the calls it acted on, ``tokens`` every header it received. ``json_409`` makes a 409's body
    ``{"highest": N}`` (the newer fence; ``bad_highest`` replaces N), else plain text.
    """
    gate = FenceGate(store=get_store(app))
    state = SimpleNamespace(
        actions=[], tokens=[], signed=True, url="", json_409=False, bad_highest=None
    )

    def wsgi(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        state.tokens.append(environ.get("HTTP_FENCING_TOKEN"))
        try:
            fence = check_fencing_token(environ, gate, signer=SIGNER if state.signed else None)
        except StaleFenceError as exc:
            if state.json_409:
                highest = exc.highest if state.bad_highest is None else state.bad_highest
                start_response("409 Conflict", [("Content-Type", "application/json")])
                return [json.dumps({"highest": highest}).encode()]
            start_response("409 Conflict", [("Content-Type", "text/plain")])
            return [str(exc).encode()]
        except InvalidFenceTokenError as exc:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [str(exc).encode()]
        state.actions.append(fence)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"fence": fence}).encode()]

    server = make_server("127.0.0.1", 0, wsgi, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_port}/act"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _take_over(app, resource: str) -> Any:
    """A newer owner claims ``resource`` (the running holder is evicted, as after a freeze)."""
    store = get_store(app)
    store.force_release(resource)
    return store.acquire(resource, Owner.new("newer"), 30)


class TestFencedRequest:
    def test_the_current_lease_is_sent_signed_and_the_gateway_acts(self, app, gateway, client):
        """Inside a lease task: the current lease's fence arrives signed, the call passes."""

        @lease_task(app=app, resource="browser/account-{n}", name=unique("act"))
        def act(n: int) -> int:
            response = fenced_request(client, "POST", gateway.url, json={"n": n}, signer=SIGNER)
            assert response.status_code == 200
            return current_lease().fence

        result = act.apply((1,))
        assert result.state == "SUCCESS", result.result
        assert gateway.actions == [result.result]
        assert SIGNER.verify(gateway.tokens[0]) == ("browser/account-1", result.result)

    def test_a_409_stops_the_body_and_sends_the_task_to_retry(self, app, gateway, client):
        """A newer owner claimed (and has not called yet): the gateway's gate refuses the old
        fence, the helper raises StaleFenceError and the body stops; on a worker the task goes
        to RETRY with the lease lost (stale_fence) and its re-run, once the newer owner is
        done, acts with a newer fence."""
        from celery.contrib.testing.worker import start_worker

        acted: list[int] = []
        newer: list[Any] = []
        app.conf.lease_lost_retry_delay = 0.1

        @lease_task(app=app, resource="browser/account-{n}", name=unique("act"))
        def act(n: int) -> None:
            if not newer:  # the first run only: a newer owner claims under it
                newer.append(_take_over(app, current_lease().resource))
            fenced_request(client, "POST", gateway.url, json={}, signer=SIGNER)
            acted.append(current_lease().fence)

        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = act.delay(2)
            deadline = time.monotonic() + 30
            while result.state != "RETRY":
                assert time.monotonic() < deadline, result.state
                time.sleep(0.01)
            assert isinstance(result.result, LeaseLostError)
            assert result.result.reason == "stale_fence"
            assert acted == [] and gateway.actions == []  # the body stopped before acting
            get_store(app).release(newer[0])  # the newer owner is done: the re-run goes on
            result.get(timeout=30)
        assert result.state == "SUCCESS"
        assert acted == gateway.actions and acted[0] > newer[0].fence

    def test_eager_the_run_ends_with_the_lease_lost(self, app, gateway, client):
        """Eager (no retries there): the run ends with LeaseLostError(stale_fence), not acting."""
        after: list[str] = []

        @lease_task(app=app, resource="browser/account-{n}", name=unique("act"))
        def act(n: int) -> None:
            _take_over(app, current_lease().resource)
            fenced_request(client, "POST", gateway.url, json={}, signer=SIGNER)
            after.append("acted on")  # never reached

        result = act.apply((5,))
        assert isinstance(result.result, LeaseLostError) and result.result.reason == "stale_fence"
        assert after == [] and gateway.actions == []

    @pytest.mark.parametrize("body", ["json", "text"])
    def test_the_stale_fence_line_names_the_newer_fence_after_its_owner_released(
        self, app, gateway, client, caplog, body
    ):
        """The newer owner claimed, acted and released before the old one's call: its 409
        still names the newer fence in the stale_fence line, from the answer's body
        ``{"highest": N}`` or else from the store's newest granted fence (nobody holds the
        lease to read it from)."""
        gateway.json_409 = body == "json"
        newer: list[Any] = []

        @lease_task(app=app, resource="browser/account-{n}", name=unique("act"))
        def act(n: int) -> None:
            newer.append(_take_over(app, current_lease().resource))
            gateway_call = fencing_headers(newer[0], signer=SIGNER)  # the newer owner acts
            assert client.request("POST", gateway.url, headers=gateway_call).status_code == 200
            get_store(app).release(newer[0])  # ... and is done
            fenced_request(client, "POST", gateway.url, json={}, signer=SIGNER)

        with caplog.at_level("WARNING", logger="celery_lease"):
            result = act.apply((7,))
        assert isinstance(result.result, LeaseLostError)
        assert get_store(app).get("browser/account-7") is None  # nobody holds it now
        lines = [r.getMessage() for r in caplog.records if "] stale_fence: " in r.getMessage()]
        assert len(lines) == 1, lines
        assert f"newer_fence={newer[0].fence}" in lines[0]

    def test_a_newer_owner_whose_lease_expired_is_not_named_the_holder(self):
        """A 409 with no fence in its body, read against the store: a newer owner whose lease
        ran out too gives its fence but no holder (it holds nothing); while it is live (the
        control), both."""
        from celery_lease._outcomes import newer_holder as _newer_holder
        from celery_lease.stores import MemoryLeaseStore
        from tests.tooling.servers import wait_for

        store = MemoryLeaseStore()
        old = store.acquire("doc/12", Owner.new("old"), 0.05)
        wait_for(lambda: store.get("doc/12").expired, 5, "the old lease to expire")
        newer = store.acquire("doc/12", Owner.new("newer"), 0.05)
        refused = StaleFenceError("409", "doc/12", old.fence, None)
        assert _newer_holder(old, refused) == (newer.fence, "newer")
        wait_for(lambda: store.get("doc/12").expired, 5, "the newer lease to expire")
        assert _newer_holder(old, refused) == (newer.fence, None)

    def test_a_409_body_names_the_newer_fence_only_when_it_is_a_fence(self, app, gateway, client):
        """``{"highest": N}`` sets StaleFenceError.highest; a string, a bool, 0 or a number past
        any fence is ignored (highest None), as is a body that is no JSON."""
        lease = get_store(app).acquire("doc/11", Owner.new(), 30)
        newer = _take_over(app, "doc/11")
        assert (
            client.request(
                "POST", gateway.url, headers=fencing_headers(newer, signer=SIGNER)
            ).status_code
            == 200
        )
        gateway.json_409 = True
        with pytest.raises(StaleFenceError) as caught:
            fenced_request(client, "POST", gateway.url, lease=lease, signer=SIGNER)
        assert caught.value.highest == newer.fence
        assert f"it accepted fence {newer.fence}" in str(caught.value)
        for bad in ("12", True, 0, 2**63):
            gateway.bad_highest = bad
            with pytest.raises(StaleFenceError) as caught:
                fenced_request(client, "POST", gateway.url, lease=lease, signer=SIGNER)
            assert caught.value.highest is None, bad
        gateway.json_409 = False
        with pytest.raises(StaleFenceError) as caught:
            fenced_request(client, "POST", gateway.url, lease=lease, signer=SIGNER)
        assert caught.value.highest is None

    def test_negative_control_without_the_check_the_body_goes_on(self, app, gateway, client):
        """The same call with the headers alone: the gateway answers 409 too, but nothing
        stops the body, which goes on acting, and the task ends in SUCCESS."""
        after: list[int] = []

        @lease_task(app=app, resource="browser/account-{n}", name=unique("act"))
        def act(n: int) -> None:
            _take_over(app, current_lease().resource)
            headers = fencing_headers(signer=SIGNER, expires_in=60)
            response = client.request("POST", gateway.url, json={}, headers=headers)
            after.append(response.status_code)

        result = act.apply((3,))
        assert result.state == "SUCCESS"
        assert after == [409]

    def test_a_403_raises_invalid_fence_token(self, app, gateway, client):
        """A token signed with a key the gateway does not know: InvalidFenceTokenError (the
        task fails: a retry would not fix a wrong key), and the gateway did not act."""
        stranger = FenceSigner({"k1": b"x" * 32}, active="k1")

        @lease_task(app=app, resource="browser/account-{n}", name=unique("act"))
        def act(n: int) -> None:
            fenced_request(client, "POST", gateway.url, json={}, signer=stranger)

        result = act.apply((4,))
        assert result.state == "FAILURE"
        assert isinstance(result.result, InvalidFenceTokenError)
        assert "403" in str(result.result) and "browser/account-4" in str(result.result)
        assert gateway.actions == []

    def test_a_given_lease_outside_a_task_and_the_errors_fields(self, app, gateway, client):
        """lease= works outside a task; the StaleFenceError names the resource and fence and
        survives pickling and cls(*args) (Celery rebuilds it from the result backend)."""
        import pickle

        store = get_store(app)
        old = store.acquire("doc/1", Owner.new("old"), 30)
        assert (
            fenced_request(client, "GET", gateway.url, lease=old, signer=SIGNER).status_code == 200
        )
        _take_over(app, "doc/1")
        with pytest.raises(StaleFenceError) as caught:
            fenced_request(client, "GET", gateway.url + "?api_key=s3cret", lease=old, signer=SIGNER)
        error = caught.value
        assert (error.key, error.fence) == ("doc/1", old.fence)
        assert "409" in str(error) and "s3cret" not in str(error)
        for copy in (type(error)(*error.args), pickle.loads(pickle.dumps(error))):
            assert (type(copy), copy.args) == (StaleFenceError, error.args)
        with pytest.raises(LeaseError, match="no lease is held here"):
            fenced_request(client, "GET", gateway.url)

    def test_unsigned_tokens_and_the_callers_headers(self, app, gateway, client):
        """Without a signer the plain token goes; the caller's own headers go too, and a
        Fencing-Token among them is replaced by the lease's."""
        gateway.signed = False
        lease = get_store(app).acquire("doc/2", Owner.new(), 30)
        fenced_request(
            client,
            "POST",
            gateway.url,
            lease=lease,
            headers={"X-Trace": "1", "fencing-token": "doc/2;999999"},
        )
        assert gateway.tokens == [f"doc/2;{lease.fence}"]
        assert gateway.actions == [lease.fence]


class TestTokenExpiry:
    def test_the_lifetime_of_a_signed_token_is_settable(self, app, gateway, client):
        """expires_in sets the expiry written in the token (default 60 s); None writes none."""
        lease = get_store(app).acquire("doc/3", Owner.new(), 30)
        before = time.time()
        for expires_in, expected in ((None, 60.0), (5, 5.0), (3600, 3600.0)):
            options = {} if expires_in is None else {"expires_in": expires_in}
            fenced_request(client, "GET", gateway.url, lease=lease, signer=SIGNER, **options)
            expiry = int(gateway.tokens[-1].split(".")[4])
            assert before + expected - 1 <= expiry <= time.time() + expected
        fenced_request(client, "GET", gateway.url, lease=lease, signer=SIGNER, expires_in=None)
        assert gateway.tokens[-1].split(".")[4] == "0"  # never expires
        assert len(gateway.actions) == 4

    def test_an_expired_token_is_refused_with_403(self, app, gateway, client):
        """A token whose lifetime ended (here: before it was sent) is refused by the gateway
        and raises InvalidFenceTokenError; the gateway did not act."""
        lease = get_store(app).acquire("doc/4", Owner.new(), 30)
        expired = {FENCING_HEADER: SIGNER.sign(lease.resource, lease.fence, expires_in=-5)}
        with pytest.raises(InvalidFenceTokenError, match="expired"):
            raise_for_fence(client.request("GET", gateway.url, headers=expired), lease)
        assert gateway.actions == []
        token = gateway.tokens[-1]
        with pytest.raises(InvalidFenceTokenError, match="expired"):
            SIGNER.verify(token)

    def test_a_lifetime_that_ended_long_ago_is_not_read_as_no_expiry(self):
        """An expiry is never written as 0 (which means "never expires")."""
        token = SIGNER.sign("doc/9", 1, expires_in=-(10**10))
        assert token.split(".")[4] == "1"
        with pytest.raises(InvalidFenceTokenError, match="expired"):
            SIGNER.verify(token)

    def test_a_bad_lifetime_is_a_config_error(self, app, client, gateway):
        lease = get_store(app).acquire("doc/5", Owner.new(), 30)
        with pytest.raises(LeaseConfigError, match="expires_in"):
            fenced_request(client, "GET", gateway.url, lease=lease, signer=SIGNER, expires_in="60")
        assert gateway.tokens == []

    @pytest.mark.parametrize(
        ("value", "shown"),
        [
            (float("inf"), "inf"),
            (float("nan"), "nan"),
            (1e20, "1e+20"),
            (-5, "-5"),
            (0, "0:"),
            (-0.5, "-0.5"),
        ],
    )
    def test_a_lifetime_no_token_can_carry_is_refused_naming_it(
        self, app, client, gateway, value, shown
    ):
        """inf and nan (before: a bare OverflowError / ValueError), one past what a token's
        expiry holds, and one that ended before the token is sent (before: sent anyway, and
        refused by every gateway): a LeaseConfigError naming the value, and nothing sent."""
        lease = get_store(app).acquire(unique("doc/"), Owner.new(), 30)
        for call in (
            lambda: fenced_request(
                client, "GET", gateway.url, lease=lease, signer=SIGNER, expires_in=value
            ),
            lambda: fencing_headers(lease, signer=SIGNER, expires_in=value),
            lambda: fencing_headers(lease, expires_in=value),
        ):
            with pytest.raises(LeaseConfigError, match=re.escape(f"expires_in={shown}")):
                call()
        assert gateway.tokens == []

    def test_a_signer_refuses_a_lifetime_that_is_not_finite(self):
        """FenceSigner.sign may be asked for an expired token (tests do), never a non-finite
        or out-of-range one."""
        for value in (float("inf"), float("nan"), 1e20):
            with pytest.raises(LeaseConfigError, match="expires_in="):
                SIGNER.sign("doc/9", 1, expires_in=value)
        assert SIGNER.sign("doc/9", 1, expires_in=10**9).count(".") == 5  # the longest kind


def test_httpx_async_client(app, gateway):
    """fenced_request_async with an httpx.AsyncClient: a pass, then a 409 after a takeover."""
    httpx = pytest.importorskip("httpx")
    lease = get_store(app).acquire("doc/6", Owner.new(), 30)

    async def calls() -> tuple[int, BaseException | None]:
        async with httpx.AsyncClient() as session:
            first = await fenced_request_async(
                session, "POST", gateway.url, lease=lease, signer=SIGNER
            )
            _take_over(app, "doc/6")
            try:
                await fenced_request_async(session, "POST", gateway.url, lease=lease, signer=SIGNER)
            except StaleFenceError as exc:
                return first.status_code, exc
            return first.status_code, None

    status, refused = asyncio.run(calls())
    assert status == 200 and isinstance(refused, StaleFenceError)
    assert gateway.actions == [lease.fence]


def test_raise_for_fence_on_responses_of_both_libraries(app, gateway, client):
    """For calls made by hand: 409 and 403 raise, any other status comes back."""
    lease = get_store(app).acquire("doc/7", Owner.new(), 30)
    ok = client.request("GET", gateway.url, headers=fencing_headers(lease, signer=SIGNER))
    assert raise_for_fence(ok, lease) is ok
    _take_over(app, "doc/7")
    stale = client.request("GET", gateway.url, headers=fencing_headers(lease, signer=SIGNER))
    with pytest.raises(StaleFenceError, match="doc/7"):
        raise_for_fence(stale, lease)
    forged = client.request("GET", gateway.url, headers={FENCING_HEADER: "doc/7;999999999"})
    with pytest.raises(InvalidFenceTokenError):
        raise_for_fence(forged)


def test_the_token_names_the_lease_resource_in_base64(app):
    """(What a gateway sees: the resource, base64, and the fence, under the signature.)"""
    lease = get_store(app).acquire("doc/8", Owner.new(), 30)
    token = fencing_headers(lease, signer=SIGNER, expires_in=10)[FENCING_HEADER]
    encoded = token.split(".")[2]
    assert base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)) == b"doc/8"
