"""`scalerl export RUN_DIR OUT [--merge]`: a run's checkpointed policy as a folder other
tools load.

- A LoRA run (`learner.lora`), without --merge: a peft adapter folder
  (adapter_config.json, adapter_model.safetensors) that `peft.PeftModel.from_pretrained`
  and vLLM's LoRA requests load over the base model. The base is the model source
  (`base_model_name_or_path`), or, when the run's supervised warm-up changed it, the
  base written beside the adapter in OUT/base.
- --merge, or a run without LoRA: a Hugging Face model folder (config.json,
  model.safetensors, the tokenizer where it has files) with the adapters merged into
  the weights: W + (alpha / r) B A (Hu et al. 2021, eq. 3).

Bad input (no checkpoint, an OUT that exists and is not empty) prints one line and exits
with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `scalerl export` on the top-level subparsers."""
    parser = sub.add_parser(
        "export",
        help="Write a run's checkpointed policy as a peft adapter or a merged HF folder.",
        description="Write RUN_DIR's checkpoint to OUT: a LoRA run's adapter as a peft "
        "folder, or with --merge (always without LoRA) a Hugging Face model folder.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("out", type=Path, metavar="OUT")
    parser.add_argument(
        "--merge", action="store_true", help="Merge the adapters into a full HF model folder."
    )


def main(args: argparse.Namespace) -> int:
    """Run `scalerl export`; 0 on success, 2 on bad input (one line on stderr)."""
    from scalerl.entrypoint import load_config_or_none
    from scalerl_cli.eval_cli import find_source

    try:
        source = find_source(args.run_dir)
        if source.config is None or source.step is None:
            raise FileNotFoundError(f"RUN_DIR {args.run_dir}: no run folder with a checkpoint")
        if args.out.exists() and any(args.out.iterdir()):
            raise FileExistsError(f"OUT {args.out}: exists and is not empty")
    except (FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        print(f"scalerl export: {exc}", file=sys.stderr)
        return 2
    config = load_config_or_none("scalerl export", str(source.config), [])
    if config is None:
        return 2
    written = export(config, source.weights, args.out, merge=args.merge)
    print(f"wrote {written} from step {source.step} of {args.run_dir}")
    return 0


def export(config: Any, weight_files: tuple[Path, ...], out: Path, merge: bool) -> str:
    """Write the policy of a checkpoint's `weight_files` (a run with `config`) to `out`;
    returns what was written ("a peft adapter" or "a merged HF model")."""
    from safetensors.torch import load_file

    from scalerl.policy.lora import attach_lora, merge_adapters
    from scalerl.policy.models import load_policy

    model, tokenizer = load_policy(config.model, seed=config.seed)
    lora = config.learner.lora
    if lora is not None:
        attach_lora(model, lora)
    state: dict = {}
    for file in weight_files:
        state.update(load_file(str(file)))
    model.load_state_dict(state, strict=False)  # the tied head is left out of the file
    out.mkdir(parents=True, exist_ok=True)
    if lora is None or merge:
        _save_model(merge_adapters(model) if lora is not None else model, tokenizer, out)
        return "a merged HF model"
    _save_adapter(model, lora, config, out)
    return "a peft adapter"


def _save_model(model: Any, tokenizer: Any, out: Path) -> None:
    model.save_pretrained(out)
    save = getattr(tokenizer.tokenizer, "save_pretrained", None)
    if save is not None:  # an HF tokenizer (the tiny model's is a character table)
        save(out)


def _save_adapter(model: Any, lora: Any, config: Any, out: Path) -> None:
    """adapter_config.json and adapter_model.safetensors in peft's layout."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from scalerl.policy.lora import lora_layers, target_modules_of

    base = _base_source(model, config, out)
    tensors = {}
    for name, layer in lora_layers(model):
        for kind in ("lora_A", "lora_B"):
            weight = getattr(layer, kind)["default"].weight
            tensors[f"base_model.model.{name}.{kind}.weight"] = weight.detach().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_modules_of(model, lora),
        base_model_name_or_path=base,
    ).save_pretrained(str(out))


def _base_source(model: Any, config: Any, out: Path) -> str:
    """What `base_model_name_or_path` names: the model source, or the warmed-up base
    written to OUT/base (the adapters removed, never merged)."""
    from scalerl.policy.models import policy_folder

    if not config.model.warmup_steps and config.model.from_folder:
        return str(policy_folder(config.model).resolve())
    from scalerl.policy.models import load_policy
    from scalerl.weights.wire import LORA_BASE, snapshot_state_dict

    base: Any = load_policy(config.model, seed=config.seed)[0]
    state = snapshot_state_dict(model, part=LORA_BASE)  # the base and the adapters
    base.load_state_dict({n: t for n, t in state.items() if ".lora_" not in n}, strict=False)
    base.save_pretrained(out / "base")
    return str((out / "base").resolve())
