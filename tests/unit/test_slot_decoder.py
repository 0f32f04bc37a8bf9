"""The torch engine's slot-batched forward (`SlotDecoder`) against the HF forward on the
tiny Llama, and its sampling math (tempered inverse-CDF draw, top-p renormalisation).
Tiny model, fp32, CPU. Every other family: test_architectures.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rollout_service.engines.torch.decoder import SlotDecoder, single_query_attention
from rollout_service.engines.torch.sampling import sample

torch.set_num_threads(1)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """HF forward logits [len(ids), vocab] fp32."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ----- slot forward -----------------------------------------------------------------------


def test_slot_decoder_matches_hf_prefill_and_mixed_decode(model0):
    ids = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    reference = hf_logits(model0, ids)
    llama = SlotDecoder(copy.deepcopy(model0), max_batch=4, max_seq_len=32)
    prefill = llama.extend(3, 0, ids[:6], all_logits=True)
    assert prefill.dtype == torch.float32
    torch.testing.assert_close(prefill, reference[:6], atol=1e-4, rtol=0)
    # Slot 0 runs the same sequence three tokens behind slot 3: per-row positions.
    llama.extend(0, 0, ids[:3])
    for pos in range(6, 10):
        logits = llama.decode(
            torch.tensor([3, 0]),
            torch.tensor([pos, pos - 3]),
            torch.tensor([ids[pos], ids[pos - 3]]),
        )
        torch.testing.assert_close(logits[0], reference[pos], atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[1], reference[pos - 3], atol=1e-4, rtol=0)


def test_single_query_attention_is_sdpa_with_grouped_heads_and_mask():
    """The decode step's grouped matmul equals SDPA with GQA: 9 q heads over 3 kv heads
    (q head h reads kv head h // 3), rows masked at different lengths."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 9, 1, 16, generator=gen)
    keys, values = torch.randn(2, 4, 3, 7, 16, generator=gen).unbind(0)
    lengths = torch.tensor([1, 3, 5, 7])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).view(4, 1, 1, 7)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(
        single_query_attention(q, keys, values, mask, 16**-0.5), expected, atol=1e-6, rtol=0
    )
    # Row 0 sees only position 0: its output is that position's value, per kv group.
    torch.testing.assert_close(
        single_query_attention(q, keys, values, mask, 16**-0.5)[0, 4, 0],
        values[0, 1, 0],
        atol=1e-6,
        rtol=0,
    )


def test_extend_batch_matches_one_slot_at_a_time(model0):
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 4]]
    slots, batched = [2, 0, 1], SlotDecoder(copy.deepcopy(model0), max_batch=3, max_seq_len=32)
    single = SlotDecoder(copy.deepcopy(model0), max_batch=3, max_seq_len=32)
    batched.extend(0, 0, [16, 15, 14, 13, 12, 11, 10, 9, 8])  # stale keys a mask must hide
    first = batched.extend_batch(slots, [0, 0, 0], prompts)
    assert [tuple(t.shape) for t in first] == [(21,)] * 3
    for slot, prompt, logits in zip(slots, prompts, first, strict=True):
        torch.testing.assert_close(logits, single.extend(slot, 0, prompt), atol=1e-5, rtol=0)
    # Forced-phrase shape: chunks of different lengths, each at its own position.
    chunks = [[5, 6, 7], [8], [9, 3]]
    starts = [len(p) for p in prompts]
    out = batched.extend_batch(slots, starts, chunks, all_logits=True)
    assert [tuple(t.shape) for t in out] == [(3, 21), (1, 21), (2, 21)]
    for slot, start, chunk, logits in zip(slots, starts, chunks, out, strict=True):
        expected = single.extend(slot, start, chunk, all_logits=True)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    # The caches agree too: the next decode step reads them (positions 10, 3, 6).
    args = (torch.tensor(slots), torch.tensor([10, 3, 6]), torch.tensor([4, 5, 6]))
    torch.testing.assert_close(batched.decode(*args), single.decode(*args), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        single.extend(2, 0, prompts[0] + chunks[0] + [4])[None],
        hf_logits(model0, prompts[0] + chunks[0] + [4])[-1:],
        atol=1e-4,
        rtol=0,
    )


def test_extend_batch_rejects_bad_batches(model0):
    llama = SlotDecoder(copy.deepcopy(model0), max_batch=2, max_seq_len=8)
    cases = [
        (([0, 1], [0], [[3], [4]]), "same length"),
        (([0, 0], [0, 0], [[3], [4]]), "distinct"),
        (([2], [0], [[3]]), r"0\.\.1"),
        (([0, 1], [0, 0], [[3], []]), "slot 1 positions"),
        (([0], [6], [[3, 4, 5]]), r"slot 0 positions 6\.\.8"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            llama.extend_batch(*args)


def test_bf16_body_keeps_full_precision_fp32_head(model0):
    original = model0.lm_head.weight.detach().clone()
    llama = SlotDecoder(copy.deepcopy(model0), max_batch=1, max_seq_len=16, dtype=torch.bfloat16)
    assert llama.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert torch.equal(llama.head_fp32, original)  # taken before the bf16 cast
    logits = llama.extend(0, 0, [3, 4, 5])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(model0, [3, 4, 5])[-1], atol=0.1, rtol=0)


# ----- sampling ----------------------------------------------------------------------------


def test_greedy_reports_untempered_logprob_of_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, logp = sample(logits, [0.0], [0.5], [None])
    assert tokens.tolist() == [1]
    # 3 - log(e^1 + e^3 + e^2) = -log(1 + e^-1 + e^-2) = -0.40761
    assert logp.item() == pytest.approx(-0.407606, abs=1e-5)


def test_tempered_inverse_cdf_draw():
    # T = 0.5 on logits (0, log 2): probabilities 1:4 -> (0.2, 0.8). The seed-0 generator's
    # first uniform is 0.4963 > 0.2, so token 1 with log 0.8.
    gen = torch.Generator().manual_seed(0)
    assert torch.rand((), generator=torch.Generator().manual_seed(0)).item() == pytest.approx(
        0.4963, abs=1e-4
    )
    tokens, logp = sample(torch.tensor([[0.0, math.log(2.0)]]), [0.5], [1.0], [gen])
    assert tokens.tolist() == [1]
    assert logp.item() == pytest.approx(math.log(0.8), abs=1e-6)


def test_sampled_logprob_is_log_softmax_of_the_tempered_logits():
    """Without a nucleus the sampler never builds the log-probs; the one it reports is
    still log softmax(logits / T) at the drawn token, for wide-ranging logits."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 1000, generator=gen) * 20
    temps = [1.0, 0.5, 2.0, 0.0, 1.3]
    gens = [torch.Generator().manual_seed(i) if t > 0 else None for i, t in enumerate(temps)]
    tokens, logp = sample(logits, temps, [1.0] * 5, gens)
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None]
    expected = torch.log_softmax(logits / scale, dim=-1)[torch.arange(5), tokens]
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)
    assert int(tokens[3]) == int(logits[3].argmax())


def test_top_p_renormalises_over_the_nucleus():
    # Probabilities (0.5, 0.3, 0.2), top_p 0.7: mass before token 2 is 0.8 >= 0.7, so the
    # nucleus is {0, 1} with renormalised probabilities (0.625, 0.375).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(400, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    tokens, logp = sample(logits, [1.0] * 400, [0.7] * 400, gens)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.where(tokens == 0, math.log(0.625), math.log(0.375))
    torch.testing.assert_close(logp, expected.float(), atol=1e-6, rtol=0)
    assert 0.55 < (tokens == 0).float().mean().item() < 0.70  # 0.625 +- 3 sigma
