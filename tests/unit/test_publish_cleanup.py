"""The publisher's payload cleanup keeps files by version and never the one just written."""

from __future__ import annotations

from scalerl.weights.senders import files_to_remove


def _files(folder, *versions):
    for v in versions:
        (folder / f"policy-v{v}.safetensors").write_bytes(b"x")


def test_keeps_the_newest_two_by_version(tmp_path) -> None:
    _files(tmp_path, 2, 9, 10, 11)
    assert sorted(p.name for p in files_to_remove(tmp_path, 11)) == [
        "policy-v2.safetensors",
        "policy-v9.safetensors",
    ]


def test_never_removes_the_file_just_written(tmp_path) -> None:
    """A crashed run left v20 and v21; the resumed learner writes v5 (before the version
    floor existed this deleted v5 itself, and no worker could load the resumed weights)."""
    _files(tmp_path, 5, 20, 21)
    removed = {p.name for p in files_to_remove(tmp_path, 5)}
    assert "policy-v5.safetensors" not in removed
    assert removed == {"policy-v20.safetensors"}
