"""The process of one OpenEnv environment instance: `python -m scalerl.agents.env_host`,
started (jailed) by `scalerl.agents.openenv.HostedSession`, one per trajectory. The
environment's code, which model output drives, runs here and not in the worker, so it
sees none of the worker's memory (the run's token among it).

One JSON object a line on stdin, one reply a line on stdout, in order:
- {"op": "open", "environment": "python:MODULE:CLASS", "kwargs": {...}}: construct it;
- {"op": "reset", "kwargs": {...}}: reset with the arguments its reset takes;
- {"op": "step", "action": {...}}: one action (built as the environment's action class);
- {"op": "close"}: close it, reply, exit.

A reply is {"ok": {"observation": {...}, "reward": float | null, "done": bool}} (open and
close: {"ok": null}), or {"error": "Type: message"} when the environment raised. The
environment's own prints go to stderr: stdout carries the replies alone.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any


class _Host:
    """The environment instance and its action class, once opened."""

    def __init__(self) -> None:
        self.env: Any = None
        self.action_class: Any = None

    def handle(self, request: dict[str, Any]) -> Any:
        from scalerl.agents.openenv import _accepted, _from_model, action_class, environment_class

        op = request.get("op")
        if op == "open":
            found = environment_class(str(request["environment"]))
            self.action_class = action_class(found)
            self.env = found(**request.get("kwargs", {}))
            return None
        if self.env is None:
            raise RuntimeError(f"{op!r} before open")
        if op == "reset":
            kwargs = _accepted(self.env.reset, request.get("kwargs", {}))
            return asdict(_from_model(self.env.reset(**kwargs)))
        if op == "step":
            return asdict(_from_model(self.env.step(self.action_class(**request["action"]))))
        if op == "close":
            close = getattr(self.env, "close", None)
            if callable(close):
                close()
            return None
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # print() of the environment: to stderr, never into a reply
    host = _Host()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": host.handle(request)}
        except Exception as exc:  # the environment's failure: the trajectory reports it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply, default=str) + "\n")
        replies.flush()
        if request.get("op") == "close":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
