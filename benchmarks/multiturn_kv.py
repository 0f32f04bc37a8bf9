"""Multi-turn generation on the torch engine: the KV cache kept across turns vs each turn
prefilled again from its first token, on SmolLM2-135M-Instruct.

8 trajectories of 4 model turns run side by side (each on its own thread, as the rollout
worker runs them). A turn generates `--turn-tokens` tokens (no stop token, so every turn
has the same length), then a tool message of about 20 tokens rendered by the chat template
(`scalerl.agents.chat.TurnTemplate`) is appended and the next turn continues the whole
sequence. With the cache kept (`GenerationRequest.keep_cache`) the engine parks a finished
turn's slot and the next turn prefills only the message; without it, every turn prefills
the whole sequence so far. Both runs sample the same tokens (same seeds), so the work
differs only by the prefill. Prints wall seconds, generated tokens per second, the prompt
tokens prefilled and reused, and the ratio.

    python benchmarks/multiturn_kv.py [--threads 1] [--dtype float32|bfloat16]
        [--turn-tokens 24] [--trajectories 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the platform's word."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(model, tokenizer, args, keep: bool) -> dict[str, float]:
    """One pass over the trajectories; its timings and prefill counts."""
    import copy

    from rollout_service.engines.api import GenerationRequest
    from rollout_service.engines.torch.engine import TorchEngine
    from scalerl.agents.chat import TurnTemplate

    template = TurnTemplate(tokenizer)
    engine = TorchEngine(
        copy.deepcopy(model),
        (),
        max_batch=args.trajectories * 2,
        max_seq_len=1024,
        dtype=args.dtype,
    )
    message = {"role": "tool", "content": "The calculator says 483. The next step is yours."}
    prefilled = [0]

    def trajectory(index: int) -> int:
        ids = template.prompt_ids(
            [{"role": "user", "content": f"What is {index + 17} * {index + 23}? Use the tool."}]
        )
        generated = 0
        for turn in range(args.turns):
            request = GenerationRequest(
                f"t{index}-{turn}",
                tuple(ids),
                args.turn_tokens,
                temperature=1.0,
                seed=1000 * index + turn,
                keep_cache=keep,
            )
            prefilled[0] += len(ids)
            out = engine.submit(request).result(timeout=600)
            generated += len(out.token_ids)
            ids = ids + out.token_ids
            if turn < args.turns - 1:
                ids += template.message_ids(message, out.token_ids)
        return generated

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.trajectories) as pool:
            tokens = sum(pool.map(trajectory, range(args.trajectories)))
    finally:
        engine.stop()
    seconds = time.perf_counter() - started
    reused = engine.prefix_tokens_reused
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "prompt_tokens_prefilled": prefilled[0] - reused,
        "prompt_tokens_reused": reused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()

    import torch

    from scalerl.config import SmolLM2Model
    from scalerl.policy.models import load_policy

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(SmolLM2Model())
    print(
        f"CPU {cpu_name()!r}, {os.cpu_count()} cores, torch {torch.__version__} capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), {args.dtype}; "
        f"{args.trajectories} trajectories x {args.turns} turns x {args.turn_tokens} tokens"
    )
    results = {}
    for keep in (False, True, False, True):  # alternated: drift in the machine hits both
        label = "kv kept" if keep else "re-prefill"
        result = run(model, tokenizer, args, keep)
        results.setdefault(label, []).append(result)
        print(
            f"{label:>10}: {result['seconds']:.2f} s, {result['tokens_per_second']:.1f} tokens/s, "
            f"prompt tokens prefilled {result['prompt_tokens_prefilled']}, "
            f"reused {result['prompt_tokens_reused']}"
        )
    best = {label: min(r["seconds"] for r in runs) for label, runs in results.items()}
    print(
        f"kv kept / re-prefill, best of 2 each: {best['re-prefill'] / best['kv kept']:.2f}x faster"
    )


if __name__ == "__main__":
    main()
