"""The run config each scalerl container of every render loads (the ConfigMap's YAML, then
its SCALERL_* environment and --set arguments, through scalerl.config.load_config) is
valid, the same for the learner and the workers, and agrees with the manifests: worker
counts and KEDA bounds, grace periods, world size, weight transport, ports, volumes.
Every command line parses with its entry point's own argument parser."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_manifests import (
    CONFIG_PATH,
    DEPLOY,
    NON_CONFIG_ENV,
    config_overrides,
    config_yaml,
    find,
    flag,
    learner,
    literal_env,
    one,
    pod_spec,
    port_numbers,
    resolved_command,
    rollout,
    split_learner,
)

from scalerl.config import RunConfig, load_config


@pytest.fixture(autouse=True)
def _no_outside_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_config also reads the test process's environment: keep it out."""
    import os

    for name in [n for n in os.environ if n.startswith("SCALERL_")]:
        monkeypatch.delenv(name)


def effective_config(docs: list[dict], kind: str, name: str, folder: Path) -> RunConfig:
    """What the container `name` of workload kind/name loads at start."""
    workload = one(docs, kind, name)
    container = learner(docs) if name == "learner" else rollout(docs)
    assert flag(container["args"], "--config") == CONFIG_PATH
    path = folder / f"{name}.yaml"
    path.write_text(config_yaml(docs, container, workload))
    return load_config(str(path), config_overrides(container))


@pytest.fixture
def configs(docs: list[dict], tmp_path: Path) -> dict[str, RunConfig]:
    return {
        "learner": effective_config(docs, "StatefulSet", "learner", tmp_path),
        "rollout": effective_config(docs, "Deployment", "rollout", tmp_path),
    }


def test_every_config_map_run_config_loads(rendered: dict, tmp_path: Path) -> None:
    """Every ConfigMap that carries a run config, in every render, is a valid RunConfig
    (a misspelt field, an out-of-range value fails here, naming the field)."""
    count = 0
    for name, docs in rendered.items():
        for config_map in find(docs, "ConfigMap"):
            for key, text in config_map.get("data", {}).items():
                if key.endswith((".yaml", ".yml")):
                    path = tmp_path / f"{name}-{key}"
                    path.write_text(text)
                    assert isinstance(load_config(str(path)), RunConfig)
                    count += 1
    assert count == len(rendered)


def test_a_misspelt_field_fails_to_load(tmp_path: Path) -> None:
    text = (DEPLOY / "overlays" / "cpu-smoke" / "scalerl.yaml").read_text()
    path = tmp_path / "spoilt.yaml"
    path.write_text(text.replace("max_steps:", "max_step:"))
    with pytest.raises(ValueError, match="max_step"):
        load_config(str(path))


def test_every_scalerl_variable_is_a_config_override(docs: list[dict]) -> None:
    """A SCALERL_* variable that names no field would be ignored silently."""
    for c in (learner(docs), rollout(docs)):
        env = {k: v for k, v in literal_env(c).items() if k.startswith("SCALERL_")}
        overrides = config_overrides(c)
        for name in set(env) - NON_CONFIG_ENV:
            key = name.removeprefix("SCALERL_").lower().replace("__", ".")
            assert any(o.startswith(key + "=") for o in overrides), f"{c['name']}: {name}"
        for name in NON_CONFIG_ENV & {i["name"] for i in c.get("env", [])}:
            assert not any(o.startswith(name.lower()) for o in overrides)


def test_learner_and_workers_load_the_same_config(configs: dict[str, RunConfig]) -> None:
    assert configs["learner"] == configs["rollout"]


def test_enough_workers_for_the_learner_and_keda_within_the_fleet(docs, configs) -> None:
    config = configs["learner"]
    deployment = one(docs, "Deployment", "rollout")
    scaled = find(docs, "ScaledObject")
    # The learner waits for rollout.workers registered workers before its first step.
    floor = scaled[0]["spec"]["minReplicaCount"] if scaled else deployment["spec"]["replicas"]
    assert floor >= config.rollout.workers
    if scaled:
        spec = scaled[0]["spec"]
        assert spec["minReplicaCount"] >= max(1, config.fleet.min_replicas)
        assert spec["maxReplicaCount"] == config.fleet.max_replicas
        assert spec["fallback"]["replicas"] >= spec["minReplicaCount"]
        assert spec["cooldownPeriod"] >= config.fleet.cooldown_s


def test_grace_period_outlasts_the_workers_drain(docs, configs) -> None:
    grace = pod_spec(one(docs, "Deployment", "rollout"))["terminationGracePeriodSeconds"]
    assert grace >= configs["rollout"].rollout.leave_grace_s + 15


def test_world_size_is_nodes_times_ranks(docs, configs) -> None:
    command = split_learner(resolved_command(learner(docs)))
    world = 1
    if command.torchrun:
        env = literal_env(learner(docs))
        world = int(env["LEARNER_NODES"]) * int(env["LEARNER_RANKS_PER_NODE"])
    assert configs["learner"].learner.world_size == world


def test_the_weight_transport_has_what_it_needs(docs, configs) -> None:
    cfg = configs["learner"]
    c = learner(docs)
    statefulset = one(docs, "StatefulSet", "learner")
    run_dir = flag(split_learner(resolved_command(c)).learner_args, "--run-dir")
    transport = cfg.learner.weights.transport
    assert transport != "stream", "stream pushes to every worker in turn: not for a cluster"
    if transport == "broadcast":
        # A fixed port the learner declares and its headless Service exposes.
        assert cfg.learner.weights.port == port_numbers(c)["weights"]
        service = one(docs, "Service", statefulset["spec"]["serviceName"])
        assert cfg.learner.weights.port in {p["port"] for p in service["spec"]["ports"]}
    if transport == "uri":
        # The learner writes RUN_DIR/weights; every worker reads the same claim there.
        weights = f"{run_dir}/weights"
        assert cfg.security.weights_root == weights
        claims = []
        for workload, container in (
            (statefulset, c),
            (one(docs, "Deployment", "rollout"), rollout(docs)),
        ):
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == weights)
            volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
            claims.append(volume["persistentVolumeClaim"]["claimName"])
        assert claims[0] == claims[1]
        claim = one(docs, "PersistentVolumeClaim", claims[0])
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_code_tasks_run_on_the_sandbox_service(docs, configs) -> None:
    """Model-written programs run on the sandbox pods, never in the pods holding the
    token: the address names the sandbox Service and a port it exposes."""
    for cfg in configs.values():
        host, port = cfg.verifier.code.service.rsplit(":", 1)
        service = one(docs, "Service", host)
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == "sandbox"
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_the_device_follows_the_gpus(docs, configs) -> None:
    for name, c in (("learner", learner(docs)), ("rollout", rollout(docs))):
        gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
        device = configs[name].device
        assert device.startswith("cuda") if gpu else device in ("cpu", "auto"), name


def test_command_lines_parse_with_their_entry_points(docs: list[dict]) -> None:
    """The manifests' flags are the entry points' flags (parsed by their own parsers, which
    import no torch; torchrun's flags by torchrun's parser)."""
    import curve_service.main
    import learner_service.main
    import rollout_service.main

    command = split_learner(resolved_command(learner(docs)))
    learner_service.main.parse_args(command.learner_args)
    if command.torchrun:
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args([*command.torchrun, "-m", command.module])
        assert parsed.module and parsed.training_script == command.module
    rollout_service.main.parse_args(resolved_command(rollout(docs))[1:])
    curve = next(
        c for c in one(docs, "Deployment", "curve")["spec"]["template"]["spec"]["containers"]
    )
    curve_service.main.parse_args(resolved_command(curve)[1:])
