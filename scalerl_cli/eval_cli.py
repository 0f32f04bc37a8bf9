"""`scalerl eval CHECKPOINT`: score any checkpoint on the held-out split with a run's
protocol, so that runs and peers are compared on one ruler.

CHECKPOINT is a run folder (its `checkpoint/` and, by default, its config.yaml), a
`checkpoint/` folder, a Hugging Face model folder (config.json and *.safetensors, e.g. a
TRL trainer's `save_pretrained`) or one .safetensors file. Its weights must fit the
config's model (`model.kind`): they are loaded into a rollout engine of this process, the
same engine a worker runs, and the held-out split is generated through the same Generate
RPC and scored by the same `learner_service.evaluation.evaluate.Evaluator` the learner uses: every
held-out prompt of every task x `eval.samples` completions at `eval.temperature`, the
interruption-based length control of `rollout.thinking_budget` (`--plain`: none, replies
are plain samples cut at `rollout.max_new_tokens`), the task-weighted mean pass rate and
its standard error over prompts. The sample seeds default to those of the run's own
evaluation at the checkpoint's step (`seed + 7919 x step`), so a run's final checkpoint
scores what its final evaluation recorded, up to the engine's batching.

Bad input (no such checkpoint, weights of another model, a bad config field) prints one
line and exits with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported only once an evaluation starts
    from scalerl.policy.hardware import ResolvedConfig

SEED_STRIDE = 7919  # the learner's evaluation seed: config.seed + 7919 x step


@dataclass(frozen=True)
class Source:
    """What CHECKPOINT names: its weight files, the config found beside it (None: none)
    and the optimizer step it was saved at (None: unknown, e.g. an HF folder)."""

    weights: tuple[Path, ...]
    config: Path | None
    step: int | None


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `scalerl eval` on the top-level subparsers."""
    from scalerl_cli.options import add_config_options

    parser = sub.add_parser(
        "eval",
        help="Score a checkpoint on the held-out split with a run's protocol.",
        description="Load CHECKPOINT (a run folder, its checkpoint/, an HF model folder or a "
        ".safetensors file) into a rollout engine and score every held-out prompt with the "
        "config's evaluation protocol; prints pass rate +- stderr.",
    )
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    add_config_options(parser, default_config=None)
    parser.add_argument(
        "--samples", type=int, default=None, help="Samples per prompt (eval.samples)."
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="Score a fixed seeded subset of N held-out prompts (eval.prompts; 0 = all).",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="Sample seed (default: the run's at that step)."
    )
    parser.add_argument(
        "--plain", action="store_true", help="No length control: plain samples, cut at the cap."
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="Torch threads (0 = every usable core)."
    )
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")


def main(args: argparse.Namespace) -> int:
    """Run `scalerl eval`; 0 on success, 2 on bad input (one line on stderr)."""
    try:
        source = find_source(args.checkpoint)
        config = _config(args, source)
    except (FileNotFoundError, ValueError) as exc:
        from scalerl.entrypoint import config_error

        print(f"scalerl eval: {config_error(exc)}", file=sys.stderr)
        return 2
    if config is None:
        return 2
    seed = args.seed if args.seed is not None else config.seed + SEED_STRIDE * (source.step or 0)
    from scalerl.entrypoint import resolve_hardware_or_none
    from scalerl.rpc.errors import InvalidArgument

    resolved = resolve_hardware_or_none("scalerl eval", config)
    if resolved is None:  # the device asked for is not here: said in one line
        return 2
    try:
        with stdout_to_stderr(args.json):
            result = evaluate_checkpoint(resolved, source, seed, args)
    except InvalidArgument as exc:
        print(f"scalerl eval: {args.checkpoint}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else summary_line(result))
    return 0


@contextlib.contextmanager
def stdout_to_stderr(on: bool) -> Iterator[None]:
    """While on: everything written to stdout (sys.stdout and file descriptor 1, where an
    engine's own libraries log: vLLM prints its start-up to stdout) goes to stderr, so
    that `--json` prints exactly one JSON document on stdout."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def find_source(path: Path) -> Source:
    """The weights, config and step CHECKPOINT names (module doc). Raises
    FileNotFoundError when it names none of the four kinds."""
    from learner_service.checkpoint.files import checkpoint_step

    if path.is_file():
        if path.suffix != ".safetensors":
            raise FileNotFoundError(f"CHECKPOINT {path}: a file must be .safetensors")
        return Source((path,), None, None)
    if (path / "config.yaml").is_file() and (path / "checkpoint").is_dir():
        inner = find_source(path / "checkpoint")
        return Source(inner.weights, path / "config.yaml", inner.step)
    step = checkpoint_step(path)  # also finds the `.old` sibling a crash left
    if step is not None:  # a scalerl checkpoint (or its .old sibling after a crash)
        found = path if (path / "state.json").exists() else path.with_name(path.name + ".old")
        weights = found / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(
                f"CHECKPOINT {path}: only sharded weights (shards/); a run's final "
                "checkpoint also exports model.safetensors"
            )
        beside = path.parent / "config.yaml"
        return Source((weights,), beside if beside.is_file() else None, step)
    files = tuple(sorted(path.glob("*.safetensors"))) if path.is_dir() else ()
    if files:
        return Source(files, None, None)
    raise FileNotFoundError(
        f"CHECKPOINT {path}: not a run folder, a checkpoint/ folder, an HF model folder "
        "(*.safetensors) or a .safetensors file"
    )


def _config(args: argparse.Namespace, source: Source):
    """The run config: --config, else the one beside the checkpoint, else the default;
    with --set, --samples and --prompts applied. None after printing the one line."""
    from scalerl.entrypoint import load_config_or_none

    name = args.config or (str(source.config) if source.config else "default")
    overrides = list(args.set)
    if args.samples is not None:
        overrides.append(f"eval.samples={args.samples}")
    overrides.append(f"eval.prompts={args.prompts}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = every usable core), got {args.threads}")
    return load_config_or_none("scalerl eval", name, overrides, args.recipe, args.leave_out)


def evaluate_checkpoint(
    resolved: ResolvedConfig, source: Source, seed: int, args: argparse.Namespace
) -> dict:
    """Load the weights into an engine (on the resolved device and dtype) served on a
    local port, score the held-out split
    (every prompt, or the `--prompts` subset) and return the result as a dict. Raises
    InvalidArgument naming the first bad tensor when the weights do not fit the model."""
    from learner_service.evaluation.evaluate import evaluator_for
    from rollout_service.server import RolloutServicer, start_server
    from scalerl.tasks import build_tasks

    config = resolved.config
    with loaded_engine(resolved, source.weights, args.threads) as (engine, tokenizer):
        r = config.rollout
        servicer = RolloutServicer(
            engine, tokenizer, "eval", config.model.kind, r.interrupt_text, r.max_new_tokens,
            think_end=r.think_end,
        )  # fmt: skip
        server, port, _ = start_server(servicer)
        try:
            evaluator = evaluator_for(
                config, build_tasks(config), tokenizer, not args.plain, r.max_batch
            )
            started = time.monotonic()
            result = evaluator.evaluate([f"127.0.0.1:{port}"], seed, full=args.prompts == 0)
            seconds = time.monotonic() - started
        finally:
            server.stop(grace=None)
    return _as_dict(result, config, source, seed, args, seconds, evaluator)


@contextlib.contextmanager
def loaded_engine(
    resolved: ResolvedConfig, weights: tuple[Path, ...], threads: int = 0
) -> Iterator[tuple[Any, Any]]:
    """(a started rollout engine of the config's model, its `PolicyTokenizer`), holding
    `weights` (files of a checkpoint, as `find_source` names them; () = the model as the
    config loads it), stopped on exit. threads: torch threads (0 = every usable core).
    Raises InvalidArgument naming the first bad tensor when the weights do not fit."""
    import torch

    from rollout_service.engines.factory import build_engine
    from scalerl.cores import torch_threads
    from scalerl.length_control import check_budgets
    from scalerl.policy.models import load_policy
    from scalerl.rpc.errors import InvalidArgument
    from scalerl.weights.check import load_state_dict
    from scalerl.weights.wire import lora_checkpoint_payload

    config = resolved.config
    torch.set_num_threads(torch_threads(threads))
    model, tokenizer = load_policy(config.model, seed=config.seed)
    check_budgets(config.rollout, tokenizer.encode)
    engine = build_engine(resolved, model, tokenizer, None)
    try:
        if weights:
            state: dict = {}
            for file in weights:
                state.update(load_state_dict(file))
            lora = config.learner.lora
            try:
                state = lora_checkpoint_payload(state, lora.alpha / lora.rank if lora else None)
            except ValueError as exc:
                field, message = "learner.lora", str(exc).removeprefix("learner.lora: ")
                raise InvalidArgument(field, message) from exc
            engine.stage_weights(state, 1).result(timeout=600)
        yield engine, tokenizer
    finally:
        engine.stop()


def _as_dict(result, config, source: Source, seed: int, args, seconds: float, evaluator) -> dict:
    """The machine-readable result (`--json`)."""
    return {
        "checkpoint": str(args.checkpoint),
        "step": source.step,
        "pass_rate": result.pass_rate,
        "stderr": result.stderr,
        "completions": result.completions,
        "samples": config.eval.samples,
        "temperature": config.eval.temperature,
        "seed": seed,
        "length_control": bool(evaluator.length_control),
        "truncation_rate": result.truncation_rate,
        "parse_failure_rate": result.parse_failure_rate,
        "mean_tokens": result.mean_tokens,
        "seconds": seconds,
        "by_task": {
            name: {"pass_rate": t.pass_rate, "stderr": t.stderr, "completions": t.completions}
            for name, t in result.by_task.items()
        },
    }


def summary_line(result: dict) -> str:
    """One line: pass rate +- stderr, what it was measured over, how replies ended."""
    stderr = f" +- {result['stderr']:.3f}" if result["stderr"] is not None else ""
    tasks = (
        "; " + ", ".join(f"{n} {t['pass_rate']:.3f}" for n, t in result["by_task"].items())
        if len(result["by_task"]) > 1
        else ""
    )
    control = "length control" if result["length_control"] else "plain sampling"
    return (
        f"pass rate {result['pass_rate']:.3f}{stderr} over {result['completions']} completions "
        f"({result['samples']} per prompt, temperature {result['temperature']}, {control}, "
        f"seed {result['seed']}); truncated {result['truncation_rate']:.3f}, "
        f"{result['mean_tokens']:.1f} tokens per reply, {result['seconds']:.0f}s{tasks}"
    )
