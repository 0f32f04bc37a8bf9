"""What `model.path` may point at (`scalerl.policy.models.policy_folder`): a model folder,
a sharded checkpoint with its index, a Hugging Face hub cache entry or snapshot, a GGUF
file; a missing or partial one is one line naming `model.path`."""

from __future__ import annotations

import shutil

import pytest
import torch
from model_families import tiny_family_model

from scalerl.config import PathModel
from scalerl.policy.models import GGUF_FILE, load_policy, policy_folder, smollm2_gguf_dir


def _config(path, **kwargs) -> PathModel:
    return PathModel(path=str(path), **kwargs)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Qwen3 saved in shards of at most 100 kB, with the SmolLM2-free tokenizer
    left out (the weights are what these tests read)."""
    folder = tmp_path_factory.mktemp("sharded")
    model = tiny_family_model("qwen3")
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder, model


def test_a_sharded_checkpoint_loads_whole(sharded):
    from transformers import AutoModelForCausalLM

    folder, model = sharded
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert policy_folder(_config(folder)) == folder
    loaded = AutoModelForCausalLM.from_pretrained(policy_folder(_config(folder)))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_missing_shard_is_one_line_naming_model_path(sharded, tmp_path):
    folder, _ = sharded
    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    shard = sorted(partial.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError) as info:
        policy_folder(_config(partial))
    message = str(info.value)
    assert message.startswith(f"model.path: {partial} lacks shards")
    assert shard.name in message and "\n" not in message


@pytest.mark.parametrize(
    ("files", "problem"),
    [((), "has no config.json"), (("config.json",), "has no weights")],
)
def test_a_folder_without_config_or_weights_is_refused(tmp_path, files, problem):
    for name in files:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ValueError, match=f"^model\\.path: {tmp_path} {problem}"):
        policy_folder(_config(tmp_path))


def test_a_hub_cache_entry_resolves_to_its_main_snapshot(sharded, tmp_path):
    folder, _ = sharded
    entry = tmp_path / "models--Qwen--Qwen3-tiny"
    snapshot = entry / "snapshots" / "0123abcd"
    shutil.copytree(folder, snapshot)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abcd\n")
    assert policy_folder(_config(entry)) == snapshot
    assert policy_folder(_config(snapshot)) == snapshot


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_into_the_cache(tmp_path):
    """SmolLM2's own GGUF named as model.path: dequantized into cache_dir/gguf, then the
    policy loads from it like any folder."""
    gguf = smollm2_gguf_dir() / GGUF_FILE
    config = _config(gguf, cache_dir=str(tmp_path))
    folder = policy_folder(config)
    assert folder == tmp_path / "gguf" / gguf.stem
    assert (folder / "model.safetensors").is_file()
    model, tokenizer = load_policy(config)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.chat
    assert policy_folder(config) == folder  # cached: not converted again
