"""Rollout throughput of the torch engine on SmolLM2-135M-Instruct.

Generates 64 sequences x 48 new tokens (no stop tokens, so every sequence has exactly 48)
with one torch thread, in bfloat16 and float32, and prints tokens per second. Prompts
are addition questions in the chat template; `--group-size G` sends each prompt G times
(the RL shape: one prefill per prompt, KV copied to the group), 1 makes all 64 distinct.

    python benchmarks/rollout_throughput.py [--group-size 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()

    import torch

    from rollout_service.engine import GenerationRequest, TorchEngine
    from scalerl.config import ModelConfig, TaskConfig
    from scalerl.models import load_policy

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(ModelConfig())
    system = TaskConfig().system_prompt
    prompts = [
        tuple(tokenizer.prompt_ids(f"What is {i % 10} + {i * 7 % 40}?", system))
        for i in range(args.sequences // args.group_size)
    ]
    requests = [
        GenerationRequest(
            f"r{i}", prompts[i // args.group_size], args.new_tokens, temperature=1.0, seed=i
        )
        for i in range(len(prompts) * args.group_size)
    ]
    max_len = max(len(p) for p in prompts) + args.new_tokens
    print(
        f"{len(requests)} sequences x {args.new_tokens} new tokens, prompts of "
        f"{min(len(p) for p in prompts)}-{max(len(p) for p in prompts)} tokens, "
        f"group size {args.group_size}, {args.threads} thread(s)"
    )
    for dtype in args.dtypes.split(","):
        engine = TorchEngine(
            copy.deepcopy(model), (), max_batch=len(requests), max_seq_len=max_len, dtype=dtype
        )
        start = time.monotonic()
        streams = [engine.submit(r) for r in requests]
        first = [s.next_chunk(timeout=600) for s in streams]
        prefilled = time.monotonic()
        tokens = len(first) + sum(len(s.result(timeout=600).token_ids) for s in streams)
        elapsed = time.monotonic() - start
        engine.stop()
        decode_tokens = tokens - len(first)
        print(
            f"{dtype:>9}: {tokens / elapsed:7.1f} tokens/s overall ({tokens} tokens in "
            f"{elapsed:.1f} s; prefill + first token {prefilled - start:.1f} s, then "
            f"{decode_tokens / (elapsed - (prefilled - start)):.1f} tokens/s decoding)"
        )


if __name__ == "__main__":
    main()
