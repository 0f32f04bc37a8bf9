"""Torch engine: a multi-turn trajectory's next turn continues its previous turn's KV
cache (`GenerationRequest.keep_cache`): only the tokens added since are prefilled, and
the continuation samples what a fresh prefill of the whole sequence would. Tiny model
(conftest.py), fp32, CPU."""

from __future__ import annotations

import copy

import torch

from rollout_service.engines.api import ABORT, GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine

torch.set_num_threads(1)
PROMPT = (3, 4, 5, 6)


def turn(prompt, rid: str, keep: bool, n: int = 6, seed: int = 7) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(prompt), max_new_tokens=n, temperature=1.0, seed=seed, keep_cache=keep
    )


def three_turns(model, keep: bool):
    """Three turns, each continuing the last with 3 'environment' tokens; returns the
    completions and the engine's reused prompt tokens."""
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=4, max_seq_len=96, autostart=False)
    ids, done = list(PROMPT), []
    for i in range(3):
        stream = engine.submit(turn(ids, f"t{i}", keep, seed=7 + i))
        while not stream.finished.is_set():
            engine.step()
        result = stream.result()
        done.append(result)
        ids += result.token_ids + [8, 9, 10]
    return done, engine.prefix_tokens_reused


def test_a_continuation_prefills_only_what_was_added_and_samples_the_same(model0) -> None:
    kept, reused = three_turns(model0, keep=True)
    fresh, none = three_turns(model0, keep=False)
    assert none == 0
    # Turn 2 reuses the prompt and turn 1's tokens in the cache; turn 3 the same of turn 2.
    # The last sampled token of a turn was never fed: it is prefilled with what follows.
    n1, n2 = len(kept[0].token_ids), len(kept[1].token_ids)
    assert reused == (len(PROMPT) + n1 - 1) + (len(PROMPT) + n1 + 3 + n2 - 1)
    for a, b in zip(kept, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_parked_slots_are_evicted_when_slots_are_needed(model0) -> None:
    engine = TorchEngine(copy.deepcopy(model0), (), max_batch=2, max_seq_len=64, autostart=False)
    streams = [engine.submit(turn(PROMPT, f"p{i}", keep=True, seed=i)) for i in range(2)]
    while not all(s.finished.is_set() for s in streams):
        engine.step()
    assert len(engine._parked) == 2 and not engine._free
    # Two fresh requests take both parked slots; nothing waits forever.
    others = [engine.submit(turn((7, 8), f"q{i}", keep=False)) for i in range(2)]
    for _ in range(50):
        engine.step()
    assert all(s.finished.is_set() for s in others) and len(engine._free) == 2


def test_an_aborted_turn_parks_nothing(model0) -> None:
    engine = TorchEngine(copy.deepcopy(model0), (), max_batch=2, max_seq_len=64, autostart=False)
    stream = engine.submit(turn(PROMPT, "a", keep=True, n=30))
    engine.step()
    engine.interrupt("a", ABORT)
    engine.step()
    assert stream.finished.is_set() and not engine._parked and len(engine._free) == 2
