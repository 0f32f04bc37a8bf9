"""Start an SGLang server for the SGLang engine and wait until it serves (needs the
`sglang` package and a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

import requests

from rollout_service.engines.api import EngineError

API_KEY_ENV = "SCALERL_SGLANG_API_KEY"


# Starts SGLang with its API key taken from the environment (then removed from it, so the
# server's own processes do not inherit it), appended to its arguments in memory: the key
# never appears in a command line, which every user of the machine can read.
_LAUNCH_WITH_KEY = (
    "import os, runpy, sys; "
    f"key = os.environ.pop({API_KEY_ENV!r}); "
    "sys.argv = ['sglang.launch_server', *sys.argv[1:], '--api-key', key]; "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)


def launch_sglang_server(
    model_path: str,
    port: int,
    *,
    dtype: str,
    api_key: str,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen:
    """Start `python -m sglang.launch_server` on 127.0.0.1:`port` for `model_path` (an HF
    directory) with `dtype` ("bfloat16", "float32", ...), an fp32 LM head, token-id
    input/output (`--skip-tokenizer-init`) and `api_key` (every request must carry it:
    another user of the machine cannot drive the engine or load weights into it);
    `extra_args` are appended. Returns the process (its own session, so the caller can
    end its whole group); wait for it with `wait_until_ready`. Raises ValueError for an
    empty api_key."""
    if not api_key:
        raise ValueError("api_key must not be empty")
    command = [
        sys.executable,
        "-c",
        _LAUNCH_WITH_KEY,
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
    env = {**os.environ, API_KEY_ENV: api_key}
    return subprocess.Popen(command, start_new_session=True, env=env)


def wait_until_ready(
    base_url: str,
    timeout_s: float = 600.0,
    process: subprocess.Popen | None = None,
    api_key: str = "",
) -> None:
    """Poll `GET /health` every second (with `api_key`) until it answers 200. Raises
    EngineError after `timeout_s` seconds or when `process` exits first."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise EngineError(f"the SGLang server exited with code {process.returncode}")
        try:
            health = requests.get(base_url.rstrip("/") + "/health", headers=headers, timeout=5.0)
            if health.status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise EngineError(f"the SGLang server at {base_url} was not ready after {timeout_s}s")
