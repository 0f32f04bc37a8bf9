"""One log format for every process: each line names the service, the run, the policy
version the process is at and the request it serves.

    2026-12-01T12:00:00 INFO service=rollout worker=w0 run=run v=3 req=g17-2 scalerl.x: ...

`SCALERL_LOG_FORMAT=json` (or `setup_logging(json_lines=True)`) writes one JSON object per
line instead, with the same fields, for log collectors on Kubernetes.

The policy version is process state (`set_policy_version`, called where the process
changes version: the learner after a step, an engine after a swap); the request id is per
thread of work (`request_context`), so concurrent handlers do not mix theirs up.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_process = {"service": "-", "run_id": "-", "worker_id": "", "policy_version": "-"}


def set_policy_version(version: int) -> None:
    """Record the policy version this process is at; later lines carry it as `v=`."""
    _process["policy_version"] = str(version)


def set_run_id(run_id: str) -> None:
    """Record the run this process serves (known after its config is loaded)."""
    _process["run_id"] = run_id


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged inside the block (in this thread or task) carry `req=request_id`."""
    token = _request_id.set(request_id or "-")
    try:
        yield
    finally:
        _request_id.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.service = _process["service"]
        record.run_id = _process["run_id"]
        record.worker = f" worker={_process['worker_id']}" if _process["worker_id"] else ""
        record.policy_version = _process["policy_version"]
        record.request_id = _request_id.get()
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
            "level": record.levelname,
            "service": getattr(record, "service", None),  # set by the filter
            "run_id": getattr(record, "run_id", None),  # set by the filter
            "worker_id": _process["worker_id"] or None,
            "policy_version": getattr(record, "policy_version", None),  # set by the filter
            "request_id": getattr(record, "request_id", None),  # set by the filter
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


TEXT_FORMAT = (
    "%(asctime)s %(levelname)s service=%(service)s%(worker)s run=%(run_id)s "
    "v=%(policy_version)s req=%(request_id)s %(name)s: %(message)s"
)


def setup_logging(
    service: str,
    *,
    run_id: str = "-",
    worker_id: str = "",
    json_lines: bool | None = None,
    level: int = logging.INFO,
) -> None:
    """Configure the root logger of this process (replaces earlier handlers).

    service: "rollout", "learner", "curve" or "launcher"; json_lines: None reads
    `SCALERL_LOG_FORMAT` ("text", the default, or "json"). Raises ValueError for another
    SCALERL_LOG_FORMAT value.
    """
    if json_lines is None:
        choice = os.environ.get("SCALERL_LOG_FORMAT", "text")
        if choice not in ("text", "json"):
            raise ValueError(f"SCALERL_LOG_FORMAT must be 'text' or 'json', got {choice!r}")
        json_lines = choice == "json"
    _process.update(service=service, run_id=run_id, worker_id=worker_id)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if json_lines:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
