"""Multi-turn agents: environments, tools and trajectories kept as token ids. Torch-free.

`environment` (the API a task's environment implements), `tools` and `tool_calls` (what
the model may call, and how it writes a call), `mcp` (an MCP server's tools), `chat`
(token-in-token-out rendering of environment messages), `trajectory` (one trajectory's
turns, limits and per-token roles), `build` (a task's environments from its config),
`stats` (the multi-turn statistics of a batch).
"""
