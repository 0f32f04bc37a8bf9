"""Every family scalerl claims, on a tiny random checkpoint with perturbed norms and biases
(tests/model_families.py): the torch engine's logits equal HF's forward, after a weight
update and with a LoRA adapter too; the learner's log-probs of the engine's sampled tokens
equal the engine's; what cannot be served exactly is refused in one line.

Tolerance: 1e-5 absolute plus 1e-5 relative on fp32 logits (magnitudes up to ~6, so at
most ~7e-5 on the largest; fp32 rounding of the two attention kernels, not a skipped
module, which moves logits by 1e-2 or more: `test_perturbed_norms_and_biases_matter`).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from model_families import FAMILY_CONFIGS, tiny_family_model
from safetensors.torch import load_file

from rollout_service.engines.api import GenerationRequest
from rollout_service.engines.torch.adapters import Adapter
from rollout_service.engines.torch.decoder import SlotDecoder, StagedWeights
from rollout_service.engines.torch.engine import TorchEngine
from scalerl.policy.architectures import (
    FAMILIES,
    CheckpointNames,
    LogitTransform,
    check_model_folder,
    check_servable,
)
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.lora import LORA_A, LORA_B
from scalerl.weights.check import folder_shapes

torch.set_num_threads(1)
NAMES = sorted(FAMILY_CONFIGS)
IDS = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50]  # 12 tokens: past every sliding window
TOL = dict(atol=1e-5, rtol=1e-5)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=NAMES)
def family(request) -> tuple[str, torch.nn.Module]:
    return request.param, tiny_family_model(request.param)


def _prefill_and_decode(decoder: SlotDecoder, ids: list[int], split: int) -> torch.Tensor:
    """Logits [len(ids), V]: rows 0..split-1 from one batched prefill (beside a shorter
    row in another slot), the rest from decode steps batched with that other slot."""
    decoder.extend(1, 0, [7, 7, 7, 7, 7, 7, 7, 7, 7])  # stale keys a mask must hide
    rows = decoder.extend_batch([1, 0], [0, 0], [ids[:split], ids[:3]], all_logits=True)
    out = [rows[0]]
    for pos in range(split, len(ids)):
        logits = decoder.decode(
            torch.tensor([0, 1]),
            torch.tensor([3 + pos - split, pos]),
            torch.tensor([ids[3 + pos - split], ids[pos]]),
        )
        out.append(logits[1:])
    return torch.cat(out)


def test_every_claimed_family_is_tested():
    built = {type(tiny_family_model(name)).__name__ for name in NAMES}
    assert built == set(FAMILIES)


def test_engine_prefill_and_decode_equal_hf_forward(family):
    name, model = family
    decoder = SlotDecoder(copy.deepcopy(model), max_batch=2, max_seq_len=32)
    torch.testing.assert_close(_prefill_and_decode(decoder, IDS, 5), hf_logits(model, IDS), **TOL)


def test_perturbed_norms_and_biases_matter(family):
    """The checkpoint's norms and biases are not at their initial values: resetting them
    moves HF's logits far beyond the tolerance, so an engine that skipped one would fail."""
    name, model = family
    reset = copy.deepcopy(model)
    with torch.no_grad():
        for key, param in reset.named_parameters():
            if "norm" in key or key.endswith("bias"):
                param.copy_(torch.ones_like(param) if "norm" in key else torch.zeros_like(param))
    gap = (hf_logits(reset, IDS) - hf_logits(model, IDS)).abs().max()
    assert gap > 1e-2


def test_engine_equals_hf_after_a_weight_update(family):
    name, model = family
    other = tiny_family_model(name, seed=1)
    decoder = SlotDecoder(copy.deepcopy(model), max_batch=2, max_seq_len=32)
    decoder.load_weights(decoder.prepare_weights(_payload(other.state_dict())))
    torch.testing.assert_close(_prefill_and_decode(decoder, IDS, 4), hf_logits(other, IDS), **TOL)


def test_engine_equals_hf_with_a_lora_adapter(family):
    """An adapter on the family's default LoRA targets (`Family.lora_targets`, e.g. Phi-3's
    fused qkv_proj) equals HF's forward with the update merged, W + B'A."""
    name, model = family
    targets = FAMILIES[type(model).__name__].lora_targets
    gen = torch.Generator().manual_seed(2)
    merged, wire = copy.deepcopy(model), {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(4, module.in_features, generator=gen) * 0.1
            b = torch.randn(module.out_features, 4, generator=gen) * 0.1
            wire[module_name + LORA_A], wire[module_name + LORA_B] = a, b
            with torch.no_grad():
                merged.get_submodule(module_name).weight.add_(b @ a)
    assert wire, f"no Linear of {name} matched its LoRA targets {targets}"
    decoder = SlotDecoder(copy.deepcopy(model), max_batch=2, max_seq_len=32)
    adapter = Adapter.of(wire, torch.float32, torch.device("cpu"))
    decoder.load_weights(StagedWeights({}, None, adapter, adapter_name="a"))
    decoder.assign_adapter(1, "a")
    decoder.assign_adapter(0, None)
    torch.testing.assert_close(_prefill_and_decode(decoder, IDS, 6), hf_logits(merged, IDS), **TOL)


def test_learner_logprobs_equal_the_engines(family):
    """The engine samples at temperature 0.8; the learner's fp32 log-probs of those tokens
    (HF's forward, the family's head) equal the engine's within 1e-5."""
    name, model = family
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=4, max_seq_len=40)
    try:
        streams = [
            engine.submit(GenerationRequest(f"r{i}", tuple(IDS[:6]), 16, temperature=0.8, seed=i))
            for i in range(3)
        ]
        done = [stream.result(timeout=60) for stream in streams]
    finally:
        engine.stop()
    for result in done:
        ids = torch.tensor([IDS[:6] + list(result.token_ids)])
        with torch.no_grad():
            learner = token_logprobs(model, ids, torch.ones_like(ids), 0.8, start=5)[0]
        torch.testing.assert_close(learner, torch.tensor(list(result.logprobs)), atol=1e-5, rtol=0)


def _payload(state_dict):
    from scalerl.policy.lora import split_payload

    return split_payload(state_dict)


def test_checkpoint_names_are_the_saved_checkpoints(family, tmp_path):
    """What a checkpoint-loading engine (vLLM) is handed for the learner's state dict:
    exactly the names and shapes of the family's saved checkpoint (MoE experts split
    back per expert), the same values."""
    name, model = family
    model.save_pretrained(tmp_path)
    saved = folder_shapes(tmp_path)
    renamed = CheckpointNames(model.config)(published(model))
    assert {key: tuple(t.shape) for key, t in renamed.items()} == saved
    reloaded = load_file(str(tmp_path / "model.safetensors"))
    for key, tensor in renamed.items():
        assert torch.equal(tensor, reloaded[key]), key
    assert CheckpointNames(model.config).identity == (not FAMILIES[type(model).__name__].moe)


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


# ----- refusals ----------------------------------------------------------------------------


def test_an_unknown_architecture_is_refused_in_one_line():
    from transformers import PretrainedConfig

    class WeirdConfig(PretrainedConfig):
        model_type = "weird"

    with pytest.raises(ValueError) as info:
        check_servable(WeirdConfig(architectures=["WeirdForCausalLM"]), 64)
    assert "architecture WeirdForCausalLM is not supported" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"attention_dropout": 0.1}, "attention_dropout > 0"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type 'dynamic' past its original length",
        ),
    ],
)
def test_features_the_engine_cannot_match_are_refused(change, named):
    config = FAMILY_CONFIGS["qwen3"](97)
    config.architectures = ["Qwen3ForCausalLM"]
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=named):
        check_servable(config, 300)  # past max_position_embeddings (256)


def test_dynamic_rope_within_its_original_length_is_served():
    config = FAMILY_CONFIGS["qwen3"](97)
    config.architectures = ["Qwen3ForCausalLM"]
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    assert check_servable(config, 256).architecture == "Qwen3ForCausalLM"


def test_the_engine_refuses_before_it_allocates():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match="Gemma2ForCausalLM is not supported"):
        TorchEngine(Gemma2ForCausalLM(config), (), max_batch=1, max_seq_len=8, autostart=False)


def test_model_folder_checks_name_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"^model\.path: .*missing is not a folder"):
        check_model_folder(_model_config(tmp_path / "missing"), 64)
    model = tiny_family_model("qwen3")
    model.save_pretrained(tmp_path / "qwen3")
    assert check_model_folder(_model_config(tmp_path / "qwen3"), 64).architecture == (
        "Qwen3ForCausalLM"
    )
    config = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    config["architectures"] = ["Gemma2ForCausalLM"]
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^model\.path: .*Gemma2ForCausalLM is not supported"):
        check_model_folder(_model_config(tmp_path / "qwen3"), 64)


def _model_config(path):
    from scalerl.config import PathModel

    return PathModel(path=str(path))


# ----- logit transforms --------------------------------------------------------------------


def test_logit_transforms_by_hand():
    z = torch.tensor([-30.0, 0.0, 2.0, 30.0])
    gemma = LogitTransform.of(type("C", (), {"final_logit_softcapping": 3.0})())
    # 3 tanh(z / 3): tanh(10) = 0.9999999958776927, tanh(2/3) = 0.5827829453479101
    expected = torch.tensor([-2.9999999876, 0.0, 1.7483488360, 2.9999999876])
    torch.testing.assert_close(gemma(z), expected, atol=1e-6, rtol=0)
    granite = LogitTransform.of(type("C", (), {"logits_scaling": 4.0})())
    torch.testing.assert_close(granite(z), z / 4)
    cohere = LogitTransform.of(type("C", (), {"logit_scale": 0.5})())
    torch.testing.assert_close(cohere(z), z * 0.5)
    assert LogitTransform.of(object()) == LogitTransform(1.0, None)
