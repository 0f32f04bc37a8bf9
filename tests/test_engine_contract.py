"""The engine contract suite (tests/engine_contract.py) bound to the engines available:
torch always; vLLM when `import vllm` works (its own environment: `make test-vllm`).

One engine per engine name for the whole module, on the tiny model in fp32, so the
log-prob tolerance is |ratio - 1| <= 1e-3 for every engine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from engine_contract import *  # noqa: F403 - the contract's test functions
from engine_contract import MAX_SEQ_LEN, make_contract

torch.set_num_threads(1)


def _torch_engine(model, folder: Path):
    from rollout_service.engines.torch.engine import TorchEngine

    return TorchEngine(model, (), max_batch=8, max_seq_len=MAX_SEQ_LEN, dtype="float32")


def _vllm_engine(model, folder: Path):
    from rollout_service.engines.vllm.engine import VLLMEngine

    model_dir = folder / "model"
    model.save_pretrained(model_dir)
    return VLLMEngine(
        str(model_dir), (), max_batch=8, max_seq_len=MAX_SEQ_LEN, dtype="float32", threads=1
    )


_VLLM_MISSING = importlib.util.find_spec("vllm") is None
# name -> (build(model, folder) -> engine serving the model, reason to skip or None).
# Adding an engine to the contract suite is one entry here.
ENGINES = {
    "torch": (_torch_engine, None),
    "vllm": (
        _vllm_engine,
        "vllm is not installed here; run `make test-vllm`" if _VLLM_MISSING else None,
    ),
}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))
        for name, (_, reason) in ENGINES.items()
    ],
)
def contract(request, tmp_path_factory):
    name = request.param
    contract = make_contract(name, ENGINES[name][0], tmp_path_factory.mktemp(name))
    yield contract
    contract.engine.stop()


def test_build_engine_selects_the_configured_engine():
    from rollout_service.engines.api import RolloutEngine
    from rollout_service.engines.factory import build_engine
    from rollout_service.engines.torch.engine import TorchEngine
    from scalerl.config import load_config
    from scalerl.policy.models import load_policy

    config = load_config("tiny", ["rollout.max_batch=3", "rollout.max_seq_len=40"])
    model, tokenizer = load_policy(config.model)
    engine = build_engine(config, model, tokenizer, None)
    try:
        assert isinstance(engine, TorchEngine) and isinstance(engine, RolloutEngine)
        assert (engine.max_batch, engine.max_seq_len, engine.vocab_size) == (3, 40, 21)
        assert engine.stop_token_ids == {1}
    finally:
        engine.stop()
    if _VLLM_MISSING:
        config = load_config("tiny", ["rollout.engine=vllm"])
        with pytest.raises(ImportError, match="vllm package"):
            build_engine(config, model, tokenizer, None)
