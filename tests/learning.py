"""The bar by which an end-to-end run of the `tiny` config has learned (importable from
every test folder: pytest puts tests/ on sys.path for its conftest)."""

from __future__ import annotations

from scalerl.run_folder import EvalRecord


def assert_pass_rate_rose(evals: list[EvalRecord]) -> None:
    """The evaluations after step 0 average a held-out pass rate at least 0.01 above step 0's.

    30 held-out prompts x 16 samples give an evaluation a standard error of about 0.02.
    In 10 runs of this config (9 cpu-smoke, 1 tiny) step 0 passed 0.315 every time and
    the later evaluations averaged 0.338-0.375, a spread of 0.011; a run that did not
    learn would average 0.315 +/- 0.008. Any one evaluation is too noisy to judge by: in
    runs that learned, the last was as little as 0.015 above step 0 and the best 0.055.
    Gains are counted in completions (of 480), so a gain of exactly 0.01 is not lost to
    float rounding."""
    start = evals[0].pass_rate
    later = [round((e.pass_rate - start) * e.completions) for e in evals[1:]]
    rates = [round(e.pass_rate, 3) for e in evals]
    assert sum(later) / len(later) >= 0.01 * evals[-1].completions, f"did not rise: {rates}"
