#!/usr/bin/env bash
# Prove a GPU machine in one command. Each section runs under its own time limit (a hung
# section is reported and the next one runs), most telling first:
#
#  1. the tiny job end to end with `device: auto` (engine and learner on cuda:0) and the
#     default weight transport (uri);
#  2. the tiny job with `learner.weights.transport=broadcast`, whose `backend: auto` is
#     nccl on CUDA: per worker, how many versions arrived by broadcast and how many by a
#     fallback pull, and the learner's weight group epochs;
#  3. the FSDP2 learner's equality with one process over NCCL
#     (tests/integration/test_fsdp_trainer.py; 2 ranks on 2 GPUs, one sharded rank on one);
#  4. engine vs learner log-prob agreement and the fp32 head on the CUDA device;
#  5. the broadcast weight group over NCCL (tests/integration/test_weight_group.py with
#     SCALERL_WEIGHT_GROUP_BACKEND=nccl; NCCL wants one CUDA device per member, so its
#     tests skip on a machine with fewer than 2-4 devices);
#  6. the broadcast's flatness in N: benchmarks/weight_delivery.py over gloo with 1, 2, 4
#     and 8 receivers where the machine has a core for each process (no oversubscription,
#     which a 2-core machine cannot give), broadcast vs pull vs the loopback TCP limit;
#  7. rollout tokens per second of the torch engine on cuda:0 (benchmarks/rollout_throughput.py,
#     SmolLM2-135M, 8 prompts x 8 samples x 48 new tokens, bfloat16), and of vLLM when it
#     is installed;
#  8. the engine contract suite for every engine available in this Python environment
#     (table: engine / passed / failed / skipped / tokens per second): torch, vLLM, and
#     SGLang with its LoRA adapters when `sglang` is installed (a server of its own on
#     the tiny model; never run yet: SGLang is protocol-tested only until then);
#  9. the in-engine weight updates of vLLM and SGLang over NCCL: reported as not checked
#     (the adapters reload each version from its file);
# 10. the code sandbox on a GPU node: the program sees no GPU device node (/dev/nvidia*,
#     /dev/dri), cannot load CUDA, reads no secret, reaches no network, and its forgeries
#     score 0, as root and as a non-root uid (tests/integration/test_code_sandbox.py and
#     test_sandbox_nonroot.py);
# 11. LoRA on CUDA: the tiny job with `learner.lora.rank=8` (adapters alone after the base,
#     report.json's publish.bytes_per_version), and the torch engine's adapted logits
#     against the learner's on cuda:0, fp32, ranks 8 and 64 (TF32 off; the FSDP2 learner's
#     adapters are checked in section 3).
# 12. model families on CUDA: `scalerl run` on tiny random Llama 3, Qwen3, Gemma 3 and
#     Qwen3-MoE checkpoints (step 1's importance ratio 1, the MoE's routed experts
#     replayed by the learner), a Qwen3 and a Qwen3-MoE run resumed and exported into
#     their own transformers classes (tests/e2e/test_e2e_families.py, `device: auto`).
# 13. idle cores lent (`learner.lend_idle: workers`): refused in one line (exit 2) where the
#     learner computes on cuda; on the node's CPU cores (`device=cpu`) the tiny job with
#     lenders on the learner's cores, its plan line and report.json's profile (each
#     process's busy share, the machine's, the seconds lent and the longest reclaim).
#
#   scripts/gpu_check.sh [PYTHON] [SECTIONS]
#
# SECTIONS: the numbers to run, comma-separated (default: all), e.g. `2,3` to rerun two.
# PYTHON defaults to .venv-vllm/bin/python when it exists (vLLM installed), else
# .venv/bin/python, else python3. On a GPU machine, install `vllm` (and `sglang`) into that
# environment first; engines whose package is missing show up as skipped. Sections 6 and 7
# load SmolLM2-135M-Instruct (`scalerl.policy.models.smollm2_dir`, under SCALERL_CACHE).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${1:-}"
SECTIONS=",${2:-1,2,3,4,5,6,7,8,9,10,11,12,13},"
if [[ -z "$PYTHON" ]]; then
  for candidate in .venv-vllm/bin/python .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PYTHON=$candidate; break; fi
  done
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1

# section N TITLE: print the heading and succeed when section N is to run.
section() {
  [[ "$SECTIONS" == *",$1,"* ]] || return 1
  echo; echo "== $1. ${*:2} ($(date -u +%H:%M:%S))"
}
# within SECONDS COMMAND...: run it, and say so when it was stopped at its limit.
within() {
  local limit=$1
  shift
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "STOPPED at its ${limit} s limit"; fi
  return $rc
}
has_cuda() { "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
has_module() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

echo "python: $PYTHON"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
echo "CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p'), $(nproc) cores"
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

report_tiny() {  # report_tiny RUN_DIR: the run's precision, pass rates and time
  "$PYTHON" - "$1/report.json" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
print("tiny job:", report["precision"], "pass rate", report["pass_rate_step0"], "->",
      report["pass_rate_final"], "at step", report["final_step"], "in",
      round(report["wall_seconds"]), "s; groups", report["groups"])
EOF
}

if section 1 "the tiny job end to end (device auto, weights by uri)"; then
  if within 300 "$PYTHON" -m scalerl_cli.main run --config tiny --run-dir "$WORK/tiny" >"$WORK/tiny.log" 2>&1; then
    report_tiny "$WORK/tiny"
  else
    echo "tiny job FAILED:"; tail -n 30 "$WORK/tiny.log"
  fi
fi

if section 2 "the tiny job with the broadcast weight transport (backend auto)"; then
  if within 240 "$PYTHON" -m scalerl_cli.main run --config tiny --run-dir "$WORK/bcast" \
    --set learner.weights.transport=broadcast --set learner.weights.timeout_s=20 \
    --set learner.max_steps=15 --set model.warmup_steps=100 >"$WORK/bcast.log" 2>&1; then
    report_tiny "$WORK/bcast"
  else
    echo "broadcast tiny job FAILED:"; tail -n 30 "$WORK/bcast.log"
  fi
  for log in "$WORK"/bcast/logs/rollout-*.log; do
    [[ -f "$log" ]] || continue
    echo "$(basename "$log" .log): $(grep -c 'broadcast weights of policy version' "$log") versions by broadcast, $(grep -c 'pulled policy version' "$log") pulled"
  done
  grep -h -E "weight group epoch|nccl|NCCL" "$WORK"/bcast/logs/learner.log 2>/dev/null | tail -n 8
fi

if section 3 "the FSDP2 learner: 2 ranks (1 with one GPU) equal one process, over NCCL"; then
  if [[ "$GPUS" -ge 1 ]]; then
    SCALERL_FSDP_BACKEND=nccl SCALERL_FSDP_WORLD=$(( GPUS >= 2 ? 2 : 1 )) within 240 "$PYTHON" -m pytest -q \
      -p no:cacheprovider -rs tests/integration/test_fsdp_trainer.py -k "not torchrun" 2>&1 | tail -n 6
  else
    echo "no CUDA device: skipped"
  fi
fi

if section 4 "log-prob agreement and fp32 head, CPU and CUDA"; then
  within 240 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/unit/test_logprob_agreement.py \
    tests/unit/test_fp32_head.py 2>&1 | tail -n 6
fi

if section 5 "the broadcast weight group over NCCL"; then
  if has_cuda; then
    SCALERL_WEIGHT_GROUP_BACKEND=nccl TORCH_NCCL_ASYNC_ERROR_HANDLING=2 within 240 "$PYTHON" -m pytest -q \
      -p no:cacheprovider -rs tests/integration/test_weight_group.py 2>&1 | tail -n 8
  else
    echo "no CUDA device: skipped"
  fi
fi

if section 6 "the broadcast's flatness in N (gloo, one core per process)"; then
  CORES=$(nproc)
  RECEIVERS=$(for n in 1 2 4 8; do (( n + 1 <= CORES )) && echo -n "$n,"; done)
  RECEIVERS=${RECEIVERS%,}
  if [[ -n "$RECEIVERS" ]]; then
    within 300 "$PYTHON" benchmarks/weight_delivery.py --workers "$RECEIVERS" --repeats 3 \
      --out "$WORK/delivery.json" 2>&1 | tail -n 20
  else
    echo "fewer than 2 cores: skipped"
  fi
fi

if section 7 "rollout tokens per second, the torch engine on cuda:0 where there is one (SmolLM2-135M, rl shape, bfloat16)"; then
  for engine in torch vllm; do
    if [[ "$engine" == vllm ]] && ! has_module vllm; then
      echo "vllm: not installed"; continue
    fi
    device=cpu
    if [[ "$engine" == torch ]] && has_cuda; then device=cuda; fi
    within 240 "$PYTHON" benchmarks/rollout_throughput.py --scenario rl --engine "$engine" \
      --dtypes bfloat16 --device "$device" >"$WORK/bench-$engine.log" 2>&1
    grep -E "tokens/s overall" "$WORK/bench-$engine.log" || tail -n 5 "$WORK/bench-$engine.log"
  done
fi

if section 8 "the engine contract suite"; then
  within 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/contract/test_engine_contract.py \
    --junitxml="$WORK/contract.xml" >"$WORK/contract.log" 2>&1
  tail -n 3 "$WORK/contract.log"
  if [[ -f "$WORK/contract.xml" ]]; then
    "$PYTHON" - "$WORK" <<'EOF'
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
  fi
fi

if section 9 "vLLM and SGLang weight updates inside the engine over NCCL"; then
  # The adapters load each version from its safetensors file (vLLM: collective_rpc
  # reload_weights; SGLang: /update_weights_from_disk); neither joins the learner's NCCL group.
  for module in vllm sglang; do
    if has_module "$module"; then state="installed"; else state="not installed"; fi
    echo "$module ($state): NOT CHECKED, the adapter has no in-engine NCCL update route"
  done
fi

if section 10 "the code sandbox on a GPU node"; then
  ls /dev/nvidia* /dev/dri 2>/dev/null | head -n 4 | sed 's/^/host device: /'
  within 60 "$PYTHON" - <<'EOF'
from scalerl.sandbox.runner import SandboxLimits, containment, run_program

limits = SandboxLimits(wall_s=20, cpu_s=10, memory_bytes=1 << 30)
print("containment:", containment(limits))
probe = (
    "import ctypes, glob, os\n"
    "print('devices', glob.glob('/dev/nvidia*') + glob.glob('/dev/dri/*'))\n"
    "for name in ('libcuda.so.1', 'libcuda.so'):\n"
    "    try:\n"
    "        ctypes.CDLL(name).cuInit(0)\n"
    "        print('cuda', name, 'LOADED')\n"
    "    except OSError as exc:\n"
    "        print('cuda', name, 'refused:', str(exc)[:80])\n"
)
print(run_program(probe, "stdio", [""], limits).outcomes[0].stdout, end="")
EOF
  within 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/integration/test_code_sandbox.py \
    tests/integration/test_sandbox_nonroot.py 2>&1 | tail -n 5
fi

if section 11 "LoRA on CUDA: the tiny job and the engine's adapted logits"; then
  if has_cuda; then
    if within 240 "$PYTHON" -m scalerl_cli.main run --config tiny --run-dir "$WORK/lora" \
      --set learner.lora.rank=8 >"$WORK/lora.log" 2>&1; then
      report_tiny "$WORK/lora"
      "$PYTHON" -c "import json, sys; print('publish', json.load(open(sys.argv[1]))['publish'])" "$WORK/lora/report.json"
    else
      echo "LoRA tiny job FAILED:"; tail -n 30 "$WORK/lora.log"
    fi
    within 120 "$PYTHON" - <<'EOF'
import torch

from rollout_service.engines.torch.engine import TorchEngine
from scalerl.config import LoraConfig, ModelConfig
from scalerl.policy.lora import BASE_VERSION, attach_lora, base_version_tensor
from scalerl.policy.models import load_policy
from scalerl.weights.wire import LORA_BASE, head_names, snapshot_state_dict

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
for rank in (8, 64):
    learner, _ = load_policy(ModelConfig(kind="tiny"), seed=0)
    attach_lora(learner, LoraConfig(rank=rank))
    with torch.no_grad():
        for name, parameter in learner.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.05)
    learner = learner.to("cuda:0").eval()
    payload = snapshot_state_dict(learner, torch.float32, head_names(learner), LORA_BASE)
    payload[BASE_VERSION] = base_version_tensor(0)
    engine = TorchEngine(load_policy(ModelConfig(kind="tiny"), seed=5)[0], [1], 2, 32,
                         device="cuda:0", autostart=False)
    engine.stage_weights(payload, 0)
    engine.step()
    engine.decoder.assign_adapter(0, "")
    ids = [3, 7, 11, 2, 9, 14, 4]
    with torch.no_grad():
        expected = learner(input_ids=torch.tensor([ids], device="cuda:0")).logits[0].float()
    got = engine.decoder.extend(0, 0, ids, all_logits=True)
    diff = float((got - expected).abs().max())
    print(f"rank {rank}: engine vs learner logits on cuda:0, max |diff| {diff:.2e}",
          "OK" if diff <= 1e-5 else "ABOVE 1e-5")
EOF
  else
    echo "no CUDA device: skipped"
  fi
fi

if section 12 "model families on CUDA: scalerl run per family, MoE routing replay, resume and export"; then
  if has_cuda; then
    within 900 "$PYTHON" -m pytest -q -p no:cacheprovider -m "" -rs tests/e2e/test_e2e_families.py \
      2>&1 | tail -n 6
  else
    echo "no CUDA device: skipped"
  fi
fi

if section 13 "idle cores lent: refused on cuda, the tiny job with lenders on the CPU cores"; then
  if has_cuda; then
    "$PYTHON" -m scalerl_cli.main run --config tiny --set learner.lend_idle=workers \
      --run-dir "$WORK/lend-cuda" 2>&1 | tail -n 1
    echo "exit code ${PIPESTATUS[0]} (2 expected: lend_idle refused on cuda)"
  else
    echo "no CUDA device: the refusal is not checked"
  fi
  within 600 "$PYTHON" -m scalerl_cli.main run --config tiny --set device=cpu \
    --set learner.lend_idle=workers --run-dir "$WORK/lend-cpu" 2>&1 | grep -E "cores:|pass rate"
  "$PYTHON" - "$WORK/lend-cpu/report.json" <<'EOF'
import json, sys
profile = json.load(open(sys.argv[1]))["profile"]
busy = profile.get("processes", {})
print("machine busy share", busy.get("machine_busy_share"), "on", busy.get("cores"), "cores")
for name, row in sorted(busy.get("processes", {}).items()):
    print(f"  {name}: busy {row['busy_share']}")
print("lending", profile.get("lending"))
EOF
fi
