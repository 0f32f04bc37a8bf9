"""The warm-up cache (`learner_service.train.warmup_cache`): a hit is the warm-up itself,
tensor for tensor, and any input the warm-up depends on misses."""

from __future__ import annotations

import pytest
import torch

from learner_service.train.warmup import warm_up, warmup_problems
from learner_service.train.warmup_cache import (
    WarmupCache,
    WarmupResult,
    warm_up_once,
    warmup_key,
)
from scalerl.config import load_config
from scalerl.policy.models import load_policy
from scalerl.tasks import build_tasks

STEPS = ["model.warmup_steps=20"]


def _fresh(overrides: list[str] = STEPS):
    """(model, tokenizer, config, tasks) as the learner makes them before its warm-up."""
    config = load_config("tiny", overrides)
    torch.manual_seed(config.seed)
    model, tokenizer = load_policy(config.model, seed=config.seed)
    return model, tokenizer, config, build_tasks(config)


def _key(model, config, tasks, device: str = "cpu") -> str:
    return warmup_key(model, config, warmup_problems(tasks), device)


def test_a_cached_warmup_is_the_warmup_tensor_for_tensor(tmp_path) -> None:
    torch.set_num_threads(1)
    cache = WarmupCache(tmp_path)
    model, tokenizer, config, tasks = _fresh()
    key = _key(model, config, tasks)
    assert cache.load(key, model) is None  # nothing yet: the model is left as it was
    loss = warm_up(model, tokenizer, tasks, config.model, config.seed)
    cache.save(key, model, WarmupResult(loss, 2.5))

    recomputed, tokenizer, config, tasks = _fresh()
    assert _key(recomputed, config, tasks) == key  # the same inputs: the same key
    warm_up(recomputed, tokenizer, tasks, config.model, config.seed)
    loaded, *_ = _fresh()
    assert cache.load(key, loaded) == WarmupResult(loss, 2.5)
    trained, cached = recomputed.state_dict(), loaded.state_dict()
    assert trained.keys() == cached.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, cached[name]), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied


@pytest.mark.parametrize(
    "override",
    ["seed=1", "model.warmup_lr=1e-3", "model.warmup_steps=21", "model.tiny_layers=3"],
)
def test_any_input_of_the_warmup_misses_the_cache(override: str) -> None:
    model, _, config, tasks = _fresh()
    other, _, other_config, other_tasks = _fresh([*STEPS, override])
    assert _key(other, other_config, other_tasks) != _key(model, config, tasks)


def test_the_initial_weights_and_the_device_are_part_of_the_key() -> None:
    model, _, config, tasks = _fresh()
    key = _key(model, config, tasks)
    assert _key(model, config, tasks, device="cuda:0") != key
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    assert _key(model, config, tasks) != key


class _Compute:
    """What a warm-up adds to the run's compute (`ComputeCounters.add`)."""

    def __init__(self) -> None:
        self.added: list[tuple[str, float]] = []

    def add(self, role: str, device_seconds: float, worker_id: str | None = None) -> float:
        self.added.append((role, device_seconds))
        return device_seconds


def test_a_run_that_loads_the_warmup_counts_its_compute_as_the_one_that_ran_it(
    tmp_path,
) -> None:
    torch.set_num_threads(1)
    overrides = [*STEPS, f"model.cache_dir={tmp_path}"]
    ran, loaded = _Compute(), _Compute()
    model, tokenizer, config, tasks = _fresh(overrides)
    warm_up_once(model, tokenizer, tasks, config, "cpu", ran)
    again, tokenizer, config, tasks = _fresh(overrides)
    warm_up_once(again, tokenizer, tasks, config, "cpu", loaded)
    [(role, seconds)] = ran.added
    assert role == "learner" and seconds > 0
    assert loaded.added == ran.added  # the same x on the curve
    pairs = zip(model.parameters(), again.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    off, tokenizer, config, tasks = _fresh([*overrides, "model.warmup_cache=false"])
    never = _Compute()
    warm_up_once(off, tokenizer, tasks, config, "cpu", never)
    assert len(never.added) == 1 and never.added != ran.added  # trained again, timed anew


def test_a_damaged_entry_stops_the_run_naming_it(tmp_path) -> None:
    """Never a half-loaded model trained on: the entry and the way out are named."""
    cache = WarmupCache(tmp_path)
    model, _, config, tasks = _fresh()
    key = _key(model, config, tasks)
    cache.save(key, model, WarmupResult(0.5, 1.0))
    weights = tmp_path / f"{key}.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=f"model.warmup_cache: the cached warm-up {weights}"):
        cache.load(key, model)
