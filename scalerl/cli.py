"""The `scalerl` command. `scalerl run [--config NAME_OR_PATH] [--run-dir DIR]`.

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
    run.add_argument("--config", default="default",
                     help="Built-in config (default, tiny) or a YAML file.")
    run.add_argument("--run-dir", type=Path, default=None,
                     help="Run folder (default runs/<run_id>-<time>).")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="Override a config field, e.g. --set learner.lr=2e-5 (repeatable).")
    run.add_argument("--rollout-workers", type=int, default=None,
                     help="Rollout worker processes (overrides rollout.workers).")
    return parser


def _config_error(exc: Exception) -> str:
    """One line naming the field and what is allowed (pydantic's first error)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        if not first["loc"]:
            return first["msg"].removeprefix("Value error, ")
        field = ".".join(str(p) for p in first["loc"])
        return f"{field}: {first['msg']} (got {first.get('input')!r})"
    return str(exc).splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from scalerl.config import load_config

    overrides = list(args.set)
    if args.rollout_workers is not None:
        overrides.append(f"rollout.workers={args.rollout_workers}")
    try:
        config = load_config(args.config, overrides)
    except (FileNotFoundError, ValueError) as exc:
        print(f"scalerl: {_config_error(exc)}", file=sys.stderr)
        return 2
    from scalerl import launcher

    return launcher.run(config, args.run_dir or launcher.default_run_dir(config))


if __name__ == "__main__":
    sys.exit(main())
