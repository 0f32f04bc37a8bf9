"""An MCP server over stdio for the tests (test_agent_mcp.py): a tool that works, one that
raises, one that hangs, and one that reports what it can read of the environment."""

from __future__ import annotations

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


if __name__ == "__main__":
    server.run(transport="stdio")
