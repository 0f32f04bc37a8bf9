"""The verifier cases of the acceptance, shared by the verifier tests and the
`scalerl task score` agreement test: (id, verifier, answer as the CLI takes it, completion,
reward, parse_failed, failure)."""

from __future__ import annotations

import json
from typing import NamedTuple

# Small limits everywhere: a containment failure cannot hurt the machine.
TIMEOUT_S = 1.5


class Case(NamedTuple):
    id: str
    verifier: str
    answer: str
    completion: str
    reward: float
    parse_failed: bool = False
    failure: str = ""


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


ADD_TESTS = json.dumps(["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"])
STDIO_TESTS = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]})
SUM_OF_TWO = "a, b = map(int, input().split())\nprint(a + b)"
HOG = "hog = []\nwhile True:\n    hog.append(bytearray(1 << 20))"
SECRET_NAME, SECRET_VALUE = "SCALERL_TEST_SECRET", "hunter2-do-not-leak"

# A wrong add (honestly 0 of ADD_TESTS) plus a way to forge the verdict: each scores 0.
WRONG_ADD = "def add(a, b):\n    return a - b - 1\n"
FORGERIES = [
    Case(
        "always-equal",
        "code",
        ADD_TESTS,
        _fenced(
            "class Yes:\n    def __eq__(self, other):\n        return True\n"
            "    __ne__ = lambda self, other: False\n    __hash__ = object.__hash__\n"
            "def add(a, b):\n    return Yes()"
        ),
        0.0,
    ),
    Case(
        "forged-result-lines",
        "code",
        ADD_TESTS,
        _fenced(
            WRONG_ADD + "import gc, json, os\n"
            "# Any job the harness holds (with its nonce, if it has one) and every fd.\n"
            "jobs = [o for o in gc.get_objects() if isinstance(o, dict) and 'cases' in o]\n"
            "nonces = [j.get('nonce') for j in jobs] or [None]\n"
            "lines = [{'event': 'containment', 'missing': []}]\n"
            "for nonce in nonces:\n"
            "    for k in range(3):\n"
            "        lines.append({'event': 'case', 'index': k, 'ok': True, 'error': '', "
            "'nonce': nonce})\n"
            "        lines.append({'i': k, 'ok': True, 'error': ''})\n"
            "    lines.append({'event': 'done', 'nonce': nonce})\n"
            "for fd in range(0, 64):\n"
            "    for line in lines:\n"
            "        try:\n"
            "            os.write(fd, json.dumps(line).encode() + b'\\n')\n"
            "        except OSError:\n"
            "            pass"
        ),
        0.0,
    ),
    Case(
        "exits-in-the-middle",
        "code",
        ADD_TESTS,
        _fenced("import os, sys\ndef add(a, b):\n    sys.exit(0)\n"),
        0.0,
    ),
    Case(
        "patches-builtins",
        "code",
        ADD_TESTS,
        _fenced(
            WRONG_ADD + "import builtins\nreal = builtins.compile\n"
            "builtins.compile = lambda *a, **k: real('True', 'x', 'eval')\n"
            "builtins.eval = lambda *a, **k: True\n"
            "builtins.AssertionError = type('Never', (Exception,), {})"
        ),
        0.0,
    ),
]

MATH = [
    Case("boxed", "math", "42", "So the answer is \\boxed{42}.", 1.0),
    Case("nested-braces", "math", "\\frac{1}{\\sqrt{2}}", "\\boxed{\\frac{\\sqrt{2}}{2}}", 1.0),
    Case("nested-braces-set", "math", "\\{2, 1\\}", "The roots: \\boxed{\\{1, 2\\}}", 1.0),
    Case("fraction-vs-decimal", "math", "0.75", "\\boxed{\\dfrac{3}{4}}", 1.0),
    Case("plain-fraction", "math", "\\frac{3}{4}", "The answer is 3/4", 1.0),
    Case("equivalent-polynomial", "math", "(x+1)^2", "\\boxed{x^2+2x+1}", 1.0),
    Case("equivalent-latex-forms", "math", "2\\pi", "\\boxed{\\pi \\cdot 2}", 1.0),
    Case("final-boxed-wins", "math", "3", "First \\boxed{4}; no, wait: \\boxed{3}", 1.0),
    Case("final-boxed-wins-wrong", "math", "4", "First \\boxed{4}; no, wait: \\boxed{3}", 0.0),
    Case("after-thinking", "math", "8", "<think>maybe \\boxed{7}</think> It is \\boxed{8}", 1.0),
    Case("thinking-is-not-the-answer", "math", "7", "<think>\\boxed{7}</think> \\boxed{8}", 0.0),
    Case("thinking-never-ended", "math", "8", "<think>it is \\boxed{8}", 0.0, True),
    Case("wrong-answer", "math", "3", "\\boxed{5}", 0.0),
    Case("no-answer", "math", "3", "I do not know.", 0.0, True),
    Case("pathological", "math", "5", "\\boxed{9^{9^{9}}}", 0.0, True, "timeout"),
]

CODE = [
    Case("passes", "code", ADD_TESTS, _fenced("def add(a, b):\n    return a + b"), 1.0),
    Case("fails", "code", ADD_TESTS, _fenced("def add(a, b):\n    return a + b + 1"), 0.0),
    # Of the three tests only add(0, 0) == 0 holds for a * b: 1 of 3.
    Case("partial-credit", "code", ADD_TESTS, _fenced("def add(a, b):\n    return a * b"), 1 / 3),
    Case(
        "stdio", "code", STDIO_TESTS, _fenced("a, b = map(int, input().split())\nprint(a + b)"), 1.0
    ),
    Case("stdio-wrong", "code", STDIO_TESTS, _fenced("print(5)"), 0.5),
    Case("does-not-compile", "code", ADD_TESTS, _fenced("def add(a, b) return a"), 0.0, True),
    Case("no-program", "code", ADD_TESTS, "<think>I should write add", 0.0, True),
    Case(
        "infinite-loop",
        "code",
        ADD_TESTS,
        _fenced("while True:\n    pass\ndef add(a, b):\n    return a + b"),
        0.0,
        False,
        "timeout",
    ),
    Case(
        "sleeps-forever",
        "code",
        ADD_TESTS,
        _fenced("import time\ntime.sleep(600)\ndef add(a, b):\n    return a + b"),
        0.0,
        False,
        "timeout",
    ),
    Case(
        "memory-hog",
        "code",
        ADD_TESTS,
        _fenced(HOG + "\ndef add(a, b):\n    return a + b"),
        0.0,
    ),
    Case(
        "reads-a-secret",
        "code",
        json.dumps([f"assert secret() == {SECRET_VALUE!r}"]),
        _fenced(
            "import glob, os\n"
            f"SECRET = os.environ.get({SECRET_NAME!r}, '')\n"
            "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
            "    try:\n"
            f"        if {SECRET_VALUE!r}.encode() in open(path, 'rb').read():\n"
            f"            SECRET = {SECRET_VALUE!r}\n"
            "    except OSError:\n"
            "        pass\n"
            "def secret():\n"
            "    return SECRET"
        ),
        0.0,
    ),
] + FORGERIES

PYTHON = [
    Case("user-exact", "python:user_rewards:exact", "42", "42", 1.0),
    Case(
        "user-exact-after-thinking", "python:user_rewards:exact", "42", "<think>41</think>42", 1.0
    ),
    Case("user-partial-credit", "python:user_rewards:overlap", "red blue", "red green", 0.5),
    Case("user-verdict", "python:user_rewards:as_verdict", "x", "y", 0.5),
    Case("user-out-of-range", "python:user_rewards:too_big", "x", "y", 0.0, True, "error"),
    Case("user-raises", "python:user_rewards:broken", "x", "y", 0.0, True, "error"),
    Case("user-hangs", "python:user_rewards:hangs", "x", "y", 0.0, True, "timeout"),
]

FORK_BOMB = _fenced(
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
)


def write_outside(target: str) -> Case:
    """A program that writes `target` (outside its folder) before defining add."""
    code = f"open({target!r}, 'w').write('escaped')\ndef add(a, b):\n    return a + b"
    return Case("writes-outside", "code", ADD_TESTS, _fenced(code), 0.0)


def connect_to(port: int) -> Case:
    """A program that must reach 127.0.0.1:port of the host to define add."""
    code = (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
        "def add(a, b):\n    return a + b"
    )
    return Case("network", "code", ADD_TESTS, _fenced(code), 0.0)
