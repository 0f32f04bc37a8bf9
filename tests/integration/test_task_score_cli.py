"""`scalerl task score` gives the training path's verdict on every verifier case (math,
code, user functions), explains it, and refuses bad input with one line and exit 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from verifier_cases import (
    ADD_TESTS,
    CODE,
    FORK_BOMB,
    MATH,
    PYTHON,
    SECRET_NAME,
    SECRET_VALUE,
    TIMEOUT_S,
    Case,
    connect_to,
    write_outside,
)

from scalerl.config import FileTaskConfig, ReasoningGymTaskConfig
from scalerl.sandbox.runner import SandboxLimits, containment
from scalerl.tasks import build_task
from scalerl.verifiers import build_verifier
from scalerl_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FORK_BOMB_CASE = Case("fork-bomb", "code", ADD_TESTS, FORK_BOMB, 0.0, False, "timeout")
LAST_INTEGER = [
    Case("last-integer", "last_integer", "12", "7 + 5 = 12", 1.0),
    Case("last-integer-wrong", "last_integer", "12", "12? No: 13", 0.0),
    Case("last-integer-none", "last_integer", "12", "twelve", 0.0, True),
]
CASES = LAST_INTEGER + MATH + PYTHON + CODE + [FORK_BOMB_CASE]


def _cli(case: Case, capsys) -> dict:
    argv = ["task", "score", "--verifier", case.verifier, "--answer", case.answer]
    argv += ["--completion", case.completion, "--timeout-s", str(TIMEOUT_S), "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _agrees(case: Case, capsys) -> None:
    shown = _cli(case, capsys)
    got = (shown["reward"], shown["parse_failed"], shown["failure"])
    assert got == (pytest.approx(case.reward), case.parse_failed, case.failure), shown
    if case.failure != "timeout":  # timeouts: the case's table is the training path's too
        training = build_verifier(case.verifier, timeout_s=TIMEOUT_S).score(
            case.completion, case.answer
        )
        assert training.as_dict() == {k: v for k, v in shown.items() if k != "verifier"}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.verifier}-{c.id}" for c in CASES])
def test_the_cli_agrees_with_the_training_path(case: Case, capsys, monkeypatch) -> None:
    monkeypatch.setenv(SECRET_NAME, SECRET_VALUE)
    _agrees(case, capsys)


def test_the_cli_agrees_on_writing_outside(tmp_path: Path, capsys) -> None:
    _agrees(write_outside(str(tmp_path / "escaped.txt")), capsys)
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.skipif(
    not containment(SandboxLimits()).contained,
    reason="no network namespace on this host",
)
def test_the_cli_agrees_on_reaching_the_network(capsys) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        _agrees(connect_to(listener.getsockname()[1]), capsys)
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--verifier", "nope", "--answer", "1"], "verifier must be one of last_integer, math"),
        (["--verifier", "python:no_such_mod_q:f", "--answer", "1"], "does not import"),
        (["--verifier", "last_integer", "--answer", "x"], "answer must be an integer"),
        (["--verifier", "math", "--answer", " "], "answer must not be empty"),
        (["--verifier", "code", "--answer", '{"inputs": [1]}'], "keys inputs and outputs"),
        (["--verifier", "code", "--answer", "[]"], "tests must hold at least one test"),
        (
            ["--verifier", "math", "--answer", "1", "--timeout-s", "0"],
            r"timeout_s must be in [0.1, 600] seconds, got 0.0",
        ),
        (["--verifier", "judge", "--answer", "1"], "verifier.judge.url is required"),
        (
            ["--verifier", "judge", "--answer", "1", "--set", "verifier.judge.url=judge:80"],
            "verifier.judge.url: 'judge:80' must be http(s)://host[:port][/path]",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main(["task", "score", *argv, "--completion", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scalerl task score: "), err
    assert message in err


def test_the_command_prints_the_reward_and_why() -> None:
    """As a user runs it: a fresh process, text output, the completion on stdin."""
    proc = subprocess.run(
        [sys.executable, "-m", "scalerl_cli.main", "task", "score", "--verifier", "math"]
        + ["--answer", "0.5", "--completion", "-"],
        input="<think>1/3?</think> so \\boxed{\\frac{1}{2}}",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "reward: 1",
        "extracted: \\frac{1}{2}",
        "expected: 0.5",
        "why: equivalent (math-verify)",
    ]


def test_the_cli_agrees_with_the_tasks_of_a_run(tmp_path: Path, capsys) -> None:
    """The reward a run's task gives a completion (`Task.score`: its verifier built from
    the task config) is the CLI's for the same verifier and reference: a math row of a
    JSONL file and a reasoning-gym item (its JSON as --answer)."""
    data = tmp_path / "rows.jsonl"
    rows = [{"q": "What is 1/2 + 1/4?", "a": "\\frac{3}{4}"}, {"q": "What is 2+2?", "a": "4"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    math_config = FileTaskConfig(
        name="m",
        path=str(data),
        prompt_field="q",
        answer_field="a",
        verifier="math",
        heldout_size=1,
    )
    gym_config = ReasoningGymTaskConfig(
        name="g", dataset="basic_arithmetic", size=20, heldout_size=5
    )
    tasks = [
        (build_task(math_config), "math"),
        (build_task(gym_config), "reasoning_gym:basic_arithmetic"),
    ]
    try:
        for task, verifier in tasks:
            problem = task.problem(task.train_ids[0])
            gym = not isinstance(problem.answer, str)
            answer = json.dumps(problem.answer) if gym else problem.answer
            right = str(problem.answer["answer"]) if gym else problem.answer
            completions = [right, "no idea", f"<think>{right}</think> 12345"]
            rewards = [
                _agrees_with_task(task, problem, verifier, answer, c, capsys) for c in completions
            ]
            assert rewards[0] == 1.0 and rewards[2] == 0.0, (verifier, rewards)
    finally:
        for task, _ in tasks:
            task.close()


def _agrees_with_task(task, problem, verifier: str, answer: str, completion: str, capsys) -> float:
    trained = task.score(problem.prompt_id, completion)
    argv = ["task", "score", "--verifier", verifier, "--answer", answer]
    assert main([*argv, "--completion", completion, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["reward"], shown["parse_failed"]) == (trained.reward, trained.parse_failed)
    return trained.reward


def test_a_judge_grades_the_completion_against_the_prompt(capsys) -> None:
    from judge_standin import JudgeStandin

    with JudgeStandin() as standin:
        argv = ["task", "score", "--verifier", "judge", "--answer", "5", "--json"]
        argv += ["--prompt", "What is 2+3?", "--completion", "It is 5."]
        argv += ["--set", f"verifier.judge.url={standin.url}", "--set", "verifier.judge.model=m"]
        assert main(argv) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert (verdict["verifier"], verdict["reward"], verdict["detail"]) == (
        "judge",
        1.0,
        "SCORE: 10",
    )
    user = standin.received[0]["messages"][1]["content"]
    assert user.startswith("Prompt:\nWhat is 2+3?\n")
