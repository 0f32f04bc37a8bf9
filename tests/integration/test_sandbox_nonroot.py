"""As a non-root uid (nothing we ship runs as root), the sandboxed program reads no
secret of its ancestors, reaches no network and writes nothing outside its own folder; its
four forgeries score 0. The run's secret sits in the caller's environment, and the caller
listens on loopback and owns a folder the program tries to write."""

from __future__ import annotations

import json
import os

import pytest
from nonroot import run_as_nonroot
from verifier_cases import SECRET_NAME, SECRET_VALUE

SCRIPT = """
import json, os, socket, sys, tempfile
sys.path.insert(0, "tests/integration")
from verifier_cases import CODE, FORGERIES, connect_to, write_outside
from scalerl.verifiers.code import CodeVerifier
from scalerl.sandbox.runner import SandboxLimits, containment, run_program

limits = SandboxLimits(cpu_s=1, wall_s=1.5)
found = containment(limits)
if not found.contained:
    print(json.dumps({"missing": found.missing}))
    sys.exit(0)
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
listener.settimeout(0.2)
port = listener.getsockname()[1]
target = os.path.join(tempfile.mkdtemp(), "escaped.txt")
cases = [c for c in CODE if c.id == "reads-a-secret"]
cases += [connect_to(port), write_outside(target), *FORGERIES]
verifier = CodeVerifier(limits)
rewards = {c.id: verifier.score(c.completion, c.answer).reward for c in cases}
probe = (
    "import socket, os\\n"
    "try:\\n"
    f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\\n"
    "except OSError as exc:\\n"
    "    print(exc.errno)\\n"
    "print(os.getuid())\\n"
)
errno, uid = run_program(probe, "stdio", [""], limits).outcomes[0].stdout.split()
try:
    listener.accept()
    connected = True
except TimeoutError:
    connected = False
print(json.dumps({"missing": [], "uid": os.getuid(), "sandbox_uid": int(uid),
                  "rewards": rewards, "errno": int(errno), "connected": connected,
                  "escaped": os.path.exists(target)}))
"""


def test_as_a_non_root_uid_the_program_is_contained() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", SECRET_NAME: SECRET_VALUE}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    out = json.loads(run_as_nonroot(SCRIPT, env).strip().splitlines()[-1])
    if out["missing"]:
        pytest.skip(f"no containment for a non-root uid here: {out['missing']}")
    assert out["uid"] != 0 and out["sandbox_uid"] == out["uid"]
    assert out["rewards"] == {
        "reads-a-secret": 0.0,
        "network": 0.0,
        "writes-outside": 0.0,
        "always-equal": 0.0,
        "forged-result-lines": 0.0,
        "exits-in-the-middle": 0.0,
        "patches-builtins": 0.0,
    }
    assert out["errno"] in (97, 101)  # EAFNOSUPPORT (seccomp) or ENETUNREACH
    assert not out["connected"] and not out["escaped"]
