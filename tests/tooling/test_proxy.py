"""The fault-injection TCP proxy itself, against the real redis-server.

Each fault is checked through a plain redis-py client with no retries, so what the client sees
is what the proxy did: a partition times out, a heal restores, a reset is one ConnectionError.
"""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lease import LeaseStoreError, Owner
from celery_lease.stores.redis import RedisLeaseStore
from tests.conftest import unique
from tests.tooling.proxy import TcpProxy
from tests.tooling.servers import free_port, wait_for

pytestmark = pytest.mark.redis


def client_for(proxy: TcpProxy, redis_url: str, timeout: float = 0.2, **kw) -> redis.Redis:
    """A redis-py client through the proxy that shows every failure (no retry)."""
    return redis.Redis.from_url(
        proxy.url_for(redis_url),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        **kw,
    )


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def proxy(redis_server):
    with TcpProxy(urlsplit(redis_server.url).port) as running:
        yield running


class TestForwarding:
    def test_ping_goes_through(self, proxy, redis_server):
        """A client pointed at the proxy talks to the real server."""
        client = client_for(proxy, redis_server.url)
        assert client.ping() is True
        key = unique("proxy:")
        client.set(key, "v" * 200_000)  # bigger than one chunk
        assert client.get(key) == b"v" * 200_000
        client.delete(key)
        client.close()

    def test_url_for_keeps_credentials_and_db(self):
        """Only host and port change in the URL."""
        with TcpProxy(6399) as proxy:
            url = proxy.url_for("redis://user:pw@10.1.2.3:6399/4?x=1")
            assert url == f"redis://user:pw@127.0.0.1:{proxy.port}/4?x=1"

    def test_refuses_non_loopback_targets(self):
        """Traffic never leaves 127.0.0.0/8."""
        with pytest.raises(ValueError, match="loopback"):
            TcpProxy(6379, "10.0.0.1")

    def test_dead_upstream_closes_the_client_promptly(self):
        """A client of a proxy whose server is down gets an error, not a hang."""
        with TcpProxy(free_port()) as proxy:
            client = client_for(proxy, "redis://127.0.0.1:1/0", timeout=2.0)
            started = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                client.ping()
            assert time.monotonic() - started < 1.5


class TestFaults:
    def test_blackhole_times_out_existing_and_new_connections(self, proxy, redis_server):
        """A partition stalls both old and new connections without closing them."""
        old = client_for(proxy, redis_server.url)
        assert old.ping()
        proxy.blackhole()
        with pytest.raises(redis.TimeoutError):
            old.ping()
        new = client_for(proxy, redis_server.url)
        with pytest.raises(redis.TimeoutError):
            new.ping()
        assert proxy.connections >= 1  # held open, not closed
        proxy.heal()
        assert old.ping() and new.ping()
        old.close()
        new.close()

    def test_stalled_request_is_delivered_late_after_heal(self, proxy, redis_server):
        """A write the client gave up on during a stall still reaches the server at heal."""
        key = unique("proxy:")
        direct = redis.Redis.from_url(redis_server.url)
        client = client_for(proxy, redis_server.url)
        assert client.ping()
        proxy.blackhole()
        with pytest.raises(redis.TimeoutError):
            client.set(key, "late")
        assert direct.get(key) is None
        proxy.heal()
        assert wait_for(lambda: direct.get(key) == b"late", 5, "the stalled SET")
        direct.delete(key)
        client.close()
        direct.close()

    def test_blackhole_drop_loses_bytes_and_resets_at_heal(self, proxy, redis_server):
        """In drop mode nothing stalled arrives later; the damaged connection is reset."""
        key = unique("proxy:")
        direct = redis.Redis.from_url(redis_server.url)
        conn = redis.Connection(port=proxy.port, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
        conn.connect()
        proxy.blackhole(drop=True)
        conn.send_command("SET", key, "dropped")
        with pytest.raises(redis.TimeoutError):
            conn.read_response()
        proxy.heal()
        assert wait_for(lambda: proxy.connections == 0, 5, "the damaged connection reset")
        assert direct.get(key) is None
        assert client_for(proxy, redis_server.url).ping()
        conn.disconnect()
        direct.close()

    def test_reset_all_fails_the_request_in_flight_once_then_reconnects(self, proxy, redis_server):
        """A reset during a blocking call is one ConnectionError; the next call reconnects."""
        name = unique("proxytest")
        client = client_for(proxy, redis_server.url, timeout=10, client_name=name)
        direct = redis.Redis.from_url(redis_server.url)
        assert client.ping()
        outcome: list[BaseException | object] = []

        def blocked() -> None:
            try:
                outcome.append(client.blpop([unique("proxy:")], timeout=8))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=blocked)
        started = time.monotonic()
        thread.start()
        wait_for(
            lambda: any(
                c.get("name") == name and c.get("cmd") == "blpop" for c in direct.client_list()
            ),
            5,
            "the BLPOP to reach the server",
        )
        proxy.reset_all()
        thread.join(5)
        assert not thread.is_alive()
        assert time.monotonic() - started < 5
        assert len(outcome) == 1 and isinstance(outcome[0], redis.ConnectionError)
        assert client.ping() is True
        client.close()
        direct.close()

    def test_lose_replies_runs_the_request_but_loses_its_answer(self, proxy, redis_server):
        """The command reaches the server and runs; the client gets a reset, not the reply."""
        client = client_for(proxy, redis_server.url, timeout=5)
        direct = redis.Redis.from_url(redis_server.url)
        key = unique("proxy:")
        assert client.ping()
        proxy.lose_replies(1)
        with pytest.raises(redis.ConnectionError):
            client.incr(key)
        assert proxy.replies_lost == 1
        assert direct.get(key) == b"1"  # it ran
        assert client.incr(key) == 2  # one reply only: the next call goes through
        direct.delete(key)
        client.close()
        direct.close()

    def test_latency_delays_each_direction(self, proxy, redis_server):
        """set_latency(d) adds about 2*d to a round trip; 0 takes it away."""
        client = client_for(proxy, redis_server.url, timeout=5)
        assert client.ping()
        proxy.set_latency(0.15)
        started = time.monotonic()
        assert client.ping()
        slow = time.monotonic() - started
        assert 0.3 <= slow < 2.0
        proxy.set_latency(0)
        fastest = 10.0
        for _ in range(3):  # (the best of three: a loaded box can stall one ping)
            started = time.monotonic()
            assert client.ping()
            fastest = min(fastest, time.monotonic() - started)
        assert fastest < 0.25
        client.close()


def test_stop_leaks_no_thread_or_socket(redis_server):
    """stop() joins the loop thread and closes the listener and every connection.

    Compared as sets of what is new: a thread or socket left over from an earlier test may
    end while this one runs, so a count could shrink and hide a leak, or differ without one.
    """
    threads, fds = set(threading.enumerate()), open_fds()
    proxy = TcpProxy(urlsplit(redis_server.url).port).start()
    clients = [client_for(proxy, redis_server.url) for _ in range(3)]
    for client in clients:
        assert client.ping()
    proxy.blackhole()
    stalled = client_for(proxy, redis_server.url)
    with pytest.raises(redis.TimeoutError):
        stalled.ping()
    proxy.stop()
    proxy.stop()  # idempotent
    for client in [*clients, stalled]:
        client.close()
    assert set(threading.enumerate()) - threads == set()
    assert open_fds() - fds == set()
    with pytest.raises(redis.ConnectionError):
        client_for(proxy, redis_server.url).ping()


def test_concurrent_clients_get_their_own_bytes_in_order(proxy, redis_server):
    """Many connections with payloads of every size, under latency: nothing mixed or lost."""
    proxy.set_latency(0.002)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        client = client_for(proxy, redis_server.url, timeout=5)
        key = unique(f"proxy:{n}:")
        try:
            for i in range(40):
                value = os.urandom((i * 7919) % 300_000 + 1)
                client.set(key, value)
                assert client.get(key) == value
            client.delete(key)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert proxy.accepted >= 4


def test_a_store_behind_a_partition_reports_uncertain_not_lost(proxy, redis_server):
    """Through a blackholed proxy a renewal is a LeaseStoreError (outcome unknown), and after
    heal the same lease renews again: the partition alone never reads as a lost lease."""
    url = proxy.url_for(redis_server.url)
    with RedisLeaseStore(url=url, key_prefix=unique("px") + ":", socket_timeout=0.3) as store:
        lease = store.acquire("proxy/a", Owner.new("behind-proxy"), 30)
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(LeaseStoreError):
            store.renew(lease)
        assert time.monotonic() - started < 3
        assert lease.lost is None
        proxy.heal()
        store.renew(lease)
        store.verify(lease)
        assert store.release(lease)
