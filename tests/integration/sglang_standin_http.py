"""The HTTP face of the SGLang stand-in (sglang_standin.py): the server, the request handler
for /generate, /abort_request, /update_weights_from_disk, the LoRA calls and the rest, and
the request checks with SGLang's own error messages."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_standin import SGLangStandin


# The fields SGLang's request models accept; anything else is refused as SGLang does.
GENERATE_FIELDS = {
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "return_sampling_mask",
    "cache_salt",
    "extra_key",
    "lora_path",
}
SAMPLING_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop_token_ids",
    "sampling_seed",
    "ignore_eos",
    "no_stop_trim",
    "skip_special_tokens",
}
UPDATE_FIELDS = {
    "model_path",
    "load_format",
    "abort_all_requests",
    "weight_version",
    "is_async",
    "torch_empty_cache",
    "keep_pause",
    "recapture_cuda_graph",
    "token_step",
    "flush_cache",
}


class BadRequest(ValueError):
    """Answered with HTTP 400 and {"error": {"message": ...}} (SGLang's error body)."""


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        return  # a client closing its connection mid-request is normal here


def handler(standin: SGLangStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def _authorized(self) -> bool:
            if not standin.api_key or self.headers.get("Authorization") == (
                f"Bearer {standin.api_key}"
            ):
                return True
            self._send(401, b"")
            return False

        def do_GET(self) -> None:
            standin.record("GET", self.path, None)
            if not self._authorized():
                return
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/get_model_info":
                self._json(
                    200,
                    {
                        "model_path": "standin",
                        "tokenizer_path": None,
                        "is_generation": True,
                        "preferred_sampling_params": None,
                        "weight_version": standin.weight_version,
                    },
                )
            elif self.path == "/flush_cache":
                self._flush()
            else:
                self._send(404, b"")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            standin.record("POST", self.path, body)
            if not self._authorized():
                return
            try:
                self._route(body if isinstance(body, dict) else {})
            except BadRequest as exc:
                self._json(400, {"error": {"message": str(exc)}})

        def _route(self, body: dict) -> None:
            if self.path == "/generate":
                self._generate(body)
            elif self.path == "/abort_request":
                if body.get("abort_all"):
                    for rid in list(standin._reqs):
                        standin.abort(rid)
                else:
                    standin.abort(str(body.get("rid", "")))
                self._send(200, b"")
            elif self.path == "/pause_generation":
                mode = body.get("mode", "abort")
                if mode not in ("abort", "retract", "in_place"):
                    raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
                if mode == "abort":
                    for rid in list(standin._reqs):
                        standin.abort(rid)
                standin.set_paused(True)
                self._json(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif self.path == "/continue_generation":
                standin.set_paused(False)
                self._json(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif self.path == "/update_weights_from_disk":
                ok, message = standin.update_from_disk(body)
                reply = {"success": ok, "message": message, "num_paused_requests": 0}
                self._json(200 if ok else 400, reply)
            elif self.path in ("/load_lora_adapter", "/unload_lora_adapter"):
                load = self.path == "/load_lora_adapter"
                ok, reply = standin.lora.load(body) if load else standin.lora.unload(body)
                self._json(200 if ok else 400, reply)
            elif self.path == "/flush_cache":
                self._flush()
            else:
                self._send(404, b"")

        def _flush(self) -> None:
            busy = standin.unfinished() > 0
            text = (
                b"Cache flushed.\nPlease check backend logs for more details. (When there "
                b"are running or waiting requests, the operation will not be performed.)\n"
            )
            self._send(400 if busy else 200, text)

        def _generate(self, body: dict) -> None:
            req = standin.register(body)
            if not req.stream:
                out = None
                while out is None or out["meta_info"]["finish_reason"] is None:
                    out = standin.wait_output(req, len(req.output_ids), 60.0)
                    if out is None:
                        raise BadRequest("the stand-in stopped")
                self._json(200, out)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent = 0
            try:
                while True:
                    out = standin.wait_output(req, sent, 60.0)
                    if out is None:
                        break
                    sent = len(out["output_ids"])
                    self._chunk(b"data: " + json.dumps(out).encode() + b"\n\n")
                    if out["meta_info"]["finish_reason"] is not None:
                        break
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except OSError:  # the client went away: SGLang aborts the request
                standin.abort(req.rid, "client disconnected")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _json(self, status: int, payload: object) -> None:
            self._send(status, json.dumps(payload).encode(), "application/json")

        def _send(self, status: int, data: bytes, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def check_fields(body: dict, allowed: set[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"{what}: unknown field {unknown[0]!r}")


def check_sampling(params: dict, vocab: int) -> None:
    """SamplingParams.verify's checks on the fields the adapter sends."""
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    check_fields(params, SAMPLING_FIELDS, "sampling_params")
    temperature = params.get("temperature", 1.0)
    if not isinstance(temperature, int | float) or temperature < 0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}.")
    top_p = params.get("top_p", 1.0)
    if not isinstance(top_p, int | float) or not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    if params.get("top_k", -1) != -1 and not params.get("top_k", -1) >= 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {params['top_k']}.")
    if not 0.0 <= params.get("min_p", 0.0) <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {params['min_p']}.")
    max_new = params.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or any(not 0 <= int(t) < vocab for t in stops):
        raise BadRequest("stop_token_ids must be a list of token ids")
    seed = params.get("sampling_seed")
    if seed is not None and not isinstance(seed, int):
        raise BadRequest("sampling_seed must be an integer")
