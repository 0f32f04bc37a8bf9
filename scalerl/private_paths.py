"""The files and folders this process keeps secrets in: the token file, the TLS private
key, the Redis password file and the run folder (which holds the run's token and its
Redis password). A child that model output drives (an MCP server) runs with each of them
hidden (`scalerl.agents.jail`). The code that reads a secret registers where it was."""

from __future__ import annotations

import threading
from pathlib import Path

_lock = threading.Lock()
_paths: set[str] = set()


def register(path: str | Path) -> None:
    """Add `path` ("" ignored), made absolute."""
    if str(path):
        with _lock:
            _paths.add(str(Path(path).resolve()))


def private_paths() -> list[str]:
    """Every registered path, sorted."""
    with _lock:
        return sorted(_paths)
