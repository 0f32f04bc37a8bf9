"""Learner throughput at 1 and 2 ranks (FSDP2 over gloo, one torch thread per rank) against
plain Hugging Face forward+backward of the same model and batch in one process.

SmolLM2-135M-Instruct, eight groups of 8 completions (3-26 tokens) behind the default chat
prompt, CISPO, the default learner config (shared prefix, micro-batches of 16 samples).
Completion tokens trained per second of:
- hf: `model(input_ids).logits` -> log-softmax of each completion token -> sum -> backward,
  per micro-batch of 16 padded samples (no optimizer step: the floor of any learner);
- 1 rank: `Trainer.step` (forward, backward, clip, AdamW) in one process;
- 2 ranks: the same step sharded over two processes (`learner.world_size: 2`).
Each is the median of --repeats steps after one warm-up step, all in one run; the 2-rank
line also gives its time split (forward/backward vs optimizer, from the step's metrics).

    python benchmarks/learner_ranks.py [--repeats 3] [--autocast auto|true|false] [--groups 8]

`--groups 2` (one micro-batch per rank) shows the sharding's fixed cost per pass: each
rank gathers every layer's parameters for its forward, again for its backward, and
reduce-scatters the gradients.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path


def batch(tok, count: int = 8):
    """The benchmark's `count` groups (seeded)."""
    from scalerl.v1 import rollout_pb2

    rng = random.Random(0)
    groups = []
    for i in range(count):
        prompt = tok.prompt_ids(f"What is {i}+3?", "Reply with only the final number.")
        samples = []
        for j in range(8):
            n = rng.randint(3, 26)
            samples.append(
                rollout_pb2.Sample(
                    token_ids=[rng.randint(100, 40000) for _ in range(n)],
                    logprobs=[-3.0] * n,
                    policy_versions=[0] * n,
                    reward=float(j % 2),
                    finish_reason=rollout_pb2.FINISH_REASON_STOP,
                )
            )
        groups.append(rollout_pb2.RolloutGroup(prompt_token_ids=prompt, samples=samples))
    return groups


def completion_tokens(groups) -> int:
    return sum(len(s.token_ids) for g in groups for s in g.samples)


def hf_step(model, groups, micro: int, autocast: bool) -> None:
    """Plain forward+backward: full sequences, padded, the whole vocabulary's logits."""
    import torch

    rows = [(list(g.prompt_token_ids), list(s.token_ids)) for g in groups for s in g.samples]
    model.zero_grad(set_to_none=True)
    for start in range(0, len(rows), micro):
        chunk = rows[start : start + micro]
        width = max(len(p) + len(c) for p, c in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        target = torch.zeros(len(chunk), width, dtype=torch.bool)
        for r, (p, c) in enumerate(chunk):
            ids[r, : len(p) + len(c)] = torch.tensor(p + c)
            mask[r, : len(p) + len(c)] = 1
            target[r, len(p) : len(p) + len(c)] = True
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(picked * target[:, 1:]).sum()).backward()


def timed(step, repeats: int) -> list[float]:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return times


def learner_config(autocast):
    from scalerl.config import LearnerConfig

    return LearnerConfig(autocast_bf16=autocast, lr=1e-9)


def two_ranks(rank: int, port: int, repeats: int, autocast, out: str, count: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from learner_service.train.trainer import Trainer
    from scalerl.config import SmolLM2Model
    from scalerl.policy.models import load_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, tok = load_policy(SmolLM2Model())
    groups = batch(tok, count)
    mesh = init_device_mesh("cpu", (2,))
    trainer = Trainer(model, learner_config(autocast), 1.0, pad_id=tok.pad_token_id, mesh=mesh)
    metrics = []
    times = timed(lambda: metrics.append(trainer.step(groups)), repeats)
    if rank == 0:
        torch.save({"times": times, "metrics": metrics[1:]}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--autocast", default="auto", help="learner.autocast_bf16")
    parser.add_argument("--groups", type=int, default=8, help="groups of 8 in the batch")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    from learner_service.train.trainer import Trainer
    from scalerl.config import SmolLM2Model
    from scalerl.policy.hardware import native_bf16
    from scalerl.policy.models import load_policy
    from scalerl.ports import free_port

    torch.set_num_threads(1)
    autocast = {"true": True, "false": False}.get(args.autocast, "auto")
    model, tok = load_policy(SmolLM2Model())
    groups = batch(tok, args.groups)
    tokens = completion_tokens(groups)
    on = native_bf16("cpu")[0] if autocast == "auto" else autocast
    print(f"torch {torch.__version__}, {native_bf16('cpu')[1]}, bf16 autocast {on}")
    print(f"{tokens} completion tokens, {8 * args.groups} samples, one torch thread per process")
    medians = {}
    medians["hf"] = statistics.median(timed(lambda: hf_step(model, groups, 16, on), args.repeats))
    trainer = Trainer(model, learner_config(autocast), 1.0, pad_id=tok.pad_token_id)
    medians["1 rank"] = statistics.median(timed(lambda: trainer.step(groups), args.repeats))
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "two.pt")
        mp.start_processes(
            two_ranks,
            args=(free_port(), args.repeats, autocast, out, args.groups),
            nprocs=2,
            start_method="spawn",
        )
        two = torch.load(out)
    medians["2 ranks"] = statistics.median(two["times"])
    for label, seconds in medians.items():
        print(
            f"{label:8s} {seconds:6.2f} s/step  {tokens / seconds:7.1f} tokens/s  "
            f"{medians['hf'] / seconds:5.2f}x hf"
        )
    efficiency = medians["1 rank"] / medians["2 ranks"] / 2
    backward = statistics.median(m.forward_backward_seconds for m in two["metrics"])
    optimizer = statistics.median(m.optimizer_seconds for m in two["metrics"])
    peaks = two["metrics"][-1]["peak_memory_bytes_by_rank"]
    print(f"2-rank scaling efficiency (1-rank time / 2-rank time / 2): {efficiency:.2f}")
    print(
        f"2 ranks, rank 0: forward/backward {backward:.2f} s, optimizer {optimizer:.2f} s; "
        f"peak RSS per rank {[round(p / 2**20) for p in peaks]} MiB"
    )


if __name__ == "__main__":
    main()
