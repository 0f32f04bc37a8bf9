"""deploy/README.md: every shell command is either marked as needing a cluster (or docker)
or run here, in order, on a copy of deploy/; its kustomize snippets render."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_manifests import DEPLOY, KubectlMissing, find, render

README = DEPLOY / "README.md"
MARKS = ("# needs a cluster", "# needs docker")
# What an unmarked command may run: it runs on the test machine.
ALLOWED = ("kubectl kustomize ", "printf ")


def fenced(language: str) -> list[str]:
    """The bodies of the README's ```language blocks."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def commands() -> list[str]:
    """Every command of the ```sh blocks (continuation lines joined)."""
    found = []
    for block in fenced("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(line.strip())
    return found


def unmarked() -> list[str]:
    return [c for c in commands() if not c.endswith(MARKS)]


def test_the_readme_has_commands_of_both_kinds() -> None:
    assert len(commands()) >= 15
    assert len(unmarked()) >= 3


def test_every_unmarked_command_is_one_this_test_may_run() -> None:
    for command in unmarked():
        assert command.startswith(ALLOWED), f"mark it {MARKS[0]!r} or run it here: {command}"


def test_the_unmarked_commands_run(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("the README's commands render with kubectl, which is not installed")
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("secrets.env"))
    for command in unmarked():
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{command}: {done.stderr}"
        if command.startswith("kubectl kustomize"):
            kinds = {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}
            assert {"StatefulSet", "Deployment", "Secret", "ConfigMap"} <= kinds, command
    secrets = (tmp_path / "deploy/overlays/gpu-1node/secrets.env").read_text()
    keys = ("auth-token", "redis-learner", "redis-rollout", "redis-curve", "redis-probe")
    assert re.fullmatch("".join(rf"{key}=[0-9a-f]{{64}}\n" for key in keys), secrets)


def _snippet(after: str) -> dict:
    """The first ```yaml block after the heading or sentence `after`."""
    text = README.read_text()
    block = re.search(r"^```yaml\n(.*?)^```", text[text.index(after) :], flags=re.M | re.S)
    return yaml.safe_load(block.group(1))


def _render_on(overlay: str, extra: dict, tmp_path: Path) -> list[dict]:
    folder = tmp_path / "overlay"
    folder.mkdir()
    base = Path(os.path.relpath(DEPLOY / "overlays" / overlay, folder))
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [str(base)], **extra}))
    try:
        return render(folder)
    except KubectlMissing as exc:
        pytest.skip(f"cannot render without kubectl: {exc}")


def test_the_managed_redis_snippet_replaces_the_statefulset(tmp_path: Path) -> None:
    docs = _render_on("cpu-smoke", _snippet("### Managed Redis"), tmp_path)
    assert not find(docs, "StatefulSet", "redis")
    (service,) = find(docs, "Service", "redis")
    assert service["spec"] == {"type": "ExternalName", "externalName": "my-redis.example.internal"}


def test_the_external_redis_snippet_points_every_component_at_the_urls(tmp_path: Path) -> None:
    snippet = _snippet("### External Redis or Redis Cluster")
    [component] = snippet.pop("components")
    assert component == "../../components/external-redis"  # from an overlay's folder
    here = Path(os.path.relpath(DEPLOY / "components" / "external-redis", tmp_path / "overlay"))
    docs = _render_on("cpu-smoke", {**snippet, "components": [str(here)]}, tmp_path)
    assert not find(docs, "StatefulSet", "redis") and not find(docs, "Service", "redis")
    [config] = [
        d for d in find(docs, "ConfigMap") if d["metadata"]["name"].startswith("scalerl-redis")
    ]
    urls = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if e["name"] == "REDIS_URL":
                        ref = e["valueFrom"]["configMapKeyRef"]
                        assert ref["name"] == config["metadata"]["name"]
                        urls[c["name"]] = config["data"][ref["key"]]
    assert urls == {
        name: f"redis://{name}@redis-0.example.internal:6379/0?cluster=true"
        for name in ("learner", "rollout", "curve")
    }


def test_the_registry_snippet_renames_the_image(tmp_path: Path) -> None:
    docs = _render_on("cpu-smoke", _snippet("To pull from your own registry"), tmp_path)
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert "registry.example.com/ml/scalerl:0.1.0" in images
    assert "ghcr.io/scalerl/scalerl:0.1.0" not in images
