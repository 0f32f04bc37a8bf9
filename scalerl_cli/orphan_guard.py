"""`python -m scalerl_cli.orphan_guard PARENT_PID COMMAND [ARG...]`: become COMMAND (exec,
same pid) tied to process PARENT_PID: it gets SIGKILL when that process dies (Linux's
PR_SET_PDEATHSIG, which an exec keeps), and it never starts when that process is already
gone. So a launcher that dies, however (SIGKILL, `timeout -s KILL`, an OOM kill), leaves
no worker, learner or Redis behind.

Why SIGKILL and not SIGTERM: a launcher that stops normally (its own SIGTERM, SIGINT or
SIGHUP) stops its children in order before it exits, so the tie only fires when nobody is
left to coordinate a drain. A SIGTERM then made every child drain towards services that
were going too: a worker whose Redis had gone retried its leave for minutes. Every
process is safe to kill at any point (the replay stream, the checkpoint and Redis's
fsynced append-only file are crash-safe).

Why a process of its own and not a `preexec_fn`: the launcher starts children again while
its gRPC threads run, and Python code between fork and exec in a threaded process can
abort the child (gRPC's fork handlers run in it: one restart in about seventy died by
SIGABRT before it started). Without a `preexec_fn` the child is spawned with no Python
code between fork and exec; this module then runs single-threaded before the exec.

The guard also pins the command to the CPUs `SCALERL_CPUS` names (`scalerl.cores`, the
launcher's core plan) and puts a lender worker at SCHED_IDLE (`SCALERL_SCHED_IDLE`,
`scalerl.lending`): the affinity and the policy, like the tie, survive the exec.

Elsewhere than Linux there is no PR_SET_PDEATHSIG: the command runs untied (the launcher
still stops its children on every exit but SIGKILL).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from scalerl.cores import idle_priority_from_env, pin_from_env

_PR_SET_PDEATHSIG = 1
# Exit code when the parent died before the tie was made (the command never ran).
PARENT_GONE = 3


def tie_to_parent() -> None:
    """Ask the kernel for SIGKILL when this process's parent dies (Linux; else nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl here
        pass


def main(argv: list[str]) -> int:
    """Exec `argv[1:]` tied to pid `argv[0]`; returns only on failure (2: bad usage,
    PARENT_GONE: that process already died, 127: the command cannot be run)."""
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m scalerl_cli.orphan_guard PARENT_PID COMMAND...", file=sys.stderr)
        return 2
    tie_to_parent()
    if os.getppid() != int(argv[0]):  # the parent died before the tie: nobody to die with
        print(f"orphan_guard: parent {argv[0]} is gone; not starting {argv[1]}", file=sys.stderr)
        return PARENT_GONE
    try:
        pin_from_env()
        idle_priority_from_env()
    except (ValueError, OSError) as exc:  # a CPU outside this machine's set
        print(f"orphan_guard: cannot pin {argv[1]}: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as exc:
        print(f"orphan_guard: cannot run {argv[1]}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
