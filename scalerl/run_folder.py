"""The run folder's records: one `StepRecord` per optimizer step in metrics.jsonl, one
`EvalRecord` per held-out evaluation in eval.jsonl, one `ResumeRecord` per resume in
resumes.jsonl, one `EndRecord` per learner process that reached its end in ends.jsonl.

One writer (`append_record`) and one reader (`read_records`) for every file, so the
learner, the launcher's report, the sweep and the benchmarks agree on every field. The
JSON keys are the field names. Torch-free: the launcher and the sweep read run folders
without loading torch.

Compute is in accelerator-hours (device-hours of the CPU processes on a CPU-only machine,
`scalerl.compute`), the C of the paper's curve R(C) (Eq. 1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class _Record(BaseModel):
    """A frozen record. Building one with an unknown field is an error (a writer's typo or
    a new metric without its field); `read_records` skips the keys this version does not
    know (a newer writer's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    FILE: ClassVar[str]
    step: int  # every record is of a step; each kind says which (its own description)


class MultiTurnStats(BaseModel):
    """The multi-turn trajectories of a step's batch (StepRecord.multi_turn), or of a run
    (report.json `multi_turn`): counts, and the means and shares derived from them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trajectories: int = Field(description="Multi-turn samples.")
    turns_total: int = Field(description="Model turns, summed over the trajectories.")
    turns_max: int = Field(description="Most model turns of one trajectory.")
    tool_calls_total: int = Field(description="Tool calls, summed.")
    tool_errors_total: int = Field(
        description="Tool calls that failed (unknown tool, malformed, bad arguments, raised, "
        "timed out), summed."
    )
    tokens_total: int = Field(description="Tokens after the prompts: model, forced, environment.")
    env_tokens_total: int = Field(description="Environment tokens (tool results, messages).")
    max_turns_total: int = Field(description="Trajectories that ended at max_turns.")

    @property
    def turns_mean(self) -> float:
        return self.turns_total / self.trajectories

    @property
    def tool_calls_mean(self) -> float:
        return self.tool_calls_total / self.trajectories

    @property
    def tool_error_rate(self) -> float:
        """Failed calls / calls (0 without calls)."""
        return self.tool_errors_total / self.tool_calls_total if self.tool_calls_total else 0.0

    @property
    def env_token_share(self) -> float:
        """Environment tokens / tokens after the prompts (0 without tokens)."""
        return self.env_tokens_total / self.tokens_total if self.tokens_total else 0.0

    def summary(self) -> dict[str, float]:
        """The report's view: turns_mean, turns_max, tool_calls_mean, tool_error_rate,
        env_token_share, max_turns_rate and the trajectories counted."""
        return {
            "trajectories": self.trajectories,
            "turns_mean": self.turns_mean,
            "turns_max": self.turns_max,
            "tool_calls_mean": self.tool_calls_mean,
            "tool_error_rate": self.tool_error_rate,
            "env_token_share": self.env_token_share,
            "max_turns_rate": self.max_turns_total / self.trajectories,
        }

    def __add__(self, other: MultiTurnStats) -> MultiTurnStats:
        counts = {
            name: getattr(self, name) + getattr(other, name)
            for name in MultiTurnStats.model_fields
            if name != "turns_max"
        }
        return MultiTurnStats(turns_max=max(self.turns_max, other.turns_max), **counts)


class TaskStepStats(BaseModel):
    """One task's part of a step's batch (StepRecord.by_task), and its prompt pool after
    the step (No-Positive-Resampling, Sec. 3.2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    groups: int = Field(description="Groups of the task in the batch.")
    mean_reward: float = Field(description="Mean reward over the task's samples.")
    groups_zero_variance: int = Field(description="The task's groups with all rewards equal.")
    zero_variance_frac: float = Field(description="groups_zero_variance / groups.")
    parse_failure_rate: float = Field(description="The task's samples with no parsed answer.")
    truncation_rate: float = Field(description="The task's samples that hit the length limit.")
    prompts_eligible: int = Field(description="The task's training prompts still in its pool.")
    prompts_retired: int = Field(description="The task's prompts retired by NPR so far.")


class StepRecord(_Record):
    """One optimizer step of the learner (a line of metrics.jsonl).

    Rollout statistics (mean_reward, the *_rate fields, samples_by_finish_reason) cover
    every sample of the step's batch; tokens, samples, groups_used, loss and the ratio
    statistics cover what was trained on. The *_total fields are run totals so far.
    """

    FILE: ClassVar[str] = "metrics.jsonl"

    step: int = Field(description="Optimizer steps taken, this one included (1, 2, ...).")
    policy_version: int = Field(description="The learner's policy version after the step.")
    time: float = Field(description="Unix seconds when the step was recorded.")
    compute: float = Field(description="Run compute so far, accelerator-hours.")
    step_seconds: float = Field(description="Busy device-seconds of forward, backward, update.")
    batch_wait_seconds: float = Field(description="Wall seconds spent waiting for the batch.")
    publish_seconds: float = Field(
        description="Wall seconds of the last weight publication (snapshot, serialize, send)."
    )
    publish_block_seconds: float = Field(
        description="Learner-thread seconds spent publishing since the previous step."
    )
    publish_bytes: int = Field(
        0,
        description="Payload bytes of the last weight publication (with LoRA, after the "
        "first: the adapters alone).",
    )
    publish_delta_bytes: int = Field(
        0,
        description="Bytes of the last weight publication's delta from the version before "
        "(learner.weights.delta), what a worker holding that version receives; 0 when it "
        "went whole.",
    )
    eval_wait_seconds: float = Field(
        description="Learner-thread seconds spent waiting for evaluations since the previous step."
    )
    eval_wait_share: float | None = Field(
        None, description="Share of the learner's wall time so far spent waiting for evaluations."
    )
    eval_compute_share: float | None = Field(
        None,
        description="Share of the run's compute so far (outside R0) spent on the evaluations "
        "between R0 and the final one (`learner_service.evaluation.budget`).",
    )
    busy_seconds_by_role: dict[str, float] = Field(
        description="Run compute so far by role (learner, rollout, ...), device-seconds."
    )
    queue_depth: int = Field(description="Groups waiting in the replay stream after the step.")
    staleness_mean: float = Field(
        description="Mean staleness of the batch's groups, policy versions (paper Sec. 3.1)."
    )
    staleness_max: int = Field(description="Largest staleness in the batch, policy versions.")
    staleness_hist: list[int] = Field(
        description="Groups by staleness 0..k (index = versions behind; beyond k counts in k)."
    )
    zero_variance_frac: float = Field(
        description="Fraction of the batch's groups whose rewards were all equal (Sec. 3.2)."
    )
    groups_stale_total: int = Field(description="Groups dropped as stale, run total.")
    groups_dead_lettered_total: int | None = Field(
        None, description="Groups moved to the dead-letter stream (malformed), this process."
    )
    groups_unscored_total: int | None = Field(
        None,
        description="Groups the workers dead-lettered because a sample's verifier could not "
        "run (the sandbox, a judge or a reward service busy or down past its retries) or no "
        "distillation teacher scored them in time, run total from the replay ledger.",
    )
    groups_future_total: int | None = Field(
        default=None,
        description="Groups dropped for a policy version above the learner's (left by a "
        "crashed run's learner), run total.",
    )
    groups_zero_variance_total: int = Field(
        description="Groups with all rewards equal, run total (dropped when the filter is on)."
    )
    groups_trained_total: int | None = Field(
        None,
        description="Groups in the batches of this run's steps, run total (the replay "
        "ledger's `trained`).",
    )
    prompts_retired_total: int = Field(
        description="Prompts retired by No-Positive-Resampling (Sec. 3.2), run total."
    )
    truncation_warnings_total: int = Field(
        description="Steps whose truncation rate exceeded 10% (Sec. 3.1), run total."
    )
    prompts_eligible: int = Field(description="Training prompts still in the pool.")
    groups_zero_variance: int = Field(description="Groups of the batch with all rewards equal.")
    mean_reward: float = Field(description="Mean reward over the batch's samples.")
    truncation_rate: float = Field(
        description="Fraction of the batch's samples that hit the length limit (LENGTH)."
    )
    interrupted_rate: float = Field(
        description="Fraction of the batch's samples whose thinking was interrupted."
    )
    parse_failure_rate: float = Field(
        description="Fraction of the batch's samples whose reply had no parseable answer."
    )
    loss: float = Field(description="Policy loss of the step (0 when no step was taken).")
    grad_norm: float = Field(
        description="Global gradient norm before clipping (may be inf/nan: then no step)."
    )
    tokens: int = Field(description="Completion tokens trained on (forced tokens excluded).")
    samples: int = Field(description="Samples trained on.")
    groups_used: int = Field(description="Groups trained on.")
    ratio_mean: float = Field(description="Mean importance ratio exp(logp - logp_gen).")
    ratio_max: float = Field(description="Largest importance ratio of the step.")
    ratio_clipped_frac: float = Field(
        description="Fraction of tokens whose ratio was truncated (CISPO) or clipped (PPO)."
    )
    stepped: bool = Field(description="Whether the weights were updated (finite gradient).")
    # The learner's time split and throughput; None in run folders written before.
    forward_backward_seconds: float | None = Field(
        default=None, description="Wall seconds of the step's forward and backward passes."
    )
    optimizer_seconds: float | None = Field(
        default=None, description="Wall seconds of gradient clipping and the AdamW step."
    )
    learner_tokens_per_second: float | None = Field(
        default=None,
        description="Completion tokens trained on per second of forward, backward and update.",
    )
    peak_memory_bytes_by_rank: list[int] | None = Field(
        default=None,
        description="Peak memory of each learner rank, bytes (CUDA: allocated during the "
        "step; CPU: the process's peak resident set).",
    )
    mfu: float | None = Field(
        default=None,
        description="Model FLOPs utilisation, 6 x parameters x forward tokens / seconds / "
        "device peak; None where the peak is unknown (CPUs).",
    )
    # Counts behind the fractions above (for Prometheus counters); None in run folders
    # written before they were recorded.
    groups_in_batch: int | None = Field(
        default=None, description="Admissible groups in the step's batch."
    )
    entry_ids: list[str] | None = Field(
        default=None,
        description="Replay stream entry ids of the batch's groups (each is trained once "
        "in a run's timeline).",
    )
    multi_turn: MultiTurnStats | None = Field(
        default=None,
        description="The batch's multi-turn trajectories (None: no multi-turn sample).",
    )
    samples_by_finish_reason: dict[str, int] | None = Field(
        default=None,
        description="The batch's samples by finish reason (FINISH_REASON_STOP, ...).",
    )
    tokens_ratio_clipped: int | None = Field(
        default=None, description="Tokens trained on whose ratio was truncated or clipped."
    )
    # The engine/learner mismatch (learner.mismatch); None in run folders written before.
    mismatch_logp_abs_mean: float | None = Field(
        default=None,
        description="Mean |logp - logp_gen| over the tokens trained on (nats; learner at the "
        "step against the engine at sampling).",
    )
    mismatch_logp_abs_p99: float | None = Field(
        default=None, description="99th percentile of |logp - logp_gen| (nats)."
    )
    mismatch_kl_k3: float | None = Field(
        default=None,
        description="k3 estimate of KL(engine || learner) per token, mean of rho - 1 - log "
        "rho (nats).",
    )
    mismatch_masked_frac: float | None = Field(
        default=None,
        description="Fraction of the tokens trained on that learner.mismatch masked out.",
    )
    ratio_histogram: list[int] | None = Field(
        default=None,
        description="Tokens trained on per importance-ratio bucket, bucket i holding "
        "EDGES[i-1] <= rho < EDGES[i] (scalerl.config.RATIO_HISTOGRAM_EDGES).",
    )
    distill_reverse_kl: float | None = Field(
        default=None,
        description="On-policy distillation: mean over the tokens trained on of log "
        "pi_student - log pi_teacher (the student at sampling), the one-sample estimate of "
        "KL(student || teacher) per token (nats); None without learner.distill.",
    )
    # MoE routing replay (R3); None in run folders written before it was recorded.
    routing_choices: int | None = Field(
        default=None,
        description="(token, MoE layer) choices the learner replayed from the engine's "
        "routed experts (0: a dense model, or no routes carried).",
    )
    routing_agreed: int | None = Field(
        default=None, description="Replayed choices the learner's own router made alike."
    )
    routing_agreement: float | None = Field(
        default=None,
        description="routing_agreed / routing_choices (None: nothing replayed); below 1 "
        "where the engine's and the learner's numerics route tokens differently.",
    )
    # The fleet sizing after the step (`scalerl.fleet`); None in run
    # folders written before it was recorded.
    learner_starvation: float | None = Field(
        default=None,
        description="Batch-wait seconds over step seconds of the steps in the last "
        "fleet.window_s seconds.",
    )
    generator_throttle: float | None = Field(
        default=None,
        description="Fraction of the workers' time blocked on the full replay stream over "
        "the last fleet.window_s seconds, [0, 1].",
    )
    free_admission_slots: int | None = Field(
        default=None,
        description="The replay capacity - (groups queued + groups being generated), "
        "groups; <= 0 when the k bound is reached.",
    )
    desired_replicas: int | None = Field(
        default=None,
        description="Rollout workers the learner asks for (scalerl_rollout_desired_replicas).",
    )
    by_task: dict[str, TaskStepStats] | None = Field(
        default=None,
        description="The batch's statistics per task (tasks without a group in the batch "
        "are left out); None in run folders written before runs had several tasks.",
    )


class EvalRecord(_Record):
    """One held-out evaluation of one task, or of the run (a line of eval.jsonl): a point
    of that curve series, at the step, policy version and compute of the evaluation's
    start. An evaluation writes a record per task, then the run's (task "", the mean of
    the tasks' weighted by task weight); `run_evals` picks the run's."""

    FILE: ClassVar[str] = "eval.jsonl"

    step: int = Field(description="Optimizer steps taken when the evaluation started.")
    policy_version: int = Field(description="Policy version that generated every completion.")
    compute: float = Field(description="Run compute at the start, accelerator-hours.")
    task: str = Field(
        "", description='The task evaluated; "" = the run (task-weighted mean of its tasks).'
    )
    pass_rate: float = Field(description="Mean reward over the held-out completions, [0, 1].")
    stderr: float | None = Field(
        default=None,
        description="Standard error of pass_rate: the spread of the prompts' mean rewards "
        "(`learner_service.evaluation.evaluate.prompt_stderr`); None before it was recorded.",
    )
    parse_failure_rate: float = Field(
        description="Fraction of completions with no parseable answer."
    )
    completions: int = Field(description="Completions scored.")
    mean_tokens: float = Field(description="Mean completion length, tokens.")
    truncation_rate: float = Field(description="Fraction of completions that hit the length limit.")
    seconds: float = Field(description="Wall seconds the evaluation took.")
    learner_steps_meanwhile: int = Field(
        description="Optimizer steps taken while it ran (background evaluation)."
    )
    time: float = Field(description="Unix seconds when it was recorded (after it ended).")


class ResumeRecord(_Record):
    """One resume of the run from its checkpoint (a line of resumes.jsonl): where it went
    on from, what of the previous process's work after the checkpoint was superseded."""

    FILE: ClassVar[str] = "resumes.jsonl"

    step: int = Field(description="The checkpoint's step: the run continues with step + 1.")
    checkpoint_version: int = Field(description="Policy version of the checkpoint's weights.")
    policy_version: int = Field(
        description="The version the resumed learner published: above every version "
        "label found in Redis, so versions only go up."
    )
    steps_discarded: int = Field(description="Step records after the checkpoint, dropped.")
    evals_discarded: int = Field(description="Evaluation records after the checkpoint, dropped.")
    groups_lost: int = Field(
        description="Groups acknowledged by the discarded steps: trained into weights the "
        "crash lost, never read again (moved from `trained` to `lost` in the replay ledger)."
    )
    groups_replayed: int = Field(
        description="Groups read but not acknowledged by the previous learner: read again."
    )
    pool_restored: bool = Field(
        description="Whether the checkpoint's prompt pool replaced Redis's (only when Redis "
        "held an older or no pool)."
    )
    seconds_discarded: float = Field(
        0.0,
        description="Learner seconds the discarded steps took (from the checkpoint to the "
        "last of them): still counted against learner.max_minutes.",
    )
    time: float = Field(description="Unix seconds of the resume.")


# The learner's exit code when it gave up (no admissible group for
# `learner.batch_timeout_s`): the launcher does not restart it, and `scalerl run` exits 1.
GAVE_UP_EXIT = 3


class EndRecord(_Record):
    """How one learner process ended the run (a line of ends.jsonl; a resumed run has one
    per process that reached its end)."""

    FILE: ClassVar[str] = "ends.jsonl"

    step: int = Field(description="The last optimizer step.")
    ended: Literal["max_steps", "time_budget", "stopped", "gave_up"] = Field(
        description="max_steps reached, time_budget (max_minutes) reached, stopped (a "
        "signal or the run's stop flag), or gave_up (no admissible group for "
        "learner.batch_timeout_s: the run did not finish)."
    )
    reason: str = Field(description="What the learner logged about its end.")
    time: float = Field(description="Unix seconds of the end.")


R = TypeVar("R", bound=_Record)


def run_evals(records: list[EvalRecord]) -> list[EvalRecord]:
    """The run's own evaluation records (task ""), in order: its curve."""
    return [r for r in records if r.task == ""]


def evals_by_task(records: list[EvalRecord]) -> dict[str, list[EvalRecord]]:
    """Each task's evaluation records, in order, by task name (the run's left out)."""
    series: dict[str, list[EvalRecord]] = {}
    for record in records:
        if record.task:
            series.setdefault(record.task, []).append(record)
    return series


def append_record(run_dir: Path, record: _Record) -> None:
    """Append `record` as one JSON line to its file (`record.FILE`) in `run_dir`.

    A partial last line left by a crashed writer is cut off first, so a resumed run does
    not glue its first record to it. Non-finite floats are written as NaN/Infinity (what
    Python's json reads back). Raises OSError when the file cannot be written."""
    path = Path(run_dir) / record.FILE
    line = json.dumps(record.model_dump()) + "\n"
    with open(path, "ab+") as handle:
        _cut_partial_line(handle)
        handle.write(line.encode())


def _cut_partial_line(handle: BinaryIO) -> None:
    """Truncate an append-mode file after its last newline (nothing when it ends in one)."""
    size = handle.seek(0, os.SEEK_END)
    if size == 0:
        return
    handle.seek(size - 1)
    if handle.read(1) == b"\n":
        return
    handle.seek(0)
    keep = handle.read().rfind(b"\n") + 1
    handle.truncate(keep)


def keep_records_until(run_dir: Path, kind: type[R], step: int) -> list[R]:
    """Cut `kind`'s file in `run_dir` to the records of steps <= `step` (a resumed run
    continues one timeline from its checkpoint at `step`: what the crashed run wrote after
    it is superseded). The file is replaced atomically (a temporary file renamed over it).
    Returns the records dropped, in file order; [] when nothing changed.

    Raises ValueError as `read_records` does (the file is then unchanged)."""
    records = read_records(run_dir, kind)
    kept = [r for r in records if r.step <= step]
    if len(kept) == len(records):
        return []
    path = Path(run_dir) / kind.FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.writelines(json.dumps(r.model_dump()) + "\n" for r in kept)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    return [r for r in records if r.step > step]


def read_records(run_dir: Path, kind: type[R]) -> list[R]:
    """The records of `kind` (StepRecord or EvalRecord) in `run_dir`, in file order; []
    when the file does not exist.

    A last line without its newline that is not valid JSON (a run that crashed while
    writing it) is skipped.

    Raises:
        ValueError: any other line is not JSON or lacks a field; the message names the
            file and line (pydantic.ValidationError is a ValueError).
    """
    path = Path(run_dir) / kind.FILE
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_parse(kind, line))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    return records


def _parse(kind: type[R], line: str) -> R:
    """One JSON line as a `kind` record, keys unknown to `kind` dropped."""
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return kind.model_validate({k: v for k, v in data.items() if k in kind.model_fields})
