"""Least-privilege accounts for the secure runs of the store contract suite.

* Redis: a user per store, limited by ACL to the store's key prefix (``~<prefix>*``, no pub/sub
  channels) and to the commands the store sends or its scripts call, on a TLS-only server. Any
  key outside the prefix, or any other command, is refused with NOPERM, so the contract suite
  passing as that user proves every key the store touches is under its prefix.
* PostgreSQL: a login role that is no superuser, may create no role, database or table (it has
  no CREATE on any schema), owns nothing, and holds only the rights ``TABLE_RIGHTS`` lists on the
  tables the owner (the admin) created beforehand.

docs/stores.md ("Secure deployment") shows the same ACL line and GRANT statements.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url

#: Everything the Redis store sends (EVALSHA, SCRIPT LOAD when the script cache is cold, PING
#: and GET for the health check and the fence gate, HSCAN and friends for identity_records)
#: or its scripts call. CONFIG GET is left out
#: on purpose (it reads secrets such as masterauth): the health check then warns that it could
#: not read the configuration.
REDIS_ACL_COMMANDS = (
    "+evalsha",
    "+script|load",
    "+ping",
    "+time",
    "+get",
    "+hmget",
    "+hget",
    "+hset",
    "+hdel",
    "+zadd",
    "+zrem",
    "+zrangebyscore",
    "+zscore",
    "+hscan",
)
#: The admin (default user) password of the TLS server; stores never use it.
REDIS_ADMIN_PASSWORD = "admin-" + secrets.token_hex(8)
#: The password of every ACL user made here.
REDIS_USER_PASSWORD = "lease-" + secrets.token_hex(8)


def redis_acl_rules(keys: str, password: str, drop: str = "") -> list[str]:
    """``ACL SETUSER <user> ...`` rules for the key pattern ``keys`` (``<key_prefix>*``),
    without the command ``drop`` (for the test that each one is needed)."""
    commands = [command for command in REDIS_ACL_COMMANDS if command != drop]
    return ["reset", "on", f">{password}", f"~{keys}", "resetchannels", "-@all", *commands]


def redis_acl_user(server: Any, prefix: str, *, keys: str | None = None, drop: str = "") -> str:
    """Create a user limited to the keys ``<prefix>*`` (or the pattern ``keys``); return its
    URL on ``server``."""
    user = f"lease{os.getpid():x}{secrets.token_hex(4)}"
    admin = redis.Redis.from_url(server.url_for(password=REDIS_ADMIN_PASSWORD))
    try:
        rules = redis_acl_rules(keys or f"{prefix}*", REDIS_USER_PASSWORD, drop)
        admin.execute_command("ACL", "SETUSER", user, *rules)
    finally:
        admin.close()
    return str(server.url_for(user, REDIS_USER_PASSWORD))


class PostgresRole:
    """A least-privilege login role on the test PostgreSQL (made once per session)."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.name = f"lease_app_{os.getpid():x}_{secrets.token_hex(3)}"
        self.password = secrets.token_hex(12)
        engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(
                    sa.text(
                        f"CREATE ROLE {self.name} LOGIN PASSWORD '{self.password}' NOSUPERUSER "
                        "NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS"
                    )
                )
        finally:
            engine.dispose()

    @property
    def url(self) -> str:
        """The admin URL with this role's name and password."""
        return (
            make_url(self.admin_url)
            .set(username=self.name, password=self.password)
            .render_as_string(hide_password=False)
        )

    def grant(self, store: Any) -> None:
        """Run ``store.grant_statements(role)`` as the tables' owner (``store`` is the admin's)."""
        with store.engine.connect() as conn:
            for statement in store.grant_statements(self.name):
                conn.execute(sa.text(statement))
            conn.commit()

    def drop(self) -> None:
        """Remove the role and every right it was granted (the tables stay with their owner)."""
        engine = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(f"DROP OWNED BY {self.name}"))
                conn.execute(sa.text(f"DROP ROLE {self.name}"))
        finally:
            engine.dispose()
