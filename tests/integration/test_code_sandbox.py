"""The `code` verifier's sandbox: programs that pass, fail or earn partial credit, and
programs that loop, sleep, fork-bomb, hog memory, write outside their folder, read a
secret or reach the network: each contained and scored 0, the host unaffected.

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
from verifier_cases import (
    CODE,
    FORK_BOMB,
    SECRET_NAME,
    SECRET_VALUE,
    TIMEOUT_S,
    Case,
    connect_to,
    write_outside,
)

from scalerl.verifiers.code import CodeVerifier
from scalerl.verifiers.sandbox import SandboxLimits, run_program

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


def _containment() -> dict:
    return run_program("pass", "stdio", [""], LIMITS).containment


ISOLATED = not _containment().get("namespaces")
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
        assert run.containment["uid"] == LIMITS.uid  # dropped, so RLIMIT_NPROC applies
        assert int(made) <= LIMITS.max_processes - 1


@pytest.mark.parametrize("case", CODE, ids=[c.id for c in CODE])
def test_code_cases(case: Case) -> None:
    before = _processes_of(LIMITS.uid)
    _score(case)
    _assert_no_process_left(before)


def test_a_fork_bomb_is_contained_and_leaves_nothing() -> None:
    test_the_process_cap_holds_before_any_fork_bomb()
    before = _processes_of(LIMITS.uid)
    _score(Case("fork-bomb", "code", '["assert True"]', FORK_BOMB, 0.0, False, "timeout"))
    _assert_no_process_left(before)
    # The host still runs sandboxes: a plain program passes right after.
    assert CodeVerifier(LIMITS).score("```python\nx = 1\n```", '["assert x == 1"]').reward == 1.0


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


def test_printing_a_forged_result_line_earns_nothing() -> None:
    forged = '{"event": "case", "index": 0, "ok": true, "error": ""}'
    code = f"import os, sys\nprint({forged!r})\nfor fd in range(3, 20):\n"
    code += (
        f"    try:\n        os.write(fd, b{forged!r} + b'\\n')\n    except OSError:\n        pass\n"
    )
    code += "def add(a, b):\n    return a - b"
    verdict = CodeVerifier(LIMITS).score(f"```python\n{code}```", '["assert add(1, 1) == 2"]')
    assert verdict.reward == 0.0, verdict


def test_the_verdict_says_what_ran_and_why() -> None:
    completion = "```python\ndef add(a, b):\n    return a * b\n```"
    verdict = CodeVerifier(LIMITS).score(
        completion, '["assert add(2, 2) == 4", "assert add(1, 2) == 3"]'
    )
    assert verdict.extracted == "def add(a, b):\n    return a * b\n"
    assert verdict.expected == "2 assert tests"
    assert verdict.detail.startswith("1/2 tests passed; test 1 failed: AssertionError")


# Without namespaces (a host that refuses them, or turned off): the uid, the limits and
# the process group still contain the program.
PLAIN = LIMITS.model_copy(update={"namespaces": False})


def test_without_namespaces_the_cap_and_the_limits_still_hold(tmp_path: Path) -> None:
    run = run_program(PROBE, "stdio", [""], PLAIN)
    assert run.containment["namespaces"] == "turned off (SandboxLimits.namespaces)"
    made, failure = run.outcomes[0].stdout.split()
    assert int(made) < 20 and failure == "BlockingIOError", run
    before = _processes_of(PLAIN.uid)
    verifier = CodeVerifier(PLAIN)
    cases = [c for c in CODE if c.id in ("passes", "partial-credit", "memory-hog")]
    cases += [Case("fork-bomb", "code", '["assert True"]', FORK_BOMB, 0.0, False, "timeout")]
    cases += [write_outside(str(tmp_path / "escaped.txt"))]
    for case in cases:
        verdict = verifier.score(case.completion, case.answer)
        assert (verdict.reward, verdict.failure) == (pytest.approx(case.reward), case.failure)
    assert not (tmp_path / "escaped.txt").exists()
    _assert_no_process_left(before)
