"""The sandbox's own side, never imported: started once per caller process as
`python -I -S _child.py --zygote CONTROL_FD` by `scalerl.sandbox.zygote`, it forks one
launcher per job (below). Standard library only.

The zygote only forks: it holds no job's content, and each launcher it forks holds only
its own job's channels (the zygote closes them right after the fork). It takes from the
control socket a job's folder and four fds (SCM_RIGHTS): the launcher's stdin, REPORT_FD,
DATA_FD and STATUS_FD, and answers with the launcher's pid. The launcher leads its own
session, and writes its exit code to STATUS_FD as it ends (the zygote, its parent, reaps
it, so its caller learns the code there: end of file without one = killed). The zygote
ends when its caller closes the control socket. What a fork saves is the interpreter's
start and these imports (two thirds of a small program's CPU); every job still gets
fresh namespaces, a fresh root and a fresh contained process.

A launcher's stdin: one JSON job {"limits", "folder", "code", "kind", "cases"}. Two
channels go back:
- REPORT_FD (trusted): what containment was set up, or why the sandbox failed to start.
  It is closed before the program's first line runs, so the program never holds it.
- DATA_FD (the program's stdout, fd 1): one JSON line per case, data only ({"i": index,
  "value": repr} or {"i", "stdout"}, with "error"). The program can write anything there;
  the caller treats every line as the program's claim and judges it outside.

Three processes:

  launcher  reads the job, unshares the user (when not root), mount, PID, network, IPC
            and UTS namespaces, forks A;
  A (PID 1) builds a minimal read-only root in a tmpfs: the interpreter's files and the
            system's shared libraries bound read-only, /dev with null, zero, full, random
            and urandom, a fresh /proc where the kernel allows it, and a size-limited
            private /tmp (the program's folder); pivots into it, forks B and reaps until B
            ends; when A ends, the kernel kills everything left in its PID namespace;
  B         sets the resource limits, drops every privilege (as root: the sandbox uid and
            gid; in a user namespace: all capabilities), sets no_new_privs and a seccomp
            filter, reports, closes every fd but 0-2, then runs the program and its cases.

Where the namespaces are refused the same runs in a host folder, and the report names
what is missing; the caller refuses to run programs so unless allowed.
"""

import ast
import ctypes
import io
import json
import os
import resource
import signal
import struct
import sys
import sysconfig
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP = 0x02000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# statvfs flag -> mount flag: a read-only remount must keep the flags the kernel locked on
# a mount made in a user namespace (nosuid, nodev, noexec and the atime ones).
KEPT_FLAGS = (
    (2, MS_NOSUID),
    (4, MS_NODEV),
    (8, MS_NOEXEC),
    (1024, 1024),
    (2048, 2048),
    (4096, 1 << 21),
)
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38
SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
DEVICES = ("null", "zero", "full", "random", "urandom")
# Modules a program may import in a host folder as the sandbox uid when the interpreter's
# files are closed to that uid (a Python under /root): loaded before privileges go.
PRELOAD = (
    "array bisect cmath collections copy dataclasses datetime decimal fractions functools "
    "heapq itertools math operator random re statistics string time typing"
).split()

# seccomp: syscalls no program needs and sandbox escapes use (tracing other processes,
# mounts, namespaces, kernel keys, eBPF, perf, userfaultfd, io_uring, modules, reboot,
# clocks). Numbers per architecture; x86_64 (AUDIT_ARCH 0xC000003E) and aarch64
# (0xC00000B7). On another architecture the report says the filter is missing.
_DENIED = {
    "x86_64": (
        0xC000003E,
        # ptrace process_vm_readv/writev mount umount2 pivot_root chroot unshare setns
        (101, 310, 311, 165, 166, 155, 161, 272, 308)
        # keyctl add_key request_key bpf perf_event_open userfaultfd kexec_load/file_load
        + (250, 248, 249, 321, 298, 323, 246, 320)
        # init/finit/delete_module reboot swapon swapoff acct open_by_handle_at
        + (175, 313, 176, 169, 167, 168, 163, 304, 303)
        # io_uring_setup/enter/register iopl ioperm syslog open_tree..fspick mount_setattr
        + (425, 426, 427, 172, 173, 103, 428, 429, 430, 431, 432, 433, 442)
        # settimeofday clock_settime adjtimex clock_adjtime quotactl vhangup
        + (164, 227, 159, 305, 179, 153),
        {"socket": 41, "clone": 56, "clone3": 435, "pivot_root": 155},
    ),
    "aarch64": (
        0xC00000B7,
        (117, 270, 271, 40, 39, 41, 51, 97, 268)
        + (219, 217, 218, 280, 241, 282, 104, 294)
        + (105, 273, 106, 142, 224, 225, 89, 265, 264)
        + (425, 426, 427, 116, 428, 429, 430, 431, 432, 433, 442)
        + (170, 112, 171, 266, 60, 58),
        {"socket": 198, "clone": 220, "clone3": 435, "pivot_root": 41},
    ),
}
AF_UNIX, EPERM, ENOSYS, EAFNOSUPPORT = 1, 1, 38, 97
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4


def _check(result):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)))


def _exit_code(status):
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


class _Report:
    """Lines on the trusted report fd."""

    def __init__(self, fd):
        self.fd = fd

    def emit(self, **event):
        _write_all(self.fd, (json.dumps(event) + "\n").encode())


# -- the launcher: namespaces ---------------------------------------------------------


def _unshare(job, missing):
    """Enter new namespaces; True when done. Not root: a user namespace too, mapping our
    own uid and gid onto themselves (the one mapping an unprivileged process may write),
    which gives this process the capabilities to build the root inside it only."""
    if not job["limits"]["namespaces"]:
        missing.append("namespaces: turned off (SandboxLimits.namespaces)")
        return False
    uid, gid = os.geteuid(), os.getegid()
    flags = NAMESPACES if uid == 0 else NAMESPACES | CLONE_NEWUSER
    try:
        _check(_libc.unshare(flags))
        if uid != 0:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
    except OSError as exc:
        missing.append(f"namespaces: unshare refused ({exc.strerror})")
        return False
    return True


# -- A: the minimal root --------------------------------------------------------------


def _interpreter_paths():
    """What the interpreter needs: its executable, its standard library, its extension
    modules and shared library, the system's shared libraries. Paths inside another
    listed folder are dropped."""
    paths = [os.path.realpath(p) for p in SYSTEM_LIBRARIES if os.path.exists(p)]
    paths += [p for p in SYSTEM_LIBRARIES if os.path.islink(p)]
    for path in (
        os.path.dirname(os.__file__),
        sysconfig.get_config_var("DESTSHARED") or "",
        sysconfig.get_config_var("LIBDIR") or "",
        sys.executable,
    ):
        if path and os.path.exists(path):
            paths.append(os.path.realpath(path))
    kept = []
    for path in sorted(set(paths), key=len):
        if not any(path.startswith(k.rstrip("/") + "/") for k in kept if not os.path.islink(k)):
            kept.append(path)
    return kept


def _bind_read_only(source, target):
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = os.statvfs(target).f_flag
    kept = sum(mount_flag for vfs_flag, mount_flag in KEPT_FLAGS if flags & vfs_flag)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _build_root(job, uid, gid, notes):
    """Assemble the new root on the job's folder (a tmpfs mounted there) and pivot into
    it. Raises OSError when a required step is refused."""
    limits, root = job["limits"], job["folder"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in _interpreter_paths():
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        else:
            _bind_read_only(path, target)
    for name in DEVICES:
        _bind_read_only(f"/dev/{name}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.mkdir(f"{root}/proc")
    try:
        _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:  # a container masking parts of its /proc: run without one
        notes.append(f"/proc: not mounted ({exc.strerror})")
    os.mkdir(f"{root}/tmp")
    size = f"size={limits['folder_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={gid}"
    _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size)
    os.chdir(root)
    _pivot_root()
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _pivot_root():
    """pivot_root(".", "."), then detach the old root stacked under the new one: nothing
    of the host's file system stays reachable."""
    number = _DENIED.get(os.uname().machine, (0, (), {}))[2].get("pivot_root")
    if number is None:
        raise OSError(ENOSYS, f"pivot_root: unknown on {os.uname().machine}")
    _check(_libc.syscall(number, b".", b"."))
    _check(_libc.umount2(b".", MNT_DETACH))
    os.chdir("/")


def _become_a(job, missing, report_fd, data_fd, isolated):
    # A dies with the launcher, and ends the sandbox itself past the wall time should the
    # caller be gone; killing A's group (and, when isolated, A as PID 1) ends every process.
    _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
    signal.alarm(int(job["limits"]["wall_s"]) + 2)
    notes, folder = [], job["folder"]
    uid, gid = _sandbox_ids(job)
    if isolated:
        try:
            _build_root(job, uid, gid, notes)
            folder = "/tmp"
        except OSError as exc:
            missing.append(f"root: not built ({exc.strerror}): the program runs on the host")
    else:
        missing.append("root: not built (no namespaces): the program runs on the host")
    child = os.fork()
    if child == 0:
        _become_b(job, missing, notes, report_fd, data_fd, folder)
    os.close(report_fd)
    os.close(data_fd)
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(_exit_code(status))


def _sandbox_ids(job):
    """The uid and gid the program runs as: the configured ones when we are root, else our
    own (mapped onto themselves in the user namespace)."""
    if os.geteuid() == 0:
        return job["limits"]["uid"], job["limits"]["gid"]
    return os.geteuid(), os.getegid()


# -- B: privileges, limits, seccomp ---------------------------------------------------


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


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def _drop_privileges(job, missing):
    """Root: the sandbox uid and gid (RLIMIT_NPROC does not apply to root). In a user
    namespace: every capability it gave us, cleared and checked."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(job["limits"]["gid"])
        os.setuid(job["limits"]["uid"])
        try:
            os.setuid(0)
        except PermissionError:
            return
        raise RuntimeError("privileges could still be regained after setuid")
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data))
    _check(_libc.capget(ctypes.byref(header), data))
    if any(getattr(d, f) for d in data for f in ("effective", "permitted", "inheritable")):
        raise RuntimeError("capabilities remain after capset")


def _seccomp_program(machine):
    arch, denied, numbers = _DENIED[machine]
    op = lambda code, k=0, jt=0, jf=0: struct.pack("HBBI", code, jt, jf, k)  # noqa: E731
    program = [op(LD_ABS_W, 4), op(JEQ, arch, 1, 0), op(RET, RET_KILL_PROCESS), op(LD_ABS_W, 0)]
    if machine == "x86_64":  # the x32 ABI's numbers carry bit 30: none may pass
        program += [op(JGE, 0x40000000, 0, 1), op(RET, RET_ERRNO | EPERM)]
    for number in denied:
        program += [op(JEQ, number, 0, 1), op(RET, RET_ERRNO | EPERM)]
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc use clone.
    program += [op(JEQ, numbers["clone3"], 0, 1), op(RET, RET_ERRNO | ENOSYS)]
    namespaces = NAMESPACES | CLONE_NEWUSER | CLONE_NEWCGROUP
    for number, refuse_unless_skipped, refused in (
        (numbers["socket"], op(JEQ, AF_UNIX, 1, 0), RET_ERRNO | EAFNOSUPPORT),
        (numbers["clone"], op(JSET, namespaces, 0, 1), RET_ERRNO | EPERM),
    ):
        # socket: AF_UNIX only; clone: no new namespace (args[0]'s low word is at 16).
        program += [op(JEQ, number, 0, 4), op(LD_ABS_W, 16), refuse_unless_skipped]
        program += [op(RET, refused), op(RET, RET_ALLOW)]
    program += [op(RET, RET_ALLOW)]
    return b"".join(program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp(missing):
    machine = os.uname().machine
    if machine not in _DENIED:
        missing.append(f"seccomp: no filter for {machine}")
        return
    code = _seccomp_program(machine)
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(fprog), 0, 0))


def _preload_if_degraded(missing):
    if missing and os.geteuid() == 0:
        for name in PRELOAD:
            __import__(name)


def _become_b(job, missing, notes, report_fd, data_fd, folder):
    report = _Report(report_fd)
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd, target in ((devnull, 0), (data_fd, 1), (devnull, 2)):
            os.dup2(fd, target)
        os.chdir(folder)
        os.environ.clear()
        os.environ.update(PATH="/usr/bin:/bin", LANG="C.UTF-8", HOME=folder, TMPDIR=folder)
        _preload_if_degraded(missing)
        _limit(job)
        _drop_privileges(job, missing)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        _seccomp(missing)
        report.emit(event="containment", missing=missing, notes=notes, uid=os.getuid())
        os.closerange(3, 1 << 16)  # the report fd and anything else inherited
    except BaseException:  # noqa: BLE001 - report the sandbox's own failure, then end
        try:
            report.emit(event="error", error=traceback.format_exc()[-2000:])
        except BaseException:  # noqa: BLE001
            pass
        os._exit(1)
    _serve(job)
    os._exit(0)


# -- B, contained: the program and its cases (everything here is the program's to break) --

PLAIN = (type(None), bool, int, float, complex, str, bytes)
CONTAINERS = (list, tuple, set, frozenset, dict)


def _plain_repr(value, depth=0):
    """repr of plain data only: the caller reads it with ast.literal_eval."""
    if depth > 32:
        raise ValueError("nested too deeply")
    kind = type(value)
    if kind in PLAIN:
        return repr(value)
    if kind in CONTAINERS:
        items = value.items() if kind is dict else [(v,) for v in value]
        for item in items:
            for part in item:
                _plain_repr(part, depth + 1)
        return repr(value)
    raise TypeError(f"returned a {kind.__name__}, not plain data")


def _run(compiled, namespace, stdin_text, output_bytes, expression=False):
    """exec (or eval) with the case's stdin and a captured stdout: (stdout, value, error)."""
    saved = sys.stdin, sys.stdout, sys.stderr
    out = io.BytesIO()
    stdout = io.TextIOWrapper(out, encoding="utf-8", errors="replace", write_through=True)
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin_text.encode()), encoding="utf-8")
    sys.stdout, sys.stderr = stdout, io.StringIO()
    value, error = None, ""
    try:
        if expression:
            value = _plain_repr(eval(compiled, namespace))  # noqa: S307 - contained
        else:
            exec(compiled, namespace)  # noqa: S102 - running it is the point, contained
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - the program's failure is a failed case
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    try:
        stdout.flush()
    except BaseException:  # noqa: BLE001 - the program may have closed it
        pass
    text = out.getvalue()[:output_bytes].decode("utf-8", errors="replace")
    return text, value, error


def _serve(job):
    output_bytes = job["limits"]["output_bytes"]
    emit = lambda **line: _write_all(1, (json.dumps(line) + "\n").encode())  # noqa: E731
    try:
        compiled = compile(job["code"], "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        emit(syntax_error=f"{type(exc).__name__}: {exc}"[:500])
        return
    if job["kind"] == "stdio":
        for index, stdin_text in enumerate(job["cases"]):
            stdout, _, error = _run(compiled, {"__name__": "__main__"}, stdin_text, output_bytes)
            emit(i=index, stdout=stdout, error=error)
        return
    namespace = {"__name__": "solution"}
    _, _, program_error = _run(compiled, namespace, "", output_bytes)
    for index, expression in enumerate(job["cases"]):
        if program_error:
            emit(i=index, value=None, error=f"program: {program_error}")
            continue
        try:
            case = compile(ast.parse(expression, mode="eval"), f"case_{index}", "eval")
        except SyntaxError as exc:
            emit(i=index, value=None, error=f"SyntaxError: {exc}"[:500])
            continue
        _, value, error = _run(case, namespace, "", output_bytes, expression=True)
        if value is not None and len(value) > output_bytes:
            value, error = None, f"the value's repr is over {output_bytes} bytes"
        emit(i=index, value=value, error=error)


def _launch(report_fd, data_fd):
    """The launcher: read the job from stdin, unshare, fork A; A's exit code."""
    job = json.loads(sys.stdin.buffer.read())
    missing = []
    isolated = _unshare(job, missing)
    child = os.fork()
    if child == 0:
        _become_a(job, missing, report_fd, data_fd, isolated)
    os.close(report_fd)
    os.close(data_fd)
    _, status = os.waitpid(child, 0)
    return _exit_code(status)


# -- the zygote -----------------------------------------------------------------------


def _zygote(control_fd):
    """Fork a launcher per request on the control socket until it closes."""
    import socket

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the launchers
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 4096, 4)
        except OSError:
            os._exit(0)
        if not message or len(fds) != 4:
            os._exit(0)  # the caller is gone (or broke the protocol)
        pid = os.fork()
        if pid == 0:
            control.close()
            _forked_launcher(message.decode(), *fds)
        for fd in fds:
            os.close(fd)
        control.sendall(struct.pack("=i", pid))


def _forked_launcher(folder, stdin_fd, report_fd, data_fd, status_fd):
    code, launcher = 1, os.getpid()
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the launcher waits for A
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        os.chdir(folder)
        code = _launch(report_fd, data_fd)
    finally:
        # Only the launcher reports: A and B inherit STATUS_FD (B closes it before the
        # program's first line), and an A that failed must not answer for it.
        try:
            if os.getpid() == launcher:
                _write_all(status_fd, b"%d\n" % code)
                # Without a PID namespace a program's children outlive B: they are in
                # this group, which ends with the launcher (the caller no longer can: the
                # zygote reaps the launcher, and its pid may then be another's).
                os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(code)


def main():
    if sys.argv[1] == "--zygote":
        _zygote(int(sys.argv[2]))
    os._exit(_launch(int(sys.argv[1]), int(sys.argv[2])))


if __name__ == "__main__":
    main()
