"""The pods of a rendered overlay as local processes: what the kubelet would run, on one
machine without a cluster.

For every container of every Deployment and StatefulSet (replicas expanded, one pod each)
the command line and environment are resolved exactly as the kubelet resolves them
(`resolve_env`, `kube_command`: env `value` with `$(VAR)` expansion, `valueFrom` of the
rendered ConfigMaps and Secrets, pod fields), and only then made local by one function,
`localize`, which rewrites the few things a machine without a cluster lacks:

- a Service's or a pod's DNS name (`redis`, `curve:50053`, `learner-0.learner.scalerl.svc`)
  becomes 127.0.0.1, and so does the wildcard bind address 0.0.0.0 (a pod has a network
  of its own; here every process shares the machine's, and the downward API's pod IP is
  127.0.0.1 already);
- each container port becomes a free loopback port of that pod (`LocalNetwork`): the same
  pod port is the same local port everywhere it is referenced (its own `--port` flag, a
  Service's port that targets it, a URL naming it), and two pods listening on the same
  number in the cluster get different local ports;
- each volume mount path becomes a folder of the sandbox (`LocalVolumes`): ConfigMap and
  Secret volumes hold their keys as files, emptyDir is a fresh folder per pod, a
  PersistentVolumeClaim (or a StatefulSet's claim template) one folder per claim.

The executable is the image's entry point found locally (`local_argv`): the console
scripts of the venv the tests run in, `python` as that interpreter, and `redis-server` as
the one `scalerl_cli.redis_server.find_redis_binary` finds (its port, which the manifest
leaves at Redis's default, is given on the command line). Nothing else of the manifests'
values is changed.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from scalerl.ports import free_port
from scalerl_cli.processes import spawn_tied
from scalerl_cli.redis_server import find_redis_binary

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"
DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when the manifest sets none
REDIS_DEFAULT_PORT = 6379  # redis-server listens here unless --port says otherwise
# The environment the images set (deploy/images/*.Dockerfile ENV) that the manifests
# do not repeat; PYTHONPATH stands in for the package the image installs.
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class Pod:
    """One replica of a workload: the name the controller gives it (StatefulSet:
    `<name>-<ordinal>`; Deployment: `<name>-local<i>`, standing in for the ReplicaSet's
    hash and random suffix), its ordinal and its workload document."""

    name: str
    ordinal: int
    workload: dict

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"].get("labels", {})

    @property
    def namespace(self) -> str:
        return self.workload["metadata"].get("namespace", "default")

    @property
    def kind(self) -> str:
        return self.workload["kind"]

    @property
    def grace_s(self) -> int:
        """terminationGracePeriodSeconds: how long the kubelet waits after SIGTERM."""
        return int(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))


def pods_of(docs: list[dict]) -> list[Pod]:
    """Every pod the Deployments and StatefulSets of `docs` ask for, in document order.
    Raises ValueError for a pod with init containers (not run locally)."""
    pods = []
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        name = workload["metadata"]["name"]
        for i in range(int(workload["spec"].get("replicas", 1))):
            pod_name = f"{name}-{i}" if workload["kind"] == "StatefulSet" else f"{name}-local{i}"
            pod = Pod(pod_name, i, workload)
            if pod.spec.get("initContainers"):
                raise ValueError(f"{pod_name}: init containers are not run locally")
            pods.append(pod)
    return pods


def find_doc(docs: list[dict], kind: str, name: str) -> dict:
    """The document of `kind` and `name`; KeyError naming it when absent."""
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind} named {name!r} in the render")


# ----- what the kubelet resolves ---------------------------------------------------------


def expand(text: str, values: dict[str, str]) -> str:
    """Kubernetes variable expansion: `$(VAR)` becomes values[VAR] when defined (else it
    stays as written), `$$` becomes `$`."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return values.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


def config_data(docs: list[dict], kind: str, name: str) -> dict[str, str]:
    """The keys of a ConfigMap or Secret (a Secret's `data` base64-decoded, its
    `stringData` as written)."""
    doc = find_doc(docs, kind, name)
    data = dict(doc.get("data") or {})
    if kind == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
        data.update(doc.get("stringData") or {})
    return data


def field_value(pod: Pod, path: str) -> str:
    """A `fieldRef` of the downward API. The pod and host IPs are the loopback address
    (every local process shares it). Raises ValueError for a field not supported."""
    fields = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": LOOPBACK,
        "status.hostIP": LOOPBACK,
        "spec.nodeName": "localhost",
    }
    label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
    if label:
        labels = dict(pod.labels)
        if pod.kind == "StatefulSet":
            labels["apps.kubernetes.io/pod-index"] = str(pod.ordinal)
        return labels.get(label.group(1), "")
    if path not in fields:
        raise ValueError(f"{pod.name}: fieldRef {path!r} is not supported locally")
    return fields[path]


def resolve_env(docs: list[dict], pod: Pod, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: `envFrom` first, then `env`
    in order, each `value` expanded against the variables before it. Raises KeyError for
    a ConfigMap/Secret (or key) that is not in the render, ValueError for an unsupported
    source."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source.get("configMapRef") or source["secretRef"]
        for key, value in config_data(docs, kind, ref["name"]).items():
            env[source.get("prefix", "") + key] = value
    for item in container.get("env", []):
        env[item["name"]] = _env_value(docs, pod, item, env)
    return env


def _env_value(docs: list[dict], pod: Pod, item: dict, env: dict[str, str]) -> str:
    if "valueFrom" not in item:
        return expand(item.get("value", ""), env)
    source = item["valueFrom"]
    for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
        if key in source:
            ref = source[key]
            return config_data(docs, kind, ref["name"])[ref["key"]]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"])
    raise ValueError(f"{pod.name}: env {item['name']}: {sorted(source)} not supported locally")


def kube_command(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded from the container's environment, as the
    kubelet starts them (no shell)."""
    return [expand(part, env) for part in container.get("command", []) + container.get("args", [])]


# ----- the local stand-ins -----------------------------------------------------------------


class LocalNetwork:
    """A free loopback port for every (pod, container port), and the DNS names of the
    render's Services and of the pods behind headless ones.

    Service `svc` in namespace `ns` answers to `svc`, `svc.ns`, `svc.ns.svc` and
    `svc.ns.svc.cluster.local`; a pod of a StatefulSet governed by a headless Service
    also to `<pod>.svc[.ns[.svc[.cluster.local]]]`. A Service's port leads to its
    targetPort (by name or number) on the one pod it selects."""

    def __init__(self, docs: list[dict], pods: list[Pod]) -> None:
        self.pods = pods
        self.ports: dict[tuple[str, int], int] = {}
        for pod in pods:
            for container in pod.spec["containers"]:
                for port in container.get("ports", []):
                    self.ports[(pod.name, int(port["containerPort"]))] = free_port()
        self.names: dict[str, tuple[dict, Pod | None]] = {}  # DNS name -> (Service, pod)
        for service in (d for d in docs if d["kind"] == "Service"):
            self._add_service(service)

    def _add_service(self, service: dict) -> None:
        name, ns = service["metadata"]["name"], service["metadata"].get("namespace", "default")
        forms = [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]
        for form in forms:
            self.names[form] = (service, None)
        if service["spec"].get("clusterIP") == "None":
            for pod in self._selected(service):
                if pod.workload["spec"].get("serviceName") == name:
                    for form in forms:
                        self.names[f"{pod.name}.{form}"] = (service, pod)

    def _selected(self, service: dict) -> list[Pod]:
        selector = service["spec"].get("selector") or {}
        return [
            p
            for p in self.pods
            if selector and all(p.labels.get(k) == v for k, v in selector.items())
        ]

    def local_port(self, pod: Pod, container_port: int) -> int:
        """The loopback port standing in for `container_port` of `pod`. KeyError when the
        pod declares no such container port."""
        try:
            return self.ports[(pod.name, container_port)]
        except KeyError:
            raise KeyError(f"{pod.name} declares no container port {container_port}") from None

    def address(self, host: str, port: int) -> int:
        """The local port of `host:port`, host a Service's or a pod's DNS name. Raises
        KeyError for a port the Service does not have, ValueError for a Service that
        does not select exactly one pod (no balancing here)."""
        service, pod = self.names[host]
        if pod is not None:
            return self.local_port(pod, port)
        spec_port = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
        if spec_port is None:
            raise KeyError(f"Service {host} has no port {port}")
        selected = self._selected(service)
        if len(selected) != 1:
            raise ValueError(f"Service {host} selects {len(selected)} pods; locally it needs 1")
        return self.local_port(selected[0], _target_port(selected[0], spec_port))


def _target_port(pod: Pod, spec_port: dict) -> int:
    """The container port a Service port's targetPort names (a number, or a port name)."""
    target = spec_port.get("targetPort", spec_port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod.spec["containers"]:
        for port in container.get("ports", []):
            if port.get("name") == target:
                return int(port["containerPort"])
    raise KeyError(f"{pod.name}: no container port named {target!r}")


class LocalVolumes:
    """A folder under `root` for every volume: ConfigMap/Secret volumes written with
    their keys (`items` path -> key, or every key), emptyDir per pod, and one folder per
    PersistentVolumeClaim shared by every pod that mounts it (a StatefulSet's claim
    templates give `<template>-<pod>`)."""

    def __init__(self, docs: list[dict], root: Path) -> None:
        self.docs = docs
        self.root = root

    def folder(self, pod: Pod, volume_name: str) -> Path:
        """The folder of `pod`'s volume `volume_name`, created (and filled) on first use.
        Raises KeyError for a volume the pod does not have, ValueError for a type not
        supported locally."""
        claims = [
            t["metadata"]["name"] for t in pod.workload["spec"].get("volumeClaimTemplates", [])
        ]
        if volume_name in claims:
            return self._make(self.root / "pvc" / f"{volume_name}-{pod.name}")
        volume = next((v for v in pod.spec.get("volumes", []) if v["name"] == volume_name), None)
        if volume is None:
            raise KeyError(f"{pod.name}: no volume {volume_name!r}")
        if "persistentVolumeClaim" in volume:
            return self._make(self.root / "pvc" / volume["persistentVolumeClaim"]["claimName"])
        folder = self.root / "pods" / pod.name / volume_name
        if "emptyDir" in volume:
            return self._make(folder)
        for key, kind in (("configMap", "ConfigMap"), ("secret", "Secret")):
            if key in volume:
                name = volume[key].get("name") or volume[key]["secretName"]
                return self._fill(folder, config_data(self.docs, kind, name), volume[key])
        raise ValueError(f"{pod.name}: volume {volume_name}: type not supported locally")

    @staticmethod
    def _make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @staticmethod
    def _fill(folder: Path, data: dict[str, str], source: dict) -> Path:
        if folder.exists():
            return folder
        folder.mkdir(parents=True)
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            path = folder / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data[item["key"]])
            path.chmod(item.get("mode", source.get("defaultMode", 0o644)))  # as the kubelet
        return folder

    def mounts(self, pod: Pod, container: dict) -> dict[str, Path]:
        """mountPath -> local folder (or file, with subPath) of every volume mount."""
        out = {}
        for mount in container.get("volumeMounts", []):
            local = self.folder(pod, mount["name"])
            out[mount["mountPath"].rstrip("/")] = local / mount.get("subPath", "")
        return out


# ----- the one rewrite ------------------------------------------------------------------------


def localize(
    text: str, pod: Pod, container: dict, network: LocalNetwork, mounts: dict[str, Path]
) -> str:
    """One resolved argument or environment value of `pod`'s `container`, made local.
    Everything else of the manifest's value is kept. In order:

    1. the whole value is one of the container's own port numbers -> its local port;
    2. the whole value is 0.0.0.0 or a dotted Service/pod DNS name -> 127.0.0.1 (a bare
       Service name alone is left: `learner` may be a word, not a host);
    3. each `name:port` inside it (a URL's host, an address flag), name a Service's or a
       pod's DNS name -> 127.0.0.1:<local port> (`LocalNetwork.address`);
    4. each mount path at its start or after `=` (and what follows it) -> the mount's
       local folder (`LocalVolumes`).
    """
    own_ports = {int(p["containerPort"]) for p in container.get("ports", [])}
    if text.isdigit() and int(text) in own_ports:
        return str(network.local_port(pod, int(text)))
    if text == WILDCARD or ("." in text and text in network.names):
        return LOOPBACK
    names = "|".join(re.escape(n) for n in sorted(network.names, key=len, reverse=True))
    text = re.sub(
        rf"(?<![\w.-])({names}):(\d+)(?!\d)",
        lambda m: f"{LOOPBACK}:{network.address(m.group(1), int(m.group(2)))}",
        text,
    )
    if mounts:  # one pass: a local folder may itself lie under a mount path (/tmp)
        paths = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        text = re.sub(rf"(?<![^=])({paths})(?=/|$)", lambda m: str(mounts[m.group(1)]), text)
    return text


def local_argv(argv: list[str], pod: Pod, network: LocalNetwork) -> list[str]:
    """The image's executable found on this machine: a console script of the running
    venv (the images install the same package), `python` as this interpreter, and
    `redis-server` as the bundled or installed binary, bound to loopback on the local
    port of the pod's Redis port (the manifest leaves it at Redis's default, 6379).
    Raises FileNotFoundError for an executable with no local counterpart."""
    head, rest = argv[0], argv[1:]
    if head == "redis-server":
        port = network.local_port(pod, REDIS_DEFAULT_PORT)
        return [find_redis_binary(), *rest, "--port", str(port), "--bind", LOOPBACK]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    script = Path(sys.executable).parent / head
    if not script.is_file():
        raise FileNotFoundError(f"{pod.name}: no console script {head!r} in {script.parent}")
    return [str(script), *rest]


# ----- the processes ----------------------------------------------------------------------


@dataclass
class LocalProcess:
    """One container of one pod running locally: its argv and environment as resolved
    from the manifest (`cluster_argv`, `cluster_env`), the local ones it runs with, the
    pod's local ports, its log, and its working folder (standing in for the read-only
    root file system: nothing should be written there)."""

    pod: Pod
    container: dict
    cluster_argv: list[str]
    cluster_env: dict[str, str]
    argv: list[str]
    env: dict[str, str]
    workdir: Path
    log_path: Path
    ports: dict[int, int]  # the pod's container ports -> their local ports
    proc: subprocess.Popen | None = None
    stopped_in_s: float | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.pod.name}/{self.container['name']}"

    def start(self) -> LocalProcess:
        """Start (or, like the kubelet after an exit, start again) the process in a
        process group of its own, which dies with the test process."""
        with open(self.log_path, "ab") as log:
            self.proc = spawn_tied(
                self.argv,
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def terminate(self) -> int:
        """SIGTERM, then wait up to the pod's grace period (SIGKILL after it, as the
        kubelet does). Returns the exit status; `stopped_in_s` records the wait."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=self.pod.grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.stopped_in_s = time.monotonic() - started
        return code

    def group_alive(self) -> bool:
        """True while any process of this process's group (its children too) runs."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ---\n" + "\n".join(text.splitlines()[-lines:])


def local_processes(docs: list[dict], sandbox: Path) -> list[LocalProcess]:
    """A `LocalProcess` (not started) for every container of every pod of `docs`, with
    its volumes and logs under `sandbox`."""
    pods = pods_of(docs)
    network = LocalNetwork(docs, pods)
    volumes = LocalVolumes(docs, sandbox / "volumes")
    out = []
    for pod in pods:
        for container in pod.spec["containers"]:
            out.append(_process(docs, pod, container, network, volumes, sandbox))
    return out


def _process(docs, pod, container, network, volumes, sandbox) -> LocalProcess:
    cluster_env = resolve_env(docs, pod, container)
    cluster_argv = kube_command(container, cluster_env)
    mounts = volumes.mounts(pod, container)

    def local(value: str) -> str:
        return localize(value, pod, container, network, mounts)

    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    env |= IMAGE_ENV | {"HOSTNAME": pod.name}
    if "/tmp" in mounts:  # the pod's /tmp is its volume; Python's tempfile honours TMPDIR
        env["TMPDIR"] = str(mounts["/tmp"])
    env |= {k: local(v) for k, v in cluster_env.items()}
    workdir = sandbox / "rootfs" / pod.name / container["name"]
    workdir.mkdir(parents=True, exist_ok=True)
    logs = sandbox / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    argv = local_argv([local(a) for a in cluster_argv], pod, network)
    log_path = logs / f"{pod.name}.{container['name']}.log"
    ports = {port: mapped for (name, port), mapped in network.ports.items() if name == pod.name}
    return LocalProcess(
        pod, container, cluster_argv, cluster_env, argv, env, workdir, log_path, ports
    )


def stop_all(processes: list[LocalProcess]) -> None:
    """SIGKILL every process group still alive (the clean-up after a failed test)."""
    for p in processes:
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()
        if p.proc is not None:
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
