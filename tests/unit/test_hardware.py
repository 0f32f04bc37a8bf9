"""Device and precision by hardware (scalerl.policy.hardware): capability strings with and
without native bf16, explicit settings winning, and the resolved values the processes and
the run folder see."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from scalerl.config import load_config
from scalerl.policy.hardware import (
    cpu_native_bf16,
    gpu_uuid,
    native_bf16,
    resolve_autocast,
    resolve_device,
    resolve_dtype,
    resolved_config,
)


@pytest.mark.parametrize(
    ("capability", "avx512_bf16", "amx", "isa", "native"),
    [
        ("AVX2", False, False, None, False),  # most laptops: bf16 emulated, ~50x slower
        ("AVX512", True, False, None, True),  # Zen 4 / Cooper Lake: AVX512-BF16
        ("AVX512", False, True, None, True),  # Sapphire Rapids: AMX tiles
        ("AVX512", False, False, None, False),  # Skylake-X, Ice Lake: AVX512 without bf16
        ("AVX2", True, True, None, False),  # ATEN_CPU_CAPABILITY=avx2 caps the kernels
        ("AVX512", True, False, "AVX2", False),  # oneDNN capped below its bf16 ISA
        ("AVX512", True, False, "avx512_core_bf16", True),
        ("AVX512", True, False, "", True),
        ("DEFAULT", True, True, None, False),
        ("SVE256", False, False, None, False),
    ],
)
def test_cpu_native_bf16_from_capability_and_flags(capability, avx512_bf16, amx, isa, native):
    assert cpu_native_bf16(capability, avx512_bf16, amx, isa) is native


def test_auto_follows_the_hardware_and_explicit_values_win():
    assert resolve_dtype("auto", True) == "bfloat16"
    assert resolve_dtype("auto", False) == "float32"
    assert resolve_dtype("float32", True) == "float32"
    assert resolve_dtype("bfloat16", False) == "bfloat16"
    assert resolve_autocast("auto", True) is True
    assert resolve_autocast("auto", False) is False
    assert resolve_autocast(False, True) is False
    assert resolve_autocast(True, False) is True


def test_resolved_config_on_this_machine():
    native, reason = native_bf16("cpu")
    assert "bf16" in reason
    resolved = resolved_config(load_config("default"))
    config, precision = resolved.config, resolved.precision
    assert (resolved.device, resolved.rollout_dtype) == (config.device, config.rollout.dtype)
    expected = "bfloat16" if native else "float32"
    assert config.rollout.dtype == precision.rollout_dtype == expected
    assert config.learner.autocast_bf16 is precision.autocast_bf16 is native
    if not torch.cuda.is_available():
        assert config.device == precision.device == "cpu"
    explicit = resolved_config(
        load_config(
            "default", ["rollout.dtype=bfloat16", "learner.autocast_bf16=false", "device=cpu"]
        )
    ).config
    assert (explicit.rollout.dtype, explicit.learner.autocast_bf16) == ("bfloat16", False)
    assert explicit.device == "cpu"


def test_capped_cpu_resolves_to_fp32_in_a_fresh_process():
    """ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 make any x86 machine compute
    like an AVX2-only one (a bf16 matmul then runs ~40x slower than fp32): auto must pick
    fp32 there."""
    code = (
        "import json; from scalerl.policy.hardware import resolved_config; "
        "from scalerl.config import load_config; "
        "p = resolved_config(load_config('default')).precision; "
        "print(json.dumps([p.rollout_dtype, p.autocast_bf16, p.reason]))"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    dtype, autocast, reason = json.loads(out.stdout.splitlines()[-1])
    assert (dtype, autocast) == ("float32", False)
    assert "no native bf16" in reason


def test_device_resolution_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device: 'cuda' asked for, but torch sees no CUDA"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="cuda:1"):
        resolve_device("cuda:1")


def test_device_resolution_picks_the_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == "cuda:1"
    assert resolve_device("cuda:0") == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="LOCAL_RANK 2: only 2 CUDA devices"):
        resolve_device("cuda")


@pytest.mark.parametrize(
    ("override", "field"),
    [("rollout.dtype=float16", "rollout.dtype"), ("device=gpu", "device")],
)
def test_bad_precision_settings_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        load_config("default", [override])


def test_gpu_uuid_is_empty_off_cuda():
    assert gpu_uuid("cpu") == ""
