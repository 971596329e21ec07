"""A claim whose reply is lost on the way back, retried by the store, recovers like the first.

The claim reaches the server and takes over a crashed owner's work; the proxy drops the reply
and resets the connection (``TcpProxy.lose_replies``), so the store's own retry, on a fresh
connection, finds "our own live lease". That retry must return what the first attempt would
have: ``previous_fence`` and ``previous_owner_label`` of the crashed owner, ``identity_state``
and its ``checkpoints``. Before the fix it came back as a fresh lease, so ``reconcile()`` was
skipped and checkpointed steps ran again. Against the real redis-server and PostgreSQL.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest

from celery_lease import Owner
from celery_lease.stores import store_from_url
from tests.conftest import unique
from tests.stores.test_contract import expire
from tests.tooling.proxy import TcpProxy

pytestmark = [pytest.mark.chaos_ci]

LONG = 30.0
SHORT = 0.05


def _stores(kind: str, url: str, proxy: TcpProxy) -> tuple[object, object]:
    """The same store twice: directly, and through the proxy."""
    prefix = unique("lr")
    options = {"key_prefix": f"{prefix}:"} if kind == "redis" else {"table_prefix": f"{prefix}_"}
    return store_from_url(url, **options), store_from_url(proxy.url_for(url), **options)


@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_a_claim_retried_after_a_lost_reply_reports_the_recovery(kind, request):
    """The retried claim names the crashed owner, its state and checkpoints: reconcile runs."""
    server = request.getfixturevalue(f"{kind}_server")
    with TcpProxy(urlsplit(server.url).port) as proxy:
        direct, proxied = _stores(kind, server.url, proxy)
        try:
            crashed = direct.acquire("job/r", Owner.new("crashed"), SHORT, identity="job-1")
            direct.checkpoint(crashed, json.dumps({"page": 3}))
            expire(direct, "job/r")
            assert proxied.get("job/r").fence == crashed.fence  # connection open, scripts loaded
            proxy.lose_replies(1)
            lease = proxied.acquire("job/r", Owner.new("next"), LONG, identity="job-1")
            assert proxy.replies_lost == 1, "no reply was lost: the fault did not happen"
            print(
                f"{kind}: the claim's reply was lost; the retry returned fence {lease.fence}, "
                f"recovered={lease.recovered}, previous_fence={lease.previous_fence}, "
                f"state={lease.identity_state}, checkpoints={lease.checkpoints}"
            )
            assert direct.get("job/r").fence == lease.fence  # one claim, found again
            assert lease.recovered
            assert (lease.previous_owner_label, lease.previous_fence) == ("crashed", crashed.fence)
            assert lease.identity_state == "running"
            assert lease.checkpoints == {"page": 3}
        finally:
            proxied.close()
            direct.close()
