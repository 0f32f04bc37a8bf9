"""OpenEnv environments (the `openenv-core` package) as the environments of trajectories,
unchanged: a user's `openenv.core.env_server.interfaces.Environment` subclass runs in the
worker's jailed environment host (`scalerl.agents.hosted`: model output drives its code,
none of which runs in the worker), or its server (the same class behind OpenEnv's
HTTP/WebSocket app, in a container or on a Space) is reached through OpenEnv's own client;
one session per trajectory.

The mapping (`OpenEnvTrajectory`):
- reset: `reset(seed=row seed, episode_id=prompt id, **reset_kwargs)` (only the arguments
  the environment's reset takes, in process); every trajectory of a group starts the same
  episode. The reset observation's text, after the row's question if it has one, is the
  first user message.
- each model turn is one action: the turn's text (special tokens left out, a forced
  phrase kept) in `action_field`; the observation's text is the next user message.
- the episode ends when an observation says done; `max_turns` and the token budgets of
  `task.environment` end it too (`scalerl.agents.trajectory`).
- the trajectory's reward is the sum S of the observations' rewards (None counts 0),
  mapped onto [0, 1] by clip((S - reward_min) / (reward_max - reward_min), 0, 1); each
  observation carries the increase of that mapped running sum, so the trajectory's summed
  rewards equal it however the episode ends.

The package is imported on first use (extra `openenv`); nothing here imports torch.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, get_args

from scalerl.agents.environment import Message, ModelTurn, Observation, Opening
from scalerl.agents.hosted import EnvHost
from scalerl.agents.jail import probe
from scalerl.agents.trajectory import TurnLimits
from scalerl.config import EnvironmentConfig, OpenEnvConfig

log = logging.getLogger(__name__)
# Fields of every OpenEnv observation that are not shown to the model.
_CONTROL_FIELDS = ("done", "reward", "metadata")


@dataclass(frozen=True)
class EnvStep:
    """One reset or step result: the observation's fields (without done, reward and
    metadata), its reward (None: none this step) and done."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


class Session(Protocol):
    """One episode's connection to an OpenEnv environment."""

    def reset(self, **kwargs: Any) -> EnvStep: ...

    def step(self, action: dict[str, Any]) -> EnvStep: ...

    def close(self) -> None: ...


class RemoteSession:
    """One WebSocket session with an OpenEnv server at `url` (`GenericEnvClient`, plain
    dict actions and observations: none of the environment's code runs here)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        from openenv.core.generic_client import GenericEnvClient

        client = GenericEnvClient(
            base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s
        )
        self.client = client.sync()

    def reset(self, **kwargs: Any) -> EnvStep:
        return _from_result(self.client.reset(**kwargs))

    def step(self, action: dict[str, Any]) -> EnvStep:
        return _from_result(self.client.step(action))

    def close(self) -> None:
        self.client.close()


@dataclass
class OpenEnvTrajectory:
    """One trajectory's `Environment` over an OpenEnv session, opened by `connect` at
    reset (on the trajectory's thread: an environment that fails to start ends its
    trajectory, not the worker). See the module docstring for the mapping. The
    environment scores (`scores` True)."""

    connect: Callable[[], Session]
    config: OpenEnvConfig
    system_prompt: str
    question: str
    seed: int
    episode_id: str
    scores: bool = True
    _mapped: float = 0.0  # the mapped reward so far (what earlier observations carried)
    _raw: float = 0.0  # the environment's rewards so far
    _session: Session | None = None

    @property
    def session(self) -> Session:
        if self._session is None:
            raise RuntimeError("the OpenEnv session is opened by reset")
        return self._session

    def reset(self) -> Opening:
        self._session = self.connect()
        first = self.session.reset(
            seed=self.seed, episode_id=self.episode_id, **self.config.reset_kwargs
        )
        self._add(first.reward)  # a reset's reward is rare; it counts when given
        text = observation_text(first.observation, self.config.observation_field)
        content = f"{self.question}\n\n{text}" if self.question else text
        messages: list[Message] = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Opening(messages)

    def step(self, turn: ModelTurn) -> Observation:
        before = self._mapped
        result = self.session.step({self.config.action_field: turn.text.strip()})
        self._add(result.reward)
        reward = self._mapped - before
        if result.done:
            return Observation(reward=reward, done=True)
        text = observation_text(result.observation, self.config.observation_field)
        return Observation({"role": "user", "content": text}, reward=reward)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def _add(self, reward: float | None) -> None:
        if reward is None:
            return
        self._raw += float(reward)
        self._mapped = mapped_reward(self._raw, self.config.reward_min, self.config.reward_max)


class OpenEnvEnvironments:
    """The `EnvironmentFactory` of an OpenEnv task: a session per trajectory, local (the
    environment class imported here to check it, its instances in the worker's environment
    host, `scalerl.agents.hosted`) or with the server at `url`.

    Raises ValueError naming the field for a class that does not import, is not an OpenEnv
    `Environment`, or has no action class with `action_field`, and where the host cannot be
    jailed unless `allow_uncontained` (`check_contained`); the package itself is imported
    here, so a worker without the `openenv` extra fails at start, not mid-run."""

    def __init__(self, config: EnvironmentConfig, system_prompt: str) -> None:
        assert config.openenv is not None
        self.config = config
        self.openenv = config.openenv
        self.system_prompt = system_prompt
        try:
            importlib.import_module("openenv.core.env_server.interfaces")
        except ImportError as exc:
            raise ValueError(
                f"environment.openenv: the openenv-core package is not installed "
                f"(pip install 'scalerl[openenv]'): {exc}"
            ) from None
        self.environment_class = (
            environment_class(self.openenv.environment) if self.openenv.environment else None
        )
        self.host: EnvHost | None = None
        if self.environment_class is not None:
            fields = action_class(self.environment_class).model_fields
            if self.openenv.action_field not in fields:
                raise ValueError(
                    f"environment.openenv.action_field: {self.openenv.action_field!r} is not "
                    f"a field of the action (its fields: {sorted(fields)})"
                )
            contained = check_contained(self.openenv)
            self.host = EnvHost(self.openenv.environment, self.openenv.timeout_s, contained)

    def make(self, problem: Any, tools_in_template: bool = False) -> OpenEnvTrajectory:
        """The environment of one trajectory of `problem` (a `scalerl.tasks.Problem`): the
        episode of the row's seed (`episode_seed`)."""
        return OpenEnvTrajectory(
            self._session,
            self.openenv,
            self.system_prompt,
            problem.question,
            episode_seed(problem.prompt_id),
            problem.prompt_id,
        )

    def limits(self, turn_tokens: int) -> TurnLimits:
        """The trajectory limits, with `turn_tokens` (`rollout.max_new_tokens`) a turn."""
        c = self.config
        return TurnLimits(c.max_turns, c.max_tokens, c.max_env_tokens, turn_tokens)

    def close(self) -> None:
        """End the environment host, if any (each trajectory closes its own session)."""
        if self.host is not None:
            self.host.close()

    def _session(self) -> Session:
        if self.host is not None:
            return self.host.open(self.openenv.environment_kwargs)
        return RemoteSession(self.openenv.url, self.openenv.timeout_s)


def check_contained(config: OpenEnvConfig) -> bool:
    """Whether the environment host runs jailed: True where the jail can be set up here
    (`scalerl.agents.jail.probe`); else False with a warning when `allow_uncontained`,
    and ValueError (one line naming the setting) when not."""
    why = probe()
    if not why:
        return True
    if not config.allow_uncontained:
        raise ValueError(
            f"environment.openenv.allow_uncontained: the environment cannot be jailed here "
            f"({why}); set it true to run the environment with the worker's view"
        )
    log.warning("the OpenEnv environment runs uncontained (allow_uncontained): %s", why)
    return False


def mapped_reward(total: float, low: float, high: float) -> float:
    """clip((total - low) / (high - low), 0, 1): a trajectory's reward in [0, 1]."""
    return min(1.0, max(0.0, (total - low) / (high - low)))


def episode_seed(prompt_id: str) -> int:
    """The reset seed of a prompt: its row id when that is a number (source `episodes`),
    else a stable hash of the prompt id (CRC-32), so every process picks the same one."""
    row = prompt_id.rpartition("/")[2]
    return int(row) if row.isdigit() else zlib.crc32(prompt_id.encode())


def observation_text(observation: dict[str, Any], field: str) -> str:
    """What the model reads of an observation: `field`'s value; '' = its only text field,
    else all of its fields as JSON. Raises KeyError for a missing `field`."""
    if field:
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    shown = {k: v for k, v in observation.items() if k not in _CONTROL_FIELDS}
    texts = [v for v in shown.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(shown, sort_keys=True, default=str)


def environment_class(name: str) -> type:
    """The OpenEnv `Environment` subclass 'python:MODULE:CLASS' names. Raises ValueError."""
    from openenv.core.env_server.interfaces import Environment

    module_name, _, attribute = name.removeprefix("python:").rpartition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"environment.openenv.environment: cannot import {name!r}: {exc}"
        ) from None
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise ValueError(
            f"environment.openenv.environment: {name!r} is not an OpenEnv Environment subclass"
        )
    return found


def action_class(environment: Any) -> Any:
    """The action class of an OpenEnv `Environment` subclass: its first generic argument,
    else the annotation of `step`'s action. Raises ValueError when neither is an Action."""
    from openenv.core.env_server.types import Action

    candidates: list[Any] = []
    for base in getattr(environment, "__orig_bases__", ()):
        candidates += list(get_args(base))[:1]
    try:
        hints = inspect.get_annotations(environment.step, eval_str=True)
    except Exception:  # an annotation that does not resolve: the generic argument decides
        hints = {}
    candidates += [hints.get("action")]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Action):
            return candidate
    raise ValueError(
        f"environment.openenv.environment: cannot tell {environment.__name__}'s action class "
        "(declare it as Environment[MyAction, ...] or annotate step(self, action: MyAction))"
    )


def accepted_kwargs(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `kwargs` that `function` takes (all of them with **kwargs)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {k: v for k, v in kwargs.items() if k in names}


def env_step(observation: Any) -> EnvStep:
    """An OpenEnv `Observation` (pydantic) as an `EnvStep`."""
    fields = observation.model_dump()
    shown = {k: v for k, v in fields.items() if k not in _CONTROL_FIELDS}
    return EnvStep(shown, _reward(fields.get("reward")), bool(fields.get("done")))


def env_step_of(fields: Any) -> EnvStep:
    """An `EnvStep` from its fields as the environment host replies them
    (`scalerl.agents.env_host`), checked: the host runs code that model output drives.
    Raises ValueError for anything else."""
    if not (isinstance(fields, dict) and isinstance(fields.get("observation"), dict)):
        raise ValueError(f"the environment host replied no observation: {str(fields)[:200]}")
    done = fields.get("done")
    if not isinstance(done, bool):
        raise ValueError(f"the environment host replied done={done!r}, not a bool")
    return EnvStep(fields["observation"], _reward(fields.get("reward")), done)


def _from_result(result: Any) -> EnvStep:
    """A client's `StepResult` (observation as a dict) as an `EnvStep`."""
    shown = {k: v for k, v in dict(result.observation).items() if k not in _CONTROL_FIELDS}
    return EnvStep(shown, _reward(result.reward), bool(result.done))


def _reward(value: Any) -> float | None:
    """A reward as a float (None: none); raises ValueError for a non-number."""
    if value is None:
        return None
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    raise ValueError(f"the environment's reward must be a finite number, got {value!r}")
