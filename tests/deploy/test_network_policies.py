"""The NetworkPolicies of every render, evaluated: each pod's allowed peers and ports,
listed and compared with the intended table (deploy/base/network-policies.yaml). A
connection is allowed when the sender's egress and the receiver's ingress both allow it
(NetworkPolicy semantics: a pod selected by no policy of a direction is open in it)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from deploy_manifests import find, pod_labels, workloads

NAMESPACE = "scalerl"
# The ports a connection may aim at: the services', the stores', DNS, HTTPS, and one
# ephemeral port (torch.distributed's peer connections).
PORTS = (53, 443, 6379, 9101, 9102, 9103, 29400, 29501, 50051, 50052, 50053, 50054, 50055, 40000)
ANY = frozenset(PORTS)


@dataclass(frozen=True)
class Peer:
    name: str
    namespace_labels: tuple[tuple[str, str], ...]
    labels: tuple[tuple[str, str], ...]
    ours: bool  # in the run's namespace: its own policies apply
    ip: str = ""  # outside the Kubernetes cluster: its address (ipBlock rules match it)


def _peers(docs: list[dict]) -> list[Peer]:
    ns = (("kubernetes.io/metadata.name", NAMESPACE),)
    pods = {
        pod_labels(w)["app.kubernetes.io/component"]: Peer(
            pod_labels(w)["app.kubernetes.io/component"], ns, tuple(pod_labels(w).items()), True
        )
        for w in workloads(docs)
    }
    outside = [
        Peer("monitoring", (("scalerl.io/monitoring", "true"),), (), False),
        Peer(
            "curve-client",
            (("scalerl.io/curve-client", "true"),),
            (("scalerl.io/curve-client", "true"),),
            False,
        ),
        Peer(
            "kube-dns",
            (("kubernetes.io/metadata.name", "kube-system"),),
            (("k8s-app", "kube-dns"),),
            False,
        ),
        Peer("elsewhere", (("kubernetes.io/metadata.name", "default"),), (("app", "x"),), False),
        # A managed Redis in the private network (deploy/components/external-redis).
        Peer("external-redis", (), (), False, ip="10.20.30.40"),
        Peer("internet", (), (), False, ip="203.0.113.7"),
    ]
    return [*pods.values(), *outside]


def _matches(selector: dict | None, labels: tuple[tuple[str, str], ...]) -> bool:
    """A label selector (matchLabels, and matchExpressions with In); {} selects all."""
    selector, have = selector or {}, dict(labels)
    if not all(have.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression  # the only one we use
        if have.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _peer_matches(entry: dict, peer: Peer) -> bool:
    """One `from`/`to` entry: a podSelector alone means this namespace; an ipBlock, the
    addresses outside the Kubernetes cluster in it."""
    if "ipBlock" in entry:
        block = entry["ipBlock"]
        if not peer.ip:
            return False
        address = ipaddress.ip_address(peer.ip)
        excepted = any(address in ipaddress.ip_network(e) for e in block.get("except", []))
        return address in ipaddress.ip_network(block["cidr"]) and not excepted
    if "namespaceSelector" in entry:
        if not _matches(entry["namespaceSelector"], peer.namespace_labels):
            return False
    elif not peer.ours:
        return False
    return "podSelector" not in entry or _matches(entry["podSelector"], peer.labels)


def _allowed_ports(policies: list[dict], pod: Peer, other: Peer, direction: str) -> frozenset:
    kind = "Ingress" if direction == "ingress" else "Egress"
    selecting = [
        p
        for p in policies
        if kind in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], pod.labels)
    ]
    if not selecting:
        return ANY
    allowed: set[int] = set()
    for policy in selecting:
        for rule in policy["spec"].get(direction, []):
            peers = rule.get("from" if direction == "ingress" else "to")
            if peers is not None and not any(_peer_matches(e, other) for e in peers):
                continue
            ports = rule.get("ports")
            allowed |= ANY if ports is None else {p["port"] for p in ports}
    return frozenset(allowed)


def allowed_peers(docs: list[dict]) -> dict[tuple[str, str], frozenset]:
    """(sender, receiver) -> the ports it may reach, for every pair with any."""
    policies = find(docs, "NetworkPolicy")
    peers = _peers(docs)
    table = {}
    for sender in peers:
        for receiver in peers:
            out = _allowed_ports(policies, sender, receiver, "egress") if sender.ours else ANY
            into = _allowed_ports(policies, receiver, sender, "ingress") if receiver.ours else ANY
            if not (sender.ours or receiver.ours):
                continue
            ports = out & into
            if ports:
                table[(sender.name, receiver.name)] = ports
    return table


OURS = ("learner", "rollout", "curve", "redis", "sandbox")
EXPECTED = {
    **{(c, "kube-dns"): frozenset({53}) for c in OURS if c != "sandbox"},
    ("learner", "sandbox"): frozenset({50054}),
    ("rollout", "sandbox"): frozenset({50054}),
    ("learner", "redis"): frozenset({6379}),
    ("rollout", "redis"): frozenset({6379}),
    ("curve", "redis"): frozenset({6379}),
    ("learner", "curve"): frozenset({50053}),
    ("curve-client", "curve"): frozenset({50053}),
    ("learner", "learner"): ANY,
    ("learner", "rollout"): ANY,
    ("rollout", "learner"): ANY,
    ("rollout", "rollout"): ANY,
    ("monitoring", "learner"): frozenset({9101}),
    ("monitoring", "rollout"): frozenset({9102}),
    ("monitoring", "curve"): frozenset({9103}),
}


# With deploy/components/external-redis: no Redis pod; the same components reach the
# external one on the same port, and nothing else outside.
EXTERNAL_REDIS = {
    **{pair: ports for pair, ports in EXPECTED.items() if "redis" not in pair},
    **{(c, "kube-dns"): frozenset({53}) for c in ("learner", "rollout", "curve")},
    **{(c, "external-redis"): frozenset({6379}) for c in ("learner", "rollout", "curve")},
}


# With deploy/components/reward-model: the reward service, scored by the learner and the
# workers, reaching nothing.
REWARD = {
    **EXPECTED,
    ("learner", "reward"): frozenset({50055}),
    ("rollout", "reward"): frozenset({50055}),
}


def test_each_pod_reaches_only_its_peers(docs: list[dict]) -> None:
    ours = {p.name for p in _peers(docs) if p.ours}
    if "redis" not in ours:  # an external Redis
        assert ours == set(OURS) - {"redis"}
        assert allowed_peers(docs) == EXTERNAL_REDIS
        return
    if "reward" in ours:
        assert ours == {*OURS, "reward"}
        assert allowed_peers(docs) == REWARD
        return
    assert ours == set(OURS)
    assert allowed_peers(docs) == EXPECTED


def test_everything_else_is_denied_by_default(docs: list[dict]) -> None:
    [deny] = [p for p in find(docs, "NetworkPolicy") if p["metadata"]["name"] == "default-deny"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
