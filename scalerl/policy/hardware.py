"""Device and precision chosen by the hardware: `device: auto`, `rollout.dtype: auto`,
`learner.autocast_bf16: auto` (torch is imported only when a function needs it).

Why precision depends on the machine: bf16 halves memory traffic and runs at twice the
fp32 rate where the hardware has bf16 arithmetic (CUDA GPUs from Ampere on; x86 CPUs with
AVX512-BF16 or AMX), but elsewhere every bf16 matrix multiply is emulated. Measured with
torch 2.13 on one thread, [64 x 576] x [576 x 1536]: an AVX2-only CPU ran fp32 at 59
GFLOP/s and bf16 at 1.1 (50x slower); an AMD EPYC with AVX512-BF16 ran fp32 at 91 and
bf16 at 195.

The CPU test: torch's kernel dispatch level (`torch.backends.cpu.get_cpu_capability()`)
must be AVX512 or above AND the CPU must report AVX512-BF16 or AMX tiles, AND oneDNN (which
runs torch's bf16 matmuls) must not be capped below its bf16 ISA by ONEDNN_MAX_CPU_ISA.
The capability string alone is not enough: Skylake-X and Ice Lake report AVX512 without
bf16 arithmetic, and ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA can lower what torch uses
below what the CPU has (both measured: with ONEDNN_MAX_CPU_ISA=AVX2 a bf16 matmul fell
from 195 to 2.5 GFLOP/s on the EPYC above).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from scalerl.config import RunConfig

# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) at or above its first bf16-arithmetic ISA.
_ONEDNN_BF16_ISAS = frozenset(
    {
        "ALL",
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX512_CORE_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512",
        "AVX10_1_512_AMX",
        "AVX10_1_512_AMX_FP16",
        "AVX10_2_512",
        "AVX10_2_512_AMX_2",
    }
)
_AVX512_CAPABILITIES = frozenset({"AVX512", "AVX512_BF16", "AMX"})


@dataclass(frozen=True)
class Precision:
    """What a process runs on: device ("cpu", "cuda:0"), the engine's dtype ("float32" or
    "bfloat16"), whether the learner's body runs under bf16 autocast, and why."""

    device: str
    rollout_dtype: str
    autocast_bf16: bool
    reason: str

    @property
    def learner_dtype(self) -> str:
        """The learner body's compute dtype as a label."""
        return "bfloat16" if self.autocast_bf16 else "float32"


def cpu_native_bf16(
    capability: str, avx512_bf16: bool, amx: bool, onednn_max_isa: str | None = None
) -> bool:
    """True when this CPU computes bf16 matmuls natively (module docstring).

    capability: `torch.backends.cpu.get_cpu_capability()` ("AVX2", "AVX512", "DEFAULT",
    "ZVECTOR", "VSX", "SVE256", ...); avx512_bf16, amx: the CPU's flags (torch.cpu's
    `_is_avx512_bf16_supported`, `_is_amx_tile_supported`); onednn_max_isa: the
    ONEDNN_MAX_CPU_ISA environment value, None or "" when unset.
    """
    if capability.upper() not in _AVX512_CAPABILITIES or not (avx512_bf16 or amx):
        return False
    return not onednn_max_isa or onednn_max_isa.upper() in _ONEDNN_BF16_ISAS


def resolve_device(setting: str) -> str:
    """A device setting ("cpu", "cuda", "cuda:N" or "auto") -> a torch device string.

    "cuda:N" is taken as given; "auto" and "cuda" pick `cuda:N` with N the process's local
    rank (LOCAL_RANK, set by torchrun; 0 otherwise) among the devices CUDA_VISIBLE_DEVICES
    leaves visible. Raises ValueError when CUDA is asked for and no CUDA device is
    present, or when the index (or local rank) has no device.
    """
    import torch

    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"device: {setting!r} asked for, but torch sees no CUDA device")
    count = torch.cuda.device_count()
    if setting.startswith("cuda:"):
        index = int(setting.split(":", 1)[1])
        if index >= count:
            raise ValueError(f"device: {setting!r}, but only {count} CUDA devices are visible")
        return setting
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= rank < count:
        raise ValueError(f"LOCAL_RANK {rank}: only {count} CUDA devices are visible")
    return f"cuda:{rank}"


def gpu_uuid(device: str) -> str:
    """UUID of the CUDA device that `device` ("cuda", "cuda:N") names, "" for any other
    device. Processes on one GPU report the same UUID, whatever index they see it at."""
    if not device.startswith("cuda"):
        return ""
    import torch

    index = torch.device(device).index
    return str(torch.cuda.get_device_properties(index or 0).uuid)


def native_bf16(device: str) -> tuple[bool, str]:
    """(whether `device` computes bf16 natively, a one-line reason)."""
    import torch

    if device.startswith("cuda"):
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name(torch.device(device))
        return ok, f"{name} {'has' if ok else 'lacks'} native bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    avx512_bf16 = bool(torch.cpu._is_avx512_bf16_supported())
    amx = bool(torch.cpu._is_amx_tile_supported())
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    ok = cpu_native_bf16(capability, avx512_bf16, amx, isa)
    flags = [name for name, on in (("avx512_bf16", avx512_bf16), ("amx", amx)) if on]
    detail = f"CPU capability {capability}, flags [{', '.join(flags) or 'no bf16'}]"
    if isa:
        detail += f", ONEDNN_MAX_CPU_ISA={isa}"
    return ok, f"{detail}: {'native' if ok else 'no native'} bf16"


def resolve_dtype(setting: str, bf16_ok: bool) -> str:
    """ "auto" -> "bfloat16" where bf16 is native, else "float32"; explicit values win."""
    if setting != "auto":
        return setting
    return "bfloat16" if bf16_ok else "float32"


def resolve_autocast(setting: bool | str, bf16_ok: bool) -> bool:
    """ "auto" -> bf16 autocast where bf16 is native; True/False win."""
    return bf16_ok if setting == "auto" else bool(setting)


def resolve_precision(config) -> Precision:
    """Device and precision for this process from a `RunConfig` (on this machine: each
    process resolves `auto` for the hardware it runs on). Raises ValueError as
    `resolve_device` does."""
    device = resolve_device(config.device)
    bf16_ok, reason = native_bf16(device)
    return Precision(
        device=device,
        rollout_dtype=resolve_dtype(config.rollout.dtype, bf16_ok),
        autocast_bf16=resolve_autocast(config.learner.autocast_bf16, bf16_ok),
        reason=reason,
    )


@dataclass(frozen=True)
class ResolvedConfig:
    """A run config resolved for this machine, with the `Precision` it came from: its
    device, rollout.dtype and learner.autocast_bf16 are concrete, never "auto". The
    engine factory and the learner take this, not a `RunConfig`, so none of them decides
    "auto" on its own: an unresolved config is a type error, not a silent fallback."""

    config: RunConfig
    precision: Precision

    @property
    def device(self) -> str:
        """ "cpu", "cuda" or "cuda:N"."""
        return self.precision.device

    @property
    def rollout_dtype(self) -> str:
        """The engine's and the published weights' dtype: "float32" or "bfloat16"."""
        return self.precision.rollout_dtype


def resolved_config(config: RunConfig) -> ResolvedConfig:
    """`config` resolved for this machine: a copy with device, rollout.dtype and
    learner.autocast_bf16 set from `resolve_precision` (what the launcher writes to the
    run's config.yaml), with that Precision. Raises ValueError when the device asked for
    is not there."""
    precision = resolve_precision(config)
    resolved = config.model_copy(deep=True)
    resolved.device = precision.device
    resolved.rollout.dtype = precision.rollout_dtype  # type: ignore[assignment]
    resolved.learner.autocast_bf16 = precision.autocast_bf16
    return ResolvedConfig(resolved, precision)


# Dense bf16 peak of accelerators, FLOP/s (vendors' datasheets, without sparsity), by a
# substring of torch.cuda.get_device_name(); for the learner's MFU.
PEAK_BF16_FLOPS = {
    "B200": 2.25e15,
    "H200": 9.89e14,
    "H100": 9.89e14,
    "A100": 3.12e14,
    "L40S": 3.62e14,
    "A10G": 1.25e14,
}


def peak_flops(device: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of `device` when it is a CUDA device in
    PEAK_BF16_FLOPS, else None (CPUs and unknown GPUs: no MFU is reported)."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
