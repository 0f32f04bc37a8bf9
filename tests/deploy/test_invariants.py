"""What schemas cannot see: the rendered manifests hang together. Selectors select the pods
they mean, Services and monitors name ports the containers declare, GPU requests equal
limits, probes are gRPC on the gRPC port (readiness of workers on "scalerl.ready"), images
are pinned, every referenced ConfigMap/Secret key exists, every $(VAR) is defined, KEDA
targets the rollout Deployment, and the learner's torchrun flags, GPUs and headless
Service agree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from deploy_manifests import (
    COMPOSITIONS,
    DEPLOY,
    EXTERNAL_REDIS_URLS,
    OVERLAYS,
    ROOT,
    containers,
    env_names,
    find,
    flag,
    image_tag,
    labels_match,
    learner,
    literal_env,
    one,
    ours,
    pod_labels,
    pod_spec,
    port_numbers,
    references,
    resolved_command,
    rollout,
    split_learner,
    workloads,
)


def _ready_health_name() -> str:
    """rollout_service.worker.READY_HEALTH_NAME, read without importing torch."""
    tree = ast.parse((ROOT / "rollout_service" / "worker.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "READY_HEALTH_NAME":
            return node.value.value
    raise AssertionError("rollout_service/worker.py defines no READY_HEALTH_NAME")


def _selected_pods(docs: list[dict], selector: dict[str, str]) -> list[dict]:
    return [w for w in workloads(docs) if labels_match(selector, pod_labels(w))]


def test_everything_lands_in_one_namespace(docs: list[dict]) -> None:
    namespaced = [d for d in docs if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"scalerl"}
    assert [d["metadata"]["name"] for d in find(docs, "Namespace")] == ["scalerl"]


def test_workload_selectors_match_their_pod_labels(docs: list[dict]) -> None:
    for w in workloads(docs):
        selector = w["spec"]["selector"]["matchLabels"]
        assert labels_match(selector, pod_labels(w)), w["metadata"]["name"]
        others = [o for o in workloads(docs) if o is not w]
        assert not any(labels_match(selector, pod_labels(o)) for o in others), (
            f"{w['metadata']['name']}: its selector also matches another workload's pods"
        )


def test_services_select_pods_that_declare_their_target_ports(docs: list[dict]) -> None:
    for svc in find(docs, "Service"):
        if svc["spec"].get("type") == "ExternalName":
            continue
        pods = _selected_pods(docs, svc["spec"]["selector"])
        assert len(pods) == 1, f"Service/{svc['metadata']['name']} selects {len(pods)} workloads"
        declared = [port_numbers(c) for c in containers(pods[0])]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found = any(
                target in names if isinstance(target, str) else target in names.values()
                for names in declared
            )
            assert found, f"Service/{svc['metadata']['name']} port {port['name']}: {target}"


def test_the_learner_has_a_headless_service_that_publishes_not_ready_addresses(docs) -> None:
    statefulset = one(docs, "StatefulSet", "learner")
    service = one(docs, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_monitors_scrape_declared_metrics_ports(docs: list[dict]) -> None:
    for monitor in find(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [
            s for s in find(docs, "Service") if labels_match(selector, s["metadata"]["labels"])
        ]
        assert len(services) == 1, f"ServiceMonitor/{monitor['metadata']['name']}"
        names = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= names
    for monitor in find(docs, "PodMonitor"):
        pods = _selected_pods(docs, monitor["spec"]["selector"]["matchLabels"])
        assert len(pods) == 1, f"PodMonitor/{monitor['metadata']['name']}"
        names = {n for c in containers(pods[0]) for n in port_numbers(c)}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= names
    # Every scalerl service is scraped where the prometheus-operator component is used.
    if find(docs, "ServiceMonitor"):
        scraped = {
            m["metadata"]["name"] for m in docs if m["kind"] in ("ServiceMonitor", "PodMonitor")
        }
        assert scraped == {"curve", "learner", "rollout"}


def test_gpu_requests_equal_limits(docs: list[dict]) -> None:
    for w in workloads(docs):
        for c in containers(w):
            requests = c.get("resources", {}).get("requests", {})
            limits = c.get("resources", {}).get("limits", {})
            for key in {k for k in (*requests, *limits) if "/" in k}:  # extended resources
                assert requests.get(key) == limits.get(key), f"{c['name']}: {key}"


def _check_tls_probes(container: dict, probes: dict, grpc_port: int) -> None:
    """On a TLS port: every probe is the TLS health check of scalerl.rpc.probe, on that
    port, with the CA of the mounted Secret and the name every client verifies."""
    assert sorted(probes) == ["livenessProbe", "readinessProbe", "startupProbe"]
    for kind, probe in probes.items():
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, kind
        command = probe["exec"]["command"]
        assert command[:4] == ["python", "-m", "scalerl.rpc.probe", f"127.0.0.1:{grpc_port}"]
        assert flag(command, "--server-name") == "scalerl.internal"
        ca = flag(command, "--tls-ca")
        assert any(ca.startswith(m["mountPath"] + "/") for m in container["volumeMounts"]), ca
    ready = flag(probes["readinessProbe"]["exec"]["command"], "--service")
    assert ready == (_ready_health_name() if container["name"] == "rollout" else None)


def test_probes_are_grpc_on_the_grpc_port(docs: list[dict]) -> None:
    ready = _ready_health_name()
    for w in workloads(docs):
        for c in filter(ours, containers(w)):
            grpc_port = port_numbers(c)["grpc"]
            probes = {
                k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c
            }
            multi_node = int(literal_env(c).get("LEARNER_NODES", "1")) > 1
            if multi_node:  # no gRPC on most ranks: each rank's liveness file instead
                assert sorted(probes) == ["livenessProbe"], c["name"]
                command = probes["livenessProbe"]["exec"]["command"]
                base = literal_env(c)["SCALERL_LIVENESS_FILE"]
                assert command[:3] == ["python", "-m", "scalerl.obs.liveness"]
                assert command[3] == base and float(command[4]) >= 60
                continue
            if literal_env(c).get("SCALERL_SECURITY__TLS_CA_FILE") or "--tls-cert" in c["args"]:
                _check_tls_probes(c, probes, grpc_port)  # the kubelet's gRPC is plaintext
                continue
            for kind, probe in probes.items():
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
                assert probe["grpc"]["port"] == grpc_port, f"{c['name']} {kind}"
            # Alive ("") for startup and liveness; a worker is ready on its own service.
            for kind in ("startupProbe", "livenessProbe"):
                if kind in probes:
                    assert probes[kind]["grpc"].get("service", "") == "", f"{c['name']} {kind}"
            if c["name"] == "rollout":
                assert probes["readinessProbe"]["grpc"]["service"] == ready
            assert probes, f"{c['name']}: no probes"


def test_probe_budgets_cover_start_up(docs: list[dict]) -> None:
    """A startup probe gives at least 5 minutes (model load, rendezvous); engines that
    load through vLLM or SGLang at least 15."""
    for w in workloads(docs):
        for c in filter(ours, containers(w)):
            if "startupProbe" not in c or c["name"] in ("curve", "sandbox"):  # no model load
                continue
            probe = c["startupProbe"]
            seconds = probe["periodSeconds"] * probe["failureThreshold"]
            engine = literal_env(c).get("SCALERL_ROLLOUT__ENGINE", "torch")
            least = 900 if (c["name"] == "rollout" and engine != "torch") else 300
            assert seconds >= least, f"{c['name']}: {seconds} s"


def test_images_are_pinned(docs: list[dict]) -> None:
    for w in workloads(docs):
        for c in containers(w):
            image = c["image"]
            assert "@sha256:" in image or image_tag(image), f"{image}: no tag"
            assert image_tag(image) != "latest", image


def test_referenced_config_map_and_secret_keys_exist(docs: list[dict]) -> None:
    data = {}
    for kind in ("ConfigMap", "Secret"):
        for d in find(docs, kind):
            keys = set(d.get("data", {})) | set(d.get("stringData", {}))
            data[(kind, d["metadata"]["name"])] = keys
    refs = {"configMapKeyRef": "ConfigMap", "secretKeyRef": "Secret"}
    for w in workloads(docs):
        for c in containers(w):
            for item in c.get("env", []):
                for field, kind in refs.items():
                    ref = item.get("valueFrom", {}).get(field)
                    if ref:
                        assert ref["key"] in data.get((kind, ref["name"]), ()), (c["name"], ref)
        for volume in pod_spec(w).get("volumes", []):
            if "configMap" in volume:
                keys = data.get(("ConfigMap", volume["configMap"]["name"]))
                assert keys is not None, volume
                assert {i["key"] for i in volume["configMap"].get("items", [])} <= keys
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert find(docs, "PersistentVolumeClaim", claim), claim


def test_every_variable_reference_is_defined(docs: list[dict]) -> None:
    """$(VAR) in command and args names a variable of the container; in an env value, a
    variable defined above it (the kubelet leaves anything else as literal text)."""
    for w in workloads(docs):
        for c in containers(w):
            names = env_names(c)
            for part in c.get("command", []) + c.get("args", []):
                for ref in references(part):
                    assert ref in names, f"{c['name']}: {part}"
            for i, item in enumerate(c.get("env", [])):
                for ref in references(item.get("value", "")):
                    assert ref in names[:i], f"{c['name']}: {item['name']} uses {ref}"


def test_containers_serve_on_the_ports_they_declare(docs: list[dict]) -> None:
    for w in workloads(docs):
        for c in filter(ours, containers(w)):
            argv = resolved_command(c)
            ports = port_numbers(c)
            assert int(flag(argv, "--port")) == ports["grpc"], c["name"]
            if c["name"] not in ("sandbox", "reward"):  # these services export no metrics
                assert int(flag(argv, "--metrics-port")) == ports["metrics"], c["name"]
            assert flag(argv, "--host") == "0.0.0.0", c["name"]


def _service_port(docs: list[dict], address: str) -> None:
    host, port = address.rsplit(":", 1)
    service = one(docs, "Service", host.split(".")[0])
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}, address


def _redis_password_key(workload: dict, container: dict) -> str:
    """The Secret key mounted at SCALERL_REDIS_PASSWORD_FILE."""
    path = literal_env(container)["SCALERL_REDIS_PASSWORD_FILE"]
    folder, name = path.rsplit("/", 1)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == folder)
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    [item] = [i for i in volume["secret"]["items"] if i["path"] == name]
    return item["key"]


def test_no_secret_is_in_an_environment_or_argument_but_redis_own(docs: list[dict]) -> None:
    """No secret is an environment variable of our containers (what /proc/<pid>/environ
    shows to anything in the pod): the token and the Redis passwords are files of the
    Secret, readable by the pod's group only (mode 0440, fsGroup). Redis's own container
    takes its users' passwords in its arguments: nothing else runs in its pod."""
    for w in workloads(docs):
        for c in filter(ours, containers(w)):
            refs = [
                e["valueFrom"]["secretKeyRef"]["key"]
                for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            ]
            assert refs == [], (c["name"], refs)
            assert "SCALERL_AUTH_TOKEN" not in env_names(c), c["name"]
        pod = w["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"].get("defaultMode") == 0o440, volume["name"]
                assert pod["securityContext"].get("fsGroup") == 10001, w["metadata"]["name"]


def test_redis_has_a_user_per_component_and_no_default(docs: list[dict]) -> None:
    if not find(docs, "StatefulSet", "redis"):  # an external Redis: its users are its own
        assert find(docs, "NetworkPolicy", "external-redis")
        return
    [redis_w] = [w for w in workloads(docs) if w["metadata"]["name"] == "redis"]
    args = containers(redis_w)[0]["args"]
    users = {}
    for i, word in enumerate(args):
        if word == "--user":
            end = next((j for j in range(i + 1, len(args)) if args[j].startswith("--")), len(args))
            users[args[i + 1]] = args[i + 2 : end]
    assert users["default"] == ["off"]
    assert set(users) == {"default", "learner", "rollout", "curve", "probe"}
    for name in ("learner", "rollout", "curve"):
        rules = users[name]
        assert rules[:2] == ["on", f">$(REDIS_{name.upper()})"]
        assert "-@admin" in rules and "-@dangerous" in rules and "-@all" in rules
    assert [r for r in users["curve"] if r.startswith("~")] == [
        "~scalerl:*:curve:*",
        "~scalerl:curve-service:*",
    ]
    assert users["probe"] == ["on", ">$(REDIS_PROBE)", "-@all", "+ping"]


def test_addresses_name_services_and_their_ports(docs: list[dict]) -> None:
    learner_c = learner(docs)
    argv = split_learner(resolved_command(learner_c)).learner_args
    _service_port(docs, flag(argv, "--curve-address"))
    for w in workloads(docs):
        for c in filter(ours, containers(w)):
            if c["name"] in ("sandbox", "reward"):  # they hold no secret: no Redis, no token
                assert not env_names(c) or "REDIS_URL" not in env_names(c)
                assert "SCALERL_AUTH_TOKEN" not in env_names(c)
                continue
            # The component's ACL user; its password only in a file from the Secret.
            assert flag(c["args"], "--redis-url") == "$(REDIS_URL)", c["name"]
            assert _redis_password_key(w, c) == f"redis-{c['name']}", c["name"]
            if not find(docs, "StatefulSet", "redis"):
                _assert_external_redis_url(docs, c)
                continue
            redis_url = literal_env(c)["REDIS_URL"]
            assert redis_url == f"redis://{c['name']}@redis:6379/0", c["name"]
            _service_port(docs, redis_url.split("@", 1)[1].split("/", 1)[0])


def _assert_external_redis_url(docs: list[dict], container: dict) -> None:
    """deploy/components/external-redis: REDIS_URL is the container's key of the ConfigMap
    scalerl-redis (its own ACL user, a Redis Cluster here), and no Service `redis` is left."""
    [item] = [e for e in container["env"] if e["name"] == "REDIS_URL"]
    ref = item["valueFrom"]["configMapKeyRef"]
    assert ref["key"] == container["name"] and "value" not in item, item
    [config] = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"] == ref["name"]]
    assert config["metadata"]["name"].startswith("scalerl-redis")
    assert config["data"][ref["key"]] == EXTERNAL_REDIS_URLS[container["name"]]
    assert not find(docs, "Service", "redis")


def test_the_learner_advertises_its_stable_dns_name(docs: list[dict]) -> None:
    statefulset = one(docs, "StatefulSet", "learner")
    args = learner(docs)["args"]
    host = args[args.index("--advertise-host") + 1]
    assert host == f"$(POD_NAME).{statefulset['spec']['serviceName']}.$(POD_NAMESPACE).svc"


def test_keda_targets_the_rollout_deployment(docs: list[dict]) -> None:
    for scaled in find(docs, "ScaledObject"):
        ref = scaled["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment"
        target = one(docs, "Deployment", ref["name"])
        assert target["metadata"]["namespace"] == scaled["metadata"]["namespace"]
        assert target["metadata"]["name"] == "rollout"
        assert "replicas" not in target["spec"], "the HPA owns the rollout replicas"
        trigger = scaled["spec"]["triggers"][0]
        assert trigger["type"] == "prometheus"
        assert "scalerl_rollout_desired_replicas" in trigger["metadata"]["query"]
        assert f'namespace="{scaled["metadata"]["namespace"]}"' in trigger["metadata"]["query"]
        assert (trigger["metricType"], trigger["metadata"]["threshold"]) == ("AverageValue", "1")


def test_workers_drain_within_their_grace_period_without_surging(docs: list[dict]) -> None:
    deployment = one(docs, "Deployment", "rollout")
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    # The learner's ranks: torchrun waits for them inside the pod's grace period.
    statefulset = one(docs, "StatefulSet", "learner")
    command = split_learner(resolved_command(learner(docs)))
    if command.torchrun:
        shutdown = int(flag(command.torchrun, "--shutdown-timeout"))
        assert shutdown + 15 <= pod_spec(statefulset)["terminationGracePeriodSeconds"]


def test_learner_ranks_nodes_and_gpus_agree(docs: list[dict]) -> None:
    statefulset = one(docs, "StatefulSet", "learner")
    c = learner(docs)
    command = split_learner(resolved_command(c))
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if not command.torchrun:
        assert statefulset["spec"]["replicas"] == 1
        assert gpus in (None, "1")
        return
    assert command.module == "learner_service.main"
    env = literal_env(c)
    nodes, per_node = int(env["LEARNER_NODES"]), int(env["LEARNER_RANKS_PER_NODE"])
    assert statefulset["spec"]["replicas"] == nodes
    assert gpus is None or int(gpus) == per_node
    assert flag(command.torchrun, "--rdzv-backend") == "static"  # node rank = pod index
    assert flag(command.torchrun, "--node-rank") == "0"  # from the pod-index label
    endpoint = flag(command.torchrun, "--rdzv-endpoint")
    service = statefulset["spec"]["serviceName"]
    assert endpoint.startswith(f"learner-0.{service}.")
    assert int(endpoint.rsplit(":", 1)[1]) == port_numbers(c)["rdzv"]
    if nodes > 1:
        assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
        runs = one(docs, "PersistentVolumeClaim", "runs")
        assert runs["spec"]["accessModes"] == ["ReadWriteMany"]


def _learner_args(docs: list[dict]) -> list[str]:
    """The learner's own arguments but the Redis URL's value (each render's URL is checked
    by test_addresses_name_services_and_their_ports)."""
    argv = split_learner(resolved_command(learner(docs))).learner_args
    at = argv.index("--redis-url") + 1
    return argv[:at] + argv[at + 1 :]


def test_the_learner_gets_the_same_arguments_under_torchrun(rendered: dict) -> None:
    plain = _learner_args(rendered["cpu-smoke"])
    for name, docs in rendered.items():
        assert _learner_args(docs) == plain, name


@pytest.mark.parametrize("name", ["rollout", "learner"])
def test_the_gpu_renders_put_every_gpu_pod_on_gpu_nodes(rendered: dict, name: str) -> None:
    for docs in rendered.values():
        workload = next(w for w in workloads(docs) if w["metadata"]["name"] == name)
        c = rollout(docs) if name == "rollout" else learner(docs)
        if "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}):
            continue
        spec = pod_spec(workload)
        assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert literal_env(c)["SCALERL_DEVICE"] == "cuda"
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in spec["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory"


def test_every_component_is_rendered_by_an_overlay_or_a_composition() -> None:
    used = {name for names in COMPOSITIONS.values() for name in names}
    for overlay in OVERLAYS:
        text = yaml.safe_load((DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())
        used |= {Path(c).name for c in text.get("components", [])}
    assert used == {p.name for p in (DEPLOY / "components").iterdir() if p.is_dir()}
