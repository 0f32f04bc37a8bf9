"""Rendering deploy/ with kustomize and reading what the rendered manifests say: workloads,
containers, environment, ports, the run config each scalerl container loads, Dockerfiles.

Rendering needs `kubectl` (kustomize is built in); `render` raises KubectlMissing without
it, and the fixtures turn that into a skip. The GPU overlays read the run's secrets from
a secrets.env that is never committed, so they are rendered from a copy of deploy/ with
one written from secrets.env.example (`copy_deploy`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu-smoke", "gpu-1node", "gpu-multinode")
# Components that no overlay uses, rendered on the base with their prerequisites.
COMPOSITIONS = {
    "gpu+engine-sglang": ("gpu", "engine-sglang"),
    "sandbox-gvisor": ("sandbox-gvisor",),
    "tls": ("tls",),
    "external-redis": ("external-redis",),
    "reward-model": ("reward-model",),
}
# The ConfigMap of deploy/components/external-redis: each component's Redis URL, by name.
EXTERNAL_REDIS_URLS = {
    name: f"redis://{name}@redis-0.example.internal:6379/0?cluster=true"
    for name in ("learner", "rollout", "curve")
}
KUBERNETES_VERSION = "1.32"  # what kubernetes-validate checks against (kubectl 1.32 here)
IMAGE_PREFIX = "ghcr.io/scalerl/"  # images built from deploy/images/<name>.Dockerfile
CONFIG_PATH = "/etc/scalerl/scalerl.yaml"
# SCALERL_* variables that are no run-config field (scalerl.rpc.security, scalerl.obs.logging,
# scalerl.policy.models).
NON_CONFIG_ENV = frozenset(
    {
        "SCALERL_AUTH_TOKEN",
        "SCALERL_LOG_FORMAT",
        "SCALERL_CACHE",
        "SCALERL_REDIS_PASSWORD_FILE",
        "SCALERL_LIVENESS_FILE",
    }
)
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class KubectlMissing(RuntimeError):
    """kubectl is not on PATH."""


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize directory`, parsed. Raises KubectlMissing, or RuntimeError with
    kustomize's message when the directory does not render."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KubectlMissing("kubectl is not installed (it carries kustomize)")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def copy_deploy(target: Path) -> Path:
    """Copy deploy/ to target/deploy with a secrets.env (from secrets.env.example, every
    key given a test value) in each overlay that has an example. Returns target/deploy."""
    copy = target / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("secrets.env"))
    for example in copy.glob("overlays/*/secrets.env.example"):
        keys = [line.split("=", 1)[0] for line in _data_lines(example)]
        example.with_name("secrets.env").write_text("".join(f"{k}=test{k}\n" for k in keys))
    return copy


def _data_lines(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def compose(target: Path, deploy: Path, components: tuple[str, ...]) -> Path:
    """A kustomization in `target` of deploy/base plus `components`, with a Secret of test
    values (and, with external-redis, its ConfigMap of Redis URLs). Returns its folder."""
    target.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(deploy, target))
    text = {
        "namespace": "scalerl",
        "resources": [str(rel / "base")],
        "components": [str(rel / "components" / name) for name in components],
        "secretGenerator": [
            {
                "name": "scalerl-secrets",
                "options": {"disableNameSuffixHash": True},
                "literals": ["auth-token=test-token"]
                + [f"redis-{user}=test{user}" for user in ("learner", "rollout", "curve", "probe")],
            }
        ],
    }
    if "external-redis" in components:
        literals = [f"{name}={url}" for name, url in EXTERNAL_REDIS_URLS.items()]
        text["configMapGenerator"] = [{"name": "scalerl-redis", "literals": literals}]
    (target / "kustomization.yaml").write_text(yaml.safe_dump(text))
    return target


# ----- reading rendered documents ----------------------------------------------------------

WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    """Documents of `kind` (and `name`, when given)."""
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[dict], kind: str, name: str) -> dict:
    """The document of `kind` and `name`; AssertionError unless exactly one."""
    found = find(docs, kind, name)
    assert len(found) == 1, f"{kind}/{name}: {len(found)} documents"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    """The Deployments and StatefulSets."""
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: dict, init: bool = True) -> list[dict]:
    """The workload's containers (and init containers)."""
    spec = pod_spec(workload)
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def ours(container: dict) -> bool:
    """A container running one of this project's images."""
    return container["image"].startswith(IMAGE_PREFIX)


def main_container(docs: list[dict], kind: str, name: str) -> dict:
    """The container named like its workload (learner, rollout, curve, redis)."""
    found = [c for c in containers(one(docs, kind, name)) if c["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: no container {name!r}"
    return found[0]


def learner(docs: list[dict]) -> dict:
    return main_container(docs, "StatefulSet", "learner")


def rollout(docs: list[dict]) -> dict:
    return main_container(docs, "Deployment", "rollout")


def port_numbers(container: dict) -> dict[str, int]:
    """containerPort by port name."""
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ----- environment and command lines -----------------------------------------------------


def literal_env(container: dict) -> dict[str, str]:
    """Environment variables with a literal `value`, references to earlier literal ones
    expanded the way the kubelet does (references to valueFrom variables kept as $(NAME))."""
    known: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            known[item["name"]] = expand(item["value"], known)
    return known


def env_names(container: dict) -> list[str]:
    return [item["name"] for item in container.get("env", [])]


def expand(text: str, values: dict[str, str]) -> str:
    """$(VAR) replaced by values[VAR] where known (else kept, as the kubelet keeps it)."""
    return _VAR.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def references(text: str) -> list[str]:
    """Names of the $(VAR) references in text."""
    return _VAR.findall(text)


def resolved_command(container: dict) -> list[str]:
    """command + args with every $(VAR) replaced: literal values, and a placeholder that
    names the variable for valueFrom ones (pod fields, secrets)."""
    values: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            values[item["name"]] = expand(item["value"], values)
        else:
            values[item["name"]] = _placeholder(item)
    return [
        expand(part, values) for part in container.get("command", []) + container.get("args", [])
    ]


def _placeholder(item: dict) -> str:
    """A value standing in for a valueFrom variable: a pod index is a number, a pod name
    or IP a host name."""
    field = item["valueFrom"].get("fieldRef", {}).get("fieldPath", "")
    if "pod-index" in field:
        return "0"
    return item["name"].lower().replace("_", "-")


@dataclass
class LearnerCommand:
    """The learner container's command line split into torchrun's flags (empty for a
    single rank) and the learner entry point's own arguments."""

    torchrun: list[str]
    module: str | None  # the -m module under torchrun, None for the console script
    learner_args: list[str]


def split_learner(argv: list[str]) -> LearnerCommand:
    """Split a resolved learner command line (`resolved_command`)."""
    if argv[:3] == ["python", "-m", "torch.distributed.run"]:
        rest = argv[3:]
        at = rest.index("-m")
        return LearnerCommand(rest[:at], rest[at + 1], rest[at + 2 :])
    return LearnerCommand([], None, argv[1:])


def flag(argv: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in argv, else None."""
    for i, part in enumerate(argv):
        if part == name and i + 1 < len(argv):
            return argv[i + 1]
        if part.startswith(name + "="):
            return part.split("=", 1)[1]
    return None


def config_overrides(container: dict) -> list[str]:
    """`section.field=value` overrides the container's process applies: its SCALERL_*
    environment (scalerl.config.environment_overrides) and its --set arguments."""
    from scalerl.config import environment_overrides

    argv = container.get("args", [])
    sets = [argv[i + 1] for i, part in enumerate(argv) if part == "--set"]
    return environment_overrides(literal_env(container)) + sets


def config_yaml(docs: list[dict], container: dict, workload: dict) -> str:
    """The run config file the container reads at CONFIG_PATH: the key of the ConfigMap
    volume mounted at its folder."""
    folder, name = CONFIG_PATH.rsplit("/", 1)
    mount = next(m for m in container.get("volumeMounts", []) if m["mountPath"] == folder)
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    items = {i["path"]: i["key"] for i in volume["configMap"].get("items", [])}
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    return config_map["data"][items.get(name, name)]


# ----- the package and its images ----------------------------------------------------------


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def console_scripts() -> dict[str, str]:
    """[project.scripts]: name -> module:function."""
    return pyproject()["project"]["scripts"]


@dataclass
class Dockerfile:
    """What the checks need from a Dockerfile: base images with ARG defaults applied,
    the final stage's USER, ENTRYPOINT and EXPOSE, and every RUN line."""

    path: Path
    bases: list[str]
    user: str | None
    entrypoint: list[str] | None
    exposed: set[int]
    runs: list[str]


def dockerfiles() -> dict[str, Dockerfile]:
    """deploy/images/<image name>.Dockerfile by image name."""
    return {
        p.name.removesuffix(".Dockerfile"): parse_dockerfile(p)
        for p in sorted((DEPLOY / "images").glob("*.Dockerfile"))
    }


def parse_dockerfile(path: Path) -> Dockerfile:
    """Parse the instructions (continuation lines joined, comments dropped). Global ARG
    defaults (before the first FROM) are substituted into FROM lines."""
    import json

    args: dict[str, str] = {}
    bases: list[str] = []
    user = entrypoint = None
    exposed: set[int] = set()
    runs: list[str] = []
    for instruction, rest in _instructions(path.read_text()):
        if instruction == "ARG" and not bases and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
        elif instruction == "FROM":
            image = rest.split()[0]
            bases.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image))
            user, entrypoint, exposed = None, None, set()  # a new stage
        elif instruction == "USER":
            user = rest
        elif instruction == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif instruction == "EXPOSE":
            exposed |= {int(p.split("/")[0]) for p in rest.split()}
        elif instruction == "RUN":
            runs.append(rest)
    return Dockerfile(path, bases, user, entrypoint, exposed, runs)


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    joined = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        joined += line
        instruction, _, rest = joined.strip().partition(" ")
        yield instruction.upper(), " ".join(rest.split())
        joined = ""


def image_name(image: str) -> str:
    """ghcr.io/scalerl/scalerl-vllm:0.1.0 -> scalerl-vllm."""
    return image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def image_tag(image: str) -> str | None:
    """The tag of an image reference (None when it has none)."""
    last = image.rsplit("/", 1)[-1].split("@")[0]
    return last.split(":", 1)[1] if ":" in last else None
