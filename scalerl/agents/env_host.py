"""The process that holds a worker's OpenEnv environment instances:
`python -m scalerl.agents.env_host python:MODULE:CLASS`, started (jailed) by
`scalerl.agents.hosted.EnvHost`, one per worker. The environments' code, which model output
drives, runs here and not in the worker, so it sees none of the worker's memory (the run's
token among it). The class is imported once; each trajectory's instance is a session.

One JSON object a line on stdin, one reply a line on stdout, matched by "id" (each request
runs on a thread of its own, so one session's slow step does not hold another's):
- at start, unasked: {"id": 0, "ok": null} once the class imported, else {"id": 0,
  "error": ...} and exit 2;
- {"id", "session", "op": "open", "kwargs"}: construct an instance for `session`;
- {"id", "session", "op": "reset", "kwargs"}: reset with the arguments its reset takes;
- {"id", "session", "op": "step", "action"}: one action (built as the action class);
- {"id", "session", "op": "close"}: close the instance and forget it;
- {"session", "op": "drop"} (no reply): forget the session whose call the worker gave up
  on; an instance still being constructed is closed once it exists.

A reply is {"id", "ok": ...} (reset and step: {"observation", "reward", "done"}) or
{"id", "error": "Type: message"}. A reply over MAX_REPLY_BYTES is not sent: its call gets
an error and its session is dropped. The environments' own prints go to stderr. The host
ends when stdin closes (the worker is gone), whatever its threads are doing.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import asdict
from typing import IO, Any

# The largest reply (an observation as JSON): the model reads max_env_tokens of it at most.
MAX_REPLY_BYTES = 4 << 20


class Host:
    """The environment class, its action class, and the live instances by session id."""

    def __init__(self, environment: str, replies: IO[str]) -> None:
        from scalerl.agents.openenv import action_class, environment_class

        self.environment_class = environment_class(environment)
        self.action_class = action_class(self.environment_class)
        self.replies = replies
        self.sessions: dict[int, Any] = {}
        self.dropped: set[int] = set()
        self.lock = threading.Lock()

    def handle(self, request: dict[str, Any]) -> None:
        """Run one request (on its own thread) and write its reply."""
        session = int(request["session"])
        try:
            reply: dict[str, Any] = {"ok": self._run(session, request)}
        except Exception as exc:  # the environment's failure: its trajectory reports it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        line = json.dumps({"id": request["id"], **reply}, default=str)
        if len(line) > MAX_REPLY_BYTES:
            self.drop(session)
            line = json.dumps(
                {"id": request["id"], "error": f"replied more than {MAX_REPLY_BYTES} bytes"}
            )
        with self.lock:
            self.replies.write(line + "\n")
            self.replies.flush()

    def drop(self, session: int) -> None:
        """Forget `session`, closing its instance (one still being built: once it is)."""
        with self.lock:
            env = self.sessions.pop(session, None)
            if env is None:
                self.dropped.add(session)
        if env is not None:
            _close(env)

    def _run(self, session: int, request: dict[str, Any]) -> Any:
        from scalerl.agents.openenv import accepted_kwargs, env_step

        op = request.get("op")
        if op == "open":
            self._open(session, request.get("kwargs", {}))
            return None
        with self.lock:
            env = self.sessions.get(session)
        if env is None:
            raise RuntimeError(f"no open session {session} for {op!r}")
        if op == "reset":
            kwargs = accepted_kwargs(env.reset, request.get("kwargs", {}))
            return asdict(env_step(env.reset(**kwargs)))
        if op == "step":
            return asdict(env_step(env.step(self.action_class(**request["action"]))))
        if op == "close":
            with self.lock:
                self.sessions.pop(session, None)
            _close(env)
            return None
        raise ValueError(f"unknown op {op!r}")

    def _open(self, session: int, kwargs: dict[str, Any]) -> None:
        env = self.environment_class(**kwargs)
        with self.lock:
            given_up = session in self.dropped
            self.dropped.discard(session)
            if not given_up:
                self.sessions[session] = env
        if given_up:
            _close(env)


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


def main(argv: list[str]) -> int:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # print() of an environment: to stderr, never into a reply
    try:
        host = Host(argv[0], replies)
    except Exception as exc:
        replies.write(json.dumps({"id": 0, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        replies.flush()
        return 2
    replies.write(json.dumps({"id": 0, "ok": None}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "drop":
            threading.Thread(target=host.drop, args=(int(request["session"]),), daemon=True).start()
        else:
            threading.Thread(target=host.handle, args=(request,), daemon=True).start()
    # The worker is gone: end now, hung environment calls and all.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
