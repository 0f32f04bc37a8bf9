"""`task`: the prompts, their splits and verifiers (one entry per task, one variant per
source of its prompts)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    Tag,
    TypeAdapter,
    model_validator,
)

from scalerl.config.base import _Section, told_apart_by
from scalerl.state.keys import TASK_NAME_PATTERN

ADDITIONS_SYSTEM_PROMPT = "Reply with only the final number."


class McpServerConfig(_Section):
    """An MCP server whose tools an agent task offers, started by the worker over stdio."""

    command: list[str] = Field(
        min_length=1, description="The server's command line (argv), e.g. [python, -m, srv]."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="The server's environment (nothing of the worker's is passed on: no "
        "token, no Redis URL).",
    )
    tools: list[str] = Field(
        default_factory=list, description="The server's tools to offer (empty = all of them)."
    )
    allow_uncontained: bool = Field(
        False,
        description="Run the server even where it cannot be jailed (no user namespaces): it "
        "would see the worker's processes (/proc/<pid>/environ) and secret files. Off: a "
        "run with such a server refuses to start there.",
    )


class OpenEnvConfig(_Section):
    """An OpenEnv environment (the `openenv-core` package, extra `openenv`) as a task's
    environment, unchanged: its class run in the worker's jailed environment host, or its
    server at `url`. Each
    model turn is one action (the turn's text in `action_field`); each observation's
    text is the next user message; its rewards, summed and mapped from
    [reward_min, reward_max] onto [0, 1], are the trajectory's reward."""

    environment: str = Field(
        "",
        description="'python:MODULE:CLASS': an `openenv.core.env_server.interfaces."
        "Environment` subclass, one instance per trajectory, all in one jailed process per "
        "worker (none of the worker's secrets, processes or run folder in its sight).",
    )
    environment_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of the environment class's constructor."
    )
    url: str = Field(
        "",
        pattern=r"^$|^https?://[^\s]+$",
        description="A running OpenEnv server (http://host:port): one WebSocket session per "
        "trajectory (its max_concurrent_envs must cover the trajectories in flight).",
    )
    action_field: str = Field(
        "message", min_length=1, description="The action's field that gets the turn's text."
    )
    observation_field: str = Field(
        "",
        description="The observation's field shown to the model ('' = its only text field, "
        "else all of its fields as JSON).",
    )
    reset_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More arguments of reset (besides seed, episode_id)."
    )
    reward_min: float = Field(0.0, description="The trajectory reward that maps to 0.")
    reward_max: float = Field(1.0, description="The trajectory reward that maps to 1.")
    timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Wall time of one call of the environment (its constructor, reset, step "
        "or close), seconds: past it the trajectory fails and its instance is given up.",
    )
    allow_uncontained: bool = Field(
        False,
        description="Run `environment` unjailed where the jail cannot be set up (no user "
        "namespaces): it would see the worker's processes and files. Off: such a machine "
        "refuses the task.",
    )

    @model_validator(mode="after")
    def _check(self) -> OpenEnvConfig:
        if bool(self.environment) == bool(self.url):
            raise ValueError("environment.openenv: set exactly one of environment and url")
        if self.environment and not self.environment.startswith("python:"):
            raise ValueError(
                f"environment.openenv.environment: {self.environment!r} must be "
                "'python:MODULE:CLASS'"
            )
        if not self.reward_max > self.reward_min:
            raise ValueError(
                "environment.openenv: reward_max must be above reward_min, got "
                f"{self.reward_min} .. {self.reward_max}"
            )
        return self


class EnvironmentConfig(_Section):
    """A multi-turn task (`scalerl.agents`). With tools: the model may call tools, whose
    results come back as messages, until it answers without a call; the task's verifier
    scores the final answer; tools run in the code sandbox (`verifier.code`). With
    `openenv`: an OpenEnv environment answers every turn and its rewards score the
    trajectory."""

    tools: list[str] = Field(
        default_factory=list,
        description="Python tools: 'calculator' (built in) or 'python:MODULE:FUNCTION' (a "
        "stdlib-only function with JSON-typed annotations, run in the code sandbox).",
    )
    mcp_servers: list[McpServerConfig] = Field(
        default_factory=list, description="MCP servers whose tools are offered too."
    )
    call_format: Literal["hermes", "equals"] = Field(
        "hermes",
        description="How the model writes a tool call ('hermes': <tool_call>JSON</tool_call>; "
        "'equals': =EXPRESSION calls the calculator, for character-level models).",
    )
    max_turns: int = Field(4, ge=1, le=256, description="Model turns per trajectory.")
    max_tokens: int = Field(
        512,
        ge=2,
        le=1_048_576,
        description="Tokens after the prompt per trajectory: model, forced and environment.",
    )
    max_env_tokens: int = Field(
        256, ge=1, le=1_048_576, description="Environment tokens (tool results) per trajectory."
    )
    tool_timeout_s: float = Field(
        5.0, gt=0, le=600, description="Wall time of one tool call, seconds."
    )
    openenv: OpenEnvConfig | None = Field(
        None, description="An OpenEnv environment instead of tools (None: a tool task)."
    )

    @model_validator(mode="after")
    def _check_tools(self) -> EnvironmentConfig:
        has_tools = bool(self.tools or self.mcp_servers)
        if has_tools == (self.openenv is not None):
            raise ValueError(
                "environment: needs tools or mcp_servers (a tool task), or openenv, not both"
            )
        for name in self.tools:
            if name != "calculator" and not name.startswith("python:"):
                raise ValueError(
                    f"environment.tools: {name!r} must be 'calculator' or 'python:MODULE:FUNCTION'"
                )
        return self


class _Task(_Section):
    """What every task takes, whatever its prompts' source: its name, share, verifier,
    held-out split, prompts' framing and environment. One variant per `source`:
    `AdditionsTaskConfig`, `FileTaskConfig`, `ReasoningGymTaskConfig` and
    `EpisodesTaskConfig`, each with only its source's own fields.

    The held-out split is the file's (split_field, or a saved DatasetDict's splits) or else
    a seeded i.i.d. split of heldout_size prompts sharing no prompt text with training.
    """

    default_system_prompt: ClassVar[str] = ""
    source: str
    name: str = Field(
        "addition",
        pattern=TASK_NAME_PATTERN.pattern,
        description="Task name: prefix of its prompt ids, label of its metrics and curve.",
    )
    weight: float = Field(
        1.0, gt=0, le=1e6, description="Share of training prompts, relative to the other tasks."
    )
    verifier: str = Field(
        "",
        description="last_integer, math, code, judge, reward_model, reasoning_gym:DATASET or "
        "python:MODULE:FUNCTION; empty = the source's own (additions: last_integer, "
        "reasoning_gym: the dataset's scorer; a file source must name one).",
    )
    verifier_timeout_s: float | None = Field(
        None, ge=0.1, le=600, description="Time limit of one check, seconds; None = default."
    )
    heldout_size: int = Field(
        200, ge=1, le=100_000, description="Held-out prompts of a seeded split."
    )
    seed: int = Field(0, description="Seed of the train/held-out split.")
    system_prompt: str | None = Field(
        None,
        description="System prompt (chat models); None = the source's default (additions: "
        f"{ADDITIONS_SYSTEM_PROMPT!r}, others: none).",
    )
    prompt_template: str = Field(
        "{prompt}",
        description="The user message made of a text prompt; must contain {prompt}.",
    )
    environment: EnvironmentConfig | None = Field(
        None, description="Multi-turn with tools (None: one completion per prompt)."
    )

    @model_validator(mode="after")
    def _check_template(self) -> _Task:
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"task {self.name!r}: prompt_template must contain {{prompt}}")
        return self

    @property
    def effective_system_prompt(self) -> str:
        """The system prompt in use (the source's default when unset)."""
        if self.system_prompt is not None:
            return self.system_prompt
        return self.default_system_prompt


class AdditionsTaskConfig(_Task):
    """The built-in "What is a+b?" prompts."""

    default_system_prompt: ClassVar[str] = ADDITIONS_SYSTEM_PROMPT
    source: Literal["additions"] = "additions"
    small_max: int = Field(9, ge=0, le=99, description="Largest one-digit operand.")
    large_max: int = Field(39, ge=1, le=9999, description="Largest value of the other operand.")


class FileTaskConfig(_Task):
    """A local JSONL or Parquet file, or a Hugging Face `datasets` folder saved with
    `save_to_disk`; it must name its verifier."""

    source: Literal["file"] = "file"
    path: str = Field(
        "",
        description="A .jsonl/.parquet file or a save_to_disk folder; relative paths in a "
        "config file are relative to its folder.",
    )
    format: Literal["auto", "jsonl", "parquet", "hf"] = Field(
        "auto", description="auto = by extension (a folder is a saved `datasets`)."
    )
    prompt_field: str = Field("prompt", description="Column of the prompt (text, or messages).")
    answer_field: str = Field(
        "answer", description="Column of the reference answer (or the code tests)."
    )
    id_field: str = Field("", description="Column of unique row ids; empty = row number.")
    split_field: str = Field(
        "", description="Column naming each row's split; empty = a seeded split."
    )
    train_split: str = Field("train", description="Split value (or name) of training.")
    heldout_split: str = Field("test", description="Split value (or name) held out.")

    @model_validator(mode="after")
    def _check_file(self) -> FileTaskConfig:
        where = f"task {self.name!r}"
        if not self.path:
            raise ValueError(f"{where}: path is required for source file")
        if not self.verifier:
            raise ValueError(
                f"{where}: verifier is required for source file (last_integer, math, code, "
                "judge, reward_model or python:MODULE:FUNCTION)"
            )
        return self


class ReasoningGymTaskConfig(_Task):
    """A seeded procedural generator of the `reasoning-gym` package, scored by that
    dataset's own scorer."""

    source: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field("", description="Dataset name (e.g. basic_arithmetic).")
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="The dataset's options."
    )
    size: int = Field(10_000, ge=2, le=10_000_000, description="Prompts generated in all.")

    @model_validator(mode="after")
    def _check_dataset(self) -> ReasoningGymTaskConfig:
        if not self.dataset:
            raise ValueError(f"task {self.name!r}: dataset is required for source reasoning_gym")
        return self


class EpisodesTaskConfig(_Task):
    """`size` episodes of an OpenEnv environment (`environment.openenv`), each a reset
    seed; the environment opens and scores them."""

    source: Literal["episodes"] = "episodes"
    size: int = Field(10_000, ge=2, le=10_000_000, description="Episodes (reset seeds).")

    @model_validator(mode="after")
    def _check_environment(self) -> EpisodesTaskConfig:
        if self.environment is None or not self.environment.openenv:
            raise ValueError(f"task {self.name!r}: source episodes needs environment.openenv")
        return self


TASK_SOURCES: dict[str, type[_Task]] = {
    "additions": AdditionsTaskConfig,
    "file": FileTaskConfig,
    "reasoning_gym": ReasoningGymTaskConfig,
    "episodes": EpisodesTaskConfig,
}
# Every field some task takes (a bare `task.FIELD` override of a run of one task).
TASK_FIELDS = frozenset(name for task in TASK_SOURCES.values() for name in task.model_fields)


# One task: a variant per source, told apart by `source`.
TaskConfig = Annotated[
    Annotated[AdditionsTaskConfig, Tag("additions")]
    | Annotated[FileTaskConfig, Tag("file")]
    | Annotated[ReasoningGymTaskConfig, Tag("reasoning_gym")]
    | Annotated[EpisodesTaskConfig, Tag("episodes")],
    told_apart_by("source", ("additions", "file", "reasoning_gym", "episodes")),
]


class CodeVerifierConfig(_Section):
    """The `code` verifier's sandbox (`scalerl.sandbox.runner`): in this process, or
    the sandbox service (`scalerl-sandbox`) at `service`."""

    service: str = Field(
        "",
        pattern=r"^$|^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$",
        description="host:port of the sandbox service to run programs on ('' = run them "
        "in this process's own sandbox).",
    )

    allow_uncontained: bool = Field(
        False,
        description="Run model-written programs even where the sandbox cannot contain them "
        "(no user namespaces): they would run with this process's uid, files and network. "
        "Off: a run with a code task refuses to start there.",
    )

    retry_s: float = Field(
        120.0,
        ge=0,
        le=3600,
        description="Seconds a program is retried with back-off when the sandbox cannot run "
        "it (busy, down, failed to start); then its group is dead-lettered "
        "(verifier_unavailable), never scored 0.",
    )


DEFAULT_RUBRIC = (
    "Grade how well the response answers the prompt: 10 when it is correct and complete "
    "(it agrees with the reference answer when one is given), 0 when it is wrong or "
    "missing, in between for partial answers."
)
DEFAULT_JUDGE_TEMPLATE = "Prompt:\n{prompt}\n\nReference answer:\n{reference}\n\n{response}"
JUDGE_PLACEHOLDERS = ("prompt", "reference", "response")


class JudgeVerifierConfig(_Section):
    """The `judge` verifier (`scalerl.verifiers.judge`): a generative model grading each
    completion by a rubric, served by any OpenAI-compatible endpoint (vLLM's or SGLang's
    server, a hosted API) at `url`."""

    url: str = Field(
        "",
        description="Base URL of the OpenAI-compatible API, e.g. http://judge:8000/v1 "
        "(requests go to {url}/chat/completions).",
    )
    model: str = Field("", description="The judge's model name, as the endpoint knows it.")
    key_file: str = Field(
        "",
        description="File holding the endpoint's API key, sent as a bearer token ('' = no "
        "key). Never readable by every user; hidden from what model output drives.",
    )
    rubric: str = Field(
        DEFAULT_RUBRIC, min_length=1, description="How to grade (the judge's instructions)."
    )
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="The judge's user message: {prompt} (the task's prompt), {reference} "
        "(the row's answer, 'none' without one) and {response} (the completion, quoted "
        "between delimiters the completion cannot guess). Must contain {response}.",
    )
    score_min: float = Field(0.0, description="The lowest score; it maps to reward 0.")
    score_max: float = Field(10.0, description="The highest score; it maps to reward 1.")
    max_tokens: int = Field(512, ge=8, le=65_536, description="Tokens of the judge's reply.")
    temperature: float = Field(0.0, ge=0, le=2, description="The judge's sampling temperature.")
    concurrency: int = Field(
        8, ge=1, le=1024, description="Requests in flight at once from one process."
    )
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Wall time of one request, seconds.")
    retry_s: float = Field(
        120.0,
        ge=0,
        le=3600,
        description="Seconds a judge that does not answer (down, busy: 429 or 5xx, past "
        "timeout_s) is retried with back-off; then the completion is unscored and its group "
        "dead-lettered (verifier_unavailable), never scored 0.",
    )
    parse_retries: int = Field(
        1,
        ge=0,
        le=10,
        description="Times a reply without a valid final 'SCORE: n' line is asked again; "
        "then the completion is unscored (a judge's failure is never a reward).",
    )
    cache_size: int = Field(
        65_536,
        ge=0,
        le=10_000_000,
        description="Verdicts kept by (prompt, reference, completion, rubric); 0 = none.",
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeVerifierConfig:
        if self.url:
            check_http_url("verifier.judge.url", self.url)
        if not self.score_max > self.score_min:
            raise ValueError(
                "verifier.judge: score_max must be above score_min, got "
                f"{self.score_min} .. {self.score_max}"
            )
        check_template("verifier.judge.template", self.template, JUDGE_PLACEHOLDERS)
        return self


def check_http_url(field: str, url: str) -> None:
    """Raise ValueError naming `field` unless `url` is http(s)://host[:port][/path] with
    no query, fragment or credentials (a key goes in a key file, never in the URL)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{field}: {url!r} does not parse: {exc}") from None
    del port  # read for its check: a port out of range raises
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{field}: {url!r} must be http(s)://host[:port][/path]")
    if parts.query or parts.fragment or parts.username or parts.password or " " in url:
        raise ValueError(f"{field}: {url!r} must have no query, fragment, spaces or credentials")


def check_template(field: str, template: str, placeholders: tuple[str, ...]) -> None:
    """Raise ValueError naming `field` unless `template` is a str.format template using
    only `placeholders`, with the last of them ({response}) present."""
    import string

    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    unknown = sorted(set(names) - set(placeholders))
    if unknown:
        known = ", ".join("{" + p + "}" for p in placeholders)
        raise ValueError(f"{field}: unknown placeholder {{{unknown[0]}}} (known: {known})")
    if placeholders[-1] not in names:
        raise ValueError(f"{field}: must contain {{{placeholders[-1]}}}")


class RewardModelVerifierConfig(_Section):
    """The `reward_model` verifier (`scalerl.verifiers.reward_model`): a sequence-
    classification checkpoint served by the reward service (`scalerl-reward`) at
    `service`, its raw score mapped onto [0, 1]: "sigmoid" gives
    1 / (1 + exp(-(score - center) / scale)), "linear" gives (score - low) / (high - low)
    clipped to [0, 1]."""

    service: str = Field(
        "",
        pattern=r"^$|^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$",
        description="host:port of the reward service (scalerl-reward).",
    )
    normalize: Literal["sigmoid", "linear"] = Field(
        "sigmoid", description="How a raw score becomes a reward in [0, 1]."
    )
    center: float = Field(0.0, description="sigmoid: the score that maps to 0.5.")
    scale: float = Field(1.0, gt=0, description="sigmoid: the score's scale (a temperature).")
    low: float = Field(0.0, description="linear: the score that maps to 0.")
    high: float = Field(1.0, description="linear: the score that maps to 1.")
    timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Wall time of one call, queueing included, seconds."
    )
    retry_s: float = Field(
        120.0,
        ge=0,
        le=3600,
        description="Seconds a reward service that does not answer (down, busy, past "
        "timeout_s) is retried with back-off; then the completion is unscored and its group "
        "dead-lettered (verifier_unavailable), never scored 0.",
    )
    cache_size: int = Field(
        65_536,
        ge=0,
        le=10_000_000,
        description="Scores kept by (prompt, completion); 0 = none.",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardModelVerifierConfig:
        if self.normalize == "linear" and not self.high > self.low:
            raise ValueError(
                f"verifier.reward_model: high must be above low, got {self.low} .. {self.high}"
            )
        return self


class VerifierConfig(_Section):
    """Settings of the verifiers shared by every task."""

    code: CodeVerifierConfig = CodeVerifierConfig()
    judge: JudgeVerifierConfig = JudgeVerifierConfig()
    reward_model: RewardModelVerifierConfig = RewardModelVerifierConfig()


def as_task_list(value: Any) -> Any:
    """`task:` may be one mapping (a run of one task) or a list of them."""
    return [value] if isinstance(value, dict) else value


_TASK = TypeAdapter(TaskConfig)


def task_config(fields: Any) -> _Task:
    """One task's config from a mapping, its `source` picking the variant (`additions`
    when left out). Raises pydantic.ValidationError naming the field."""
    return _TASK.validate_python(fields)
