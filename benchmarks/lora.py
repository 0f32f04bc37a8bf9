"""Full fine-tuning against LoRA (`learner.lora`) on SmolLM2-135M-Instruct, per policy
version, in one run on one machine:

- bytes published: the payload of one version as the learner publishes it
  (`scalerl.weights.publisher.WeightPublisher`): full weights (the body in
  `--dtype`, the tied head in fp32), or the adapters alone (rank `--rank` on every Linear
  of the decoder layers, in `--dtype`, with the base version). The LoRA base a learner
  publishes once is given too.
- publish to serving, 2 workers: `WeightPublisher.publish(wait=True)` over the `stream`
  transport (the payload in chunks over gRPC) to two rollout-worker processes
  (`rollout_service.server` with a torch engine, one thread each), from the call until
  both engines serve the version (UpdateWeights returns after the swap). The LoRA base
  goes first and is not timed.
- learner step: `Trainer.step` on the eight groups of `benchmarks/learner_ranks.py`
  (64 completions of 3-26 tokens), median of `--repeats` steps after one warm-up, and the
  peak resident memory of the process (each variant runs in a fresh process).
- engine: the torch engine generating 32 completions of 26 tokens (the default job's
  prompt and length), one thread, with the adapter applied unmerged (the engine's way:
  adapters side by side) against the same weights merged into the base (W + s B A) and
  served as full weights; and, with fp32 engines, each one's largest logit difference
  from the learner's own fp32 logits (the exactness bound is 1e-5).

    python benchmarks/lora.py [--rank 16] [--repeats 3] [--dtype bfloat16] [--out r.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _policy(rank: int):
    """SmolLM2 as the learner holds it: with rank-`rank` adapters whose B is no longer
    zero (as after training) when rank > 0."""
    from scalerl.config import LoraConfig, SmolLM2Model
    from scalerl.policy.lora import attach_lora
    from scalerl.policy.models import load_policy

    model, tok = load_policy(SmolLM2Model())
    if rank:
        attach_lora(model, LoraConfig(rank=rank))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if ".lora_B." in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1e-3)
    return model, tok


# ----- worker processes ----------------------------------------------------------------


def worker_main(dtype: str, folder: str, ports: mp.Queue, stop: mp.Event) -> None:
    from rollout_service.engines.torch.engine import TorchEngine
    from rollout_service.server import RolloutServicer, start_server
    from scalerl.rpc.security import Security

    torch.set_num_threads(1)
    model, tok = _policy(0)
    engine = TorchEngine(model, tok.stop_token_ids, max_batch=8, max_seq_len=128, dtype=dtype)
    servicer = RolloutServicer(engine, tok, "w", "smollm2", "", 26, weights_root=folder)
    server, port, _ = start_server(servicer, security=Security())
    ports.put(port)
    stop.wait()
    server.stop(grace=None)
    engine.stop()


class _Registry:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    def workers(self) -> dict[str, str]:
        return {f"w{i}": a for i, a in enumerate(self.addresses)}


class _Board:
    def publish(self, ref, base: bool = False) -> None:
        pass

    def forget_base(self) -> None:
        pass


class _State:
    versions = _Board()


def time_publish(rank: int, dtype: str, repeats: int, first_version: int, addresses, folder):
    """(first publication's bytes, a version's bytes, seconds per version)."""
    from scalerl.weights.publisher import WeightPublisher
    from scalerl.weights.senders import StreamSender

    model, _ = _policy(rank)
    registry = _Registry(addresses)
    sender = StreamSender(registry, Path(folder), timeout_s=600)  # type: ignore[arg-type]
    publisher = WeightPublisher(registry, _State(), sender, dtype, lora=rank > 0)  # type: ignore[arg-type]
    publisher.publish(model, first_version, wait=True)  # LoRA: the base, once
    first = publisher.last_bytes
    seconds = []
    for version in range(first_version + 1, first_version + 1 + repeats):
        start = time.perf_counter()
        publisher.publish(model, version, wait=True)
        seconds.append(time.perf_counter() - start)
    assert sender.failures == 0, "a worker refused a version"
    return first, publisher.last_bytes, seconds


# ----- learner step, one process per variant --------------------------------------------


def step_main(rank: int, repeats: int, results: mp.Queue) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from learner_ranks import batch

    from learner_service.train.trainer import Trainer
    from scalerl.config import LearnerConfig

    torch.set_num_threads(1)
    model, tok = _policy(rank)
    trainer = Trainer(model, LearnerConfig(lr=1e-9), 1.0, pad_id=tok.pad_token_id)
    groups = batch(tok)
    trainer.step(groups)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.step(groups)
        times.append(time.perf_counter() - start)
    trained = sum(p.numel() for p in trainer.params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results.put((times, peak, trained))


def time_step(rank: int, repeats: int) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=step_main, args=(rank, repeats, results))
    process.start()
    times, peak, trained = results.get(timeout=1800)
    process.join()
    return {"seconds": times, "peak_rss_bytes": peak, "trained_parameters": trained}


# ----- engine: unmerged against merged ---------------------------------------------------


def time_engines(rank: int, dtype: str, repeats: int) -> dict:
    """Generation seconds of the unmerged and the merged engine in `dtype`, and each
    one's largest logit difference from the learner's fp32 logits with fp32 engines."""
    from rollout_service.engines.api import GenerationRequest

    torch.set_num_threads(1)
    learner, tok = _policy(rank)
    prompt = tuple(tok.prompt_ids("What is 417+385?", "Reply with only the final number."))
    with torch.no_grad():
        reference = learner(input_ids=torch.tensor([prompt])).logits[0].float()
    exactness = {}
    for name, engine in _engines(learner, tok, "float32").items():
        logits = engine.decoder.extend(0, 0, list(prompt), all_logits=True)
        exactness[name] = float((logits - reference).abs().max())
    engines = _engines(learner, tok, dtype)
    seconds: dict[str, list[float]] = {n: [] for n in engines}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            streams = [
                engine.submit(GenerationRequest(f"{name}{repeat}-{i}", prompt, 26, seed=i))
                for i in range(32)
            ]
            start = time.perf_counter()
            while engine.step():
                pass
            elapsed = time.perf_counter() - start
            assert all(len(s.result().token_ids) >= 1 for s in streams)
            if repeat:
                seconds[name].append(elapsed)
    return {"seconds": seconds, "fp32_max_abs_logit_difference": exactness}


def _engines(learner, tok, dtype: str) -> dict:
    """Torch engines (not started) serving the learner's adapters unmerged, and the same
    weights merged into the base (W + s B A) as full weights."""
    from rollout_service.engines.torch.engine import TorchEngine
    from scalerl.policy.lora import BASE_VERSION, base_version_tensor, merge_adapters
    from scalerl.weights.wire import LORA_BASE, head_names, snapshot_state_dict

    unmerged = snapshot_state_dict(learner, dtype, head_names(learner), LORA_BASE)
    unmerged[BASE_VERSION] = base_version_tensor(0)
    plain = merge_adapters(copy.deepcopy(learner))
    merged = snapshot_state_dict(plain, dtype, head_names(plain))
    engines = {}
    for name, payload in (("unmerged", unmerged), ("merged", merged)):
        engine = TorchEngine(_policy(0)[0], tok.stop_token_ids, 32, 128, dtype, autostart=False)
        engine.stage_weights(payload, 1)
        engine.step()
        engine.decoder.assign_adapter(0, "")  # the policy's adapter, as a request gets
        engines[name] = engine
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from scalerl.policy.hardware import native_bf16

    print(f"torch {torch.__version__}, {native_bf16('cpu')[1]}, dtype {args.dtype}")
    result: dict = {"rank": args.rank, "dtype": args.dtype}
    context = mp.get_context("spawn")
    stop, ports = context.Event(), context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        workers = [
            context.Process(target=worker_main, args=(args.dtype, folder, ports, stop))
            for _ in range(2)
        ]
        for worker in workers:
            worker.start()
        addresses = [f"127.0.0.1:{ports.get(timeout=600)}" for _ in workers]
        try:
            for label, rank, first_version in (("full", 0, 1), ("lora", args.rank, 100)):
                first, each, seconds = time_publish(
                    rank, args.dtype, args.repeats, first_version, addresses, folder
                )
                result[label] = {"first_bytes": first, "bytes": each, "publish_s": seconds}
        finally:
            stop.set()
            for worker in workers:
                worker.join(60)
    for label, rank in (("full", 0), ("lora", args.rank)):
        result[label]["step"] = time_step(rank, args.repeats)
    result["engine"] = time_engines(args.rank, args.dtype, args.repeats)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def table(result: dict) -> str:
    full, lora = result["full"], result["lora"]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    rows = [
        f"{'per version':<34}{'full':>14}{'LoRA r' + str(result['rank']):>14}{'full/LoRA':>11}",
        _row("bytes published", full["bytes"], lora["bytes"], "{:,.0f}"),
        _row("publish to serving, 2 workers (s)", med(full["publish_s"]), med(lora["publish_s"])),
        _row("learner step (s)", med(full["step"]["seconds"]), med(lora["step"]["seconds"])),
        _row(
            "learner peak RSS (MiB)",
            full["step"]["peak_rss_bytes"] / 2**20,
            lora["step"]["peak_rss_bytes"] / 2**20,
            "{:,.0f}",
        ),
        _row(
            "trained parameters",
            full["step"]["trained_parameters"],
            lora["step"]["trained_parameters"],
            "{:,.0f}",
        ),
        f"LoRA base, published once: {lora['first_bytes']:,} bytes",
    ]
    engine = result["engine"]
    unmerged, merged = med(engine["seconds"]["unmerged"]), med(engine["seconds"]["merged"])
    exact = engine["fp32_max_abs_logit_difference"]
    rows.append(
        f"engine, 32 x 26 tokens: unmerged {unmerged:.2f} s, merged {merged:.2f} s "
        f"(unmerged/merged {unmerged / merged:.2f}x); fp32 logits vs the learner's: "
        f"unmerged {exact['unmerged']:.1e}, merged {exact['merged']:.1e}"
    )
    return "\n".join(rows)


def _row(label: str, full: float, lora: float, fmt: str = "{:.3f}") -> str:
    ratio = full / lora if lora else float("inf")
    return f"{label:<34}{fmt.format(full):>14}{fmt.format(lora):>14}{ratio:>10.1f}x"


if __name__ == "__main__":
    main()
