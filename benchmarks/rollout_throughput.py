"""Rollout throughput of the torch engine (or vLLM, --engine vllm) on SmolLM2-135M-Instruct.

Two scenarios, each with one torch thread by default and no stop tokens (so every
sequence generates exactly the given number of new tokens):

- `rl`: 8 prompts x 8 samples (group size 8, the RL shape: one prefill per prompt, KV
  copied to the group), 48 new tokens, bfloat16 and float32.
- `default`: the default job's shape, 8 prompts x 8 samples x 26 new tokens
  (`rollout.max_new_tokens`), float32 and bfloat16.
- `eval`: 200 distinct prompts x 2 samples, 32 new tokens, bfloat16 (the learner's
  evaluation shape, where prefilling many distinct prompts dominates).
- `prefill`: the forward alone for 64 distinct prompts, bfloat16: one forward per prompt
  vs one batched forward (`SlotDecoder.extend_batch`, when the engine has it).

Prompts are addition questions in the chat template. The script prints tokens per second,
the time until every request has its first token (prefill included), and the load average
before and after each run (the machine may be shared).

Every float32 run is also set against this CPU's own bound: the fp32 matmul rate measured
at start (GFLOP/s of the model's own weight shapes at the scenario's batch, `--threads`
threads) divided by the model's FLOPs per generated token (2 x the matmul parameters,
LM head included, plus 4 x layers x hidden x context for attention; Kaplan et al. 2020,
Sec. 2.1). The fraction printed is measured tokens/s over that bound. With `--device
cuda` the torch engine runs on the GPU (cuda:0) and no CPU bound is computed.

    python benchmarks/rollout_throughput.py [--scenario rl|eval|prefill|all] [--threads 1]
        [--max-prefill-tokens N] [--engine torch|vllm] [--dtypes bfloat16 float32]
        [--device cpu|cuda] [--model smollm2|qwen3-shaped]

`--model qwen3-shaped` times a random Qwen3 of SmolLM2's size instead (the torch engine
runs each family's own modeling code; this is what Qwen3's q/k norms cost).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    """prompts distinct prompts, each sent group_size times, new_tokens tokens each."""

    prompts: int
    group_size: int
    new_tokens: int
    dtypes: tuple[str, ...]


SCENARIOS = {
    "rl": Scenario(prompts=8, group_size=8, new_tokens=48, dtypes=("bfloat16", "float32")),
    "eval": Scenario(prompts=200, group_size=2, new_tokens=32, dtypes=("bfloat16",)),
    "default": Scenario(prompts=8, group_size=8, new_tokens=26, dtypes=("float32", "bfloat16")),
}


def weight_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight one token passes through: per layer q, k, v, o,
    gate, up, down, then the LM head."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    layer = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]
    layer += [(hidden, inter), (hidden, inter), (inter, hidden)]
    return layer * config.num_hidden_layers + [(hidden, config.vocab_size)]


def flops_per_token(config, context: int) -> float:
    """Forward FLOPs of one token at `context` positions: 2 x matmul parameters (LM head
    included) + 4 x layers x hidden x context (q k^T and the weighted sum of v;
    Kaplan et al. 2020, Sec. 2.1)."""
    matmul = sum(a * b for a, b in weight_shapes(config))
    return 2.0 * matmul + 4.0 * config.num_hidden_layers * config.hidden_size * context


def matmul_gflops(config, rows: int, seconds: float = 3.0) -> float:
    """This CPU's fp32 matmul rate, GFLOP/s, on the model's weight shapes with `rows`
    input rows (the decode batch): every distinct (in, out) shape, weighted by how often a
    token meets it, timed over about `seconds`."""
    import torch

    counts: dict[tuple[int, int], int] = {}
    for shape in weight_shapes(config):
        counts[shape] = counts.get(shape, 0) + 1
    pairs = [(torch.randn(rows, a), torch.randn(b, a), n) for (a, b), n in counts.items()]
    for x, w, _ in pairs:  # warm-up: oneDNN/MKL pick their kernels on first use
        torch.nn.functional.linear(x, w)
    flops, start, repeats = 0.0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds or repeats == 0:
        for x, w, n in pairs:
            for _ in range(n):
                torch.nn.functional.linear(x, w)
            flops += 2.0 * rows * w.shape[0] * w.shape[1] * n
        repeats += 1
    return flops / (time.perf_counter() - start) / 1e9


def qwen3_shaped(smollm2_config):
    """A random Qwen3ForCausalLM of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads
    over 3 kv heads of 64, MLP 1536, vocabulary 49152, tied head), with Qwen3's per-head
    q/k norms: what another family costs the torch engine at the same size."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = smollm2_config
    config = Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def load_average() -> str:
    """The 1/5/15-minute load averages as text."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_scenario(name: str, scenario: Scenario, model, tokenizer, system: str, args) -> None:
    """Generate the scenario's requests once per dtype and print the timings."""
    from rollout_service.engines.api import GenerationRequest
    from rollout_service.engines.torch.engine import TorchEngine

    prompts = [
        tuple(tokenizer.prompt_ids(f"What is {i} + {i * 7 % 40}?", system))
        for i in range(scenario.prompts)
    ]
    assert len(set(prompts)) == len(prompts), "prompts must be distinct"
    requests = [
        GenerationRequest(
            f"r{i}",
            prompts[i // scenario.group_size],
            scenario.new_tokens,
            temperature=1.0,
            seed=i,
        )
        for i in range(scenario.prompts * scenario.group_size)
    ]
    max_len = max(len(p) for p in prompts) + scenario.new_tokens
    rows = len(requests)
    context = (sum(map(len, prompts)) / len(prompts)) + scenario.new_tokens / 2
    on_cpu = args.device == "cpu"
    bound = (
        matmul_gflops(model.config, rows) * 1e9 / flops_per_token(model.config, context)
        if on_cpu
        else 0.0
    )
    print(
        f"[{name}] {scenario.prompts} prompts x {scenario.group_size} samples = "
        f"{len(requests)} sequences x {scenario.new_tokens} new tokens, prompts of "
        f"{min(len(p) for p in prompts)}-{max(len(p) for p in prompts)} tokens, "
        f"{args.threads} thread(s), {args.device}"
    )
    extra = {}
    if args.max_prefill_tokens is not None:
        extra["max_prefill_tokens"] = args.max_prefill_tokens
    if "max_prefill_tokens" not in inspect.signature(TorchEngine).parameters:
        extra = {}  # an engine without batched prefill (for before/after comparisons)
    for dtype in args.dtypes or scenario.dtypes:
        if args.engine == "vllm":
            from rollout_service.engines.vllm.engine import VLLMEngine
            from scalerl.policy.models import smollm2_dir

            engine = VLLMEngine(
                str(smollm2_dir()),
                (),
                max_batch=len(requests),
                max_seq_len=max_len,
                dtype=dtype,
                threads=args.threads,
            )
            # One short request first, so the timing excludes vLLM's first-call set-up.
            engine.submit(GenerationRequest("warm-up", prompts[0], 2)).result(timeout=600)
        else:
            engine = TorchEngine(
                copy.deepcopy(model),
                (),
                max_batch=len(requests),
                max_seq_len=max_len,
                dtype=dtype,
                device=args.device,
                **extra,
            )
        load_before = load_average()
        start = time.monotonic()
        streams = [engine.submit(r) for r in requests]
        first = [s.next_chunk(timeout=1800) for s in streams]
        prefilled = time.monotonic()
        tokens = len(first) + sum(len(s.result(timeout=1800).token_ids) for s in streams)
        elapsed = time.monotonic() - start
        engine.stop()
        after_first = elapsed - (prefilled - start)
        print(
            f"{args.engine} {dtype:>9}: {tokens / elapsed:7.1f} tokens/s overall ({tokens} "
            f"tokens in {elapsed:.1f} s; all first tokens after {prefilled - start:.1f} s, then "
            f"{(tokens - len(first)) / after_first:.1f} tokens/s); load average "
            f"{load_before} before, {load_average()} after"
        )
        if dtype == "float32" and on_cpu:
            print(
                f"  fp32 bound {bound:.1f} tokens/s (matmul rate at {rows} rows / "
                f"{flops_per_token(model.config, context) / 1e9:.3f} GFLOP per token): "
                f"{tokens / elapsed / bound:.2f} of it overall, "
                f"{(tokens - len(first)) / after_first / bound:.2f} after the first tokens"
            )


def run_prefill(model, tokenizer, system: str, prompts: int = 64) -> None:
    """Time the prefill forward of `prompts` distinct prompts (bf16): one by one, batched."""
    import torch

    from rollout_service.engines.torch.decoder import SlotDecoder

    ids = [tokenizer.prompt_ids(f"What is {i} + {i * 7 % 40}?", system) for i in range(prompts)]
    llama = SlotDecoder(copy.deepcopy(model), prompts, max(map(len, ids)), torch.bfloat16)
    llama.extend(0, 0, ids[0])  # warm-up
    load_before, start = load_average(), time.monotonic()
    for slot, prompt in enumerate(ids):
        llama.extend(slot, 0, prompt)
    single = time.monotonic() - start
    line = f"[prefill] {prompts} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
    line += f"bfloat16: one by one {single:.2f} s ({1000 * single / prompts:.0f} ms/prompt)"
    if hasattr(llama, "extend_batch"):
        start = time.monotonic()
        llama.extend_batch(list(range(prompts)), [0] * prompts, ids)
        batched = time.monotonic() - start
        line += f", batched {batched:.2f} s ({1000 * batched / prompts:.0f} ms/prompt)"
    print(f"{line}; load average {load_before} before, {load_average()} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "prefill", "all"], default="all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="engine prefill token budget"
    )
    parser.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="vllm needs the vllm package (make test-vllm creates .venv-vllm with it)",
    )
    parser.add_argument(
        "--model",
        choices=["smollm2", "qwen3-shaped"],
        default="smollm2",
        help="qwen3-shaped: a random Qwen3 of SmolLM2's size (q/k norms; torch engine)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=["bfloat16", "float32"], help="override the scenario's"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the torch engine runs (cuda: cuda:0; vLLM picks its own device)",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"
    if args.engine == "vllm" and args.model != "smollm2":
        parser.error("--model qwen3-shaped runs on the torch engine only")
    if args.engine == "vllm" and "prefill" in ([args.scenario] if args.scenario != "all" else []):
        parser.error("--scenario prefill times the torch engine's forward only")

    import torch

    from scalerl.config import AdditionsTaskConfig, SmolLM2Model
    from scalerl.policy.models import load_policy

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(SmolLM2Model())
    if args.model == "qwen3-shaped":
        model = qwen3_shaped(model.config)
    system = AdditionsTaskConfig().effective_system_prompt
    names = [*SCENARIOS, "prefill"] if args.scenario == "all" else [args.scenario]
    for name in names:
        if name == "prefill":
            if args.engine != "torch":
                continue
            run_prefill(model, tokenizer, system)
        else:
            run_scenario(name, SCENARIOS[name], model, tokenizer, system, args)


if __name__ == "__main__":
    main()
