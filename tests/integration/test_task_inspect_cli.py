"""`scalerl task inspect`: per task of a config, its source, split sizes and a few
prompts; a config whose task cannot be built is one line and exit 2."""

from __future__ import annotations

import json

from scalerl_cli.main import main


def _tasks(rows) -> str:
    return (
        "[{name: add, large_max: 9, heldout_size: 30},"
        f" {{name: sums, source: file, path: '{rows}', prompt_field: q, answer_field: a,"
        " verifier: math, heldout_size: 5, weight: 3, system_prompt: 'Be brief.'}]"
    )


def test_inspect_shows_every_task_with_its_split_and_prompts(tmp_path, capsys) -> None:
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) + "\n" for i in range(30)]
    rows.write_text("".join(lines))
    argv = ["task", "inspect", "--config", "tiny", "--set", f"task={_tasks(rows)}"]
    assert main([*argv, "--show", "2", "--json"]) == 0
    add, sums = json.loads(capsys.readouterr().out)["tasks"]
    assert (add["task"], add["train_prompts"], add["heldout_prompts"]) == ("add", 70, 30)
    assert (sums["task"], sums["train_prompts"], sums["heldout_prompts"]) == ("sums", 25, 5)
    assert (add["share"], sums["share"]) == (0.25, 0.75)
    assert sums["verifier"] == "math" and sums["source"].startswith("file ")
    first = sums["prompts"][0]
    n = int(first["answer"]) - 1
    assert first["prompt"] == f"[system] Be brief.\n[user] What is {n} + 1?"
    assert len(add["prompts"]) == 2 and add["prompts"][0]["prompt_id"].startswith("add/")

    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "task sums  (weight 3, 75% of training prompts)" in text
    assert "prompts:  25 training, 5 held out" in text


def test_a_task_that_cannot_be_built_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.jsonl"
    task = f"{{name: m, source: file, path: '{missing}', verifier: math}}"
    assert main(["task", "inspect", "--config", "default", "--set", f"task={task}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scalerl task inspect: task 'm': path"), err
    assert main(["task", "inspect", "--config", "tiny", "--show", "99"]) == 2
    assert "--show must be in [0, 50]" in capsys.readouterr().err


def test_inspect_runs_one_trajectory_and_shows_its_roles(capsys) -> None:
    argv = ["task", "inspect", "--config", "multiturn-tiny", "--show", "0", "--trajectory"]
    # The tiny model before training writes anything: the shape is checked (the prompt,
    # then turns of the model, an environment message between two turns).
    assert main([*argv, "--json"]) == 0
    (task,) = json.loads(capsys.readouterr().out)["tasks"]
    t = task["trajectory"]
    roles = [s["role"] for s in t["segments"]]
    assert roles[0] == "prompt" and roles[1] == "model" and roles[-1] == "model"
    assert t["prompt_id"].startswith("addition/") and t["turns"] == roles.count("model")
    assert t["segments"][0]["text"].startswith("Q:") and t["finish_reason"].startswith("FINISH_")
    assert main(argv) == 0
    assert "--- trajectory of addition/" in capsys.readouterr().out
