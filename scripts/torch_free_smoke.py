"""The torch-free install works: run inside a virtual environment where `pip install .` put
only the base dependencies. Checks that torch is absent, starts `scalerl-curve` as a user
would, fits a sigmoid with known parameters over gRPC and checks the answer.

Exit status 0 when every check holds; otherwise one line naming the failed check, status 1.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

# Known curve (paper Eq. 1): R0 0.1, A 0.6, B 1.5, C_mid 50 (compute in arbitrary units).
R0, A, B, C_MID = 0.1, 0.6, 1.5, 50.0


def main() -> int:
    for heavy in ("torch", "transformers", "safetensors", "matplotlib"):
        if importlib.util.find_spec(heavy) is not None:
            print(f"torch-free install: {heavy} is installed", file=sys.stderr)
            return 1
    from curve_service.sigmoid import sigmoid
    from scalerl.ports import free_port
    from scalerl.rpc.channel import wait_healthy
    from scalerl.rpc.clients.curve import CurveClient, FitSpec

    port = free_port()
    binary = Path(sys.executable).parent / "scalerl-curve"  # the environment's own script
    if not binary.exists():
        print("torch-free install: no scalerl-curve console script", file=sys.stderr)
        return 1
    server = subprocess.Popen([binary, "--port", str(port), "--metrics-port", "0"])
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout_s=60)
        computes = [2.0 * 1.4**i for i in range(16)]
        rewards = [float(r) for r in sigmoid(computes, A, B, C_MID, R0)]
        with CurveClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            fitted = client.fit(FitSpec(compute=computes, reward=rewards))
        if abs(fitted.a - A) > 0.01 or abs(fitted.b - B) > 0.1:
            print(f"torch-free install: fit gave A={fitted.a}, B={fitted.b}", file=sys.stderr)
            return 1
        print(f"torch-free install: scalerl-curve fitted A={fitted.a:.3f} B={fitted.b:.3f}")
        return 0
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
