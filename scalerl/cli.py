"""The `scalerl` command. `scalerl run [--config NAME_OR_PATH] [--run-dir DIR]`;
`scalerl curve fit|compare ...` (see `scalerl.curve_cli`).

Bad input prints one line naming the field and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalerl", description="ScaleRL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="Train with ScaleRL: every service on this machine.")
    run.add_argument(
        "--config", default="default", help="Built-in config (default, tiny) or a YAML file."
    )
    run.add_argument(
        "--run-dir", type=Path, default=None, help="Run folder (default runs/<run_id>-<time>)."
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set learner.lr=2e-5 (repeatable).",
    )
    run.add_argument(
        "--rollout-workers",
        type=int,
        default=None,
        help="Rollout worker processes (overrides rollout.workers).",
    )
    from scalerl import curve_cli  # no torch: the curve commands load numpy/scipy/grpc only

    curve_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "curve":
        from scalerl import curve_cli

        return curve_cli.main(args)
    from scalerl.entrypoint import load_config_or_none

    overrides = list(args.set)
    if args.rollout_workers is not None:
        overrides.append(f"rollout.workers={args.rollout_workers}")
    config = load_config_or_none("scalerl", args.config, overrides)
    if config is None:
        return 2
    from scalerl import launcher

    return launcher.run(config, args.run_dir or launcher.default_run_dir(config))


if __name__ == "__main__":
    sys.exit(main())
