"""The `scalerl` command: `scalerl run [--config NAME_OR_PATH] [--recipe NAME]
[--leave-out COMPONENT] [--set KEY=VALUE] [--run-dir DIR]`; `scalerl run --resume RUN_DIR
[--set KEY=VALUE]` (continue a run: its config.yaml, its Redis data, its checkpoint);
`scalerl sweep --vary
KEY=V1,V2 ...` (see `scalerl_cli.sweep`); `scalerl curve fit|compare ...` (see
`scalerl_cli.curve_cli`); `scalerl workers add|remove RUN_DIR [N]` (grow or shrink a
running job's launcher-managed rollout workers, see `scalerl_cli.fleet`); `scalerl task score
--verifier NAME --answer A --completion TEXT [--json]` (a verifier's reward for one
completion, and why: see `scalerl_cli.task_cli`); `scalerl eval CHECKPOINT [--config ...]
[--samples N] [--seed S] [--plain] [--json]` (a checkpoint's held-out pass rate with a run's
protocol: see `scalerl_cli.eval_cli`); `scalerl export RUN_DIR OUT [--merge]` (a LoRA run's
adapter as a peft folder, or a merged HF model: see `scalerl_cli.export_cli`); `scalerl
serve [CHECKPOINT] [--port P]` (a model on our engine behind an OpenAI-compatible API, e.g.
a judge: see `scalerl_cli.serve_cli`).

Bad input prints one line naming the field and exits with code 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import NoReturn

from scalerl_cli.options import add_config_options


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in one line (`scalerl run: --rollout-workers: invalid int
    value: 'x'`, exit code 2), as every other refusal of bad input; `--help` shows usage.
    Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message.replace('argument ', '', 1)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="scalerl", description="ScaleRL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="Train with ScaleRL: every service on this machine.",
        description="Start Redis, the curve service, the rollout workers and the learner, "
        "train, and write the run folder (metrics, evaluations, fit, plot, report).",
    )
    add_config_options(run)
    run.add_argument(
        "--run-dir", type=Path, default=None, help="Run folder (default runs/<run_id>-<time>)."
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="Continue the run in RUN_DIR from its checkpoint, with its config.yaml (--set "
        "may change limits, e.g. learner.max_steps).",
    )
    run.add_argument(
        "--allow-unsigned-checkpoint",
        action="store_true",
        help="With --resume: load a checkpoint without integrity.json, or whose manifest "
        "leaves state.json out (written by an older version), unchecked. Without it such a "
        "checkpoint is refused: its files could have been swapped.",
    )
    run.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="Use this Redis instead of starting one: redis[s]://[[user]:password@]host:port"
        "[/db], with ?cluster=true for a Redis Cluster (default: SCALERL_REDIS_URL when set, "
        "which keeps the password off the command line). It may hold other runs' data "
        "(keys are per run_id); a --resume of such a run needs it again.",
    )
    run.add_argument(
        "--rollout-workers",
        type=int,
        default=None,
        help="Rollout worker processes (overrides rollout.workers).",
    )
    sweep = sub.add_parser(
        "sweep",
        help="Run variants of a config, then fit and compare their curves.",
        description="Run every combination of the --vary values as a full run, one after "
        "another, then fit each held-out curve and compare them on the curve service.",
    )
    add_config_options(sweep)
    sweep.add_argument(
        "--vary",
        action="append",
        default=[],
        required=True,
        metavar="KEY=V1,V2",
        help="A config field (or recipe, leave_out) and its values; several --vary "
        "combine as a cartesian product.",
    )
    sweep.add_argument(
        "--sweep-dir", type=Path, default=None, help="Sweep folder (default runs/sweep-<time>)."
    )
    sweep.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="Runs per variant, seeds seed..seed+N-1, fitted together as one recipe.",
    )
    sweep.add_argument(
        "--no-final-eval",
        action="store_true",
        help="Skip scoring every run's last checkpoint (scalerl eval) to check the verdict.",
    )
    sweep.add_argument(
        "--compare-only",
        action="store_true",
        help="Run nothing: compare the runs already in --sweep-dir again (the final scores "
        "its sweep.json holds are reused) and rewrite its sweep.json.",
    )
    workers = sub.add_parser(
        "workers",
        help="Add or remove rollout workers of a running `scalerl run`.",
        description="Change how many rollout workers the launcher of the running job in "
        "RUN_DIR keeps; it starts new ones (they join once they serve weights within k of "
        "the learner) or asks the newest to leave (SIGTERM: they push their groups in "
        "flight first). Workers started by hand join and leave without this.",
    )
    workers.add_argument("action", choices=["add", "remove"])
    workers.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    workers.add_argument("count", type=int, nargs="?", default=1, metavar="N")
    from scalerl_cli import (
        curve_cli,  # no torch: the curve commands load numpy/scipy/grpc only
        eval_cli,  # torch only once it runs
        export_cli,  # torch only once it runs
        serve_cli,  # torch only once it runs
        task_cli,  # no torch: the verifiers are torch-free
    )

    curve_cli.add_parser(sub)
    task_cli.add_parser(sub)
    eval_cli.add_parser(sub)
    export_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "curve":
        from scalerl_cli import curve_cli

        return curve_cli.main(args)
    if args.command == "task":
        from scalerl_cli import task_cli

        return task_cli.main(args)
    if args.command == "eval":
        from scalerl_cli import eval_cli

        return eval_cli.main(args)
    if args.command == "export":
        from scalerl_cli import export_cli

        return export_cli.main(args)
    if args.command == "serve":
        from scalerl_cli import serve_cli

        return serve_cli.main(args)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "workers":
        from scalerl_cli.fleet import workers_command

        return workers_command(args.action, args.run_dir, args.count)
    from scalerl.entrypoint import load_config_or_none

    overrides = list(args.set)
    if args.rollout_workers is not None:
        overrides.append(f"rollout.workers={args.rollout_workers}")
    run_dir, problem = _run_dir_or_problem(args)
    redis_url, redis_problem = _redis_url_or_problem(args.redis_url)
    problem = problem or redis_problem
    if problem:
        print(f"scalerl: {problem}", file=sys.stderr)
        return 2
    config_source = str(args.resume / "config.yaml") if args.resume else args.config
    config = load_config_or_none("scalerl", config_source, overrides, args.recipe, args.leave_out)
    if config is None:
        return 2
    from scalerl.obs.logging import setup_logging
    from scalerl_cli import launcher

    setup_logging("launcher", run_id=config.run_id)

    # Ctrl-C (SIGINT) stops the run cleanly (exit 130) even when the shell that started it
    # ignores SIGINT, as non-interactive shells do for background jobs: Python leaves an
    # inherited "ignore" in place unless told otherwise. SIGTERM (`kill`) and SIGHUP (the
    # terminal closed) stop it the same way; by default they would end this process alone
    # and leave Redis, the workers and the learner running.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    try:
        return launcher.run(
            config,
            run_dir or launcher.default_run_dir(config),
            resume=args.resume is not None,
            redis_url=redis_url,
            allow_unsigned_checkpoint=args.allow_unsigned_checkpoint,
        )
    except KeyboardInterrupt:  # while finishing: the children die with this process
        print("scalerl run: interrupted while finishing: every process stopped", file=sys.stderr)
        return 130


def _interrupted(signum: int, frame: object) -> None:
    """A stop signal, handled as Ctrl-C: the launcher stops every process in order."""
    raise KeyboardInterrupt


def _redis_url_or_problem(flag: str | None) -> tuple[str | None, str]:
    """(the external Redis URL of `--redis-url` or SCALERL_REDIS_URL, or None: the
    launcher starts its own; "") or (None, one line naming the option and what is wrong)."""
    from scalerl.state.client import check_redis_url, take_redis_url

    try:
        url = take_redis_url(flag)
        return (None if url is None else check_redis_url(url)), ""
    except ValueError as exc:
        return None, f"--redis-url: {exc}"


def _run_dir_or_problem(args: argparse.Namespace) -> tuple[Path | None, str]:
    """(the run folder, "") or (None, one line saying why the command cannot run): a new
    run needs an empty folder, a resume an existing run folder, never both options."""
    if args.resume is not None:
        if args.run_dir is not None and args.run_dir != args.resume:
            return None, "--resume RUN_DIR names the run folder: drop --run-dir"
        if args.config != "default" or args.recipe or args.leave_out:
            return None, "--resume uses the run's config.yaml: change fields with --set"
        if not (args.resume / "config.yaml").is_file():
            return None, f"--resume {args.resume}: no config.yaml there (not a run folder)"
        return args.resume, ""
    if args.run_dir is not None and args.run_dir.is_dir() and any(args.run_dir.iterdir()):
        return None, (
            f"run folder {args.run_dir} is not empty: continue it with "
            f"`scalerl run --resume {args.run_dir}` or choose another --run-dir"
        )
    return args.run_dir, ""


def _sweep(args: argparse.Namespace) -> int:
    from scalerl.entrypoint import config_error
    from scalerl_cli import sweep

    try:
        if not 1 <= args.seeds <= sweep.MAX_SEEDS:
            raise ValueError(f"--seeds: must be 1..{sweep.MAX_SEEDS}, got {args.seeds}")
        axes = sweep.parse_vary(args.vary)
        variants = sweep.build_variants(
            args.config, axes, args.recipe, args.leave_out, list(args.set), args.seeds
        )
        if args.compare_only and args.sweep_dir is None:
            raise ValueError("--compare-only: name the sweep's folder with --sweep-dir")
    except (FileNotFoundError, ValueError) as exc:
        print(f"scalerl sweep: {config_error(exc)}", file=sys.stderr)
        return 2
    from scalerl.obs.logging import setup_logging

    setup_logging("launcher")
    final_eval = not args.no_final_eval
    if args.compare_only:
        return sweep.compare_again(variants, args.sweep_dir, final_eval)
    sweep_dir = args.sweep_dir or sweep.default_sweep_dir()
    return sweep.run_sweep(variants, sweep_dir, final_eval=final_eval)


if __name__ == "__main__":
    sys.exit(main())
