"""The sandbox's own side: run as `python -I -S _sandbox_child.py RESULT_FD` by
`scalerl.verifiers.sandbox`, never imported. Standard library only.

stdin: one JSON job {"nonce", "limits", "folder", "code", "kind", "cases"}; results go to
RESULT_FD as JSON lines carrying the nonce (the program's own stdout and stderr are
captured, so printing cannot forge a result). Three processes:

  launcher (root)  reads the job, unshares mount, PID and network namespaces, forks A;
  A (root, PID 1)  mounts a fresh /proc, a size-limited tmpfs on /tmp (the sandbox folder),
                   read-only empty tmpfs on the other world-writable folders, keeps the
                   interpreter readable, forks B, reaps until B ends; when A ends, the kernel
                   kills everything left in its PID namespace (a fork bomb's children too);
  B (unprivileged) sets the resource limits, drops to the sandbox uid/gid (so RLIMIT_NPROC
                   applies: it does not to root), then runs the program and its tests.

Where namespaces are not allowed (not root, or a container without CAP_SYS_ADMIN) the same
runs without them and the start event says why; the caller logs it.
"""

import ctypes
import io
import json
import os
import resource
import signal
import stat
import sys
import traceback

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
# Modules a program may import when the interpreter's files are not readable by the sandbox
# uid and no mount namespace can expose them: loaded before the privileges are dropped.
PRELOAD = (
    "array bisect cmath collections copy dataclasses datetime decimal fractions functools "
    "heapq itertools math operator random re statistics string time typing"
).split()

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _check(result):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)))


def _exit_code(status):
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _unshare(job, report):
    if not job["limits"]["namespaces"]:
        report["namespaces"] = "turned off (SandboxLimits.namespaces)"
        return False
    if os.geteuid() != 0:
        report["namespaces"] = "not root: no mount, PID or network namespace"
        return False
    try:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET))
    except OSError as exc:
        report["namespaces"] = f"unshare refused ({exc.strerror}): no namespaces"
        return False
    return True


def _traversable(path, uid, gid):
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _hidden_parent(prefix, uid, gid):
    """The outermost folder above `prefix` the sandbox uid cannot enter, or None."""
    parts = prefix.strip("/").split("/")
    for depth in range(len(parts)):
        folder = "/" + "/".join(parts[:depth])
        if not _traversable(folder, uid, gid):
            return folder
    return None


def _expose_prefix(report, uid, gid):
    """Keep the interpreter's prefix readable when a folder above it is closed to the
    sandbox uid (a Python under /root): that folder is covered by an empty tmpfs, and the
    prefix alone is bind-mounted back, read-only."""
    prefix = os.path.realpath(sys.base_prefix)
    hidden = _hidden_parent(prefix, uid, gid)
    if hidden is None:
        return
    stage = "/tmp/.prefix"
    os.mkdir(stage)
    _mount(prefix, stage, None, MS_BIND | MS_REC)
    _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    os.makedirs(prefix)
    _mount(stage, prefix, None, MS_MOVE)
    _mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.rmdir(stage)
    report["interpreter"] = f"exposed under {hidden}"


def _mount_namespace(job, report):
    """In A: the sandbox's own view of the file system. Returns the sandbox folder."""
    limits = job["limits"]
    uid, gid = limits["uid"], limits["gid"]
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        options = f"size={limits['folder_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={gid}"
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
    except OSError as exc:
        report["mounts"] = f"mount refused ({exc.strerror}): the folder is on the host"
        return job["folder"]
    problems = []
    for name, step in (
        ("/proc", lambda: _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)),
        ("interpreter", lambda: _expose_prefix(report, uid, gid)),
    ):
        try:
            step()
        except OSError as exc:
            problems.append(f"{name}: {exc.strerror}")
    for path in ("/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(path):
            try:
                flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
                _mount("tmpfs", path, "tmpfs", flags, "size=4k,mode=0555")
            except OSError as exc:
                problems.append(f"{path}: {exc.strerror}")
    report["mounts"] = "; ".join(problems)
    return "/tmp"


def _limit(job):
    limits = job["limits"]
    cpu = limits["cpu_s"]
    for which, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_NPROC, limits["max_processes"]),
    ):
        resource.setrlimit(which, (value, value))
    # SIGXCPU at the soft limit, SIGKILL a second later should it be caught.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _drop_privileges(job):
    if os.geteuid() != 0:
        return
    limits = job["limits"]
    os.setgroups([])
    os.setgid(limits["gid"])
    os.setuid(limits["uid"])
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise RuntimeError("privileges could still be regained after setuid")


class _Channel:
    """Result lines on the private fd, each with the job's nonce."""

    def __init__(self, fd, nonce):
        self.fd, self.nonce, self.write, self.dumps = fd, nonce, os.write, json.dumps

    def emit(self, **event):
        event["nonce"] = self.nonce
        data = (self.dumps(event) + "\n").encode()
        while data:
            data = data[self.write(self.fd, data) :]


def _run(compiled, namespace, stdin_text, output_bytes):
    """exec the program with its own stdin/stdout/stderr: (stdout text, error or "")."""
    saved = sys.stdin, sys.stdout, sys.stderr
    out = io.BytesIO()
    stdout = io.TextIOWrapper(out, encoding="utf-8", errors="replace", write_through=True)
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin_text.encode()), encoding="utf-8")
    sys.stdout, sys.stderr = stdout, io.StringIO()
    error = ""
    try:
        exec(compiled, namespace)  # noqa: S102 - running it is the point, inside the sandbox
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - the program's failure is a failed test
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    try:
        stdout.flush()
    except BaseException:  # noqa: BLE001 - the program may have closed it
        pass
    # Read before the wrapper goes: collecting it closes the buffer.
    text = out.getvalue()[:output_bytes].decode("utf-8", errors="replace")
    return text, error


def _harness(job, channel):
    output_bytes = job["limits"]["output_bytes"]
    try:
        compiled = compile(job["code"], "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        channel.emit(event="syntax_error", error=f"{type(exc).__name__}: {exc}"[:500])
        return
    if job["kind"] == "stdio":
        for index, stdin_text in enumerate(job["cases"]):
            stdout, error = _run(compiled, {"__name__": "__main__"}, stdin_text, output_bytes)
            channel.emit(event="case", index=index, ok=None, stdout=stdout, error=error)
        return
    namespace = {"__name__": "solution"}
    _, program_error = _run(compiled, namespace, "", output_bytes)
    for index, test in enumerate(job["cases"]):
        if program_error:
            channel.emit(event="case", index=index, ok=False, error=f"program: {program_error}")
            continue
        try:
            test_code = compile(test, f"test_{index}.py", "exec")
            _, error = _run(test_code, namespace, "", output_bytes)
        except BaseException as exc:  # noqa: BLE001 - a test that does not compile fails
            error = f"{type(exc).__name__}: {exc}"[:500]
        channel.emit(event="case", index=index, ok=not error, error=error)


def _preload_if_hidden(job, report):
    """Without a mount namespace, a program as the sandbox uid cannot read an interpreter
    under a closed folder: load the common modules while still allowed to."""
    limits = job["limits"]
    if os.geteuid() != 0 or "interpreter" in report:
        return
    prefix = os.path.realpath(sys.base_prefix)
    if _hidden_parent(prefix, limits["uid"], limits["gid"]) is None:
        return
    for name in PRELOAD:
        __import__(name)
    report["interpreter"] = "not readable by the sandbox uid: only preloaded modules import"


def _become_b(job, report, result_fd, folder):
    channel = _Channel(result_fd, job["nonce"])
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(folder)
        os.environ.clear()
        os.environ.update(PATH="/usr/bin:/bin", LANG="C.UTF-8", HOME=folder, TMPDIR=folder)
        _preload_if_hidden(job, report)
        _limit(job)
        _drop_privileges(job)
        report["uid"], report["folder"] = os.getuid(), folder
        channel.emit(event="start", containment=report)
        _harness(job, channel)
        channel.emit(event="done")
    except BaseException:  # noqa: BLE001 - report the sandbox's own failure, then end
        try:
            channel.emit(event="error", error=traceback.format_exc()[-2000:])
        except BaseException:  # noqa: BLE001
            pass
        os._exit(1)
    os._exit(0)


def _become_a(job, report, result_fd, isolated):
    # A dies with the launcher, and ends the sandbox itself past the wall time should the
    # caller be gone; killing A's group (and, when isolated, A as PID 1) ends every process.
    _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
    signal.alarm(int(job["limits"]["wall_s"]) + 2)
    folder = _mount_namespace(job, report) if isolated else job["folder"]
    child = os.fork()
    if child == 0:
        _become_b(job, report, result_fd, folder)
    os.close(result_fd)
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(_exit_code(status))


def main():
    result_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read())
    report = {"namespaces": "", "mounts": ""}
    isolated = _unshare(job, report)
    child = os.fork()
    if child == 0:
        _become_a(job, report, result_fd, isolated)
    os.close(result_fd)
    _, status = os.waitpid(child, 0)
    os._exit(_exit_code(status))


if __name__ == "__main__":
    main()
