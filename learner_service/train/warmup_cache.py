"""The supervised warm-up's result, cached on disk (`model.warmup_cache`): a second run
of the same warm-up (every variant of a sweep, a test suite's tiny runs, a run started
again from scratch) loads the weights the first one made instead of training them again.

The key is the sha256 of everything the warmed-up weights depend on: the initial weights
(every tensor's name, dtype, shape and bytes), the model and warm-up config, the seed, the
warm-up problems with their system prompts, the tool demonstrations' tasks, the device,
torch's version and thread count, and the source of the code that runs the warm-up. Any
change misses, so a hit is the same computation (the warm-up is deterministic on one
machine for a fixed seed and thread count), never a near one.

An entry is `{cache}/warmup/{key}.safetensors` (the warmed-up state dict) and
`{key}.json` (steps, final loss, device-seconds), each written to a temporary name and
renamed into place. A hit adds the recorded device-seconds to the learner's compute, so a
run's compute axis (and its curve) is the same whether the warm-up ran or was loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from learner_service.train.warmup import warm_up, warmup_problems
from scalerl.compute import BusyTimer, ComputeCounters
from scalerl.config import RunConfig
from scalerl.policy.models import model_cache_dir
from scalerl.tasks import TaskSet

log = logging.getLogger(__name__)

# The code a warm-up's result depends on besides its inputs: a change to any of these
# files misses the cache.
_CODE = (
    Path(__file__).with_name("warmup.py"),
    Path(__file__).resolve().parents[2] / "scalerl" / "policy" / "models.py",
    Path(__file__).resolve().parents[2] / "scalerl" / "agents" / "chat.py",
    Path(__file__).resolve().parents[2] / "scalerl" / "agents" / "tool_calls.py",
)


@dataclass(frozen=True)
class WarmupResult:
    """What a warm-up made besides its weights: its final loss (nats per target token)
    and the learner device-seconds it took."""

    loss: float
    device_seconds: float


def warmup_key(
    model: torch.nn.Module, config: RunConfig, problems: Sequence[tuple[object, str]], device: str
) -> str:
    """The hex sha256 naming the warm-up of `model` (its weights before the warm-up) under
    `config` on `problems` (`warmup.warmup_problems`) on `device` (module docstring)."""
    digest = hashlib.sha256()
    inputs = {
        "model": config.model.model_dump(mode="json", exclude={"cache_dir", "warmup_cache"}),
        "tasks": [task.model_dump(mode="json") for task in config.task],
        "seed": config.seed,
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "problems": [(repr(problem), system) for problem, system in problems],
    }
    digest.update(json.dumps(inputs, sort_keys=True).encode())
    for path in _CODE:
        digest.update(path.read_bytes())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name} {flat.dtype} {tuple(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class WarmupCache:
    """Warm-up results under `folder` (`{model.cache_dir or the default cache}/warmup`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def load(self, key: str, model: torch.nn.Module) -> WarmupResult | None:
        """Load the entry `key` into `model` (every tensor, strictly) and return what it
        recorded; None when there is no complete entry (then `model` is unchanged).
        Raises RuntimeError naming the entry when it cannot be read whole (a damaged
        file; `model` may then be half loaded, so the run must not go on with it)."""
        weights, meta = self._paths(key)
        if not (weights.is_file() and meta.is_file()):
            return None
        device = str(next(model.parameters()).device)
        try:
            recorded = json.loads(meta.read_text())
            result = WarmupResult(float(recorded["loss"]), float(recorded["device_seconds"]))
            load_model(model, str(weights), strict=True, device=device)  # tied tensors as one
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
            raise RuntimeError(
                f"model.warmup_cache: the cached warm-up {weights} cannot be read ({exc}); "
                "delete it, or set model.warmup_cache=false"
            ) from exc
        return result

    def save(self, key: str, model: torch.nn.Module, result: WarmupResult) -> None:
        """Store `model`'s weights and `result` as the entry `key`. A failure to write is
        logged, not raised: the run does not need the cache."""
        weights, meta = self._paths(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _atomic(weights, lambda tmp: save_model(model, str(tmp)))
            record = {"loss": result.loss, "device_seconds": result.device_seconds}
            _atomic(meta, lambda tmp: tmp.write_text(json.dumps(record)))
        except OSError as exc:
            log.warning("warm-up cache: could not write %s: %s", weights, exc)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.folder / f"{key}.safetensors", self.folder / f"{key}.json"


def _atomic(path: Path, write) -> None:
    """`write(tmp)` then rename tmp to `path`: readers never see a partial file."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    write(tmp)
    tmp.replace(path)


def warm_up_once(
    model: torch.nn.Module,
    tokenizer,
    tasks: TaskSet,
    config: RunConfig,
    device: str,
    compute: ComputeCounters,
) -> None:
    """The supervised warm-up of a fresh `model` on `device` (`warmup.warm_up`), counted
    as learner compute in `compute`; or, with `model.warmup_cache`, its cached result
    (counted the same), and a warm-up that ran is cached."""
    cache = WarmupCache(model_cache_dir(config.model) / "warmup")
    key = warmup_key(model, config, warmup_problems(tasks), device)
    cached = cache.load(key, model) if config.model.warmup_cache else None
    if cached is not None:
        compute.add("learner", cached.device_seconds)
        log.info(
            "supervised warm-up: loaded from the cache (%s), final loss %.3f", key[:12], cached.loss
        )
        return
    with BusyTimer(compute, "learner") as timer:
        loss = warm_up(model, tokenizer, tasks, config.model, config.seed)
    log.info("supervised warm-up: %d steps, final loss %.3f", config.model.warmup_steps, loss)
    if config.model.warmup_cache:
        cache.save(key, model, WarmupResult(loss, timer.device_seconds))
