from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# the harness the benchmarks share with the tests (benchmarks/harness: ports, paths, real Redis servers)
sys.path.insert(1, str(Path(__file__).parent.parent / "benchmarks"))
# every test folder too: tests import each other's helpers and fixtures by module name (test files'
# names are unique across folders, as pytest's default import mode needs)
for _folder in sorted({p.parent for p in Path(__file__).parent.rglob("test_*.py")}):
    sys.path.insert(1, str(_folder))

from harness.redis_cluster import RedisCluster, RedisSentinel  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402

# Every process a test starts (torchrun ranks, CLIs, agents) prints its Python stacks if it
# dies of a signal (SIGABRT, SIGSEGV): a rank that crashes in CI then says where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests flush what they use via unique namespaces."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(params=["filesystem", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL of each default backend: a fresh filesystem store, and the session's real Redis (marked ``redis``)."""
    if request.param == "filesystem":
        return f"file://{tmp_path / 'cache'}"
    request.applymarker(pytest.mark.redis)
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real 3-primary Redis Cluster for the session (no replicas: tests that kill a node start their own)."""
    with RedisCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    with RedisSentinel(tmp_path_factory.mktemp("sentinel")) as sentinel:
        yield sentinel
