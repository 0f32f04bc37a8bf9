"""The reward service (`scalerl-reward`) and the `reward_model` verifier on a tiny random
sequence classifier: its scores are the model's own, a batch scores as its items alone,
concurrent calls share a pass, bad requests and full queues are refused with the right
status, a folder that is no reward model is refused before the port opens, and a dead
service leaves the sample unscored within its deadline."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from reward_models import save_reward_model

from reward_service.scorer import RewardScorer
from reward_service.server import Batcher, RewardServicer, serve
from scalerl.config import RewardModelVerifierConfig, VerifierConfig, load_config
from scalerl.entrypoint import config_error
from scalerl.ports import free_port
from scalerl.rpc.errors import InvalidArgument, ResourceExhausted
from scalerl.rpc.security import Security
from scalerl.verifiers import build_verifier
from scalerl.verifiers.reward_model import RewardClient, normalized

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PAIRS = [
    ("What is 2+3?", "5"),
    ("What is 2+3?", "It is 6, I think, after counting on my fingers twice."),
    ("Name a colour.", "Blue."),
]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


@pytest.fixture(scope="module")
def scorer(model_folder: Path) -> RewardScorer:
    return RewardScorer(model_folder)


@pytest.fixture
def service(scorer: RewardScorer):
    batcher = Batcher(scorer, max_batch=8, wait_s=0.05)
    server, port = serve(RewardServicer(batcher), 0)
    yield f"127.0.0.1:{port}", batcher
    server.stop(0).wait()
    batcher.stop()


def test_a_score_is_the_models_head_on_the_chat_templated_pair(
    scorer: RewardScorer, model_folder: Path
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForSequenceClassification.from_pretrained(model_folder).eval()
    for prompt, completion in PAIRS:
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=False)
        batch = tokenizer(ids, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            expected = float(model(**batch).logits[0, 0])
        [score], [cut] = scorer.score([(prompt, completion)])
        assert score == pytest.approx(expected, abs=1e-5) and not cut


def test_a_batch_scores_each_item_as_alone(scorer: RewardScorer) -> None:
    together, _ = scorer.score(PAIRS)
    alone = [scorer.score([pair])[0][0] for pair in PAIRS]
    assert together == pytest.approx(alone, abs=1e-4)
    assert len(set(together)) == 3  # the items differ, so do their scores


def test_a_long_item_keeps_its_end(model_folder: Path) -> None:
    short = RewardScorer(model_folder, max_length=64)
    long_prompt = "word " * 200
    [cut_score], [cut] = short.score([(long_prompt, "5")])
    [same], _ = short.score([("word " * 150 + long_prompt, "5")])
    assert cut and cut_score == pytest.approx(same, abs=1e-5)  # only the start differed


def test_concurrent_calls_share_a_forward_pass(service, scorer: RewardScorer) -> None:
    address, batcher = service
    results: dict[int, list[float]] = {}

    def call(i: int) -> None:
        with RewardClient(address, security=Security()) as client:
            results[i] = client.score([PAIRS[i % 3]])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    alone = [scorer.score([pair])[0][0] for pair in PAIRS]
    assert [results[i][0] for i in range(6)] == pytest.approx(alone * 2, abs=1e-4)
    assert batcher.items == 6 and batcher.batches < 6


def test_bad_requests_name_the_field(service) -> None:
    address, _ = service
    with RewardClient(address, security=Security()) as client:
        with pytest.raises(InvalidArgument, match="at least one item"):
            client.score([])
        with pytest.raises(InvalidArgument, match="at most 256, got 257"):
            client.score([("p", "c")] * 257)


def test_a_full_queue_is_resource_exhausted() -> None:
    class Slow:
        name = "slow"

        def score(self, items):
            time.sleep(0.5)
            return [0.0] * len(items), [False] * len(items)

    batcher = Batcher(Slow(), max_batch=2, wait_s=0.0, queue=2)
    try:
        first = batcher.submit([("p", "c"), ("p", "c")])
        time.sleep(0.1)  # the first call is in its pass, the queue empty again
        batcher.submit([("p", "c"), ("p", "c")])
        with pytest.raises(ResourceExhausted, match="2 items queued"):
            batcher.submit([("p", "c")])
        assert first.result(timeout=5) == ([0.0, 0.0], 0) and batcher.refused == 1
    finally:
        batcher.stop()
    assert batcher.items == 4  # stop scored what was queued


@pytest.mark.parametrize(
    ("score", "settings", "reward"),
    [
        (0.0, {}, 0.5),
        (2.0, {"center": 1.0, "scale": 0.5}, 1 / (1 + math.exp(-2.0))),
        (-800.0, {}, 0.0),
        (800.0, {}, 1.0),
        (3.0, {"normalize": "linear", "low": -1.0, "high": 7.0}, 0.5),
        (9.0, {"normalize": "linear", "low": -1.0, "high": 7.0}, 1.0),
        (-9.0, {"normalize": "linear", "low": -1.0, "high": 7.0}, 0.0),
    ],
)
def test_a_raw_score_is_normalised_as_configured(score, settings, reward) -> None:
    assert normalized(score, RewardModelVerifierConfig(**settings)) == pytest.approx(reward)


def test_the_verifier_rewards_the_sigmoid_of_the_services_score(
    service, scorer: RewardScorer
) -> None:
    address, _ = service
    settings = VerifierConfig(reward_model=RewardModelVerifierConfig(service=address))
    verifier = build_verifier("reward_model", settings=settings)
    prompt, completion = PAIRS[1]
    verdict = verifier.score(completion, None, prompt)
    [raw], _ = scorer.score([(prompt, completion)])
    assert verdict.reward == pytest.approx(1 / (1 + math.exp(-raw)), abs=1e-5)
    assert verdict.detail == f"score {raw:.6g}" and not verdict.parse_failed
    assert verifier.score("  ", None, prompt).parse_failed  # nothing to score: no call
    verifier.close()


def test_a_dead_service_is_unscored_within_its_deadline() -> None:
    address = f"127.0.0.1:{free_port()}"
    settings = RewardModelVerifierConfig(service=address, retry_s=1.0, timeout_s=0.5)
    verifier = build_verifier("reward_model", settings=VerifierConfig(reward_model=settings))
    began = time.monotonic()
    verdict = verifier.score("5", None, "What is 2+3?")
    assert verdict.unscored and verdict.detail.startswith(
        f"the reward service at {address} did not score it within 1 s"
    )
    assert "UNAVAILABLE" in verdict.detail and time.monotonic() - began < 3.0


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["verifier.reward_model.service=rm"], "verifier.reward_model.service"),
        (
            ["verifier.reward_model.normalize=linear", "verifier.reward_model.high=0"],
            "high must be above low",
        ),
        (["verifier.reward_model.scale=0"], "verifier.reward_model.scale"),
        (["verifier.reward_model.normalize=softmax"], "verifier.reward_model.normalize"),
    ],
)
def test_a_bad_reward_model_config_is_one_line_naming_the_field(sets, line) -> None:
    with pytest.raises(ValueError) as caught:
        load_config("tiny", sets)
    message = config_error(caught.value)
    assert "\n" not in message and line in message


def test_a_reward_model_task_without_a_service_is_refused() -> None:
    with pytest.raises(ValueError, match="verifier.reward_model.service .* is required"):
        build_verifier("reward_model", settings=VerifierConfig())


def _start(folder: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "reward_service.main", "--model", str(folder), "--port", "0"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_folder_that_is_no_reward_model_is_refused_before_the_port_opens(tmp_path) -> None:
    two_labels = save_reward_model(tmp_path / "two", labels=2)
    done = _start(two_labels)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].endswith("has 2 labels; a reward model has 1")
    missing = _start(tmp_path / "nowhere")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].endswith("nowhere has no config.json")


def test_a_repeated_completion_is_scored_once(service) -> None:
    address, batcher = service
    settings = VerifierConfig(reward_model=RewardModelVerifierConfig(service=address))
    verifier = build_verifier("reward_model", settings=settings)
    threads = [
        threading.Thread(target=verifier.score, args=("5", None, "What is 2+3?")) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = verifier.score("5", None, "What is 2+3?")
    other = verifier.score("5", None, "What is 1+4?")  # another prompt: another score
    assert batcher.items == 2 and first.reward != other.reward
    verifier.close()
