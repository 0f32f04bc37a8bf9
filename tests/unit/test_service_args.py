"""The rollout and learner mains take the Redis URL from --redis-url or, as `scalerl run`
hands it (its password off every command line), from SCALERL_REDIS_URL, which they then
remove from their environment; with neither, one line naming the flag and exit code 2."""

from __future__ import annotations

import os

import pytest

import learner_service.main
import rollout_service.main
from scalerl.state.client import REDIS_URL_ENV

MAINS = {
    "rollout": (rollout_service.main, ["--config", "tiny", "--worker-id", "w0"]),
    "learner": (learner_service.main, ["--config", "tiny", "--run-dir", "run"]),
}


@pytest.mark.parametrize("name", sorted(MAINS))
def test_the_redis_url_comes_from_the_flag_or_the_environment(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    main, required = MAINS[name]
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(SystemExit) as ended:
        main.parse_args(required)
    assert ended.value.code == 2
    assert f"--redis-url: required (or ${REDIS_URL_ENV})" in capsys.readouterr().err
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:secret@127.0.0.1:7/0")
    assert main.parse_args(required).redis_url == "redis://:secret@127.0.0.1:7/0"
    assert REDIS_URL_ENV not in os.environ
    flag = ["--redis-url", "redis://127.0.0.1:8/0"]
    assert main.parse_args(required + flag).redis_url == "redis://127.0.0.1:8/0"
