"""Run a Python snippet as a non-root uid, for the sandbox's containment tests.

Not root: as ourselves. Root: as uid/gid 10001, in a private mount namespace where a
folder above the interpreter that others cannot enter (a Python under /root) is covered by
an empty tmpfs with the interpreter's prefix bound back, so the unprivileged process can
start Python at all. Nothing else of the host changes.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import tempfile

NONROOT_UID = 10001
_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_MOVE = 0x00020000, 4096, 16384, 1 << 18, 8192


def run_as_nonroot(script: str, env: dict[str, str], timeout_s: float = 120) -> str:
    """stdout of `python -c script` run as a non-root uid in the project root. Raises
    CalledProcessError (with its stderr) when it fails."""
    preexec = None if os.geteuid() != 0 else _become_nonroot
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        preexec_fn=preexec,  # noqa: PLW1509 - the child sets up its own namespace only
        check=False,
    )
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, "python -c", done.stdout, done.stderr)
    return done.stdout


def _mount(
    libc: ctypes.CDLL,
    source: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    enc = lambda s: s.encode() if s else None  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def _closed_parent(prefix: str) -> str | None:
    parts = prefix.strip("/").split("/")
    for depth in range(1, len(parts)):
        folder = "/" + "/".join(parts[:depth])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def _become_nonroot() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    prefix = os.path.realpath(sys.base_prefix)
    closed = _closed_parent(prefix)
    if closed is not None:
        stage = tempfile.mkdtemp()
        _mount(libc, prefix, stage, None, _MS_BIND | _MS_REC)
        _mount(libc, "tmpfs", closed, "tmpfs", 0, "size=64k,mode=0755")
        os.makedirs(prefix)
        _mount(libc, stage, prefix, None, _MS_MOVE)
    os.setgroups([])
    os.setgid(NONROOT_UID)
    os.setuid(NONROOT_UID)
