"""Start an SGLang server for the SGLang engine and wait until it serves (needs the
`sglang` package and a GPU)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

import requests

from rollout_service.engines.api import EngineError


def launch_sglang_server(
    model_path: str, port: int, *, dtype: str, extra_args: Sequence[str] = ()
) -> subprocess.Popen:
    """Start `python -m sglang.launch_server` on 127.0.0.1:`port` for `model_path` (an HF
    directory) with `dtype` ("bfloat16", "float32", ...), an fp32 LM head and token-id
    input/output (`--skip-tokenizer-init`); `extra_args` are appended. Returns the process
    (its own session, so the caller can end its whole group); wait for it with
    `wait_until_ready`."""
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enable-fp32-lm-head",
        "--skip-tokenizer-init",
        *extra_args,
    ]
    return subprocess.Popen(command, start_new_session=True)


def wait_until_ready(
    base_url: str, timeout_s: float = 600.0, process: subprocess.Popen | None = None
) -> None:
    """Poll `GET /health` every second until it answers 200. Raises EngineError after
    `timeout_s` seconds or when `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineError(f"the SGLang server exited with code {process.returncode}")
        try:
            if requests.get(base_url.rstrip("/") + "/health", timeout=5.0).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise EngineError(f"the SGLang server at {base_url} was not ready after {timeout_s}s")
