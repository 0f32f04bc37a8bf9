"""The config options every command that builds a run's config shares (`scalerl run`,
`sweep`, `eval`): one home, so the subcommands' modules need not import `main`."""

from __future__ import annotations

import argparse


def add_config_options(
    parser: argparse.ArgumentParser, default_config: str | None = "default"
) -> None:
    """--config, --recipe, --leave-out and --set (`default_config` None: the command
    finds its config itself when --config is not given)."""
    from scalerl.recipes import LEAVE_OUT, RECIPES

    parser.add_argument(
        "--config",
        default=default_config,
        help="Built-in config (default, tiny) or a YAML file"
        + (f" (default: {default_config})." if default_config else "."),
    )
    parser.add_argument(
        "--recipe",
        default=None,
        help=f"Named recipe: {', '.join(RECIPES)} (default: the config's components).",
    )
    parser.add_argument(
        "--leave-out",
        action="append",
        default=[],
        metavar="COMPONENT",
        help=f"Revert one ScaleRL component to the baseline (repeatable): {', '.join(LEAVE_OUT)}.",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config field, e.g. --set learner.lr=2e-5 (repeatable).",
    )
