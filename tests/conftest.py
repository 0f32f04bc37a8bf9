"""Shared fixtures (one real redis-server for the whole test session) and the test tiers.

Tiers are folders and each folder marks its tests: `unit/` (pure, in-process), `integration/`
(real Redis, gRPC servers or child processes), `contract/` (the engine contract suite, run
against every engine installed), `e2e/` (the whole system: `scalerl run` on the tiny model;
also marked `integration`), `deploy/` (the Kubernetes manifests, rendered and checked
without a cluster; the cpu-smoke overlay also run as local processes). `pytest -m unit`
runs the fast tier alone.

Tests isolate themselves by run id (every key is prefixed `scalerl:{run_id}:`), never by
flushing the database, because servers and workers started by other fixtures may be using
it at the same time.

A module marked `single_and_cluster` runs each test that uses `redis_client` or
`any_redis_url` twice: on the session's redis-server and on a 3-master Redis Cluster
(`redis_cluster`, started once for the session when first needed).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_cluster import LocalRedisCluster

from scalerl.state.client import RedisClient, connect
from scalerl_cli.redis_server import RedisServer

TESTS = Path(__file__).resolve().parent
TIER_MARKERS = {
    "unit": ("unit",),
    "integration": ("integration",),
    "contract": ("contract",),
    "e2e": ("e2e", "integration"),
    "deploy": ("deploy",),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by the tier folder it lives in."""
    for item in items:
        tier = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        for marker in TIER_MARKERS.get(tier, ()):
            item.add_marker(marker)


@pytest.fixture(autouse=True)
def _no_stale_log_handler() -> Iterator[None]:
    """A test that ran a CLI leaves the root logger writing to its captured stderr, closed
    once the test ends (`scalerl.obs.logging.configure_logging`); the next record logged
    by a later test would then print a "Logging error" into that test's stderr."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL (redis://127.0.0.1:PORT/0) of a non-persistent redis-server stopped at the end."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A non-persistent 3-master Redis Cluster on loopback, stopped at the end."""
    with LocalRedisCluster(masters=3) as cluster:
        yield cluster


REDIS_KINDS = ("single", "cluster")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run the tests of a `single_and_cluster` module on each kind of Redis."""
    if metafunc.definition.get_closest_marker("single_and_cluster") is None:
        return
    if "redis_kind" in metafunc.fixturenames:
        metafunc.parametrize("redis_kind", REDIS_KINDS, indirect=True)


@pytest.fixture
def redis_kind(request: pytest.FixtureRequest) -> str:
    """ "single" (the session's redis-server) or "cluster" (`redis_cluster`)."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def any_redis_url(redis_kind: str, request: pytest.FixtureRequest) -> str:
    """The URL of the Redis of this test's `redis_kind` (`connect` reads either)."""
    if redis_kind == "cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def redis_client(any_redis_url: str) -> Iterator[RedisClient]:
    """A bytes client (decode_responses=False) of the session server (or, in a
    `single_and_cluster` module, of each kind of Redis in turn)."""
    client = connect(any_redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test, so keys never collide between tests."""
    return f"t-{uuid.uuid4().hex[:12]}"
