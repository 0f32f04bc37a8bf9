"""The jail of a child that model output drives (an MCP server): run as
`python -I -S _jail.py [--hide PATH]... -- COMMAND [ARG]...` by `scalerl.agents.jail`,
never imported. Standard library only, single-threaded until it execs.

It unshares a user, mount, PID and IPC namespace (no root needed; the ids map to
themselves), forks, and in the child (PID 1 of the new PID namespace, killed when the
jail's first process dies) makes every mount private, mounts a fresh /proc (so no process
outside is visible, the worker's /proc/<pid>/environ included; where the kernel refuses a
fresh one, an empty read-only tmpfs over /proc), hides each --hide path (a folder under
an empty read-only tmpfs, a file under /dev/null) and execs COMMAND. The rest of the file
system stays as it was: the server needs its interpreter and packages.

Exit status 2 with one line on stderr when the namespaces or a mount are refused (the
command never ran); else the command's own status.
"""

import ctypes
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
REFUSED = 2

_libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    """A namespace or a mount the kernel refused: the command must not run."""


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise Refused(f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _write(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def _unshare():
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _hide(path):
    if os.path.isdir(path):
        _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    elif os.path.exists(path):
        _mount("/dev/null", path, None, MS_BIND)


def _fresh_proc():
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        _mount("proc", "/proc", "proc", flags)
    except Refused:  # a container's masked /proc: hide it whole instead
        _mount("tmpfs", "/proc", "tmpfs", flags | MS_RDONLY, "size=4k")


def _child(hidden, command):
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "prctl")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _fresh_proc()
    for path in hidden:
        _hide(path)
    os.execvp(command[0], command)


def _parse(argv):
    hidden, rest = [], list(argv)
    while rest and rest[0] == "--hide" and len(rest) > 1:
        hidden.append(rest[1])
        rest = rest[2:]
    if not rest or rest[0] != "--" or len(rest) < 2:
        raise SystemExit("usage: _jail.py [--hide PATH]... -- COMMAND [ARG]...")
    return hidden, rest[1:]


def main():
    hidden, command = _parse(sys.argv[1:])
    try:
        _unshare()
    except (Refused, OSError) as exc:
        print(f"jail: namespaces refused ({exc})", file=sys.stderr)
        return REFUSED
    pid = os.fork()
    if pid == 0:
        try:
            _child(hidden, command)
        except (Refused, OSError) as exc:
            print(f"jail: {exc}", file=sys.stderr)
            os._exit(REFUSED)
    # The first process: stdin and stdout are the child's alone (its end closes them for
    # the caller); SIGTERM and SIGINT end it (the child is its namespace's init, which
    # ignores signals it has no handler for).
    os.close(0)
    os.close(1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
