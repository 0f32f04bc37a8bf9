"""Write the examples' tiny data files (examples/data/*.jsonl), deterministically.

    python examples/make_data.py          # rewrites examples/data/

math.jsonl: grade-school arithmetic with reference answers in LaTeX or plain form
(integers, fractions such as \\frac{3}{4}, decimals), scored by the `math` verifier.
Columns: id, problem, answer.

code.jsonl: one-function Python exercises with assert tests, scored by the `code`
verifier (the sandboxed program must define the function). Columns: id, prompt, tests.

products.jsonl: products of a three-digit and a two-digit number, which SmolLM2-135M
cannot work out alone but can with the calculator tool (examples/tools), scored by
`last_integer`. Each prompt is a conversation: one worked demonstration (a question, the
call `=123*45`, the calculator's result, the answer), then the question. Columns: id,
problem, answer.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).parent / "data"


def latex(value: Fraction) -> str:
    """An exact answer as LaTeX: an integer, or \\frac{p}{q} (negative sign in front)."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def math_rows(rng: random.Random, count: int) -> list[dict]:
    """`count` distinct problems of five kinds (sum, difference, product, fraction sum,
    a share of a quantity)."""
    rows, seen = [], set()
    while len(rows) < count:
        kind = rng.randrange(5)
        a, b = rng.randint(2, 40), rng.randint(2, 12)
        if kind == 0:
            problem, answer = f"What is {a} + {b}?", Fraction(a + b)
        elif kind == 1:
            problem, answer = f"What is {a} - {b}?", Fraction(a - b)
        elif kind == 2:
            problem, answer = f"What is {b} times {a % 10 + 1}?", Fraction(b * (a % 10 + 1))
        elif kind == 3:
            p, q = rng.randint(1, 5), rng.randint(2, 6)
            problem = f"What is 1/{q} + {p}/{q + 1}? Give the answer as a fraction."
            answer = Fraction(1, q) + Fraction(p, q + 1)
        else:
            whole = b * 4
            problem = (
                f"A class has {whole} pupils and a quarter of them walk to school. How many walk?"
            )
            answer = Fraction(whole, 4)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"id": f"m{len(rows):04d}", "problem": problem, "answer": latex(answer)})
    return rows


# (function name, prompt with {k}, body-free reference used to write the tests)
_CODE = [
    ("add_k", "Write a Python function add_k(x) that returns x + {k}.", lambda k, x: x + k),
    (
        "times_k",
        "Write a Python function times_k(x) that returns x multiplied by {k}.",
        lambda k, x: x * k,
    ),
    (
        "mod_k",
        "Write a Python function mod_k(x) that returns the remainder of x divided by {k}.",
        lambda k, x: x % k,
    ),
    (
        "power_k",
        "Write a Python function power_k(x) that returns x to the power {k}.",
        lambda k, x: x**k,
    ),
]


def code_rows(count_per_kind: int) -> list[dict]:
    """One exercise per (kind, k), each with three assert tests."""
    rows = []
    for name, prompt, reference in _CODE:
        for k in range(2, 2 + count_per_kind):
            tests = [f"assert {name}({x}) == {reference(k, x)}" for x in (0, 3, 7)]
            rows.append({"id": f"c{len(rows):03d}", "prompt": prompt.format(k=k), "tests": tests})
    return rows


# The demonstration before each product question: how a call looks and what comes back.
DEMONSTRATION = [
    {"role": "user", "content": "What is 123*45?"},
    {"role": "assistant", "content": "=123*45"},
    {"role": "tool", "content": "5535"},
    {"role": "assistant", "content": "5535"},
]


def product_rows(rng: random.Random, count: int) -> list[dict]:
    """`count` distinct products a x b, a in 100..999, b in 11..99 (not the
    demonstration's), each after the demonstration."""
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < count:
        pair = (rng.randint(100, 999), rng.randint(11, 99))
        if pair != (123, 45):
            pairs.add(pair)
    return [
        {
            "id": f"mul-{a}-{b}",
            "problem": [*DEMONSTRATION, {"role": "user", "content": f"What is {a}*{b}?"}],
            "answer": a * b,
        }
        for a, b in sorted(pairs)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    write_jsonl(OUT / "math.jsonl", math_rows(random.Random(0), 400))
    write_jsonl(OUT / "code.jsonl", code_rows(10))
    write_jsonl(OUT / "products.jsonl", product_rows(random.Random(0), 1000))


if __name__ == "__main__":
    main()
