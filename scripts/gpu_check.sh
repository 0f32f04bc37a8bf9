#!/usr/bin/env bash
# Prove a GPU machine in one command: the engine contract suite for every engine available
# in one Python environment (table: engine / passed / failed / skipped / rollout tokens per
# second), the engine vs learner log-prob agreement and the fp32-head checks on the CUDA
# device, the broadcast weight group over NCCL (tests/integration/test_weight_group.py with
# SCALERL_WEIGHT_GROUP_BACKEND=nccl; NCCL wants one CUDA device per member, so its tests
# skip on a machine with fewer than 2-4 devices), the FSDP2 learner's equality with one
# process over NCCL (tests/integration/test_fsdp_trainer.py; 2 ranks on 2 GPUs, one
# sharded rank on a single GPU), and the tiny job end to end with `device: auto` (engine
# and learner on cuda:0).
#
#   scripts/gpu_check.sh [PYTHON]
#
# PYTHON defaults to .venv-vllm/bin/python when it exists (vLLM installed), else
# .venv/bin/python. On a GPU machine, install `vllm` (and `sglang`) into that environment
# first; engines whose package is missing show up as skipped. Tokens per second come from
# benchmarks/rollout_throughput.py (SmolLM2-135M, 8 prompts x 8 samples x 48 new tokens,
# bfloat16) for the torch engine and for vLLM when it is installed.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${1:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv-vllm/bin/python ]]; then PYTHON=.venv-vllm/bin/python; else PYTHON=.venv/bin/python; fi
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "python: $PYTHON"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"

"$PYTHON" -m pytest -q -p no:cacheprovider tests/contract/test_engine_contract.py \
  --junitxml="$OUT/contract.xml" >"$OUT/contract.log" 2>&1
tail -n 3 "$OUT/contract.log"

for engine in torch vllm; do
  if [[ "$engine" == vllm ]] && ! "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    continue
  fi
  "$PYTHON" benchmarks/rollout_throughput.py --scenario rl --engine "$engine" \
    --dtypes bfloat16 >"$OUT/bench-$engine.log" 2>&1
done

echo "== log-prob agreement and fp32 head, CPU and CUDA"
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/unit/test_logprob_agreement.py \
  tests/unit/test_fp32_head.py 2>&1 | tail -n 6

echo "== the broadcast weight group over NCCL"
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  SCALERL_WEIGHT_GROUP_BACKEND=nccl TORCH_NCCL_ASYNC_ERROR_HANDLING=2 "$PYTHON" -m pytest -q \
    -p no:cacheprovider -rs tests/integration/test_weight_group.py 2>&1 | tail -n 8
else
  echo "no CUDA device: skipped"
fi

echo "== the FSDP2 learner: 2 ranks (1 with one GPU) equal one process, over NCCL"
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ "$GPUS" -ge 1 ]]; then
  SCALERL_FSDP_BACKEND=nccl SCALERL_FSDP_WORLD=$(( GPUS >= 2 ? 2 : 1 )) "$PYTHON" -m pytest -q \
    -p no:cacheprovider -rs tests/integration/test_fsdp_trainer.py -k "not torchrun" 2>&1 | tail -n 6
else
  echo "no CUDA device: skipped"
fi

echo "== the tiny job end to end (device auto)"
if "$PYTHON" -m scalerl_cli.main run --config tiny --run-dir "$OUT/tiny" >"$OUT/tiny.log" 2>&1; then
  "$PYTHON" - "$OUT/tiny/report.json" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
print("tiny job:", report["precision"], "pass rate", report["pass_rate_step0"], "->",
      report["pass_rate_final"], "in", round(report["wall_seconds"]), "s")
EOF
else
  echo "tiny job FAILED:"; tail -n 20 "$OUT/tiny.log"
fi

"$PYTHON" - "$OUT" <<'EOF'
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
counts = {}
for case in ET.parse(out / "contract.xml").iter("testcase"):
    match = re.search(r"\[(.*)\]$", case.get("name", ""))
    parts = match.group(1).split("-") if match else ["(no engine)"]
    engine = next((p for p in parts if not re.fullmatch(r"[0-9.]+", p)), "(no engine)")
    row = counts.setdefault(engine, {"passed": 0, "failed": 0, "skipped": 0})
    if case.find("skipped") is not None:
        row["skipped"] += 1
    elif case.find("failure") is not None or case.find("error") is not None:
        row["failed"] += 1
    else:
        row["passed"] += 1
speed = {}
for log in out.glob("bench-*.log"):
    found = re.search(r"([0-9.]+) tokens/s overall", log.read_text())
    speed[log.stem.removeprefix("bench-")] = found.group(1) if found else "failed"
print(f"{'engine':<11} {'passed':>6} {'failed':>6} {'skipped':>7} {'tokens/s':>9}")
for engine, row in sorted(counts.items()):
    print(
        f"{engine:<11} {row['passed']:>6} {row['failed']:>6} {row['skipped']:>7} "
        f"{speed.get(engine, '-'):>9}"
    )
EOF
