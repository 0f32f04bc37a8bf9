"""Learner step time on SmolLM2-135M-Instruct, one torch thread (the embedded default).

Eight groups of 8 completions (3-26 tokens, the default job's limit) behind the default
chat prompt (~30 tokens), CISPO, all of them trained (no zero-variance group). Prints the
seconds of `Trainer.step` with the prompt computed once per group (`shared_prefix`, the
default) and with one full sequence per sample in length-sorted micro-batches (the
previous default), in one run, and their ratio.

    python benchmarks/learner_step.py [--repeats 3] [--autocast auto|true|false]
"""

from __future__ import annotations

import argparse
import time

from learner_ranks import batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--autocast", default="auto", help="learner.autocast_bf16")
    parser.add_argument("--micro", type=int, default=16, help="learner.micro_batch_samples")
    args = parser.parse_args()
    import torch

    from learner_service.train.trainer import Trainer
    from scalerl.config import LearnerConfig, SmolLM2Model
    from scalerl.policy.hardware import native_bf16
    from scalerl.policy.models import load_policy

    torch.set_num_threads(1)
    model, tok = load_policy(SmolLM2Model())
    groups = batch(tok)  # the same eight groups as benchmarks/learner_ranks.py
    autocast = {"true": True, "false": False}.get(args.autocast, "auto")
    print(
        f"torch {torch.__version__}, {native_bf16('cpu')[1]}, autocast {args.autocast}, "
        f"{sum(len(s.token_ids) for g in groups for s in g.samples)} completion tokens, "
        f"prompt {len(groups[0].prompt_token_ids)} tokens x 64 samples"
    )
    medians = {}
    for shared in (True, False):
        cfg = LearnerConfig(
            autocast_bf16=autocast, shared_prefix=shared, lr=1e-9, micro_batch_samples=args.micro
        )
        trainer = Trainer(model, cfg, 1.0, pad_id=tok.pad_token_id)
        trainer.step(groups)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trainer.step(groups)
            times.append(time.perf_counter() - start)
        label = "shared prefix" if shared else "per sample"
        medians[label] = sorted(times)[len(times) // 2]
        print(
            f"{label}: median {medians[label]:.2f} s per step "
            f"({', '.join(f'{t:.2f}' for t in times)})"
        )
    print(f"per sample / shared prefix: {medians['per sample'] / medians['shared prefix']:.2f}x")


if __name__ == "__main__":
    main()
