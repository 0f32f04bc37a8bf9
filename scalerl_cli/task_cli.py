"""`scalerl task inspect [--config C] [--set K=V] [--show N] [--template] [--trajectory]
[--json]`: per task of a run config, its source, verifier, weight, the prompt counts of the
training and held-out splits and a few rendered prompts (with `--template`, exactly as the
model sees them, through its chat template); with `--trajectory`, one trajectory of each
multi-turn task run on the config's model, its tokens coloured by role.

`scalerl task score --verifier NAME --answer A --completion TEXT [--json]`: the reward a
verifier gives one completion, and why (what was extracted and compared with what).

It builds the verifier with `scalerl.verifiers.build_verifier` and scores with
`Verifier.score`, the very calls the actor and the evaluator make, so it shows the reward
training would give. `--completion -` reads the completion from stdin. Bad input (an
unknown verifier, a reference answer the verifier cannot use) prints one line and exits 2;
a completion that fails to score is not bad input: it prints reward 0 and the failure.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `scalerl task ...` on the top-level subparsers."""
    task = sub.add_parser("task", help="Inspect and debug tasks and their verifiers.")
    task_sub = task.add_subparsers(dest="task_command", required=True)
    score = task_sub.add_parser(
        "score",
        help="Score one completion with a verifier, as training would.",
        description="Print the reward a verifier gives COMPLETION against the reference "
        "answer, and what it extracted and compared.",
    )
    score.add_argument(
        "--verifier",
        required=True,
        help="last_integer, math, code, judge, reasoning_gym:DATASET or python:MODULE:FUNCTION.",
    )
    score.add_argument(
        "--answer",
        required=True,
        help="Reference answer: an integer (last_integer), LaTeX or plain math (math), the "
        'tests as JSON (code: ["assert f(1) == 2"] or {"inputs": [...], "outputs": [...]}), '
        "a reasoning-gym item as JSON or its plain answer (reasoning_gym:DATASET).",
    )
    score.add_argument("--completion", required=True, help="The completion text ('-': stdin).")
    score.add_argument(
        "--prompt", default="", help="The prompt the completion answers (what a judge reads)."
    )
    score.add_argument(
        "--config",
        default="default",
        help="Config whose `verifier:` section is used (built-in name or YAML file).",
    )
    score.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set verifier.judge.url=http://judge:8000/v1.",
    )
    score.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="Time limit of one check, seconds (math, python: the check; code: the "
        "program's wall time). Default: the verifier's, as in training.",
    )
    score.add_argument("--json", action="store_true", help="Print one JSON object.")
    inspect = task_sub.add_parser(
        "inspect",
        help="Show each task of a config: source, split sizes, a few prompts.",
        description="Build every task of the config as a run would (nothing is trained) "
        "and print its source, verifier, weight, training and held-out prompt counts and "
        "a few rendered prompts.",
    )
    inspect.add_argument(
        "--config", default="default", help="Built-in config (default, tiny) or a YAML file."
    )
    inspect.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set task.0.heldout_size=100 (repeatable).",
    )
    inspect.add_argument(
        "--show", type=int, default=3, help="Training prompts shown per task (0..50; default 3)."
    )
    inspect.add_argument(
        "--template",
        action="store_true",
        help="Render prompts through the model's chat template (loads its tokenizer).",
    )
    inspect.add_argument(
        "--trajectory",
        action="store_true",
        help="Multi-turn tasks: run one trajectory of the first training prompt on the "
        "config's model (its weights before training) and show its tokens by role: the "
        "model's, the environment's, and forced ones.",
    )
    inspect.add_argument("--json", action="store_true", help="Print one JSON object.")


def main(args: argparse.Namespace) -> int:
    """Run `scalerl task <command>`; the exit code (2 for bad input)."""
    if args.task_command == "inspect":
        return inspect_main(args)
    return score_main(args)


def inspect_main(args: argparse.Namespace) -> int:
    """`scalerl task inspect`: 0, or 2 after one line for a bad config or task."""
    from scalerl.entrypoint import config_error, load_config_or_none
    from scalerl.tasks import build_tasks

    if not 0 <= args.show <= 50:
        print(f"scalerl task inspect: --show must be in [0, 50], got {args.show}", file=sys.stderr)
        return 2
    config = load_config_or_none("scalerl task inspect", args.config, args.set)
    if config is None:
        return 2
    try:
        tasks = build_tasks(config)
        render = _renderer(config) if args.template else _plain
    except (ValueError, FileNotFoundError) as exc:
        print(f"scalerl task inspect: {config_error(exc)}", file=sys.stderr)
        return 2
    try:
        described = [
            {**about, "prompts": _shown(tasks[about["task"]], args.show, render)}
            for about in tasks.describe()
        ]
        if args.trajectory:
            for about in described:
                task = tasks[about["task"]]
                if task.environments is not None:
                    about["trajectory"] = _trajectory(config, task)
    finally:
        tasks.close()
    if args.json:
        print(json.dumps({"config": args.config, "tasks": described}, default=str))
        return 0
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    for about in described:
        console.print(_inspect_text(about), markup=False)
        if "trajectory" in about:
            console.print(_trajectory_text(about["trajectory"]))
        console.print()
    return 0


def _shown(task, count: int, render) -> list[dict]:
    """The first `count` training prompts of `task`, rendered, with their answers."""
    shown = []
    for prompt_id in list(task.train_ids[:count]):
        problem = task.problem(prompt_id)
        shown.append(
            {
                "prompt_id": prompt_id,
                "prompt": render(problem, task.system_prompt),
                "answer": problem.answer,
            }
        )
    return shown


def _trajectory(config, task) -> dict:
    """One trajectory of the task's first training prompt on the config's model (the
    torch engine, weights before training): its segments of one role each, as text."""
    from dataclasses import replace

    from rollout_service.actor import length_control_ids, rollout_request
    from rollout_service.engines.torch.engine import TorchEngine
    from scalerl.agents.chat import TurnTemplate
    from scalerl.agents.trajectory import run_trajectory
    from scalerl.policy.models import load_policy
    from scalerl.v1 import rollout_pb2

    rollout = config.rollout
    model, tokenizer = load_policy(config.model, seed=config.seed)
    engine = TorchEngine(model, tokenizer.stop_token_ids, 4, rollout.max_seq_len)
    template = TurnTemplate(tokenizer)
    base = rollout_request(
        rollout, "inspect", (0,), config.seed, length_control_ids(rollout, tokenizer)
    )

    def generate(ids, max_new_tokens, turn):
        request = replace(base, request_id=f"inspect-t{turn}", prompt_ids=tuple(ids))
        request = replace(request, max_new_tokens=max_new_tokens, keep_cache=True)
        return engine.submit(request).result(timeout=600)

    problem = task.problem(task.train_ids[0])
    factory = task.environments
    env = factory.make(problem, template.shows_tools)
    try:
        t = run_trajectory(
            env, template, generate, factory.limits(rollout.max_new_tokens), rollout.max_seq_len
        )
    finally:
        engine.stop()
    segments: list[dict] = []
    for token, role in zip(t.token_ids, t.roles(), strict=True):
        if not segments or segments[-1]["role"] != role:
            segments.append({"role": role, "ids": []})
        segments[-1]["ids"].append(token)
    shown = [{"role": "prompt", "ids": t.prompt_ids}, *segments]
    for segment in shown:
        segment["text"] = _raw_text(tokenizer, segment.pop("ids"))
    return {
        "prompt_id": problem.prompt_id,
        "turns": t.turns,
        "tool_calls": t.tool_calls,
        "tool_errors": t.tool_errors,
        "finish_reason": rollout_pb2.FinishReason.Name(t.finish_reason),
        "segments": shown,
    }


def _raw_text(tokenizer, ids: list[int]) -> str:
    """Ids as text with the template's special tokens shown."""
    if tokenizer.chat:
        return str(tokenizer.tokenizer.decode(ids, skip_special_tokens=False))
    return str(tokenizer.decode(ids))


_ROLE_STYLES = {"prompt": "dim", "model": "bold", "environment": "cyan", "forced": "yellow"}


def _trajectory_text(trajectory: dict) -> str:
    """A trajectory's segments in rich markup, one colour per role."""
    from rich.markup import escape

    head = (
        f"  --- trajectory of {trajectory['prompt_id']}: {trajectory['turns']} turns, "
        f"{trajectory['tool_calls']} tool calls ({trajectory['tool_errors']} failed), "
        f"{trajectory['finish_reason']}; [bold]model[/] [cyan]environment[/] [yellow]forced[/]"
    )
    body = "".join(
        f"[{_ROLE_STYLES[s['role']]}]{escape(s['text'])}[/]" for s in trajectory["segments"]
    )
    return head + "\n" + body


def _plain(problem, system_prompt: str) -> str:
    messages = list(problem.messages or [{"role": "user", "content": problem.question}])
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return "\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in messages)


def _renderer(config):
    """Prompts as the model sees them: its tokenizer's chat template (`model.chat_template`
    when set), decoded back to text. Raises FileNotFoundError when the model is absent."""
    from scalerl.config.model import SmolLM2Model
    from scalerl.policy.models import load_tokenizer, smollm2_dir

    if isinstance(config.model, SmolLM2Model):
        smollm2_dir(config.model.cache_dir)  # converts the embedded model once
    tokenizer = load_tokenizer(config.model)

    def render(problem, system_prompt: str) -> str:
        ids = tokenizer.prompt_ids(problem.messages or problem.question, system_prompt)
        return tokenizer.tokenizer.decode(ids)

    return render


def _inspect_text(about: dict) -> str:
    lines = [
        f"task {about['task']}  (weight {about['weight']:g}, {100 * about['share']:.0f}% of "
        "training prompts)",
        f"  source:   {about['source']}",
        f"  verifier: {about['verifier']}",
        f"  prompts:  {about['train_prompts']} training, {about['heldout_prompts']} held out",
    ]
    extra = {k: v for k, v in about.items() if k not in _SHOWN_KEYS}
    lines += [f"  {key}: {value}" for key, value in extra.items()]
    for item in about["prompts"]:
        lines.append(f"  --- {item['prompt_id']}  (answer: {_short(item['answer'])})")
        lines += [f"    {line}" for line in item["prompt"].splitlines()]
    return "\n".join(lines)


_SHOWN_KEYS = {
    "task",
    "weight",
    "share",
    "source",
    "verifier",
    "train_prompts",
    "heldout_prompts",
    "prompts",
    "trajectory",
}


def _short(value, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def score_main(args: argparse.Namespace) -> int:
    """`scalerl task score`: 0; 2 after one line for bad input; 1 when the verifier could
    not run (the sandbox down past its retries: the verdict is printed, unscored)."""
    from scalerl.config import load_config
    from scalerl.entrypoint import config_error
    from scalerl.verifiers import build_verifier

    completion = sys.stdin.read() if args.completion == "-" else args.completion
    try:
        settings = load_config(args.config, args.set).verifier
        verifier = build_verifier(args.verifier, args.timeout_s, settings)
    except (FileNotFoundError, ValueError) as exc:
        print(f"scalerl task score: {config_error(exc)}", file=sys.stderr)
        return 2
    try:
        verifier.validate_answer(args.answer)
    except ValueError as exc:
        print(f"scalerl task score: {config_error(exc)}", file=sys.stderr)
        return 2
    # Worker processes, if any, are shared and stopped at exit, as in training.
    verdict = verifier.score(completion, args.answer, args.prompt)
    if args.json:
        print(json.dumps({"verifier": args.verifier, **verdict.as_dict()}))
    else:
        print(_explain(verdict))
    return 1 if verdict.unscored else 0


def _explain(verdict) -> str:
    lines = ["reward: none (unscored)" if verdict.unscored else f"reward: {verdict.reward:g}"]
    for label, value in (
        ("extracted", verdict.extracted),
        ("expected", verdict.expected),
        ("why", verdict.detail),
    ):
        if value:
            lines.append(f"{label}: {value}")
    if verdict.parse_failed:
        lines.append("parse failed: no answer could be parsed")
    if verdict.failure:
        lines.append(f"failure: {verdict.failure} (counted in the verifier's stats in training)")
    return "\n".join(lines)
