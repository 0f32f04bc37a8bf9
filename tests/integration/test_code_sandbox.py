"""The `code` verifier's sandbox: programs that pass, fail or earn partial credit, and
programs that loop, sleep, fork-bomb, hog memory, write outside their folder, read a
secret, reach the network or forge their verdict: each contained and scored 0, the host
unaffected. The same holds as a non-root user (tests/integration/nonroot.py).

The fork bomb runs only after a bounded probe (20 forks) proved the process cap; every
limit is small (1 s CPU, 1.5 s wall, 256 MiB, 16 processes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from verifier_cases import (
    ADD_TESTS,
    CODE,
    FORGERIES,
    FORK_BOMB,
    SECRET_NAME,
    SECRET_VALUE,
    TIMEOUT_S,
    Case,
    connect_to,
    write_outside,
)

from scalerl.sandbox.runner import Containment, SandboxLimits, containment, run_program
from scalerl.verifiers.code import CodeVerifier
from scalerl.verifiers.programs import ALLOW_UNCONTAINED

LIMITS = SandboxLimits(cpu_s=1, wall_s=TIMEOUT_S, memory_bytes=256 << 20, max_processes=16)

PROBE = """
import os, time
made, failure, children = 0, "", []
for _ in range(20):
    try:
        pid = os.fork()
    except OSError as exc:
        failure = type(exc).__name__
        break
    if pid == 0:
        time.sleep(0.3)
        os._exit(0)
    children.append(pid)
    made += 1
for pid in children:
    os.waitpid(pid, 0)
print(made, failure)
"""


ISOLATED = containment(LIMITS).contained
needs_namespaces = pytest.mark.skipif(not ISOLATED, reason="no namespaces on this host")


def _processes_of(uid: int) -> set[int]:
    """PIDs of the host's processes whose real uid is `uid`."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(x for x in status.read_text().splitlines() if x.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) == uid:
            found.add(int(status.parent.name))
    return found


def _assert_no_process_left(before: set[int]) -> None:
    deadline = time.monotonic() + 2.0
    while _processes_of(LIMITS.uid) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of(LIMITS.uid) - before == set()


def _score(case: Case) -> None:
    verifier = CodeVerifier(LIMITS)
    started = time.monotonic()
    verdict = verifier.score(case.completion, case.answer)
    assert verdict.reward == pytest.approx(case.reward), verdict
    assert (verdict.parse_failed, verdict.failure) == (case.parse_failed, case.failure), verdict
    assert time.monotonic() - started < TIMEOUT_S + 2, "the wall-time limit held"
    assert verifier.stats.timeouts == (case.failure == "timeout")


def test_the_process_cap_holds_before_any_fork_bomb() -> None:
    """The bounded probe: 20 forks of a short sleep; the cap stops them before 20."""
    run = run_program(PROBE, "stdio", [""], LIMITS)
    made, failure = run.outcomes[0].stdout.split()
    assert int(made) < 20 and failure == "BlockingIOError", run
    if os.geteuid() == 0:
        assert run.containment.uid == LIMITS.uid  # dropped, so RLIMIT_NPROC applies
        assert int(made) <= LIMITS.max_processes - 1


@pytest.mark.parametrize("case", CODE, ids=[c.id for c in CODE])
def test_code_cases(case: Case) -> None:
    before = _processes_of(LIMITS.uid)
    _score(case)
    _assert_no_process_left(before)


def test_a_fork_bomb_is_contained_and_leaves_nothing() -> None:
    test_the_process_cap_holds_before_any_fork_bomb()
    before = _processes_of(LIMITS.uid)
    _score(Case("fork-bomb", "code", ADD_TESTS, FORK_BOMB, 0.0, False, "timeout"))
    _assert_no_process_left(before)
    # The host still runs sandboxes: a plain program passes right after.
    plain = "```python\ndef one():\n    return 1\n```"
    assert CodeVerifier(LIMITS).score(plain, '["assert one() == 1"]').reward == 1.0


def test_writing_outside_its_folder_fails_and_leaves_the_host_untouched(tmp_path: Path) -> None:
    targets = [tmp_path / "escaped.txt"]
    if ISOLATED:  # world-writable: only the mount namespace keeps these from the host
        targets += [Path(f"/var/tmp/scalerl-escape-{uuid.uuid4().hex}")]
        targets += [Path(f"/dev/shm/scalerl-escape-{uuid.uuid4().hex}")]
    for target in targets:
        _score(write_outside(str(target)))
        assert not target.exists(), target


def test_the_folder_is_fresh_and_removed() -> None:
    code = "import os\nprint(sorted(os.listdir('.')))\nopen('left.txt', 'w').write('x')"
    first = run_program(code, "stdio", [""], LIMITS)
    second = run_program(code, "stdio", [""], LIMITS)
    assert first.outcomes[0].stdout == second.outcomes[0].stdout == "[]\n"
    assert not list(Path(tempfile.gettempdir()).glob("scalerl-sandbox-*/left.txt"))


def test_a_secret_in_the_environment_is_not_readable(monkeypatch) -> None:
    monkeypatch.setenv(SECRET_NAME, SECRET_VALUE)
    # A host process holding the secret in its environment, for the /proc scan to look at.
    holder = subprocess.Popen(["sleep", "30"], env={SECRET_NAME: SECRET_VALUE})
    try:
        reads_a_secret = next(c for c in CODE if c.id == "reads-a-secret")
        _score(reads_a_secret)
    finally:
        holder.kill()
        holder.wait()
    env = run_program("import os\nprint(sorted(os.environ))", "stdio", [""], LIMITS)
    assert env.outcomes[0].stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


@needs_namespaces
def test_the_network_is_unreachable() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        _score(connect_to(listener.getsockname()[1]))
        with pytest.raises(TimeoutError):
            listener.accept()


@needs_namespaces
def test_the_program_sees_only_its_own_root() -> None:
    code = (
        "import os\n"
        "print(sorted(os.listdir('/')), sorted(os.listdir('/dev')), os.listdir('/tmp'))\n"
        "for path in ('/etc/passwd', '/home', '/run', '/proc/1/root/etc/passwd'):\n"
        "    print(os.path.exists(path))\n"
        "for path in ('/x', '/usr/lib/x', '/dev/x'):\n"
        "    try:\n"
        "        open(path, 'w')\n"
        "    except OSError as exc:\n"
        "        print(exc.errno)\n"
    )
    lines = run_program(code, "stdio", [""], LIMITS).outcomes[0].stdout.splitlines()
    top = eval(lines[0].split("] [")[0] + "]")  # noqa: S307 - our own test output
    assert set(top) <= {"dev", "lib", "lib32", "lib64", "proc", "root", "tmp", "usr", "opt"}
    assert "etc" not in top and "home" not in top and "work" not in top
    assert lines[1:5] == ["False", "False", "False", "False"]
    assert lines[5:] == ["30", "30", "30"]  # EROFS: the root is read-only


@needs_namespaces
def test_the_seccomp_filter_refuses_escape_calls() -> None:
    code = (
        "import ctypes, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for call in (lambda: libc.unshare(0x10000000), lambda: libc.ptrace(16, 1, 0, 0),\n"
        "             lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)):\n"
        "    print(call(), ctypes.get_errno())\n"
        "try:\n"
        "    socket.socket(socket.AF_INET6)\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
        "socket.socketpair()\n"
        "print(os.fork() >= 0)\n"
    )
    out = run_program(code, "stdio", [""], LIMITS).outcomes[0].stdout.splitlines()
    assert out[:4] == ["-1 1", "-1 1", "-1 1", "97"]  # EPERM x3, EAFNOSUPPORT
    assert "True" in out[4:]  # a plain fork still works


def test_the_four_forgeries_score_nothing() -> None:
    verifier = CodeVerifier(LIMITS)
    for case in FORGERIES:
        verdict = verifier.score(case.completion, case.answer)
        assert verdict.reward == 0.0, (case.id, verdict)


def test_the_verdict_says_what_ran_and_why() -> None:
    completion = "```python\ndef add(a, b):\n    return a * b\n```"
    verdict = CodeVerifier(LIMITS).score(
        completion, '["assert add(2, 2) == 4", "assert add(1, 2) == 3"]'
    )
    assert verdict.extracted == "def add(a, b):\n    return a * b\n"
    assert verdict.expected == "2 assert tests"
    assert verdict.detail.startswith("1/2 tests passed; test 1 failed: AssertionError")


# Without namespaces (a host that refuses them, or turned off): the verifier refuses to run
# programs unless allowed; allowed, the uid, the limits and the process group hold.
PLAIN = LIMITS.model_copy(update={"namespaces": False})


def test_without_containment_the_verifier_refuses_unless_allowed() -> None:
    assert containment(PLAIN).missing[0] == "namespaces: turned off (SandboxLimits.namespaces)"
    with pytest.raises(
        ValueError, match=f"cannot contain programs here .*; set {ALLOW_UNCONTAINED}"
    ):
        CodeVerifier(PLAIN)


def test_without_namespaces_the_cap_and_the_limits_still_hold(tmp_path: Path) -> None:
    run = run_program(PROBE, "stdio", [""], PLAIN)
    assert not run.containment.contained
    made, failure = run.outcomes[0].stdout.split()
    assert int(made) < 20 and failure == "BlockingIOError", run
    before = _processes_of(PLAIN.uid)
    verifier = CodeVerifier(PLAIN, allow_uncontained=True)
    cases = [c for c in CODE if c.id in ("passes", "partial-credit", "memory-hog")]
    cases += [Case("fork-bomb", "code", ADD_TESTS, FORK_BOMB, 0.0, False, "timeout")]
    cases += [write_outside(str(tmp_path / "escaped.txt"))]
    for case in cases:
        verdict = verifier.score(case.completion, case.answer)
        assert (verdict.reward, verdict.failure) == (pytest.approx(case.reward), case.failure)
    assert not (tmp_path / "escaped.txt").exists()
    _assert_no_process_left(before)


def test_a_run_with_a_code_task_refuses_to_start_uncontained(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`scalerl run`'s preflight: one line naming the setting, exit code 2; allowed, it
    starts. The same for a multi-turn task's Python tools, which run in the sandbox too."""
    from scalerl.verifiers import programs
    from scalerl_cli import preflight

    refused = Containment(("namespaces: unshare refused (Operation not permitted)",))
    monkeypatch.setattr(programs, "containment", lambda limits: refused)
    config = {
        "model": {"kind": "tiny"},
        "task": {
            "name": "code",
            "source": "file",
            "path": str(Path("examples/data/code.jsonl").resolve()),
            "prompt_field": "prompt",
            "answer_field": "tests",
            "verifier": "code",
            "heldout_size": 4,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert preflight.main([str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "task 'code': verifier: the code sandbox cannot contain programs here (namespaces: "
        "unshare refused (Operation not permitted)); set verifier.code.allow_uncontained: "
        "true to run them uncontained"
    ]
    path.write_text(yaml.safe_dump({**config, "verifier": {"code": {"allow_uncontained": True}}}))
    assert preflight.main([str(path)]) == 0

    tools = {"model": {"kind": "tiny"}, "rollout": {"interrupt_text": " A:"}}
    tools["task"] = {"name": "add", "environment": {"tools": ["calculator"]}}
    path.write_text(yaml.safe_dump(tools))
    assert preflight.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("task 'add': the code sandbox cannot contain programs here") and (
        err.count("\n") == 1
    )


FORKS_2_GIB = """
import os, time
kids = []
for i in range(10):  # each within its own 256 MiB address space: 2 GiB together
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 << 20)
        for j in range(0, len(block), 4096):
            block[j] = 1
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
for kid in kids:
    os.waitpid(kid, 0)
"""


def test_a_program_allocating_2_gib_is_killed_at_the_cgroup_limit() -> None:
    """The review's P8: one program held 2.9 GiB within the default limits (each process
    under RLIMIT_AS, many processes). Its processes share one memory cgroup of the run's
    memory_bytes, where this machine lets the sandbox make one."""
    from scalerl.sandbox.memcg import MemoryCgroup

    probe = MemoryCgroup.create(64 << 20)
    if probe is None:
        pytest.skip("no writable memory cgroup here")
    probe.remove()
    limits = SandboxLimits(wall_s=20, cpu_s=20, max_processes=32)
    run = run_program(FORKS_2_GIB, "stdio", [""], limits)
    assert run.stopped == "memory"  # the kernel killed its processes at the limit
    assert not any("no memory cgroup" in note for note in run.containment.notes)
