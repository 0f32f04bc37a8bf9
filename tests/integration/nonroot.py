"""Run a Python snippet as a non-root uid, for the sandbox's containment tests.

Not root: as ourselves. Root: as uid/gid 10001, in a private mount namespace where a
folder that others cannot enter above the interpreter, the project or a PYTHONPATH entry
(a Python under /root) is covered by an empty tmpfs with those paths bound back, so the
unprivileged process can start Python at all. Nothing else of the host changes.
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


def _closed_parent(path: str) -> str | None:
    """The outermost folder above `path` that others cannot enter, or None."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        folder = "/" + "/".join(parts[:depth])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def _needed() -> list[str]:
    """The interpreter's prefix, the project and PYTHONPATH: what the child must reach."""
    paths = [os.path.realpath(sys.base_prefix), os.getcwd()]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [os.path.realpath(p) for p in paths if os.path.exists(p)]


def _become_nonroot() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    by_parent: dict[str, list[str]] = {}
    for path in _needed():
        closed = _closed_parent(path)
        if closed is not None:
            by_parent.setdefault(closed, []).append(path)
    for closed, paths in by_parent.items():
        # Stage each path, cover the closed folder with an open tmpfs, move them back.
        staged = []
        for path in paths:
            stage = tempfile.mkdtemp()
            _mount(libc, path, stage, None, _MS_BIND | _MS_REC)
            staged.append((stage, path))
        _mount(libc, "tmpfs", closed, "tmpfs", 0, "size=64k,mode=0755")
        for stage, path in staged:
            os.makedirs(path, exist_ok=True)
            _mount(libc, stage, path, None, _MS_MOVE)
    os.setgroups([])
    os.setgid(NONROOT_UID)
    os.setuid(NONROOT_UID)
