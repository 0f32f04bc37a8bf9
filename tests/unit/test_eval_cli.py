"""`scalerl eval`: what CHECKPOINT may name, and bad input as one line with exit code 2
(nothing is loaded then). The score itself is checked end to end against a run's final
evaluation in tests/e2e/test_e2e_tiny.py."""

from __future__ import annotations

import json

import pytest

from scalerl_cli.eval_cli import find_source
from scalerl_cli.main import main


def _checkpoint(folder, step: int):
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step, "policy_version": step}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_run_folder_gives_its_checkpoint_config_and_step(tmp_path):
    _checkpoint(tmp_path / "checkpoint", 12)
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    source = find_source(tmp_path)
    assert source.weights == (tmp_path / "checkpoint" / "model.safetensors",)
    assert (source.config, source.step) == (tmp_path / "config.yaml", 12)


def test_a_checkpoint_left_as_old_by_a_crash_is_found(tmp_path):
    _checkpoint(tmp_path / "checkpoint.old", 7)
    source = find_source(tmp_path / "checkpoint")
    assert source.weights == (tmp_path / "checkpoint.old" / "model.safetensors",)
    assert (source.config, source.step) == (None, 7)


def test_an_hf_folder_gives_every_shard_and_no_step(tmp_path):
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"")
    source = find_source(tmp_path)
    assert [p.name for p in source.weights] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert (source.config, source.step) == (None, None)


def test_sharded_only_checkpoint_is_refused(tmp_path):
    folder = _checkpoint(tmp_path / "checkpoint", 3)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="only sharded weights"):
        find_source(folder)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nothing"], "not a run folder, a checkpoint/ folder"),
        (["{tmp}/config.yaml"], "a file must be .safetensors"),
        (["{tmp}/w.safetensors", "--samples", "0"], "eval.samples"),
        (["{tmp}/w.safetensors", "--set", "eval.temperature=-1"], "eval.temperature"),
        (["{tmp}/w.safetensors", "--threads", "-1"], "--threads must be >= 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    (tmp_path / "w.safetensors").write_bytes(b"")
    code = main(["eval", *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("scalerl eval: ") and err.count("\n") == 1 and message in err


def test_json_mode_sends_every_write_to_stdout_to_stderr(capfd):
    """An engine's library logging to stdout (vLLM does) during `--json` must not spoil
    the one JSON document: writes to sys.stdout and to file descriptor 1 go to stderr."""
    import os
    import sys

    from scalerl_cli.eval_cli import stdout_to_stderr

    with stdout_to_stderr(True):
        print("engine says hello")
        os.write(1, b"fd one says hello\n")
    print('{"pass_rate": 0.5}')
    out, err = capfd.readouterr()
    assert out == '{"pass_rate": 0.5}\n'
    assert "engine says hello" in err and "fd one says hello" in err
    with stdout_to_stderr(False):
        sys.stdout.write("kept\n")
    assert capfd.readouterr().out == "kept\n"
