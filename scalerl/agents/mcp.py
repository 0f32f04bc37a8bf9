"""Tools of an MCP server (Model Context Protocol, the `mcp` package 2.x), over stdio.

The worker starts the server as a child process (`task.environment.mcp_servers`), with
only the environment its config gives (and mcp's few defaults such as PATH and HOME):
nothing of the worker's own, so no token or Redis URL. It runs jailed
(`scalerl.agents.jail`): its own PID namespace and /proc, so the worker's
/proc/<pid>/environ is out of its reach, and the worker's secret files and run folder
hidden (unless `allow_uncontained` where the jail cannot be set up). The session lives on
a private event loop thread, so the trajectories' threads call tools concurrently with a
plain blocking call; each call has the environment's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from scalerl.agents.jail import jailed, probe
from scalerl.agents.tools import ToolError, ToolSpec
from scalerl.config import McpServerConfig
from scalerl.verifiers.base import VerifierUnavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
# Beyond a call's own timeout, for the session's answer to come back.
_SLACK_S = 5.0
CHECK_S = 2.0  # how often the watcher pings the server
PING_S = 2.0  # a ping's deadline
DOWN_WAIT_S = 10.0  # how long a call waits for a server being started again
RESTART_FIRST_S, RESTART_MAX_S = 1.0, 30.0  # the back-off between failed restarts


class McpServer:
    """One MCP server's session (module docstring). Raises RuntimeError (one line naming
    the command) when the server does not start and list its tools within
    `start_timeout_s` seconds, or ValueError naming a tool of `config.tools` it lacks.

    A server that dies (found by a ping every `check_s` seconds, or by a call) is started
    again with back-off (1 s doubling to 30 s); `up` and `restarts` say how it goes (the
    worker's /metrics: `scalerl_mcp_server_up`, `scalerl_mcp_server_restarts_total`). A
    call while it is down waits up to `DOWN_WAIT_S` for it, then raises
    VerifierUnavailable: our outage is never the model's observation."""

    def __init__(
        self,
        config: McpServerConfig,
        start_timeout_s: float = START_TIMEOUT_S,
        check_s: float = CHECK_S,
    ) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()
        self._closing: asyncio.Event | None = None
        self._session: Any = None
        self._up = threading.Event()
        self._closed = threading.Event()
        self._restart_lock = threading.Lock()
        try:
            listed = self._start()
        except Exception as exc:
            self.close()
            command = " ".join(config.command)
            raise RuntimeError(f"MCP server {command!r} did not start: {exc}") from exc
        wanted = set(config.tools) or {tool.name for tool in listed}
        missing = wanted - {tool.name for tool in listed}
        if missing:
            self.close()
            raise ValueError(f"mcp_servers.tools: the server has no tool {sorted(missing)[0]!r}")
        self.tools = [McpTool(self, tool) for tool in listed if tool.name in wanted]
        threading.Thread(target=self._watch, args=(check_s,), name="mcp-watch", daemon=True).start()

    @property
    def up(self) -> bool:
        """The session answers (as of the last check or call)."""
        return self._up.is_set()

    def _start(self) -> list[Any]:
        """Start the server and its session; its tools. Raises what the start raised."""
        ready: Future[list[Any]] = Future()
        self._done = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        listed = ready.result(self.start_timeout_s)
        self._up.set()
        return listed

    async def _serve(self, ready: Future[list[Any]]) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        command, *args = server_command(self.config)
        params = StdioServerParameters(command=command, args=args, env=dict(self.config.env))
        self._closing = asyncio.Event()
        try:
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    listed = (await session.list_tools()).tools
                    self._session = session
                    ready.set_result(listed)
                    await self._closing.wait()
        except BaseException as exc:  # the server failed: whoever waits to start hears it
            if not ready.done():
                ready.set_exception(exc)
            raise

    def _alive(self) -> bool:
        """The session answers a ping within PING_S."""
        session = self._session
        if session is None:
            return False
        ping = asyncio.run_coroutine_threadsafe(session.send_ping(), self._loop)
        try:
            ping.result(PING_S)
            return True
        except Exception:  # noqa: BLE001 - a dead stream, a timeout: not alive either way
            ping.cancel()
            return False

    def _watch(self, check_s: float) -> None:
        """Ping every `check_s` seconds; start a server that stopped answering again,
        with back-off, until `close`."""
        backoff = RESTART_FIRST_S
        while not self._closed.wait(check_s):
            if self._alive():
                backoff = RESTART_FIRST_S
                continue
            self._up.clear()
            if self._restart():
                backoff = RESTART_FIRST_S
            elif self._closed.wait(backoff):
                return
            else:
                backoff = min(2 * backoff, RESTART_MAX_S)

    def _restart(self) -> bool:
        """End the dead session and start the server again; True when it is back."""
        with self._restart_lock:
            if self._closed.is_set():
                return False
            self._stop_session()
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - retried with back-off by the watcher
                log.warning("MCP server %r did not restart: %s", self.config.command[0], exc)
                return False
            self.restarts += 1
            log.warning(
                "MCP server %r restarted (restart %d)", self.config.command[0], self.restarts
            )
            return True

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> str:
        """The tool's text content. Raises ToolError with the server's message when the
        tool reported an error, TimeoutError past `timeout_s` seconds, VerifierUnavailable
        when the server is down (not back within DOWN_WAIT_S, or it died on this call)."""
        if self._closed.is_set():
            raise ToolError("the MCP server is closed")
        if not self._up.wait(DOWN_WAIT_S):
            raise VerifierUnavailable(f"MCP server {self.config.command[0]!r} is down")
        call = self._session.call_tool(name, arguments, read_timeout_seconds=timeout_s)
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        try:
            result = future.result(timeout_s + _SLACK_S)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"{name} took more than {timeout_s:g} s") from None
        except Exception as exc:  # mcp's McpError on its read timeout, a closed stream
            if "timed out" in str(exc).lower():
                raise TimeoutError(f"{name} took more than {timeout_s:g} s") from None
            if not self._alive():  # the server is gone: the watcher starts it again
                self._up.clear()
                raise VerifierUnavailable(f"MCP server died during {name}: {exc}") from exc
            raise ToolError(f"{name}: {exc}") from exc
        text = "\n".join(getattr(part, "text", "") for part in result.content)
        if result.is_error:
            raise ToolError(text or f"{name} failed")
        return text

    def _stop_session(self) -> None:
        """End the current session and its server process (waits up to 10 s)."""
        if self._closing is not None:
            self._loop.call_soon_threadsafe(self._closing.set)
            try:
                self._done.result(10.0)
            except Exception:  # noqa: BLE001 - a dead server's own failure: reported already
                pass
            self._closing = None
        self._session = None
        self._up.clear()

    def close(self) -> None:
        """Stop the watcher, the server and the loop (idempotent)."""
        self._closed.set()
        with self._restart_lock:
            self._stop_session()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)


def server_command(config: McpServerConfig) -> list[str]:
    """The server's command line: jailed, unless it may run uncontained and the jail
    cannot be set up here (`scalerl.agents.jail.probe`)."""
    if config.allow_uncontained and probe():
        return list(config.command)
    return jailed(list(config.command))


def check_contained(servers: list[McpServerConfig]) -> None:
    """Raise ValueError (one line naming the setting) when a server must be jailed and the
    jail cannot be set up on this machine; log a warning for one allowed to run without."""
    why = probe() if servers else ""
    if not why:
        return
    for i, server in enumerate(servers):
        if not server.allow_uncontained:
            raise ValueError(
                f"mcp_servers[{i}]: the MCP server cannot be jailed here ({why}); set "
                f"mcp_servers[{i}].allow_uncontained: true to run it with the worker's view"
            )
    log.warning("MCP servers run uncontained (allow_uncontained): %s", why)


class McpTool:
    """One tool of an `McpServer`, as a `scalerl.agents.tools.Tool`."""

    def __init__(self, server: McpServer, tool: Any) -> None:
        self.server = server
        schema = dict(tool.input_schema or {"type": "object"})
        self.spec = ToolSpec(tool.name, tool.description or tool.name, schema)

    def call(self, arguments: dict[str, Any], timeout_s: float) -> str:
        return self.server.call(self.spec.name, arguments, timeout_s)
