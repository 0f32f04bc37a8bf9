"""OpenEnv environments as trajectories' environments (scalerl.agents.openenv), unchanged:
the echo environment OpenEnv's own `openenv init` scaffolds, and a user's game written
against OpenEnv's API, in the worker's jailed environment host (scalerl.agents.hosted)
and behind OpenEnv's server over its WebSocket client; the reward mapping, the seeds of a
group, every way a bad config or a hung environment fails, and what an environment that
model output drives can reach of the worker (nothing secret)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from scalerl import private_paths
from scalerl.agents import hosted
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.env_host import MAX_REPLY_BYTES
from scalerl.agents.hosted import EnvHost
from scalerl.agents.jail import probe
from scalerl.agents.openenv import (
    OpenEnvEnvironments,
    episode_seed,
    mapped_reward,
    observation_text,
)
from scalerl.agents.trajectory import ABORTED, MAX_TURNS, STOP, TurnLimits, run_trajectory
from scalerl.config import EnvironmentConfig, EpisodesTaskConfig, OpenEnvConfig
from scalerl.policy.models import GGUF_FILE, _hf_policy_tokenizer, smollm2_gguf_dir
from scalerl.tasks.base import Problem
from scalerl.tasks.taskset import build_task

HERE = Path(__file__).parent
GUESS = "python:openenv_guess:GuessEnvironment"


@pytest.fixture(scope="module")
def tokenizer():
    return _hf_policy_tokenizer(
        AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=GGUF_FILE)
    )


@pytest.fixture(autouse=True)
def importable(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


class Turn:
    """A scripted model turn: `text` then <|im_end|> (a stopped turn)."""

    def __init__(self, tokenizer, text: str) -> None:
        end = tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.token_ids = tokenizer.encode(text) + [end]
        n = len(self.token_ids)
        self.logprobs, self.versions, self.forced = [-1.0] * n, [0] * n, []
        self.finish_reason = STOP


def play(tokenizer, env, replies: list[str], max_turns: int = 4):
    """One trajectory of `env` with the model's turns scripted."""
    turns = iter(replies)
    return run_trajectory(
        env,
        TurnTemplate(tokenizer),
        lambda ids, n, i: Turn(tokenizer, next(turns)),
        TurnLimits(max_turns, 400, 200, 16),
        2048,
    )


_made: list[OpenEnvEnvironments] = []


@pytest.fixture(autouse=True)
def closed_at_the_end() -> Iterator[None]:
    """Each test's environment hosts end with it (a host holds ~200 MB)."""
    yield
    while _made:
        _made.pop().close()


def factory(**openenv) -> OpenEnvEnvironments:
    config = EnvironmentConfig(max_turns=4, openenv=OpenEnvConfig(**openenv))
    _made.append(OpenEnvEnvironments(config, "Play the game."))
    return _made[-1]


def messages(tokenizer, trajectory) -> list[str]:
    """The environment's messages of a trajectory, as the model read them."""
    ids, env = trajectory.token_ids, trajectory.environment
    runs, current = [], []
    for token, is_env in zip(ids, env, strict=True):
        if is_env:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.tokenizer.decode(run, skip_special_tokens=True).strip() for run in runs]


def test_openenvs_scaffolded_echo_environment_runs_unchanged(tokenizer, tmp_path) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        environments = factory(
            environment="python:echo_env.server.echo_env_environment:EchoEnvironment",
            reward_max=2.0,
        )
        problem = Problem("echo/0", "", None)
        t = play(tokenizer, environments.make(problem), ["hello", "hi", "hey", "yo"])
    finally:
        sys.path.remove(str(tmp_path))
    # Each turn's text comes back as the next message; the echo never ends an episode.
    assert messages(tokenizer, t) == [
        "user\nhello\nassistant",
        "user\nhi\nassistant",
        "user\nhey\nassistant",
    ]
    assert (t.turns, t.finish_reason) == (4, MAX_TURNS)
    # Its reward is 0.1 per character: 0.1 * (5 + 2 + 3 + 2) = 1.2, mapped from [0, 2].
    assert t.env_scores and t.env_reward == pytest.approx(0.6)


def test_a_users_game_in_process_ends_when_solved(tokenizer) -> None:
    environments = factory(environment=GUESS)
    problem = Problem("guess/5", "", None)  # seed 5: the target is 5 (random.Random(5))
    first = play(tokenizer, environments.make(problem), ["3", "7", "5"])
    assert messages(tokenizer, first) == ["user\nhigher\nassistant", "user\nlower\nassistant"]
    assert (first.turns, first.finish_reason, first.env_reward) == (3, STOP, 1.0)
    lost = play(tokenizer, environments.make(problem), ["1", "2", "3"])
    assert (lost.turns, lost.env_reward) == (3, 0.0)
    # The opening: the system prompt, then the reset observation's only text field.
    opening = environments.make(problem).reset()
    assert opening.messages == [
        {"role": "system", "content": "Play the game."},
        {"role": "user", "content": "Guess my number from 1 to 9. You have 3 guesses."},
    ]


def test_a_hung_environment_ends_its_trajectory_not_the_worker(tokenizer) -> None:
    environments = factory(environment=GUESS, timeout_s=0.5)
    started = time.monotonic()
    t = play(tokenizer, environments.make(Problem("guess/5", "", None)), ["sleep"])
    assert t.finish_reason == ABORTED and "took longer than 0.5 s" in t.error
    assert time.monotonic() - started < 10


SNOOP = "python:openenv_snoop:SnoopEnvironment"


@pytest.fixture
def no_private_paths(monkeypatch) -> None:
    monkeypatch.setattr(private_paths, "_paths", set())


@pytest.mark.parametrize("contained", [True, False], ids=["jailed", "control"])
def test_a_hosted_environment_reads_no_secret_of_the_worker(
    tmp_path, monkeypatch, no_private_paths, contained
) -> None:
    """Model output drives the environment to read the worker's secret file and its
    /proc/<pid>/environ: jailed, it finds neither (the worker's processes are not in its
    /proc, the file is hidden), and its own environment holds no SCALERL_ variable; the
    control (unjailed) reads the file, so the snoop can see it."""
    if contained and probe():
        pytest.skip(f"no jail on this machine: {probe()}")
    secret = tmp_path / "run" / "token"
    secret.parent.mkdir()
    secret.write_text("run-folder-secret")
    private_paths.register(secret)
    monkeypatch.setenv("SCALERL_AUTH_TOKEN", "process-env-secret")
    host = EnvHost(SNOOP, 30.0, contained=contained)
    try:
        session = host.open({})
        assert session.reset().observation == {"message": "Say what to read."}
        paths = (secret, f"/proc/{os.getpid()}/environ", "/proc/self/environ")
        seen = [session.step({"message": f"read:{p}"}).observation["message"] for p in paths]
    finally:
        host.close()
    leaked = {s for s in ("run-folder-secret", "process-env-secret") if s in "".join(seen)}
    assert leaked == (set() if contained else {"run-folder-secret"})
    assert "SCALERL_" not in seen[2]
    if contained:
        assert seen[1].startswith("error: [Errno 2]")  # no such process in its /proc


def test_one_host_holds_every_session_and_a_hung_one_holds_no_other(no_private_paths) -> None:
    """Sessions share one process; a step that hangs fails at timeout_s while another
    session's steps are answered; a constructor that hangs fails at timeout_s too."""
    host = EnvHost(SNOOP, 2.0, contained=False)
    try:
        hung, other = host.open({}), host.open({})
        pid = host._proc.pid
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="step took longer than 2.0 s"):
            hung.step({"message": "hang"})
        assert 2.0 <= time.monotonic() - started < 5
        answered = other.step({"message": "read:/nonexistent"}).observation["message"]
        assert answered.startswith("error: [Errno 2]")
        with pytest.raises(TimeoutError, match="open took longer than 2.0 s"):
            host.open({"hang_s": 30})
        assert host.open({}).reset().done is False
        assert (host._proc.pid, host.restarts) == (pid, 0)
    finally:
        host.close()


@pytest.mark.slow  # two host starts: about 8 s
@pytest.mark.parametrize(
    ("attack", "failure"),
    [("die", "host ended"), ("scribble", "something else than a reply")],
)
def test_a_reply_too_large_is_refused_and_a_dead_host_comes_back(
    no_private_paths, attack, failure
) -> None:
    """An observation over MAX_REPLY_BYTES fails its call and its session, not the host;
    an environment that kills its process, or writes a line that is no reply where the
    replies go, fails every session there, and the next open starts a new host after a
    back-off of 1 s."""
    host = EnvHost(SNOOP, 30.0, contained=False)
    try:
        big, bystander = host.open({}), host.open({})
        with pytest.raises(RuntimeError, match=f"replied more than {MAX_REPLY_BYTES} bytes"):
            big.step({"message": "big"})
        with pytest.raises(RuntimeError, match="no open session"):
            big.step({"message": "read:/nonexistent"})
        first = host._proc.pid
        with pytest.raises(RuntimeError, match=failure):
            bystander.step({"message": attack})
        with pytest.raises(RuntimeError, match="restarted: this session is gone"):
            bystander.step({"message": "read:/nonexistent"})
        bystander.close()  # a session of a dead host closes without a word
        started = time.monotonic()
        again = host.open({})
        assert time.monotonic() - started >= 0.9  # the back-off
        assert again.reset().observation == {"message": "Say what to read."}
        assert host._proc.pid != first and host.restarts == 1
    finally:
        host.close()


@pytest.mark.slow  # two host starts: about 9 s
def test_hung_calls_past_the_limit_restart_the_host(monkeypatch, no_private_paths) -> None:
    monkeypatch.setattr(hosted, "HUNG_MAX", 2)
    host = EnvHost(SNOOP, 0.5, contained=False)
    try:
        first = host.open({})
        pid = host._proc.pid
        for _ in range(2):
            with pytest.raises(TimeoutError):
                host.open({}).step({"message": "hang"})
        assert host.restarts == 1
        with pytest.raises(RuntimeError, match="restarted"):
            first.step({"message": "read:/nonexistent"})
        assert host.open({}) and host._proc.pid != pid
    finally:
        host.close()


def test_a_worker_refuses_an_environment_it_cannot_jail(monkeypatch, no_private_paths) -> None:
    """Where the jail cannot be set up, the task is refused at start (one line naming the
    setting), unless allow_uncontained, which runs the host unjailed."""
    monkeypatch.setattr("scalerl.agents.openenv.probe", lambda: "jail: namespaces refused")
    with pytest.raises(ValueError, match="^environment.openenv.allow_uncontained: .*refused"):
        factory(environment=GUESS)
    environments = factory(environment=GUESS, allow_uncontained=True)
    assert environments.host is not None and environments.host.contained is False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(HERE / "openenv_guess.py"), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_same_game_over_openenvs_server(tokenizer, server: str) -> None:
    environments = factory(url=server)
    problem = Problem("guess/5", "", None)
    won = play(tokenizer, environments.make(problem), ["3", "7", "5"])
    assert messages(tokenizer, won) == ["user\nhigher\nassistant", "user\nlower\nassistant"]
    assert (won.turns, won.finish_reason, won.env_reward) == (3, STOP, 1.0)
    # Another episode (seed 1: target 3) in its own session.
    other = play(tokenizer, environments.make(Problem("guess/1", "", None)), ["3"])
    assert (other.turns, other.env_reward) == (1, 1.0)


def test_an_episodes_task_gives_a_group_one_episode() -> None:
    config = EpisodesTaskConfig(
        name="guess",
        size=20,
        heldout_size=5,
        environment=EnvironmentConfig(openenv=OpenEnvConfig(environment=GUESS)),
    )
    task = build_task(config)
    assert len(task.train_ids) == 15 and len(task.heldout_ids) == 5
    assert not set(task.train_ids) & set(task.heldout_ids)
    problem = task.problem(task.train_ids[0])
    seeds = {task.environments.make(problem).seed for _ in range(8)}
    assert seeds == {int(problem.prompt_id.split("/")[1])}
    with pytest.raises(KeyError):
        task.problem("guess/20")
    assert task.score("guess/3", "5").reward == 0.0  # a reply alone is not scored


def test_the_reward_mapping_and_the_observation_text() -> None:
    assert mapped_reward(1.2, 0.0, 2.0) == pytest.approx(0.6)
    assert (mapped_reward(-3, -1, 1), mapped_reward(5, -1, 1), mapped_reward(0, -1, 1)) == (
        0.0,
        1.0,
        0.5,
    )
    assert observation_text({"message": "hi", "n": 3}, "") == "hi"
    assert observation_text({"a": "x", "b": "y"}, "") == '{"a": "x", "b": "y"}'
    assert observation_text({"board": [1, 2]}, "board") == "[1, 2]"
    assert episode_seed("guess/17") == 17
    assert episode_seed("gsm8k/abc") == episode_seed("gsm8k/abc") != episode_seed("gsm8k/abd")


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(ValidationError, match="exactly one of environment and url"):
        OpenEnvConfig()
    with pytest.raises(ValidationError, match="exactly one of environment and url"):
        OpenEnvConfig(environment=GUESS, url="http://h:1")
    with pytest.raises(ValidationError, match="reward_max must be above reward_min"):
        OpenEnvConfig(url="http://h:1", reward_min=1.0, reward_max=1.0)
    with pytest.raises(ValidationError, match="tools or mcp_servers .* or openenv, not both"):
        EnvironmentConfig(tools=["calculator"], openenv=OpenEnvConfig(url="http://h:1"))
    with pytest.raises(ValidationError, match="source episodes needs environment.openenv"):
        EpisodesTaskConfig(
            name="t",
        )
    with pytest.raises(ValueError, match="action_field: 'text' is not a field of the action"):
        factory(environment=GUESS, action_field="text")
    with pytest.raises(ValueError, match="is not an OpenEnv Environment subclass"):
        factory(environment="python:openenv_guess:GuessAction")
    with pytest.raises(ValueError, match="cannot import 'python:nowhere:Env'"):
        factory(environment="python:nowhere:Env")
