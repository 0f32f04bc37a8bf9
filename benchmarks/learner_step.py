"""Learner step time on SmolLM2-135M-Instruct, one torch thread (the embedded default).

Three groups of 8 completions (3-32 tokens, the shape of an early default-run step after
zero-variance filtering), CISPO, bf16 autocast with fp32 head. Prints the seconds of
`Trainer.step` with samples packed group by group and packed by length.

    python benchmarks/learner_step.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from learner_service import trainer as trainer_module
    from learner_service.trainer import Trainer
    from scalerl.config import LearnerConfig, ModelConfig
    from scalerl.models import load_policy
    from scalerl.v1 import rollout_pb2

    torch.set_num_threads(1)
    model, tok = load_policy(ModelConfig())
    rng = random.Random(0)

    def group(i: int) -> rollout_pb2.RolloutGroup:
        prompt = tok.prompt_ids(f"What is {i}+3?", "Reply with only the final number.")
        samples = []
        for j in range(8):
            n = rng.randint(3, 32)
            samples.append(
                rollout_pb2.Sample(
                    token_ids=[rng.randint(100, 40000) for _ in range(n)],
                    logprobs=[-3.0] * n,
                    policy_versions=[0] * n,
                    reward=float(j % 2),
                    finish_reason=rollout_pb2.FINISH_REASON_STOP,
                )
            )
        return rollout_pb2.RolloutGroup(prompt_token_ids=prompt, samples=samples)

    groups = [group(i) for i in range(3)]
    original = trainer_module.pack_groups
    for sort in (False, True):
        trainer_module.pack_groups = lambda g, pad, sort_by_length=False, s=sort: original(
            g, pad, sort_by_length=s
        )
        trainer = Trainer(model, LearnerConfig(), 1.0, pad_id=tok.pad_token_id)
        trainer.step(groups)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trainer.step(groups)
            times.append(time.perf_counter() - start)
        label = "by length" if sort else "by group"
        print(
            f"packed {label}: median {sorted(times)[len(times) // 2]:.2f} s per step "
            f"({', '.join(f'{t:.2f}' for t in times)})"
        )
    trainer_module.pack_groups = original


if __name__ == "__main__":
    main()
