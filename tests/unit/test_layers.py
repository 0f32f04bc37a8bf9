"""The layer map of docs/architecture.md holds: import-linter's contracts (pyproject.toml) and
a fresh interpreter that imports the torch-free layers without loading torch."""

from __future__ import annotations

import json
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
    "scalerl.rpc.server",
    "scalerl.rpc.channel",
    "scalerl.obs.logging",
    "scalerl.obs.metrics",
    "scalerl.verifiers",
    "scalerl.verifiers.code",
    "scalerl.verifiers.math_answer",
    "scalerl.verifiers.reasoning_gym",
    "scalerl.tasks.files",
    "scalerl.tasks.generators",
    "scalerl.tasks.split",
    "scalerl_cli.main",
    "scalerl_cli.task_cli",
)


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
