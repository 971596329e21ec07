"""A store call's timeout agrees with the renewal promise: no loss below a round trip of ttl/3.

The timeout of a store made from the settings is ``ttl - margin - renew_interval``: a renewal
sent on time may take that long and still be answered before the self-fence deadline. It was
ttl/4 (0.2..5 s), so every call timed out at round trips between ttl/4 and ttl/3, inside the
range where the design promises that no lease is lost (a round trip below ttl/3).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from celery import Celery

from celery_lease import Owner
from celery_lease._app_stores import _store_options, get_store, store_timeout
from celery_lease._settings import MIN_STORE_CALL, LeaseSettings
from celery_lease.stores.redis import RedisLeaseStore
from tests.conftest import unique
from tests.tooling.proxy import TcpProxy

TTLS = [0.48, 1.0, 3.0, 15.0, 20.0, 60.0, 600.0]


def settings(url: str = "redis://127.0.0.1:6379/0", **values: object) -> LeaseSettings:
    return LeaseSettings.resolve(None, {"store_url": url, **values})


class TestStoreTimeout:
    @pytest.mark.parametrize("ttl", TTLS)
    def test_a_round_trip_below_a_third_of_the_ttl_never_times_out(self, ttl):
        """The promised range (RTT < ttl/3) lies inside the timeout, at every ttl."""
        assert store_timeout(settings(ttl=ttl)) >= ttl / 3

    @pytest.mark.parametrize(
        ("ttl", "interval", "margin"),
        [
            (60.0, None, None),
            (3.0, None, None),
            (10.0, 2.0, 1.0),
            (10.0, 5.0, 4.5),
            (1.0, 0.5, 0.3),
        ],
    )
    def test_a_renewal_sent_on_time_times_out_by_the_self_fence_deadline(
        self, ttl, interval, margin
    ):
        """Timeout = ttl - margin - interval: the window a renewal has, no more, no less."""
        s = settings(ttl=ttl, renew_interval=interval, self_fence_margin=margin)
        window = s.ttl - s.effective_margin - s.effective_renew_interval
        assert store_timeout(s) == pytest.approx(max(MIN_STORE_CALL, window))
        assert s.effective_renew_interval + store_timeout(s) <= s.ttl - s.effective_margin + 1e-9

    def test_the_smallest_ttl_allowed_gets_the_floor(self):
        """At the smallest ttl the window is the 0.2 s a store call is given at the least."""
        assert store_timeout(settings(ttl=0.48)) == pytest.approx(MIN_STORE_CALL)

    @pytest.mark.parametrize(
        ("url", "option"),
        [
            ("redis://127.0.0.1:6379/0", "socket_timeout"),
            ("rediss://127.0.0.1:6379/0", "socket_timeout"),
            ("unix:///tmp/redis.sock", "socket_timeout"),
            ("postgresql+psycopg://u@127.0.0.1/db", "statement_timeout"),
        ],
    )
    @pytest.mark.parametrize("ttl", [3.0, 60.0])
    def test_the_stores_are_made_with_that_timeout(self, url, option, ttl):
        """Redis's socket timeout and PostgreSQL's statement timeout are the same number."""
        s = settings(url, ttl=ttl)
        assert _store_options(s)[option] == pytest.approx(store_timeout(s))

    def test_an_explicit_store_option_still_wins(self):
        s = settings(ttl=60.0, store_options={"socket_timeout": 2.0})
        assert _store_options(s)["socket_timeout"] == 2.0


class TestThroughASlowLink:
    def test_a_round_trip_of_0_9_of_a_third_of_the_ttl_is_served(self, redis_server):
        """Claim, renew and release through a link at RTT 0.9 x ttl/3 on the app's own store.

        (With ttl/4 as the timeout, each of them failed with a socket timeout.)
        """
        ttl = 1.5
        prefix = f"{unique('timeout')}:"
        direct = RedisLeaseStore(url=redis_server.url, key_prefix=prefix)
        # Load the scripts first: a script missing after a flush costs two more round trips.
        direct.renew(warm := direct.acquire("load-scripts", Owner.new("w"), ttl))
        direct.release(warm)
        with TcpProxy(urlsplit(redis_server.url).port) as proxy:
            app = Celery(unique("app"), broker="memory://", backend="cache+memory://")
            app.conf.lease_store_url = proxy.url_for(redis_server.url)
            app.conf.lease_ttl = ttl
            app.conf.lease_key_prefix = prefix
            store = get_store(app)
            try:
                proxy.set_latency(0.9 * ttl / 3 / 2)  # each way
                lease = store.acquire("slow-link", Owner.new("w"), ttl)
                store.renew(lease)
                assert store.release(lease)
            finally:
                proxy.set_latency(0)
                store.close()
                direct.close()
