"""A task's environments from its config (`task.environment`): the one place that reads
it. `task_environments` is the factory: a tool task (`ToolTaskEnvironments`) or an OpenEnv
environment (`scalerl.agents.openenv.OpenEnvEnvironments`)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from scalerl.agents.builtin_tools import BUILTIN_TOOLS
from scalerl.agents.environment import ToolEnvironment, first_messages
from scalerl.agents.tool_calls import call_format
from scalerl.agents.tools import FunctionTool, Tool, ToolBox
from scalerl.agents.trajectory import TurnLimits
from scalerl.config import EnvironmentConfig, VerifierConfig
from scalerl.verifiers.programs import ProgramRunner


def task_environments(
    config: EnvironmentConfig, system_prompt: str, settings: VerifierConfig | None
) -> Any:
    """The `EnvironmentFactory` of a multi-turn task. Raises ValueError naming the field
    (see `ToolTaskEnvironments` and `OpenEnvEnvironments`)."""
    if config.openenv is not None:
        from scalerl.agents.openenv import OpenEnvEnvironments

        return OpenEnvEnvironments(config, system_prompt)
    return ToolTaskEnvironments(config, system_prompt, settings)


class ToolTaskEnvironments:
    """The `EnvironmentFactory` of a tool task: one `ToolEnvironment` per trajectory over
    one shared `ToolBox` (its Python tools run in the sandbox `verifier.code` describes;
    its MCP servers are started once, on first use, and stopped by `close`).

    Raises ValueError naming the field for a Python tool that cannot be imported, or a
    sandbox that cannot contain programs (unless `verifier.code.allow_uncontained`). The
    first use of `tools` raises ValueError for a tool without source or an MCP tool that
    is not there, and RuntimeError for an MCP server that does not start.
    """

    def __init__(
        self, config: EnvironmentConfig, system_prompt: str, settings: VerifierConfig | None
    ) -> None:
        self.config = config
        self.system_prompt = system_prompt
        self.call_format = call_format(config.call_format)
        self.code = (settings or VerifierConfig()).code
        for name in config.tools:
            _function(name)  # a bad name fails where the config is read
        # The sandbox is probed here (once per process, ~40 ms): a run whose tools cannot
        # be contained refuses to start (`scalerl run`'s preflight), as a code task does.
        if config.mcp_servers:  # refused here (`scalerl run`'s preflight), not mid-run
            from scalerl.agents.mcp import check_contained

            check_contained(config.mcp_servers)
        self.runner = (
            ProgramRunner(
                service=self.code.service,
                allow_uncontained=self.code.allow_uncontained,
                retry_s=self.code.retry_s,
            )
            if config.tools
            else None
        )
        self._lock = threading.Lock()
        self._tools: ToolBox | None = None
        self._servers: list[Any] = []

    @property
    def tools(self) -> ToolBox:
        """The tools, made on first use (only a process that runs trajectories starts the
        sandbox probe and the MCP servers)."""
        with self._lock:
            if self._tools is None:
                self._tools = self._make_tools()
            return self._tools

    def _make_tools(self) -> ToolBox:
        tools: list[Tool] = []
        if self.runner is not None:
            tools += [FunctionTool(_function(name), self.runner) for name in self.config.tools]
        try:
            for server_config in self.config.mcp_servers:
                from scalerl.agents.mcp import McpServer

                server = McpServer(server_config)
                self._servers.append(server)
                tools += server.tools
            return ToolBox(tools, timeout_s=self.config.tool_timeout_s)
        except BaseException:
            self._close_servers()
            raise

    @property
    def servers(self) -> list[Any]:
        """The MCP servers started so far (`scalerl.agents.mcp.McpServer`)."""
        with self._lock:
            return list(self._servers)

    def make(self, problem: Any, tools_in_template: bool) -> ToolEnvironment:
        """The environment of one trajectory of `problem` (a `scalerl.tasks.Problem`)."""
        messages = first_messages(problem.messages or problem.question)
        return ToolEnvironment(
            messages, self.tools, self.call_format, self.system_prompt, tools_in_template
        )

    def limits(self, turn_tokens: int) -> TurnLimits:
        """The trajectory limits, with `turn_tokens` (`rollout.max_new_tokens`) a turn."""
        c = self.config
        return TurnLimits(c.max_turns, c.max_tokens, c.max_env_tokens, turn_tokens)

    def close(self) -> None:
        """Stop the MCP servers (idempotent)."""
        with self._lock:
            self._close_servers()
            self._tools = None

    def _close_servers(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []


def _function(name: str) -> Callable[..., Any]:
    """The Python function a `task.environment.tools` entry names. Raises ValueError."""
    if name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name]
    module_name, _, attribute = name.removeprefix("python:").rpartition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"environment.tools: cannot import {name!r}: {exc}") from None
    if not callable(function):
        raise ValueError(f"environment.tools: {name!r} is not a function")
    return function
