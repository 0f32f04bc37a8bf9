"""The layer map of docs/architecture.md holds: import-linter's contracts (pyproject.toml), a
fresh interpreter that imports the torch-free layers without loading torch, and the map
names every package and module there is, and nothing that is not."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "gguf", "accelerate", "safetensors", "matplotlib")
TORCH_FREE = (
    "curve_service.main",
    "curve_service.server",
    "curve_service.redis_store",
    "scalerl.config",
    "scalerl.fleet",
    "scalerl.recipes",
    "scalerl.state.replay",
    "scalerl.state.push_blocked",
    "scalerl.state.prompt_pool",
    "scalerl.state.registry",
    "scalerl.state.run_state",
    "scalerl.state.tickets",
    "scalerl.rpc.server",
    "scalerl.rpc.channel",
    "scalerl.obs.logging",
    "scalerl.obs.metrics",
    "scalerl.tracking",
    "scalerl.verifiers",
    "scalerl.verifiers.code",
    "scalerl.verifiers.math_answer",
    "scalerl.verifiers.reasoning_gym",
    "scalerl.verifiers.judge",
    "scalerl.verifiers.reward_model",
    "reward_service.server",
    "scalerl.sandbox.client",
    "scalerl.sandbox.zygote",
    "scalerl.tasks.files",
    "scalerl.tasks.generators",
    "scalerl.tasks.split",
    "scalerl_cli.main",
    "scalerl_cli.task_cli",
    "scalerl.weights.delta",
)
ROOTS = ("scalerl_cli", "rollout_service", "learner_service", "curve_service", "sandbox_service")
ROOTS += ("reward_service", "scalerl")
GENERATED = "scalerl/v1"  # the protobuf modules: named by the map as one package
TAG_COLUMN = 22  # the map's package names stand left of this column, its text right of it


def test_import_contracts_hold() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports, "lint-imports (import-linter, a dev dependency) is not installed"
    proc = subprocess.run(
        [lint_imports, "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    code = (
        f"import json, sys, {module}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [], f"{module} loads {proc.stdout.strip()}"


def test_the_core_imports_no_service_and_no_cli() -> None:
    # Independent of import-linter: a plain scan of scalerl/'s import statements.
    offenders = []
    for path in (ROOT / "scalerl").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from"):
                top = words[1].split(".")[0]
                if top in ("rollout_service", "learner_service", "curve_service", "scalerl_cli"):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def layer_map() -> dict[str, str]:
    """The text docs/architecture.md's layer map gives each package ("scalerl/state":
    ...), read by the map's indentation: left of TAG_COLUMN, a `name/` opens a package
    (two spaces a level) and other words belong to the package one level up; right of
    it, text continues the package above."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc[doc.index("## Layers") :].split("```")[1].split("\n", 1)[1]
    texts: dict[str, str] = {}
    path: list[str] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent < TAG_COLUMN:
            first = line.split()[0]
            if first.endswith("/"):
                path = path[: indent // 2] + [first.rstrip("/")]
                line = line[indent + len(first) :]
            else:
                path = path[: max(indent // 2, 1)]
        if path:
            texts["/".join(path)] = texts.get("/".join(path), "") + " " + line
    return texts


def _packages() -> list[Path]:
    return sorted(
        init.parent.relative_to(ROOT)
        for root in ROOTS
        for init in (ROOT / root).rglob("__init__.py")
    )


def test_the_layer_map_names_every_package_and_module_and_nothing_else() -> None:
    texts = layer_map()
    inline = {  # a package named inside its parent's text: "torch/ (engine: ...)"
        f"{key}/{name}": key
        for key, text in texts.items()
        for name in re.findall(r"(?<![\w/])([a-z_0-9]+)/(?=[\s(,;)]|$)", text)
    }
    missing = []
    for package in map(str, _packages()):
        home = package if package in texts else inline.get(package)
        if home is None:
            missing.append(f"package {package}/")
            continue
        if package == GENERATED:
            continue
        for module in sorted((ROOT / package).glob("[!_]*.py")):
            if not re.search(rf"\b{module.stem}\b", texts[home]):
                missing.append(f"module {package}/{module.name}")
    assert missing == [], f"docs/architecture.md's layer map does not name {missing}"
    named = set(texts) | set(inline)
    assert sorted(k for k in named if not (ROOT / k / "__init__.py").exists()) == []
