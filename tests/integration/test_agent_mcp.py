"""MCP tools (scalerl.agents.mcp): a stdio server started by the test serves a tool used
in a trajectory; its failures and timeouts are observations; it reads nothing of the
worker's environment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scalerl.agents.chat import TurnTemplate
from scalerl.agents.environment import ToolEnvironment, first_messages
from scalerl.agents.mcp import McpServer
from scalerl.agents.tool_calls import HermesFormat, ToolCall
from scalerl.agents.tools import ToolBox, ToolError
from scalerl.agents.trajectory import STOP, TurnLimits, run_trajectory
from scalerl.config import McpServerConfig, TinyModel
from scalerl.policy.models import load_tokenizer

pytest.importorskip("mcp")
SERVER = [sys.executable, str(Path(__file__).with_name("mcp_tool_server.py"))]


@pytest.fixture(scope="module")
def server():
    started = McpServer(McpServerConfig(command=SERVER))
    yield started
    started.close()


def test_the_servers_tools_with_their_schemas(server: McpServer) -> None:
    specs = {tool.spec.name: tool.spec for tool in server.tools}
    assert sorted(specs) == ["fail", "multiply", "secret", "sleep", "snoop"]
    assert specs["multiply"].parameters["required"] == ["a", "b"]
    assert specs["multiply"].description == "Multiply two integers."


def test_calls_and_their_failures_are_observations(server: McpServer, monkeypatch) -> None:
    box = ToolBox(server.tools, timeout_s=1.0)
    assert box.call(ToolCall("multiply", {"a": 21, "b": 23})).content == "483"
    failed = box.call(ToolCall("fail", {"reason": "no such city"}))
    # The server says what it reveals of a crash (mcp 2 hides the exception's text).
    assert (failed.error, failed.content) == ("raised", "error: Error executing tool fail")
    hung = box.call(ToolCall("sleep", {"seconds": 30}))
    assert (hung.error, hung.content) == ("timeout", "error: sleep timed out after 1 s")
    assert box.call(ToolCall("multiply", {"a": "x", "b": 1})).error == "arguments"
    # The server still answers after a timed-out call.
    assert box.call(ToolCall("multiply", {"a": 2, "b": 3})).content == "6"


def test_the_server_reads_no_secret_of_the_worker(monkeypatch) -> None:
    monkeypatch.setenv("SCALERL_AUTH_TOKEN", "hunter2")
    started = McpServer(McpServerConfig(command=SERVER))
    try:
        assert ToolBox(started.tools).call(ToolCall("secret", {})).content == "none"
    finally:
        started.close()


# A worker: the token in its environment at exec (what /proc/<pid>/environ shows, whatever
# os.environ says later), a secret file in its run folder; it starts the MCP server.
WORKER = """
import sys
from scalerl import private_paths
from scalerl.agents import mcp
from scalerl.config import McpServerConfig

run_folder, secret_file, jail = sys.argv[1], sys.argv[2], sys.argv[3] == "jail"
private_paths.register(run_folder)
if not jail:  # the control: the server as it ran before the jail
    mcp.server_command = lambda config: list(config.command)
server = mcp.McpServer(McpServerConfig(command=sys.argv[4:]))
try:
    print(server.call("snoop", {"paths": [secret_file]}, 20.0))
finally:
    server.close()
"""


@pytest.mark.parametrize("jail", [True, False])
def test_a_jailed_server_reads_no_secret_of_the_worker(tmp_path, jail: bool) -> None:
    """The review's demonstration: a file-reading MCP tool returned the worker's token
    from /proc/<ppid>/environ. Jailed, it finds neither the token nor the secret file's
    content; the control (no jail) finds both, so the snoop can see them."""
    import os
    import subprocess

    from scalerl.agents.jail import probe

    if jail and probe():
        pytest.skip(f"no jail on this machine: {probe()}")
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    secret_file = run_folder / "token"
    secret_file.write_text("run-folder-secret")
    env = {**os.environ, "SCALERL_AUTH_TOKEN": "exec-env-secret"}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(run_folder), str(secret_file),
         "jail" if jail else "none", *SERVER],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    leaked = {s for s in ("exec-env-secret", "run-folder-secret") if s in done.stdout}
    assert leaked == (set() if jail else {"exec-env-secret", "run-folder-secret"})


def test_an_uncontainable_server_is_refused_in_one_line(monkeypatch) -> None:
    from scalerl.agents import mcp

    monkeypatch.setattr(mcp, "probe", lambda: "jail: namespaces refused (unshare: EPERM)")
    with pytest.raises(ValueError) as refused:
        mcp.check_contained([McpServerConfig(command=SERVER)])
    assert str(refused.value) == (
        "mcp_servers[0]: the MCP server cannot be jailed here (jail: namespaces refused "
        "(unshare: EPERM)); set mcp_servers[0].allow_uncontained: true to run it with the "
        "worker's view"
    )
    mcp.check_contained([McpServerConfig(command=SERVER, allow_uncontained=True)])  # allowed
    assert mcp.server_command(McpServerConfig(command=SERVER, allow_uncontained=True)) == SERVER


def test_a_missing_tool_or_server_is_one_line() -> None:
    with pytest.raises(ValueError, match="the server has no tool 'search'"):
        McpServer(McpServerConfig(command=SERVER, tools=["search"]))
    with pytest.raises(RuntimeError, match="did not start"):
        McpServer(McpServerConfig(command=[sys.executable, "-c", "pass"]), start_timeout_s=5)


def test_an_mcp_tool_in_a_trajectory(server: McpServer) -> None:
    tokenizer = load_tokenizer(TinyModel())
    box = ToolBox([t for t in server.tools if t.spec.name == "multiply"])

    class Star(HermesFormat):  # the tiny vocabulary has no JSON: "=a b" calls multiply
        def parse(self, text):
            if text[:1] != "=":
                return []
            a, b = text[1:].split()
            return [ToolCall("multiply", {"a": int(a), "b": int(b)})]

    class Turn:
        def __init__(self, text: str) -> None:
            self.token_ids = tokenizer.encode(text) + [1]
            n = len(self.token_ids)
            self.logprobs, self.versions, self.forced = [-1.0] * n, [0] * n, []
            self.finish_reason = STOP

    replies = iter(["=21 23", "483"])
    env = ToolEnvironment(first_messages("21 23"), box, Star())
    t = run_trajectory(
        env, TurnTemplate(tokenizer), lambda *_: Turn(next(replies)), TurnLimits(3, 64, 32, 8), 128
    )
    assert tokenizer.decode(t.token_ids) == "=21 23\n483\nA:483"
    assert (t.turns, t.tool_calls, t.tool_errors, t.finish_reason) == (2, 1, 0, STOP)


def test_a_killed_server_is_back_within_10_s() -> None:
    """The review's P11: a server that crashed was never started again, and every later
    call failed. Killed -9 now, it is found by the watcher's ping and back within 10 s;
    a call while it is down is no observation (VerifierUnavailable), and one after works."""
    import os
    import signal
    import subprocess
    import time

    from scalerl.verifiers import VerifierUnavailable

    marker = "mcp_tool_server.py"
    started = McpServer(McpServerConfig(command=SERVER), check_s=0.5)
    try:
        assert started.call("multiply", {"a": 6, "b": 7}, 10.0) == "42"
        mine = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
        pids = [int(p) for p in mine.stdout.split()]
        assert pids
        killed_at = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        while started.up and time.monotonic() - killed_at < 10:
            time.sleep(0.05)  # the watcher notices
        deadline = killed_at + 10
        while not (started.up and started.restarts == 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.up and started.restarts == 1, "not back within 10 s"
        assert started.call("multiply", {"a": 2, "b": 3}, 10.0) == "6"
        for pid in [int(p) for p in subprocess.run(
            ["pgrep", "-f", marker], capture_output=True, text=True
        ).stdout.split()]:  # fmt: skip
            os.kill(pid, signal.SIGKILL)
        with pytest.raises((VerifierUnavailable, ToolError)):
            started.call("multiply", {"a": 1, "b": 1}, 10.0)  # it died on this call, or
        # was found down and not back in time: either way no reward is made from it
    finally:
        started.close()
