"""A user's OpenEnv environment, written against OpenEnv's own API and nothing of
scalerl's: guess a number from 1 to 9 (the seed picks it) in at most 3 guesses, told
"higher" or "lower" after each; reward 1 when guessed, 0 otherwise. Run as a script, it
serves itself with OpenEnv's app: `python openenv_guess.py PORT`."""

from __future__ import annotations

import random
import re
import sys
import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GUESSES = 3


class GuessAction(Action):
    message: str = Field(..., description="The player's guess.")


class GuessObservation(Observation):
    message: str = Field("", description="What the game says.")
    guesses_left: int = Field(GUESSES, description="Guesses left.")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = 0
        self.left = GUESSES

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.target = random.Random(seed).randint(1, 9)
        self.left = GUESSES
        self._state = State(episode_id=episode_id, step_count=0)
        text = f"Guess my number from 1 to 9. You have {GUESSES} guesses."
        return GuessObservation(message=text, guesses_left=self.left)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        if action.message == "sleep":  # a hung environment, for the timeout test
            time.sleep(30)
        self._state.step_count += 1
        self.left -= 1
        found = re.findall(r"\d+", action.message)
        guess = int(found[-1]) if found else None
        if guess == self.target:
            return GuessObservation(
                message="Correct!", guesses_left=self.left, done=True, reward=1.0
            )
        if self.left == 0:
            return GuessObservation(
                message="Out of guesses.", done=True, reward=0.0, guesses_left=0
            )
        hint = "no number" if guess is None else ("higher" if guess < self.target else "lower")
        return GuessObservation(message=hint, guesses_left=self.left, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def app() -> Any:
    from openenv.core.env_server.http_server import create_app

    return create_app(
        GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8
    )


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
