"""A small stand-in for an SGLang server: the native HTTP calls the SGLang engine makes,
with SGLang's request and response shapes, over a deterministic fake model.

Shapes follow SGLang's `entrypoints/http_server.py` and `managers/io_struct.py` (see the
module docstring of `rollout_service.engines.sglang.client`). Behaviour mirrored from SGLang:
streamed `data: {json}` events with cumulative `output_ids` and `meta_info`, ending with
`data: [DONE]`; finish reasons {type: stop, matched} / {type: length, length} / {type:
abort, message}; one token per running request per scheduler step; `/pause_generation`
mode in_place stops stepping and keeps requests, `/continue_generation` resumes;
`/abort_request` by rid (unknown rids are ignored); `/update_weights_from_disk` reads a
directory of safetensors files, refuses unknown tensors or wrong shapes (SGLang rolls
back) and keeps tensors the file lacks (SGLang loads only what it finds); `/flush_cache`
answers 400 while requests are unfinished; per-token `weight_versions` spans. Stricter
than SGLang on purpose, to catch adapter mistakes: unknown top-level or sampling fields,
`text` input and `flush_cache` = true with unfinished requests get HTTP 400. LoRA
adapters (`max_lora_rank`): sglang_standin_lora.py.

The fake model: vocabulary V; the parameters "model.embed_tokens.weight" [V, 4] and
"lm_head.weight" [V, 4] (zeros at start); step = 1 + round(lm_head.weight[0, 0]). The next
token after token x has logits[j] = -d(j, (x + step) mod V), d the circular distance on
0..V-1, so greedy decoding counts up by `step` and its log-prob is -log(1 + 2 sum_{k=1}^{V/2-1}
e^-k + e^-(V/2)) for even V. Sampling (T > 0) draws from softmax(logits / T) restricted to
the top-p nucleus with a per-request `random.Random(sampling_seed)`; `output_token_logprobs`
are log softmax(logits / T) before top-p (SGLang's sampler), greedy untempered, and
`output_token_sampling_logprobs` (with return_sampling_mask) are renormalised over the
nucleus.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sglang_standin_http import (
    GENERATE_FIELDS,
    UPDATE_FIELDS,
    BadRequest,
    QuietServer,
    check_fields,
    check_sampling,
    handler,
)
from sglang_standin_lora import StandinLoRA

PARAMS = {"model.embed_tokens.weight": (4,), "lm_head.weight": (4,)}  # shapes after [V]


@dataclass(eq=False)
class _Req:
    rid: str
    input_ids: list[int]
    params: dict
    stream: bool
    return_logprob: bool
    logprob_start_len: int
    sampling_mask: bool
    rng: random.Random
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    input_logprobs: list | None = None
    lora: str | None = None  # the adapter's name (`lora_path`), held until finished
    shift: float = 0.0  # the adapter's effect on the fake model's step
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens)
    finish: dict | None = None


class SGLangStandin:
    """The stand-in server on 127.0.0.1 (port 0 = any free port). step_s: seconds between
    scheduler steps; spans=False leaves `weight_versions` out (an older SGLang); api_key:
    every request must carry `Authorization: Bearer <api_key>` ("" = none); max_lora_rank:
    serve LoRA adapters up to this rank (None = LoRA off). Every request is recorded in
    `calls` as (method, path, JSON body or None)."""

    def __init__(
        self,
        vocab: int = 16,
        context_len: int = 256,
        step_s: float = 0.002,
        spans: bool = True,
        weight_version: str = "default",
        api_key: str = "",
        max_lora_rank: int | None = None,
    ) -> None:
        self.api_key = api_key  # as SGLang's --api-key: 401 without it
        self.vocab = vocab
        self.context_len = context_len
        self.step_s = step_s
        self.spans = spans
        self.weight_version = weight_version
        self.weights = {name: torch.zeros(vocab, *shape) for name, shape in PARAMS.items()}
        self.calls: list[tuple[str, str, dict | None]] = []
        self.paused = False
        self._cond = threading.Condition()
        self.lora = StandinLoRA(max_lora_rank, self._cond)
        self._reqs: dict[str, _Req] = {}
        self._stopped = False
        self._server = QuietServer(("127.0.0.1", 0), handler(self))
        self._server.daemon_threads = True
        self._threads = [
            threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True),
            threading.Thread(target=self._schedule, daemon=True),
        ]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> SGLangStandin:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def bodies(self, path: str) -> list[dict | None]:
        """Recorded JSON bodies of the calls to `path`, in order."""
        with self._cond:
            return [body for _, p, body in self.calls if p == path]

    def paths(self) -> list[str]:
        with self._cond:
            return [p for _, p, _ in self.calls]

    def state_dict(self, step: int) -> dict[str, torch.Tensor]:
        """Weights of the fake model that counts up by `step` (>= 1)."""
        weights = {name: torch.zeros(self.vocab, *shape) for name, shape in PARAMS.items()}
        weights["lm_head.weight"][0, 0] = step - 1
        return weights

    # ----- the fake model ------------------------------------------------------------------

    def step_size(self, shift: float = 0.0) -> int:
        return 1 + int(round(float(self.weights["lm_head.weight"][0, 0]) + shift))

    def logits(self, last: int, shift: float = 0.0) -> list[float]:
        target = (last + self.step_size(shift)) % self.vocab
        return [-min(abs(j - target), self.vocab - abs(j - target)) for j in range(self.vocab)]

    def _sample(self, req: _Req) -> None:
        logits = self.logits((req.input_ids + req.output_ids)[-1], req.shift)
        temperature = float(req.params.get("temperature", 1.0))
        if temperature == 0:  # greedy: SGLang's sampler reports the untempered log-softmax
            token = max(range(self.vocab), key=lambda j: logits[j])
            logp = _log_softmax(logits)
            req.output_ids.append(token)
            req.logprobs.append(logp[token])
            req.sampling_logprobs.append(logp[token])
            req.masks.append([token])
            return
        logp = _log_softmax([x / temperature for x in logits])
        order = sorted(range(self.vocab), key=lambda j: -logp[j])
        top_p = float(req.params.get("top_p", 1.0))
        nucleus, mass = [], 0.0
        for j in order:  # the smallest most-likely set whose mass reaches top_p
            if nucleus and mass >= top_p:
                break
            nucleus.append(j)
            mass += math.exp(logp[j])
        u = req.rng.random() * mass
        token, acc = nucleus[-1], 0.0
        for j in nucleus:
            acc += math.exp(logp[j])
            if u < acc:
                token = j
                break
        req.output_ids.append(token)
        req.logprobs.append(logp[token])
        req.sampling_logprobs.append(logp[token] - math.log(mass))
        req.masks.append(nucleus)

    def _prefill(self, req: _Req) -> None:
        """Input log-probs from logprob_start_len on (None for position 0)."""
        if not req.return_logprob or req.logprob_start_len < 0:
            req.input_logprobs = []
            return
        rows = []
        for pos in range(req.logprob_start_len, len(req.input_ids)):
            token = req.input_ids[pos]
            previous = req.input_ids[pos - 1]
            value = None if pos == 0 else _log_softmax(self.logits(previous, req.shift))[token]
            rows.append([value, token, None])
        req.input_logprobs = rows

    def _schedule(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self.paused:
                    for req in list(self._reqs.values()):
                        if req.finish is None:
                            self._advance(req)
                    self._cond.notify_all()
            time.sleep(self.step_s)

    def _advance(self, req: _Req) -> None:
        if req.input_logprobs is None:
            self._prefill(req)
        max_new = int(req.params.get("max_new_tokens", 128))
        if len(req.output_ids) < max_new:
            self._sample(req)
            token = req.output_ids[-1]
            if token in set(req.params.get("stop_token_ids") or ()):
                self._finish(req, {"type": "stop", "matched": token})
                return
        if len(req.output_ids) >= max_new:
            self._finish(req, {"type": "length", "length": max_new})

    def _finish(self, req: _Req, reason: dict) -> None:
        """End `req` (under the lock), giving back its adapter."""
        req.finish = reason
        self.lora.release(req.lora)

    # ----- request handling ----------------------------------------------------------------

    def record(self, method: str, path: str, body: dict | None) -> None:
        with self._cond:
            self.calls.append((method, path, body))

    def register(self, body: dict) -> _Req:
        check_fields(body, GENERATE_FIELDS, "request")
        if body.get("text") is not None:
            raise BadRequest("the stand-in has no tokenizer: send input_ids")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("input_ids must be a non-empty list of token ids")
        if any(not 0 <= t < self.vocab for t in ids):
            raise BadRequest(f"input_ids: token id outside 0..{self.vocab - 1}")
        params = body.get("sampling_params") or {}
        check_sampling(params, self.vocab)
        if len(ids) + int(params.get("max_new_tokens", 128)) > self.context_len:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens."
            )
        seed = params.get("sampling_seed")
        rid = body.get("rid") or f"standin-{time.monotonic_ns()}"
        req = _Req(
            rid=rid,
            input_ids=list(ids),
            params=params,
            stream=bool(body.get("stream", False)),
            return_logprob=bool(body.get("return_logprob", False)),
            logprob_start_len=int(body.get("logprob_start_len", -1)),
            sampling_mask=bool(body.get("return_sampling_mask", False)),
            rng=random.Random(seed if seed is not None else rid),
        )
        with self._cond:
            old = self._reqs.get(rid)
            if old is not None and old.finish is None:
                raise BadRequest(f"Duplicate request ID: {rid}")
            req.lora = body.get("lora_path")
            req.shift = self.lora.acquire(req.lora)
            self._reqs[rid] = req
        return req

    def output(self, req: _Req) -> dict:
        """SGLang's out dict for a request as it stands (call under the lock)."""
        n = len(req.output_ids)
        meta = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if self.spans:
            meta["weight_versions"] = _spans(req.events, self.weight_version, n)
        if req.return_logprob:
            meta["input_token_logprobs"] = req.input_logprobs or []
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)
            ]
        if req.sampling_mask:
            meta["output_token_sampling_mask"] = [list(m) for m in req.masks]
            meta["output_token_sampling_logprobs"] = list(req.sampling_logprobs)
        text = " ".join(f"t{t}" for t in req.output_ids)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def wait_output(self, req: _Req, sent: int, timeout: float) -> dict | None:
        """The next out dict once there are tokens past `sent` or the request finished."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._stopped or req.finish is not None or len(req.output_ids) > sent,
                timeout,
            )
            return self.output(req) if ok and not self._stopped else None

    def abort(self, rid: str, message: str = "Abort request") -> None:
        with self._cond:
            req = self._reqs.get(rid)
            if req is not None and req.finish is None:
                self._finish(req, {"type": "abort", "message": message})
                self._cond.notify_all()

    def set_paused(self, paused: bool) -> None:
        with self._cond:
            self.paused = paused
            self._cond.notify_all()

    def unfinished(self) -> int:
        with self._cond:
            return sum(req.finish is None for req in self._reqs.values())

    def update_from_disk(self, body: dict) -> tuple[bool, str]:
        check_fields(body, UPDATE_FIELDS, "update request")
        path = body.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("model_path must be a string")
        if body.get("flush_cache", True) and self.unfinished():
            return False, "Cache flush failed after updating weights: requests are unfinished"
        directory = Path(path)
        if not directory.is_dir():  # SGLang would try to download it from the hub
            return False, f"Failed to get weights iterator: {path} is not a directory."
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return False, f"Failed to get weights iterator: no *.safetensors in {path}."
        from safetensors.torch import load_file

        try:
            loaded = {}
            for file in files:
                loaded.update(load_file(str(file)))
        except Exception as exc:
            return False, f"Failed to get weights iterator: {exc}."
        for name, tensor in loaded.items():
            expected = self.weights.get(name)
            if expected is None or tuple(tensor.shape) != tuple(expected.shape):
                return False, (
                    f"Failed to update weights: {name} does not fit the model.\n"
                    "Rolling back to original weights."
                )
        with self._cond:
            for name, tensor in loaded.items():
                self.weights[name] = tensor.float().clone()
            new_version = body.get("weight_version")
            if new_version is not None and str(new_version) != self.weight_version:
                for req in self._reqs.values():
                    if req.finish is None and req.output_ids:
                        req.events.append((self.weight_version, len(req.output_ids)))
                self.weight_version = str(new_version)
        return True, "Succeeded to update model weights."


def _log_softmax(values: list[float]) -> list[float]:
    peak = max(values)
    total = math.log(sum(math.exp(v - peak) for v in values)) + peak
    return [v - total for v in values]


def _spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """SGLang's weight-version spans over output positions [0, n): one span per version,
    contiguous, the last one the current version."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans
