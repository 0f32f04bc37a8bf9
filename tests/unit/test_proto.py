"""The committed generated code matches the .proto files (regenerated, byte for byte)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_has_no_drift(tmp_path):
    pytest.importorskip("grpc_tools")
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "scalerl" / "v1").glob("*.py*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "scalerl" / "v1").glob("*_pb2*.py*"))
    assert fresh == committed, "generated file set differs: run `make proto`"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), (
            f"{rel} is stale: run `make proto` and commit the result"
        )


def test_enums_start_with_unspecified():
    from scalerl.v1 import rollout_pb2

    for enum in (rollout_pb2.FinishReason, rollout_pb2.InterruptMode, rollout_pb2.WeightsFormat):
        assert enum.Name(0).endswith("_UNSPECIFIED")
