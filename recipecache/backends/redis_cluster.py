"""Redis Cluster: the Redis backend (:mod:`.redis`) through redis-py's cluster client.

``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]`` (TLS:
``rediss+cluster://``): redis-py's ``RedisCluster``, which learns the cluster's slots
from the first seed node that answers and follows them as they move. Every Redis key
of one entry (value, chunks, lease, wake list) carries the entry's key as its hash tag
(``rc:e:{ns/hex}``, ``rc:c:{ns/hex}:<gen>:<i>``, ``rc:l:{ns/hex}``, ...), so they live in
one hash slot, and the Lua scripts (which touch several of them) and the atomic publish
run on one primary, unchanged. A cluster has one database: any other than 0 is bad input.
The client is made on first use, not when the store opens: its constructor contacts the
seed nodes, and a cluster that is down must degrade a job, not fail it. ``SCAN`` walks
every primary.

The options are the Redis backend's (``ttl``, ``chunk_size``, ``timeout``, TLS). The ACL
user is the same as for one server (``deploy/README.md``), plus what the cluster client
sends to learn the topology (:data:`CLUSTER_ACL_COMMANDS`). Sentinel: :mod:`.redis_sentinel`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import redis
import redis.exceptions
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import Encoder
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from ..errors import BackendError, ConfigError, echo
from ..reasons import Reason
from .base import check_key
from .redis import RedisBackend
from .redis.calls import RedisCalls
from .redis.names import KeyNames
from .redis.options import client_credentials, client_options, url_settings
from .url import StoreURL

DEFAULT_PORT = 6379
#: What RedisCluster sends besides the backend's own commands: the slot map when it starts or
#: a slot moves, the command table it routes by, and ASKING while a slot migrates. deploy/
#: grants them to the job user of a cluster (render-acl.sh with REDIS_CLUSTER=1).
CLUSTER_ACL_COMMANDS = ("cluster|slots", "command", "asking")


class _DeferredPipeline:
    """A cluster pipeline that queues its commands and connects on ``execute``.

    Making the cluster client asks the seed nodes; on ``execute`` that happens inside the
    backend's bounded call (and its error handling), not where the pipeline is built.
    """

    def __init__(self, cluster: _LazyCluster, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._cluster, self._args, self._kwargs = cluster, args, kwargs
        self._queued: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def queue(*args: Any, **kwargs: Any) -> _DeferredPipeline:
            self._queued.append((name, args, kwargs))
            return self

        return queue

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._cluster.connect().pipeline(*self._args, **self._kwargs)
        for name, queued_args, queued_kwargs in self._queued:
            getattr(pipe, name)(*queued_args, **queued_kwargs)
        return pipe.execute(*args, **kwargs)


class _LazyCluster:
    """A ``RedisCluster`` made on first use (and again after a failed try), behind the calls the backend makes."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def connect(self) -> RedisCluster:
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._make()
                except (RedisClusterException, redis.exceptions.RedisError, OSError) as exc:
                    raise redis.exceptions.ConnectionError(f"no seed node of the cluster answered ({exc})") from None
            return self._client

    def made(self) -> RedisCluster | None:
        """The cluster client if it has been made, without contacting any node."""
        return self._client

    def get_encoder(self) -> Encoder:
        """What a registered script hashes itself with: redis-py's defaults, without connecting."""
        return Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)

    def register_script(self, script: str) -> Script:
        return Script(self, script)  # type: ignore[arg-type]  # a stand-in: Script uses only get_encoder and the client calls it forwards

    def pipeline(self, *args: Any, **kwargs: Any) -> _DeferredPipeline:
        return _DeferredPipeline(self, args, kwargs)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name: str) -> Any:
        """A method of the cluster client that connects when called (inside the backend's error handling)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.connect(), name)(*args, **kwargs)

        return call


class ClusterKeyNames(KeyNames):
    """Names whose hash tag is the entry's key: every key of one entry in one hash slot."""

    def name(self, kind: str, key: str) -> str:
        return f"rc:{kind}:{{{check_key(key)}}}"

    def pattern(self, namespace: str | None, kind: str = "e") -> str:
        return f"rc:{kind}:{{{namespace}/*" if namespace else f"rc:{kind}:*"


class ClusterCalls(RedisCalls):
    """Calls through the cluster client, whose own failures (no node for a slot...) are no RedisError."""

    def within(self, seconds: float, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().within(seconds, what, fn, *args, **kwargs)
        except RedisClusterException as exc:  # e.g. a slot whose primary is down
            raise BackendError(Reason.BACKEND_DOWN, f"redis cluster {what}: {exc}") from None


class RedisClusterBackend(RedisBackend):
    names = ClusterKeyNames()
    calls_class = ClusterCalls

    @classmethod
    def from_url(cls, url: StoreURL) -> RedisClusterBackend:
        """``redis[s]+cluster://[user:password@]host:port[,host:port...][/0][?options]``."""
        settings = url_settings(url)
        seeds = url.hosts(DEFAULT_PORT)
        if url.parts.path.strip("/") not in ("", "0"):
            raise url.error(f"a Redis Cluster has only database 0, not {echo(url.parts.path.strip('/'))}")
        credentials = client_credentials(url)

        def connect(socket_timeout: float) -> _LazyCluster:
            return _LazyCluster(
                lambda: RedisCluster(
                    startup_nodes=[ClusterNode(host, port) for host, port in seeds],
                    require_full_coverage=False,  # a primary that is down takes its slots along, not the cluster
                    socket_timeout=socket_timeout,
                    **client_options(settings["timeout"]),
                    **credentials,
                )
            )

        return cls(url.raw, connect=connect, **settings)

    def discover(self) -> None:
        try:
            self._calls.call("connect", self._client.connect)
        except BackendError as exc:
            raise ConfigError(f"cache {echo(self.url)} is unreachable: {exc}") from None

    def failure_domain(self, key: str) -> str | None:
        """The primary that serves ``key``'s hash slot in the client's slot map (None before the client is made, or
        for a slot it maps to no node): a breaker per primary. After a failover the slot maps to the new
        primary, whose breaker is its own."""
        cluster = self._client.made()
        if cluster is None:
            return None
        nodes = cluster.nodes_manager.slots_cache.get(key_slot(self.names.name("e", key).encode()))
        return nodes[0].name if nodes else None

    def _connection_kwargs(self) -> dict[str, Any]:
        return self._client.connect().get_default_node().redis_connection.connection_pool.connection_kwargs

    def _run_keyless(self, *args: Any) -> Any:
        cluster = self._client.connect()
        return cluster.execute_command(*args, target_nodes=cluster.get_default_node())

    def _acl_probes(self, key: str) -> dict[str, Callable[[], Any]]:
        """The one-server probes, and the commands the cluster client sends to follow the slots."""
        run = self._client.execute_command
        return {
            "cluster|slots": lambda: run("CLUSTER", "SLOTS"),
            "command": lambda: run("COMMAND", "INFO", "get"),
            "asking": lambda: self._run_keyless("ASKING"),
            **super()._acl_probes(key),
        }

    def _scan_batches(self, pattern: str) -> Any:
        """Batches of 500 names from redis-py's walk over every primary, each batch one bounded call."""
        names = self._calls.call("scan", lambda: iter(self._client.scan_iter(match=pattern, count=500)))
        while True:
            batch = self._calls.call("scan", lambda: list(itertools.islice(names, 500)))
            yield batch
            if len(batch) < 500:
                return
