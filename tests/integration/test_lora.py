"""LoRA RL with adapter-only publication (`scalerl.policy.lora`): the learner's adapters
travel alone, and the torch engine serves exactly the learner's policy."""

from __future__ import annotations

import copy
import threading

import grpc
import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from learner_service.checkpoint.files import LearnerState, load_checkpoint, save_checkpoint
from learner_service.server import LearnerStatus, serve
from learner_service.train.trainer import Trainer
from rollout_service.engines.api import GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import LearnerConfig, LoraConfig, load_config
from scalerl.policy.lora import BASE_VERSION, attach_lora, base_version_tensor
from scalerl.policy.models import CharTokenizer, load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.errors import InvalidArgument
from scalerl.rpc.security import Security
from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc
from scalerl.weights.follower import WeightFollower
from scalerl.weights.publisher import WeightPublisher
from scalerl.weights.receive import LastPayload
from scalerl.weights.senders import PullSender, Sender, UriSender
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import (
    LORA_ADAPTER,
    LORA_BASE,
    head_names,
    lora_checkpoint_payload,
    snapshot_state_dict,
    weights_requests,
)
from scalerl_cli import preflight
from scalerl_cli.export_cli import export


def llama(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def trained_lora(model: torch.nn.Module, rank: int, seed: int = 1) -> torch.nn.Module:
    """The model with rank-`rank` adapters on every Linear, B no longer zero (as after
    training)."""
    attach_lora(model, LoraConfig(rank=rank))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def publish(model: torch.nn.Module, part, base_version: int) -> dict[str, torch.Tensor]:
    """A publication's tensors as the learner sends them (fp32 body)."""
    snapshot = snapshot_state_dict(model, torch.float32, head_names(model), part)
    snapshot[BASE_VERSION] = base_version_tensor(base_version)
    return snapshot


def engine_logits(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    engine.decoder.assign_adapter(0, "")
    return engine.decoder.extend(0, 0, ids, all_logits=True)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("rank", [8, 64])
def test_the_engine_serves_the_learners_adapted_logits(tied: bool, rank: int) -> None:
    learner = trained_lora(llama(tied), rank)
    engine = TorchEngine(llama(tied, seed=5), [1], max_batch=2, max_seq_len=32, autostart=False)
    ids = [3, 7, 11, 2, 9, 30, 4]
    engine.stage_weights(publish(learner, LORA_BASE, base_version=0), 0)
    engine.step()
    with torch.no_grad():
        expected = learner(input_ids=torch.tensor([ids])).logits[0].float()
    assert torch.allclose(engine_logits(engine, ids), expected, atol=1e-5, rtol=0)
    # The next version: the adapter alone, a fraction of the bytes.
    with torch.no_grad():
        for name, parameter in learner.named_parameters():
            if ".lora_B." in name:
                parameter.mul_(-2.0)
    adapter = publish(learner, LORA_ADAPTER, base_version=0)
    assert all(".lora_" in n or n == BASE_VERSION for n in adapter)
    engine.stage_weights(adapter, 1)
    engine.step()
    with torch.no_grad():
        expected = learner(input_ids=torch.tensor([ids])).logits[0].float()
    assert torch.allclose(engine_logits(engine, ids), expected, atol=1e-5, rtol=0)
    assert engine.policy_version == 1 and engine.base_version == 0


def test_an_adapter_for_another_base_is_refused_and_changes_nothing() -> None:
    learner = trained_lora(llama(True), 8)
    engine = TorchEngine(llama(True), [1], max_batch=2, max_seq_len=32, autostart=False)
    with pytest.raises(InvalidArgument) as refused:  # no base loaded yet
        engine.stage_weights(publish(learner, LORA_ADAPTER, base_version=0), 1)
    assert refused.value.field == "base_version"
    engine.stage_weights(publish(learner, LORA_BASE, base_version=3), 3)
    engine.step()
    before = engine_logits(engine, [3, 4, 5])
    with pytest.raises(InvalidArgument) as refused:  # a new learner's adapter, old base
        engine.stage_weights(publish(learner, LORA_ADAPTER, base_version=7), 8)
    assert refused.value.field == "base_version"
    engine.step()
    assert engine.policy_version == 3
    assert torch.equal(engine_logits(engine, [3, 4, 5]), before)


def test_two_adapters_are_served_side_by_side_each_request_its_own() -> None:
    base = llama(False)
    first = trained_lora(copy.deepcopy(base), 8, seed=1)
    second = trained_lora(copy.deepcopy(base), 16, seed=2)
    engine = TorchEngine(copy.deepcopy(base), [1], max_batch=4, max_seq_len=32, autostart=False)

    def adapter(model):
        tensors = snapshot_state_dict(model, torch.float32, (), LORA_ADAPTER)
        return tensors

    engine.stage_adapter("first", adapter(first), 4)
    engine.stage_adapter("second", adapter(second), 9)
    prompt = (3, 7, 11, 2)
    streams = {
        name: engine.submit(
            GenerationRequest(
                f"r-{name}", prompt, max_new_tokens=5, temperature=1.0, seed=1, adapter=name
            )
        )
        for name in ("first", "second", "")
    }
    while engine.step():
        pass
    models = {"first": first, "second": second, "": base}
    for name, stream in streams.items():
        result = stream.result()
        ids = list(prompt) + result.token_ids
        with torch.no_grad():
            logits = models[name](input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        expected = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(result.token_ids)]
        assert result.logprobs == pytest.approx(expected, abs=1e-4), name
        assert set(result.versions) == {{"first": 4, "second": 9, "": 0}[name]}


# ----- publication: the base once, then adapters alone, through the board -------------


class _Learner:
    """A LoRA learner's publisher over the `uri` transport, on the real board."""

    def __init__(self, client, run_id: str, folder, sender: Sender | None = None) -> None:
        self.model = trained_lora(llama(True), 8)
        self.state = RunState(client, run_id)
        registry = WorkerRegistry(client, run_id)
        sender = sender or UriSender(registry, folder, timeout_s=5.0)
        self.publisher = WeightPublisher(registry, self.state, sender, "float32", lora=True)

    def step_and_publish(self, version: int) -> None:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if ".lora_B." in name:
                    parameter.add_(0.01 * (version + 1))
        self.publisher.publish(self.model, version, wait=True)

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([ids])).logits[0].float()


IDS = [3, 7, 11, 2, 9]


def test_the_first_version_carries_the_base_and_later_ones_the_adapter_alone(
    redis_client, run_id, tmp_path
) -> None:
    learner = _Learner(redis_client, run_id, tmp_path)
    learner.publisher.publish(learner.model, 0, force_file=True, wait=True)
    base_bytes = learner.publisher.last_bytes
    learner.step_and_publish(1)
    board = learner.state.versions
    assert board.base().version == 0 and board.published().version == 1
    assert learner.publisher.last_bytes * 5 < base_bytes  # tiny model: ~7x fewer bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base-v0.safetensors",
        "policy-v1.safetensors",
    ]
    for version in (2, 3):  # the base file stays; two policy versions are kept
        learner.step_and_publish(version)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base-v0.safetensors",
        "policy-v2.safetensors",
        "policy-v3.safetensors",
    ]


def test_a_late_joiner_and_a_worker_that_missed_versions_serve_the_latest_adapter(
    redis_client, run_id, tmp_path
) -> None:
    learner = _Learner(redis_client, run_id, tmp_path)
    learner.publisher.publish(learner.model, 0, force_file=True, wait=True)
    learner.step_and_publish(1)
    board = learner.state.versions
    board.announce(1)

    def worker() -> tuple[TorchEngine, WeightFollower]:
        engine = TorchEngine(llama(True, seed=9), [1], max_batch=2, max_seq_len=32)
        return engine, WeightFollower(engine, board, tmp_path, pulls=False, k=2, period_s=1)

    behind, behind_follower = worker()  # was there at v1, then misses three versions
    assert behind_follower.await_initial(threading.Event(), lambda: False)
    assert behind.policy_version == 0  # the base is within k: READY
    assert behind_follower.load_if_behind()  # then the adapter of v1
    assert (behind.base_version, behind.policy_version) == (0, 1)
    assert torch.allclose(engine_logits(behind, IDS), learner.logits(IDS), atol=1e-5)
    for version in (2, 3, 4):
        learner.step_and_publish(version)
    board.announce(4)
    late, late_follower = worker()  # joins now: base v0 first, then the adapter of v4
    assert late_follower.await_initial(threading.Event(), lambda: False)
    assert behind_follower.check(behind_before=False) is True  # a push may still come
    assert behind_follower.check(behind_before=True) is False  # loaded v4 alone
    for engine in (late, behind):
        assert (engine.base_version, engine.policy_version) == (0, 4)
        assert torch.allclose(engine_logits(engine, IDS), learner.logits(IDS), atol=1e-5)
        engine.stop()


def test_adapters_go_as_deltas_and_the_worker_serves_the_learners_adapted_logits(
    redis_client, run_id, tmp_path
) -> None:
    """`learner.weights.delta: auto` with LoRA over pull: the base and the first adapters
    go whole (their layouts differ), every later adapter as its delta from the one before,
    rebuilt on the worker into exactly the learner's tensors."""
    store = WeightStore()
    server, port = serve(LearnerStatus(), security=Security(), weights=store)
    sender = PullSender(store, f"grpc://127.0.0.1:{port}", deltas=True)
    learner = _Learner(redis_client, run_id, tmp_path, sender)
    board = learner.state.versions
    engine = TorchEngine(llama(True, seed=9), [1], max_batch=2, max_seq_len=32)
    last = LastPayload()
    follower = WeightFollower(engine, board, None, pulls=True, k=2, period_s=1, last=last)
    try:
        learner.publisher.publish(learner.model, 0, wait=True)
        learner.step_and_publish(1)
        assert learner.publisher.last_delta_bytes == 0  # the adapters after the base
        board.announce(1)
        assert follower.await_initial(threading.Event(), lambda: False)
        assert follower.load_if_behind() and engine.policy_version == 1
        for version in (2, 3):  # one adapter's B moves, as a small update does
            with torch.no_grad():
                b = next(p for n, p in learner.model.named_parameters() if ".lora_B." in n)
                b[0] += 0.01 * version
            learner.publisher.publish(learner.model, version, wait=True)
            assert 0 < learner.publisher.last_delta_bytes < learner.publisher.last_bytes / 2
            board.announce(version)
            assert follower.load_if_behind() and engine.policy_version == version
            assert torch.allclose(engine_logits(engine, IDS), learner.logits(IDS), atol=1e-5)
        assert store.deltas_sent == 2
        assert last.outcomes() == {"rebuilt": 2, "refused_base": 0, "refused_delta": 0}
    finally:
        engine.stop()
        server.stop(None)


def test_a_new_learners_adapter_never_lands_on_the_old_base(redis_client, run_id, tmp_path):
    """A restarted learner publishes its base again; a worker pushed its adapter first
    refuses it (no new label on stale weights) and loads the new base, then the adapter."""
    first = _Learner(redis_client, run_id, tmp_path)
    first.publisher.publish(first.model, 0, force_file=True, wait=True)
    board = first.state.versions
    board.announce(0)
    engine = TorchEngine(llama(True, seed=9), [1], max_batch=2, max_seq_len=32)
    follower = WeightFollower(engine, board, tmp_path, pulls=False, k=2, period_s=1)
    assert follower.await_initial(threading.Event(), lambda: False)
    second = _Learner(redis_client, run_id, tmp_path)  # another warm-up: another base
    with torch.no_grad():
        second.model.model.norm.weight.mul_(1.5)
    second.publisher.publish(second.model, 5, force_file=True, wait=True)
    second.step_and_publish(6)
    adapter = load_file(str(tmp_path / "policy-v6.safetensors"))
    with pytest.raises(InvalidArgument):
        engine.stage_weights(adapter, 6)
    assert engine.policy_version == 0
    board.announce(6)
    follower.check(behind_before=True)  # the new base first
    assert (engine.base_version, engine.policy_version) == (5, 5)
    follower.check(behind_before=True)  # then its adapter
    assert (engine.base_version, engine.policy_version) == (5, 6)
    assert torch.allclose(engine_logits(engine, IDS), second.logits(IDS), atol=1e-5)
    engine.stop()


# ----- checkpoints: scalerl eval's payload and scalerl export --------------------------


@pytest.fixture()
def lora_checkpoint(tmp_path):
    """A tiny LoRA run's config (with its warm-up) and a checkpoint's model.safetensors
    of a trained adapter on a changed base."""
    config = load_config("tiny", ["learner.lora.rank=8"])
    model, _ = load_policy(config.model, seed=config.seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.25)  # what a warm-up does: a base of its own
    trained = trained_lora(model, 8)
    state = {k: v for k, v in trained.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    return config, trained, tmp_path / "model.safetensors"


def test_a_lora_checkpoint_is_served_exactly_as_trained(lora_checkpoint) -> None:
    config, trained, file = lora_checkpoint
    lora = config.learner.lora
    payload = lora_checkpoint_payload(load_file(str(file)), lora.alpha / lora.rank)
    engine = TorchEngine(load_policy(config.model, seed=3)[0], [1], 2, 32, autostart=False)
    engine.stage_weights(payload, 1)
    engine.step()
    with torch.no_grad():
        expected = trained(input_ids=torch.tensor([IDS])).logits[0].float()
    assert torch.allclose(engine_logits(engine, IDS), expected, atol=1e-5)
    with pytest.raises(ValueError, match="learner.lora"):
        lora_checkpoint_payload(load_file(str(file)), None)


def test_export_writes_an_adapter_peft_loads_and_a_merged_model(lora_checkpoint, tmp_path):
    config, trained, file = lora_checkpoint
    with torch.no_grad():
        expected = trained(input_ids=torch.tensor([IDS])).logits[0].float()
    assert export(config, (file,), tmp_path / "adapter", merge=False) == "a peft adapter"
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base")
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.tensor([IDS])).logits[0].float()
    assert torch.allclose(got, expected, atol=1e-5)
    assert export(config, (file,), tmp_path / "merged", merge=True) == "a merged HF model"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(".lora_" in name for name in plain.state_dict())
    with torch.no_grad():
        got = plain(input_ids=torch.tensor([IDS])).logits[0].float()
    assert torch.allclose(got, expected, atol=1e-4)


def _groups(seed: int) -> list[rollout_pb2.RolloutGroup]:
    """Four groups of 4 replies (tokens 3..39 of `llama`'s vocabulary), rewards 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for index in range(4):
        samples = []
        for j in range(4):
            tokens = torch.randint(
                3, 40, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g
            )
            samples.append(
                rollout_pb2.Sample(
                    token_ids=tokens.tolist(),
                    logprobs=[-2.0] * len(tokens),
                    policy_versions=[0] * len(tokens),
                    reward=float(j % 2),
                    finish_reason=rollout_pb2.FINISH_REASON_STOP,
                )
            )
        prompt = torch.randint(3, 40, (5,), generator=g).tolist()
        groups.append(
            rollout_pb2.RolloutGroup(group_id=f"g{index}", prompt_token_ids=prompt, samples=samples)
        )
    return groups


def test_only_adapters_train_and_a_checkpoint_resumes_them_exactly(tmp_path) -> None:
    config = LearnerConfig(lr=1e-2, autocast_bf16=False)
    trainer = Trainer(trained_lora(llama(False), 8), config, temperature=1.0)
    frozen = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" not in n
    }
    trainer.step(_groups(1))
    assert {id(p) for p in trainer.params} == {
        id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n
    }
    for name, parameter in trainer.model.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name]), name  # the base and the head
    state = trainer.optimizer.state
    assert len(state) == len(trainer.params)  # AdamW moments of the adapters only
    save_checkpoint(tmp_path / "ckpt", trainer, LearnerState(step=1, policy_version=1))
    resumed = Trainer(trained_lora(llama(False, seed=4), 8, seed=9), config, temperature=1.0)
    load_checkpoint(tmp_path / "ckpt", resumed)
    for trainer_ in (trainer, resumed):
        trainer_.step(_groups(2))
    ours = snapshot_state_dict(trainer.model, torch.float32, (), LORA_BASE)
    theirs = snapshot_state_dict(resumed.model, torch.float32, (), LORA_BASE)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


# ----- several adapters over gRPC: one worker, two runs over one base ------------------


def test_a_worker_serves_a_named_adapter_over_grpc_beside_its_policy() -> None:
    """UpdateWeights with header.adapter loads another run's adapter; Generate naming it
    gets that adapter's log-probs and version; an unknown name is INVALID_ARGUMENT."""
    base = llama(True)
    tenant = trained_lora(copy.deepcopy(base), 8, seed=4)
    engine = TorchEngine(copy.deepcopy(base), [1], max_batch=4, max_seq_len=32)
    servicer = RolloutServicer(engine, CharTokenizer(), "w", "tiny", "", 5)
    server, port, _ = start_server(servicer, security=Security())
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel(f"127.0.0.1:{port}", Security()))
        payload = save_safetensors(snapshot_state_dict(tenant, torch.float32, (), LORA_ADAPTER))
        requests = list(weights_requests(payload, 7))
        requests[0].header.adapter = "tenant-a"
        assert stub.UpdateWeights(iter(requests), timeout=10).policy_version == 7
        assert engine.policy_version == 0 and engine.adapters == ["tenant-a"]
        prompt = [3, 7, 11, 2]
        request = rollout_pb2.GenerateRequest(prompt_token_ids=prompt, adapter="tenant-a")
        request.sampling.max_new_tokens = 4
        request.sampling.seed = 3
        chunks = list(stub.Generate(request, timeout=10))
        tokens = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in c.logprobs]
        assert {v for c in chunks for v in c.policy_versions} == {7}
        with torch.no_grad():
            logits = tenant(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        expected = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert logprobs == pytest.approx(expected, abs=1e-4)
        request.adapter = "tenant-b"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter" in refused.value.details()
    finally:
        server.stop(grace=None)
        engine.stop()


# ----- configs that cannot work: one line naming the field -----------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["learner.lora.rank=128"], "learner.lora.rank must be <= rollout.max_lora_rank (64)"),
        (["learner.lora.rank=0"], "learner.lora.rank"),
        (["learner.lora.dropout=1"], "learner.lora.dropout"),
    ],
)
def test_a_lora_config_that_cannot_work_is_refused(overrides, named) -> None:
    with pytest.raises(ValueError) as refused:
        load_config("tiny", ["learner.lora.rank=8", *overrides])
    assert named in str(refused.value).replace("\n  ", ".")


def test_target_modules_the_model_lacks_are_one_line_and_exit_2(tmp_path, capsys) -> None:
    config = load_config("tiny", ["learner.lora.target_modules=[qkv_proj]"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert preflight.main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("learner.lora.target_modules: ['qkv_proj']")
