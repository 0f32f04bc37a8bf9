"""`scalerl serve`: a tiny random checkpoint on our torch engine behind the OpenAI-compatible
API: a completion in OpenAI's shape (greedy replies repeat), the key required, bad
requests a 400 naming the field, a public host without a key refused, and the `judge`
verifier reaching it (a random model's reply has no score: unscored, never a reward)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from model_families import save_family_checkpoint

from scalerl.config import JudgeVerifierConfig, VerifierConfig
from scalerl.verifiers import build_verifier
from scalerl_cli.main import main

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
KEY = "serve-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    checkpoint = save_family_checkpoint("llama3", folder / "llama3")
    key_file = folder / "key"
    key_file.write_text(KEY)
    os.chmod(key_file, 0o600)
    argv = [sys.executable, "-m", "scalerl_cli.main", "serve", "--port", "0"]
    argv += ["--key-file", str(key_file), "--model-name", "tiny-judge", "--threads", "1"]
    argv += ["--set", "model.kind=path", "--set", f"model.path={checkpoint}"]
    argv += ["--set", "rollout.max_seq_len=512", "--set", "rollout.dtype=float32"]
    server = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    assert line.startswith("serving tiny-judge at http://127.0.0.1:"), line
    yield line.split(" at ")[1].strip()
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0


def post(url: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


MESSAGES = [{"role": "user", "content": "Grade this: 2+3=5"}]


def test_a_completion_has_openais_shape_and_greedy_repeats(served: str) -> None:
    body = {"model": "tiny-judge", "messages": MESSAGES, "temperature": 0, "max_tokens": 6}
    status, first = post(served, body)
    assert status == 200, first
    assert first["object"] == "chat.completion" and first["model"] == "tiny-judge"
    [choice] = first["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in (
        "stop",
        "length",
    )
    assert 1 <= first["usage"]["completion_tokens"] <= 6
    _, second = post(served, body)
    assert second["choices"][0]["message"] == choice["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES, "temperature": 9}, "temperature"),
        ({"messages": MESSAGES, "max_tokens": 100_000}, "max_tokens"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "stream": True}, "stream"),
        ({"messages": MESSAGES, "n": 2}, "n"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(served: str, body, param) -> None:
    status, reply = post(served, body)
    assert (status, reply["error"]["param"]) == (400, param), reply


def test_a_request_without_the_key_is_refused(served: str) -> None:
    status, reply = post(served, {"messages": MESSAGES}, key="wrong")
    assert status == 401 and reply["error"]["message"] == "invalid API key"


def test_the_judge_verifier_reaches_our_engine(served: str, tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    os.chmod(key_file, 0o600)
    judge = JudgeVerifierConfig(
        url=served, model="tiny-judge", key_file=str(key_file), max_tokens=8, parse_retries=0
    )
    verifier = build_verifier("judge", settings=VerifierConfig(judge=judge))
    verdict = verifier.score("5", 5, "What is 2+3?")
    # A random model writes no score line: the judge's failure, so no reward at all.
    assert verdict.unscored and "gave no valid score in 1 replies" in verdict.detail
    assert verifier.judge_stats.requests == 1


def test_a_public_host_without_a_key_is_refused(capsys) -> None:
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host 0.0.0.0 is reachable from elsewhere" in err
