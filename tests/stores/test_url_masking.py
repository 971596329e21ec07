"""Passwords in store URLs never reach a repr, a log line or an error message.

The drivers disagree on where a password ends: redis-py (``urllib.parse``) reads it up to the
*last* ``@`` of the host part, SQLAlchemy up to the *first* ``@``. ``mask_url`` masks from the
first ``:`` after ``//`` to the last ``@``, which covers both, and SQL URLs whose password
SQLAlchemy would misread are refused with the fix (percent-encode).
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

import pytest
import redis
from celery import Celery
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from celery_lease import LeaseConfigError, LeaseStoreError, Owner
from celery_lease._app import get_store
from celery_lease._settings import LeaseSettings
from celery_lease.stores import RedisLeaseStore, SQLLeaseStore, mask_url, store_from_url
from celery_lease.stores.urls import check_credentials

SCHEMES = ["redis://", "rediss://", "postgresql+psycopg://", "unix://"]
PLAIN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-."
# passwords made of the characters URLs treat specially, and a few plain ones
passwords = st.text(alphabet=PLAIN[:6] + "@:/%#?&=", min_size=1, max_size=24)
users = st.text(alphabet=PLAIN, max_size=8)
hosts = st.sampled_from(["127.0.0.1", "db.example", "h", "[::1]"])
FUZZ = settings(max_examples=400, deadline=None, database=None)


class TestMaskUrl:
    @FUZZ
    @given(scheme=st.sampled_from(SCHEMES), user=users, password=passwords, host=hosts)
    @example(scheme="redis://", user="", password="p@ss", host="h")
    @example(scheme="redis://", user="", password="p@ss@word", host="h")
    @example(scheme="postgresql+psycopg://", user="app", password="a:b/c#d?e", host="h")
    def test_the_whole_userinfo_password_is_masked(self, scheme, user, password, host):
        """Whatever the password holds (@ : / % # ? & =), nothing of it is left."""
        url = f"{scheme}{user}:{password}@{host}:6379/0"
        assert mask_url(url) == f"{scheme}{user}:***@{host}:6379/0"

    @FUZZ
    @given(password=passwords.filter(lambda p: "&" not in p and "#" not in p))
    def test_a_query_password_is_masked(self, password):
        """``?password=`` (redis-py, libpq) is masked too."""
        url = f"unix:///run/redis.sock?db=2&password={password}"
        assert mask_url(url) == "unix:///run/redis.sock?db=2&password=***"
        assert mask_url(f"redis://h/0?password={password}&db=1") == "redis://h/0?password=***&db=1"

    @FUZZ
    @given(user=users, password=passwords, host=hosts)
    def test_the_masked_url_hides_what_redis_py_reads(self, user, password, host):
        """Parsed by redis-py itself, the masked URL carries no password but ``***``."""
        url = f"redis://{user}:{password}@{host}:6379/0"
        try:
            parsed = redis.connection.parse_url(url)
        except ValueError:
            return  # the driver refuses it (a '/' in the password): nothing connects
        if parsed.get("password"):  # (a '#' or '?' ends its netloc before the password)
            assert redis.connection.parse_url(mask_url(url)).get("password") == "***"

    @FUZZ
    @given(user=users, password=passwords, host=hosts)
    def test_the_masked_url_hides_what_sqlalchemy_reads(self, user, password, host):
        """Parsed by SQLAlchemy itself, the masked URL carries no password but ``***``."""
        url = f"postgresql+psycopg://{user}:{password}@{host}:5432/db"
        assert make_url(mask_url(url)).password == "***"

    @pytest.mark.parametrize(
        "url",
        [
            "redis://127.0.0.1:6379/0",
            "redis://user@127.0.0.1:6379/0",
            "sqlite:////tmp/a:b@c.db",
            "sqlite://",
            "memory://",
            "postgresql+psycopg://app@db/app",
        ],
    )
    def test_urls_without_a_password_are_unchanged(self, url):
        """Nothing is masked where there is no password (a sqlite path may hold ':' and '@')."""
        assert mask_url(url) == url

    @pytest.mark.parametrize(
        "url",
        [
            " redis://:s3cretpw@host:6379/0",  # store_from_url strips: so does the mask
            "\tredis://:s3cretpw@host/0",
            "redis://host:6379/0?pass%77ord=s3cretpw",  # redis-py decodes the name
            "redis://host:6379/0?%70assword=s3cretpw&db=1",
            "rediss://127.0.0.1:1/0?ssl_password=s3cretpw",  # the TLS key passphrase
            "postgresql+psycopg://u@127.0.0.1/db?sslpassword=s3cretpw",
            "redis://us/er:s3cretpw@host/0",
        ],
    )
    def test_found_in_review_every_spelling_of_a_password_is_masked(self, url):
        """Each of these showed the password before (reproduced by a review of issue 8)."""
        assert "s3cretpw" not in mask_url(url)
        assert "***" in mask_url(url)

    def test_non_strings(self):
        """mask_url takes anything an error message may be about."""
        assert mask_url(None) == "None"


class TestStoresShowNoPassword:
    def test_redis_store_url_with_an_at_in_the_password(self):
        """redis-py accepts ``:p@ss@host``; the store's url shows none of the password."""
        store = RedisLeaseStore(url="redis://:s3cr@tpart@127.0.0.1:1/0")
        try:
            assert "tpart" not in store.url and "s3cr" not in store.url
            assert store.url == "redis://:***@127.0.0.1:1/0"
        finally:
            store.close()

    def test_a_bad_redis_url_error_quotes_no_password(self):
        """redis-py's own message for an unencoded '/' quotes part of the password."""
        with pytest.raises(LeaseConfigError) as caught:
            RedisLeaseStore(url="redis://:s3cr/tpart@127.0.0.1:6379/0")
        assert "s3cr" not in str(caught.value) and "tpart" not in str(caught.value)
        assert "percent-encode" in str(caught.value)

    @pytest.mark.parametrize("password", ["s3cr@tpart", "s3cr@t@part"])
    def test_an_sql_url_sqlalchemy_would_misread_is_refused_with_the_fix(self, password):
        """SQLAlchemy reads ``u:s3cr@tpart@host`` as password ``s3cr`` at host ``tpart@host``:
        refused before it connects anywhere, naming the fix, quoting no part of it."""
        url = f"postgresql+psycopg://app:{password}@127.0.0.1:1/db"
        for build in (lambda: store_from_url(url), lambda: SQLLeaseStore(url=url)):
            with pytest.raises(LeaseConfigError, match=r"(?i)percent-encode") as caught:
                build()
            assert "s3cr" not in str(caught.value) and "tpart" not in str(caught.value)
        with pytest.raises(LeaseConfigError):
            check_credentials(url)

    def test_the_percent_encoded_password_is_accepted(self):
        """The fix the message names works: SQLAlchemy reads the real password back."""
        url = f"postgresql+psycopg://app:{quote('s3cr@t/p#rt?', safe='')}@127.0.0.1:1/db"
        check_credentials(url)
        assert make_url(url).password == "s3cr@t/p#rt?"
        assert "s3cr" not in mask_url(url)

    def test_settings_repr_masks_the_store_url(self):
        """LeaseSettings' repr (logged, shown in tracebacks) masks the URL and option secrets."""
        settings = LeaseSettings(
            store_url="redis://:s3cr@tpart@127.0.0.1:6379/0",
            store_options={"engine_options": {"connect_args": {"password": "s3cr3t"}}},
        )
        text = repr(settings)
        assert "s3cr" not in text and "tpart" not in text
        assert "redis://:***@127.0.0.1:6379/0" in text and "ttl=60.0" in text


@pytest.mark.redis
class TestInspectConf:
    """What ``celery inspect conf`` and Flower show: ``app.conf.table()``, Celery's filter."""

    @pytest.fixture
    def acl_user(self, redis_server):
        client = redis.Redis.from_url(redis_server.url)
        name, password = f"lease_{uuid.uuid4().hex[:8]}", "s3cr@t/pw"
        client.acl_setuser(
            name, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
        )
        try:
            yield name, password
        finally:
            client.acl_deluser(name)
            client.close()

    @staticmethod
    def _app(**conf):
        app = Celery("inspect-conf", set_as_current=False)
        app.conf.update(**conf)
        return app

    def test_negative_control_a_password_in_lease_store_url_is_shown(self, redis_server):
        """Celery masks only keys it knows: a password in lease_store_url is printed."""
        url = redis_server.url.replace("redis://", "redis://:s3cr3tpw@")
        shown = repr(self._app(lease_store_url=url).conf.table())
        assert "s3cr3tpw" in shown

    def test_the_password_as_a_store_option_works_and_is_masked(self, redis_server, acl_user):
        """``lease_store_options={"password": ...}`` authenticates and is not shown."""
        name, password = acl_user
        app = self._app(
            lease_store_url=redis_server.url.replace("redis://", f"redis://{name}@"),
            lease_store_options={"password": password},
        )
        assert password not in repr(app.conf.table())
        store = get_store(app)
        try:
            store.release(store.acquire(f"inspect-{uuid.uuid4().hex}", Owner.new(), 5))
        finally:
            store.close()
        without = RedisLeaseStore(url=redis_server.url.replace("redis://", f"redis://{name}@"))
        try:
            with pytest.raises(LeaseStoreError):  # the ACL user is real: no password, no entry
                without.acquire(f"inspect-{uuid.uuid4().hex}", Owner.new(), 5)
        finally:
            without.close()
