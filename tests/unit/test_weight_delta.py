"""Lossless delta versions (`scalerl.weights.delta`): bit-exact over simulated Adam steps,
refused when damaged, forged or aimed at another base, and the chain a lagging receiver
gets."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save

from scalerl.rpc.errors import DataLoss, InvalidArgument
from scalerl.weights import delta

WIDTH, KV, MLP, ROWS = 576, 192, 1536, 2048  # SmolLM2-135M's widths, the vocabulary cut


def smollm2_layer_shapes() -> dict[str, tuple[int, ...]]:
    """One of SmolLM2-135M's 30 decoder layers at full width, its final norm and an
    embedding of ROWS of its 49,152 rows."""
    layer = "model.layers.0"
    return {
        "model.embed_tokens.weight": (ROWS, WIDTH),
        f"{layer}.self_attn.q_proj.weight": (WIDTH, WIDTH),
        f"{layer}.self_attn.k_proj.weight": (KV, WIDTH),
        f"{layer}.self_attn.v_proj.weight": (KV, WIDTH),
        f"{layer}.self_attn.o_proj.weight": (WIDTH, WIDTH),
        f"{layer}.mlp.gate_proj.weight": (MLP, WIDTH),
        f"{layer}.mlp.up_proj.weight": (MLP, WIDTH),
        f"{layer}.mlp.down_proj.weight": (WIDTH, MLP),
        f"{layer}.input_layernorm.weight": (WIDTH,),
        f"{layer}.post_attention_layernorm.weight": (WIDTH,),
        "model.norm.weight": (WIDTH,),
    }


def adam_versions(dtype: torch.dtype, steps: int, lr: float = 2e-5):
    """Payloads of `steps` + 1 policy versions: fp32 master weights (N(0, 0.02), norms at
    1) moved by Adam on random gradients, published in `dtype` as a learner does."""
    generator = torch.Generator().manual_seed(0)
    params = {
        name: torch.nn.Parameter(
            torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02
        )
        for name, shape in smollm2_layer_shapes().items()
    }
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    for _ in range(steps + 1):
        yield save({name: p.detach().to(dtype) for name, p in params.items()})
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


@pytest.mark.parametrize("dtype, most", [(torch.bfloat16, 0.35), (torch.float32, 0.9)])
def test_fifty_adam_steps_rebuild_bit_exact_and_smaller(dtype: torch.dtype, most: float) -> None:
    versions = adam_versions(dtype, steps=50)
    served = next(versions)
    ratios = []
    for target in versions:
        diff = delta.encode(served, target)
        assert diff is not None
        rebuilt = delta.decode(served, diff)
        assert bytes(rebuilt) == target  # every bit, header included
        ratios.append(len(diff) / len(target))
        served = bytes(rebuilt)
    assert len(ratios) == 50
    # bf16: Adam moves each weight by about lr = 2e-5, under half a bf16 ulp at 0.02
    # (2^-14 = 6.1e-5), so most keep their bit pattern; fp32: every element changes, in
    # its low bytes only.
    assert max(ratios) < most, ratios


def test_a_tampered_delta_is_data_loss_and_the_base_is_untouched() -> None:
    base, target = list(adam_versions(torch.bfloat16, steps=1))
    diff = delta.encode(base, target)
    assert diff is not None
    kept = bytes(base)
    for at in (len(diff) - 7, len(diff) // 2):  # inside the Zstandard frame
        forged = bytearray(diff)
        forged[at] ^= 0x5A
        with pytest.raises(DataLoss, match="delta"):
            delta.decode(base, bytes(forged))
    with pytest.raises(DataLoss, match="another base"):
        delta.decode(target, diff)  # the version after the one it was made for
    with pytest.raises(DataLoss, match="bad magic"):
        delta.decode(base, b"PK" + diff[2:])
    with pytest.raises(DataLoss, match="runs past the end"):
        delta.decode(base, diff[: len(diff) // 3])
    assert base == kept


def test_a_forged_announcement_is_refused_after_the_rebuild() -> None:
    base, target = list(adam_versions(torch.bfloat16, steps=1))
    diff = delta.encode(base, target)
    assert diff is not None
    meta = delta.meta_of(diff)
    assert meta.base_sha256 == hashlib.sha256(base).hexdigest()
    assert meta.target_sha256 == hashlib.sha256(target).hexdigest()
    first = meta.target_sha256[0]
    other = ("1" if first == "0" else "0") + meta.target_sha256[1:]
    forged = diff.replace(meta.target_sha256.encode(), other.encode())
    with pytest.raises(DataLoss, match="sha256 is not the announced one"):
        delta.decode(base, forged)
    # An honest delta of another version than the announcement names is refused too.
    with pytest.raises(DataLoss, match="another payload than the announced one"):
        delta.decode(base, diff, target_sha256=other)
    assert bytes(delta.decode(base, diff, target_sha256=meta.target_sha256)) == target


def test_another_layout_gets_no_delta() -> None:
    one = save({"a": torch.zeros(4, dtype=torch.bfloat16)})
    assert delta.encode(one, save({"a": torch.zeros(4, dtype=torch.float32)})) is None
    assert delta.encode(one, save({"a": torch.zeros(5, dtype=torch.bfloat16)})) is None
    assert delta.encode(one, save({"a": torch.zeros(2, 2, dtype=torch.bfloat16)})) is None
    # The header's bytes are in the delta too: a renamed tensor of the same size rebuilds.
    renamed = save({"b": torch.ones(4, dtype=torch.bfloat16)})
    for target in (one, renamed):
        diff = delta.encode(one, target)
        assert diff is not None and bytes(delta.decode(one, diff)) == target


def test_planes_put_each_byte_of_an_element_in_its_own_plane() -> None:
    import numpy as np

    scratch = delta._Scratch()
    xor = np.array([0x01, 0x80, 0x02, 0x80, 0x03, 0x80], dtype=np.uint8)  # 3 bf16 words
    planes = scratch.planes_of(xor, 2)
    assert planes.tobytes() == bytes([0x01, 0x02, 0x03, 0x80, 0x80, 0x80])
    base = np.array([0xFF, 0x00, 0x00, 0xFF, 0x0F, 0xF0], dtype=np.uint8)
    rebuilt = scratch.xor_unplanes(base, planes.copy(), 2)
    assert rebuilt.tobytes() == bytes([0xFE, 0x80, 0x02, 0x7F, 0x0C, 0x70])
    # fp32: four planes, each byte back in its place
    word = np.array([0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88], dtype=np.uint8)
    planes = scratch.planes_of(word, 4).copy()
    assert planes.tobytes() == bytes([0x11, 0x55, 0x22, 0x66, 0x33, 0x77, 0x44, 0x88])
    zero = np.zeros(8, dtype=np.uint8)
    assert scratch.xor_unplanes(zero, planes, 4).tobytes() == word.tobytes()


def test_a_tensor_longer_than_a_block_rebuilds_bit_exact(monkeypatch) -> None:
    """Blocks split tensors: a 3-block fp32 tensor and a bf16 one cut mid-block."""
    monkeypatch.setattr(delta, "BLOCK_BYTES", 64)
    generator = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(40, generator=generator), "b": torch.randn(37).bfloat16()}
    base = save(tensors)
    tensors["a"][::3] += 1e-3
    tensors["b"][5] = 7.0
    target = save(tensors)
    diff = delta.encode(base, target)
    assert diff is not None
    assert delta.decode(base, diff) == target


def sha(version: int) -> str:
    return f"{version:064x}"


@pytest.mark.parametrize(
    "serving, latest, held, full, chain",
    [
        (7, 10, {8: 10, 9: 10, 10: 10}, 100, (8, 9, 10)),  # missed 2 versions: a chain
        (9, 10, {10: 10}, 100, (10,)),
        (7, 10, {8: 40, 9: 40, 10: 40}, 100, None),  # the chain is larger than the whole
        (7, 10, {9: 10, 10: 10}, 100, None),  # a link no longer held
        (None, 10, {10: 10}, 100, None),  # a joiner serves nothing yet
        (11, 10, {10: 10}, 100, None),  # ahead of the learner (a restarted learner): whole
    ],
)
def test_the_cheapest_way_to_the_latest_version(serving, latest, held, full, chain) -> None:
    bases = {v: (sha(v - 1), v - 1, n) for v, n in held.items()}
    serving_sha256 = "" if serving is None else sha(serving)
    assert delta.cheapest_chain(serving_sha256, latest, bases, full) == chain


def test_a_chain_of_deltas_rebuilds_the_latest_version_and_refuses_a_gap() -> None:
    versions = list(adam_versions(torch.bfloat16, steps=3))
    deltas = [delta.encode(a, b) for a, b in zip(versions, versions[1:], strict=False)]
    assert all(d is not None for d in deltas)
    assert bytes(delta.decode(versions[0], b"".join(deltas))) == versions[-1]  # type: ignore[arg-type]
    with pytest.raises(DataLoss, match="another base"):  # the middle link left out
        delta.decode(versions[0], deltas[0] + deltas[2])  # type: ignore[operator]


def test_a_payload_whose_tensors_leave_bytes_uncovered_is_refused() -> None:
    payload = bytearray(save({"a": torch.zeros(4, dtype=torch.bfloat16)}))
    with pytest.raises(InvalidArgument, match="tile the data section"):
        delta.layout(bytes(payload) + b"\0\0")  # two stray bytes after the last tensor
    broken = payload.replace(b'"dtype"', b'"dtypo"')
    with pytest.raises(InvalidArgument, match="lacks data_offsets or dtype"):
        delta.layout(bytes(broken))
