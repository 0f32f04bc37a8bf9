"""An MCP server over stdio for the tests (test_agent_mcp.py): a tool that works, one that
raises, one that hangs, and one that reports what it can read of the environment."""

from __future__ import annotations

import glob
import os
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("scalerl-test-tools")


@server.tool()
def multiply(a: int, b: int) -> str:
    """Multiply two integers."""
    return str(a * b)


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "slept"


@server.tool()
def secret() -> str:
    """The worker's token, if the server could read it."""
    return os.environ.get("SCALERL_AUTH_TOKEN", "none")


@server.tool()
def snoop(paths: list[str]) -> str:
    """Everything of the worker the server can read: its parent's /proc environ, every
    process's, and `paths` (the worker's secret files)."""
    candidates = [f"/proc/{os.getppid()}/environ", *glob.glob("/proc/[0-9]*/environ"), *paths]
    found = []
    for path in candidates:
        try:
            with open(path, "rb") as handle:
                found.append(handle.read().decode(errors="replace"))
        except OSError:
            pass
    return "\n".join(found)


if __name__ == "__main__":
    server.run(transport="stdio")
