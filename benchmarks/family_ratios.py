"""Step 1's importance ratio of `scalerl run` on a tiny random checkpoint of every model
family (tests/model_families.py, with SmolLM2's tokenizer): `model.kind=path`, fp32,
2 steps, the zero-variance filter off. Step 1 is on-policy, so where the engine and the
learner compute the same model its ratio is 1 (mean within 1e-3, max at most 1.001;
an exact pair gives about 1.000002). Prints one markdown row per family.

    .venv/bin/python benchmarks/family_ratios.py [--families qwen3 gemma3 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from model_families import FAMILY_CONFIGS, run_two_steps

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=sorted(FAMILY_CONFIGS))
    args = parser.parse_args()
    print("| family | architecture | step 1 ratio mean | step 1 ratio max |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            first = run_two_steps(name, Path(tmp))
            config = json.loads((Path(tmp) / name / "config.json").read_text())
            row = f"| {name} | {config['architectures'][0]} | {first.ratio_mean:.7f} | "
            print(f"{row}{first.ratio_max:.7f} |", flush=True)


if __name__ == "__main__":
    main()
