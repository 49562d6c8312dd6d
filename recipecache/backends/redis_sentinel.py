"""Redis Sentinel: the Redis backend (:mod:`.redis`) on the primary its sentinels name.

``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db][?options]`` (TLS:
``rediss+sentinel://``): one primary with failover; redis-py's ``Sentinel`` asks the
sentinels for the primary of ``service`` and follows a failover. The sentinels are asked
without a password (they usually have none); the user and password are the primary's.
The options are the Redis backend's (``ttl``, ``chunk_size``, ``timeout``, TLS), and so
is the ACL user (``deploy/README.md``).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.sentinel import Sentinel

from ..errors import BackendError, ConfigError, echo
from .redis import RedisBackend
from .redis.options import client_credentials, client_options, url_settings
from .url import StoreURL

DEFAULT_SENTINEL_PORT = 26379


class RedisSentinelBackend(RedisBackend):
    @classmethod
    def from_url(cls, url: StoreURL) -> RedisSentinelBackend:
        """``redis[s]+sentinel://[user:password@]host:port[,host:port...]/service[/db][?options]``."""
        settings = url_settings(url)
        sentinels = url.hosts(DEFAULT_SENTINEL_PORT)
        service, _, db = url.parts.path.strip("/").partition("/")
        if not service:
            raise url.error(f"name the service: {url.scheme}://host:port[,host:port...]/service")
        database = url.database(db, "/SERVICE/0")
        credentials = client_credentials(url)
        timeout = settings["timeout"]
        # every sentinel gets its share of the timeout: a call that asks them one after another
        # (a hung one first) still reaches the next within the backend's bound on the whole call
        each = timeout / len(sentinels)
        sentinel = Sentinel(sentinels, sentinel_kwargs={"socket_timeout": each, **client_options(each)})

        def connect(socket_timeout: float) -> redis.Redis:
            return sentinel.master_for(
                service, db=database, socket_timeout=socket_timeout, **client_options(timeout), **credentials
            )

        return cls(url.raw, sentinel=sentinel, service=service, connect=connect, **settings)

    def __init__(self, url: str, *, sentinel: Sentinel, service: str, **options: Any) -> None:
        super().__init__(url, **options)
        self._sentinel, self._service = sentinel, service

    def discover(self) -> None:
        try:
            self._calls.call("discover", self._sentinel.discover_master, self._service)
        except BackendError as exc:
            raise ConfigError(
                f"cache {echo(self.url)}: no sentinel knows a primary for {echo(self._service)} ({exc})"
            ) from None
