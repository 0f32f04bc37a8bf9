"""What every process's console script does first: set up logging, load the config with a
one-line error, resolve the device and precision, and turn SIGTERM / SIGINT into a stop
event (torch-free until the device is resolved)."""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING

from scalerl.config import RunConfig, load_config

if TYPE_CHECKING:  # the module stays torch-free until a device is resolved
    from scalerl.policy.hardware import ResolvedConfig


def config_error(exc: Exception) -> str:
    """One line naming the field and what is allowed (pydantic's first error)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        if not first["loc"] or first["type"] == "value_error":  # our validators name fields
            return str(first["msg"]).removeprefix("Value error, ")
        field = ".".join(str(p) for p in first["loc"])
        return f"{field}: {first['msg']} (got {first.get('input')!r})"
    return str(exc).splitlines()[0]


def load_config_or_none(
    prog: str,
    name_or_path: str,
    overrides: list[str],
    recipe: str | None = None,
    leave_out: list[str] | tuple[str, ...] = (),
) -> RunConfig | None:
    """The validated config, or None after printing `prog: <one line>` to stderr (the
    caller then exits with code 2)."""
    try:
        return load_config(name_or_path, overrides, recipe, leave_out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"{prog}: {config_error(exc)}", file=sys.stderr)
        return None


def resolve_hardware_or_none(prog: str, config: RunConfig) -> ResolvedConfig | None:
    """The config resolved for this machine (`scalerl.policy.hardware.ResolvedConfig`:
    device and dtypes concrete), logged; or None after printing `prog: <one line>` when
    the device asked for is not there (the caller exits with code 2). Imports torch."""
    import logging

    from scalerl.policy.hardware import resolved_config

    try:
        resolved = resolved_config(config)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    precision = resolved.precision
    logging.getLogger(prog).info(
        "device %s, rollout dtype %s, learner body %s (%s)",
        precision.device,
        precision.rollout_dtype,
        precision.learner_dtype,
        precision.reason,
    )
    return resolved


def start_service(
    prog: str,
    service: str,
    config_path: str,
    overrides: list[str],
    worker_id: str = "",
    host: str = "127.0.0.1",
) -> ResolvedConfig | None:
    """The start of `scalerl-rollout` and `scalerl-learner`: the one log format
    (`scalerl.obs.logging`), the validated config, its device and dtypes for this machine,
    and the process's token and TLS files (`scalerl.rpc.security.configure`, for every
    server and channel it opens); a server on a non-loopback `host` without a token is
    refused (`scalerl.rpc.security.check_bind`).

    Returns the `ResolvedConfig`, or None after printing `prog: <one line>` (the caller
    exits with code 2). Imports torch (to resolve the device).
    """
    from scalerl.obs.logging import set_run_id, setup_logging
    from scalerl.rpc.security import check_bind, configure, from_config

    setup_logging(service, worker_id=worker_id)
    config = load_config_or_none(prog, config_path, overrides)
    resolved = config and resolve_hardware_or_none(prog, config)
    if not resolved:
        return None
    _register_run_folder(config_path)
    set_run_id(resolved.config.run_id)
    try:
        security = from_config(resolved.config.security)
        check_bind(host, security, resolved.config.security.allow_insecure)
        configure(security)
    except ValueError as exc:  # a file that cannot be read, half a TLS pair, open bind
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    return resolved


def _register_run_folder(config_path: str) -> None:
    """The folder of a config file (not a built-in one) is private: under `scalerl run`
    it is the run folder, which holds the run's token and its Redis password."""
    from scalerl import private_paths
    from scalerl.config import CONFIG_DIR, resolve_config_path

    folder = resolve_config_path(config_path).resolve().parent
    if folder != CONFIG_DIR.resolve():
        private_paths.register(folder)


def stop_on_signals(deadline_s: float | None = None) -> threading.Event:
    """An event set by SIGTERM or SIGINT, so a process can finish its current step.

    deadline_s: the process ends (exit 0, after one warning) that many seconds after the
    first signal, whatever it still waits on: a drain towards a Redis that is gone would
    otherwise retry for minutes, past any orchestrator's grace period."""
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if deadline_s is not None and not stop.is_set():
            threading.Thread(
                target=_exit_after, args=(deadline_s,), name="stop-deadline", daemon=True
            ).start()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def _exit_after(deadline_s: float) -> None:
    """End the process `deadline_s` seconds from now (its stop overran its deadline)."""
    import logging
    import os
    import time

    time.sleep(deadline_s)
    logging.getLogger("scalerl.entrypoint").warning(
        "still stopping %.0f s after the signal: exiting now", deadline_s
    )
    logging.shutdown()
    os._exit(0)
