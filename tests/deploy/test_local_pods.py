"""The local stand-ins of `local_pods` (what tests/deploy/test_cpu_smoke_runs.py runs):
Kubernetes' variable expansion, the environment the kubelet resolves, and `localize`
keeping one local port per pod port and one folder per volume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from local_pods import LOOPBACK, expand, local_processes

from scalerl.config import load_config


def test_expand_follows_kubernetes() -> None:
    values = {"A": "x", "B.c": "y"}
    assert expand("$(A)-$(B.c)", values) == "x-y"
    assert expand("$(MISSING)", values) == "$(MISSING)"  # kept as written
    assert expand("$$(A) costs $$5", values) == "$(A) costs $5"  # $$ escapes


@pytest.fixture
def smoke(rendered: dict, tmp_path: Path) -> dict:
    """The cpu-smoke overlay's processes (not started) by pod/container name."""
    return {p.name: p for p in local_processes(rendered["cpu-smoke"], tmp_path)}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_kubelet_environment_is_resolved_before_anything_is_local(smoke: dict) -> None:
    learner = smoke["learner-0/learner"]
    env = learner.cluster_env
    assert env["REDIS_URL"] == "redis://learner@redis:6379/0"  # no password in it
    password_file = Path(env["SCALERL_REDIS_PASSWORD_FILE"])
    assert password_file.as_posix() == "/etc/scalerl-redis/password"
    redis_env = smoke["redis-0/redis"].cluster_env
    assert redis_env["REDIS_LEARNER"] == "cpu-smoke-redis-learner-not-a-secret"  # base64
    assert (env["POD_NAME"], env["POD_NAMESPACE"]) == ("learner-0", "scalerl")
    assert _flag(learner.cluster_argv, "--advertise-host") == "learner-0.learner.scalerl.svc"
    assert smoke["rollout-local1/rollout"].cluster_env["POD_IP"] == LOOPBACK


def test_one_local_port_per_pod_port_everywhere_it_is_named(smoke: dict) -> None:
    redis_port = _flag(smoke["redis-0/redis"].argv, "--port")
    assert redis_port == str(smoke["redis-0/redis"].ports[6379])
    for name in ("learner-0/learner", "curve-local0/curve", "rollout-local0/rollout"):
        url = f"redis://{name.split('-')[0]}@{LOOPBACK}:{redis_port}/0"
        assert smoke[name].env["REDIS_URL"] == url
        assert _flag(smoke[name].argv, "--redis-url") == url
    curve_port = _flag(smoke["curve-local0/curve"].argv, "--port")
    assert curve_port == str(smoke["curve-local0/curve"].ports[50053])
    learner = smoke["learner-0/learner"]
    assert _flag(learner.argv, "--curve-address") == f"{LOOPBACK}:{curve_port}"
    assert _flag(learner.argv, "--advertise-host") == LOOPBACK
    assert _flag(learner.argv, "--host") == LOOPBACK  # not 0.0.0.0 on a shared machine
    workers = [smoke["rollout-local0/rollout"], smoke["rollout-local1/rollout"]]
    ports = {_flag(w.argv, f) for w in workers for f in ("--port", "--metrics-port")}
    ports |= {redis_port, curve_port, _flag(learner.argv, "--port")}
    assert len(ports) == 7 and "50052" not in ports  # both pods' 50052 and 9102 differ


def test_volumes_are_folders_with_the_manifests_files(smoke: dict, rendered: dict) -> None:
    learner = smoke["learner-0/learner"]
    config_path = Path(_flag(learner.argv, "--config"))
    config_map = next(d for d in rendered["cpu-smoke"] if d["kind"] == "ConfigMap")
    assert config_path.read_text() == config_map["data"]["scalerl.yaml"]
    assert load_config(str(config_path)).run_id == yaml.safe_load(config_path.read_text())["run_id"]
    run_dir = Path(_flag(learner.argv, "--run-dir"))
    assert run_dir.parent.name == "runs" and run_dir.name == "run"  # /runs/run on PVC runs
    tmp = Path(learner.env["TMPDIR"])  # the pod's /tmp emptyDir, once (no nested rewrite)
    assert learner.env["HOME"] == str(tmp) and tmp.is_dir() and tmp.name == "tmp"
    worker_tmp = {smoke[f"rollout-local{i}/rollout"].env["HOME"] for i in (0, 1)}
    assert len(worker_tmp) == 2  # an emptyDir per pod


def test_a_torchrun_learner_runs_this_interpreter_with_its_rendezvous_local(
    rendered: dict, tmp_path: Path
) -> None:
    processes = local_processes(rendered["gpu-1node"], tmp_path)
    learner = next(p for p in processes if p.pod.name == "learner-0")
    assert learner.cluster_argv[:3] == ["python", "-m", "torch.distributed.run"]
    assert learner.argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--node-rank=0" in learner.argv  # metadata.labels['apps.kubernetes.io/pod-index']
    assert f"--rdzv-endpoint={LOOPBACK}:{learner.ports[29400]}" in learner.argv
    assert _flag(learner.argv, "--port") == str(learner.ports[50051])
