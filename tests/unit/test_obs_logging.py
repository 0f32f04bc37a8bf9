"""One log format for every process: service, run, policy version and request id on each
line, as text or as JSON."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from scalerl.obs import logging as obs_logging


@pytest.fixture(autouse=True)
def _restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    obs_logging._process.update(service="-", run_id="-", worker_id="", policy_version="-")


def test_text_lines_carry_service_run_version_and_request(capsys) -> None:
    obs_logging.setup_logging("rollout", worker_id="w0", json_lines=False)
    obs_logging.set_run_id("run-7")
    obs_logging.set_policy_version(3)
    with obs_logging.request_context("g17-2"):
        logging.getLogger("rollout_service.actor").info("pushed %d samples", 8)
    logging.getLogger("rollout_service.actor").warning("outside")
    first, second = capsys.readouterr().err.splitlines()
    assert first.split(" ", 1)[1] == (
        "INFO service=rollout worker=w0 run=run-7 v=3 req=g17-2 rollout_service.actor: "
        "pushed 8 samples"
    )
    assert " req=- " in second


def test_json_lines(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SCALERL_LOG_FORMAT", "json")
    obs_logging.setup_logging("learner", run_id="r1")
    obs_logging.set_policy_version(12)
    logging.getLogger("learner_service.learner").info("step %d", 5)
    entry = json.loads(capsys.readouterr().err)
    assert {k: entry[k] for k in ("level", "service", "run_id", "policy_version", "message")} == {
        "level": "INFO",
        "service": "learner",
        "run_id": "r1",
        "policy_version": "12",
        "message": "step 5",
    }
    assert entry["request_id"] == "-" and entry["worker_id"] is None


def test_request_ids_do_not_leak_across_threads(capsys) -> None:
    obs_logging.setup_logging("curve", json_lines=True)
    seen = threading.Event()

    def other() -> None:
        logging.getLogger("x").info("other thread")
        seen.set()

    with obs_logging.request_context("mine"):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen.is_set()
    assert json.loads(capsys.readouterr().err)["request_id"] == "-"


def test_unknown_format_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("SCALERL_LOG_FORMAT", "yaml")
    with pytest.raises(ValueError, match="SCALERL_LOG_FORMAT must be 'text' or 'json', got 'yaml'"):
        obs_logging.setup_logging("curve")
