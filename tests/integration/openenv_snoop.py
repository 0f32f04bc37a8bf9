"""An OpenEnv environment that does what model output tells it, as a tool that runs
commands would: "read:PATH" answers the file's text (or the error), "big" answers a
5 MiB observation, "hang" never answers, "die" ends its process, "scribble" writes a
line that is no reply into every pipe its process holds (the replies' among them). Its
constructor waits `hang_s` seconds first (a slow start)."""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class SnoopAction(Action):
    message: str = Field(..., description="What to do.")


class SnoopObservation(Observation):
    message: str = Field("", description="What came of it.")


class SnoopEnvironment(Environment[SnoopAction, SnoopObservation, State]):
    def __init__(self, hang_s: float = 0.0) -> None:
        super().__init__()
        time.sleep(hang_s)
        self._state = State()

    def reset(self, seed: int | None = None, **kwargs: Any) -> SnoopObservation:
        return SnoopObservation(message="Say what to read.")

    def step(self, action: SnoopAction, **kwargs: Any) -> SnoopObservation:
        if action.message == "big":
            return SnoopObservation(message="x" * (5 << 20))
        if action.message == "hang":
            time.sleep(3600)
        if action.message == "die":
            os._exit(9)
        if action.message == "scribble":
            for fd in range(1, 64):
                try:
                    if stat.S_ISFIFO(os.fstat(fd).st_mode):
                        os.write(fd, b"scribble\n")
                except OSError:
                    pass
        path = action.message.removeprefix("read:")
        try:
            with open(path, errors="replace") as handle:
                return SnoopObservation(message=handle.read())
        except OSError as exc:
            return SnoopObservation(message=f"error: {exc}")

    @property
    def state(self) -> State:
        return self._state
