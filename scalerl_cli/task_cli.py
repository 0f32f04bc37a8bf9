"""`scalerl task score --verifier NAME --answer A --completion TEXT [--json]`: the reward a
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
        help="last_integer, math, code or python:MODULE:FUNCTION.",
    )
    score.add_argument(
        "--answer",
        required=True,
        help="Reference answer: an integer (last_integer), LaTeX or plain math (math), the "
        'tests as JSON (code: ["assert f(1) == 2"] or {"inputs": [...], "outputs": [...]}).',
    )
    score.add_argument("--completion", required=True, help="The completion text ('-': stdin).")
    score.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="Time limit of one check, seconds (math, python: the check; code: the "
        "program's wall time). Default: the verifier's, as in training.",
    )
    score.add_argument("--json", action="store_true", help="Print one JSON object.")


def main(args: argparse.Namespace) -> int:
    """Run `scalerl task <command>`; the exit code (2 for bad input)."""
    from scalerl.entrypoint import config_error
    from scalerl.verifiers import build_verifier

    completion = sys.stdin.read() if args.completion == "-" else args.completion
    try:
        verifier = build_verifier(args.verifier, timeout_s=args.timeout_s)
    except ValueError as exc:
        print(f"scalerl task score: {config_error(exc)}", file=sys.stderr)
        return 2
    try:
        verifier.validate_answer(args.answer)
    except ValueError as exc:
        print(f"scalerl task score: {config_error(exc)}", file=sys.stderr)
        return 2
    # Worker processes, if any, are shared and stopped at exit, as in training.
    verdict = verifier.score(completion, args.answer)
    if args.json:
        print(json.dumps({"verifier": args.verifier, **verdict.as_dict()}))
    else:
        print(_explain(verdict))
    return 0


def _explain(verdict) -> str:
    lines = [f"reward: {verdict.reward:g}"]
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
