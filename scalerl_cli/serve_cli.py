"""`scalerl serve [CHECKPOINT]`: a model on our own rollout engine behind an OpenAI-compatible
chat-completions endpoint, e.g. as the `judge` verifier's judge (`verifier.judge.url`).

    scalerl serve RUN_DIR --port 8000 [--host H --key-file F --model-name NAME --set K=V]

CHECKPOINT is what `scalerl eval` takes (a run folder, its checkpoint/, an HF model folder
or a .safetensors file); without one, the config's model as it loads (the embedded
SmolLM2, or `model.path`). The engine is the config's (`rollout.engine`), on the resolved
device and dtype; concurrent requests are batched by it.

Routes: GET /v1/models, POST /v1/chat/completions (messages; max_tokens, temperature,
top_p, seed; n = 1; no streaming). A bad request is a 400 naming the field; with
--key-file every request must carry `Authorization: Bearer KEY` (401 otherwise), and a
host other than loopback needs one. Prints "serving MODEL at http://HOST:PORT/v1" once
ready and serves until SIGINT or SIGTERM. Bad input (no such checkpoint, a bad config
field, a public host without a key) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
REQUEST_TIMEOUT_S = 600.0
MAX_BODY_BYTES = 8 << 20


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `scalerl serve` on the top-level subparsers."""
    from scalerl_cli.options import add_config_options

    parser = sub.add_parser(
        "serve",
        help="Serve a checkpoint on our engine behind an OpenAI-compatible API.",
        description="Load CHECKPOINT (or the config's model) into a rollout engine and serve "
        "/v1/chat/completions, e.g. as a judge.",
    )
    parser.add_argument("checkpoint", type=Path, nargs="?", default=None, metavar="CHECKPOINT")
    add_config_options(parser, default_config=None)
    parser.add_argument("--port", type=int, default=8000, help="Port (0 = a free one).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    parser.add_argument(
        "--key-file", default="", help="File holding the API key clients must send."
    )
    parser.add_argument(
        "--model-name", default="", help="The model's name in the API (default: the folder's)."
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="Torch threads (0 = every usable core)."
    )


def main(args: argparse.Namespace) -> int:
    """Run `scalerl serve`; 0 after a signal, 2 on bad input (one line on stderr)."""
    from scalerl.entrypoint import config_error, load_config_or_none, resolve_hardware_or_none
    from scalerl.rpc.errors import InvalidArgument
    from scalerl.rpc.security import read_secret
    from scalerl_cli.eval_cli import find_source, loaded_engine

    try:
        source = find_source(args.checkpoint) if args.checkpoint is not None else None
        key = read_secret("--key-file", args.key_file) if args.key_file else ""
        if not key and args.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"--host {args.host} is reachable from elsewhere: give --key-file")
    except (FileNotFoundError, ValueError) as exc:
        print(f"scalerl serve: {config_error(exc)}", file=sys.stderr)
        return 2
    name = args.config or (str(source.config) if source and source.config else "default")
    config = load_config_or_none("scalerl serve", name, args.set, args.recipe, args.leave_out)
    resolved = resolve_hardware_or_none("scalerl serve", config) if config else None
    if resolved is None:
        return 2
    model_name = args.model_name or _default_name(args.checkpoint, resolved.config)
    weights = source.weights if source is not None else ()
    try:
        with loaded_engine(resolved, weights, args.threads) as (engine, tokenizer):
            api = ChatApi(engine, tokenizer, model_name, resolved.config.rollout.max_seq_len, key)
            server = ThreadingHTTPServer((args.host, args.port), api.handler())
            server.daemon_threads = True
            stop = _stop_on_signals(server)
            port = server.server_address[1]
            print(f"serving {model_name} at http://{args.host}:{port}/v1", flush=True)
            server.serve_forever()
            stop.set()
            server.server_close()
    except InvalidArgument as exc:
        print(f"scalerl serve: {args.checkpoint}: {exc}", file=sys.stderr)
        return 2
    return 0


def _default_name(checkpoint: Path | None, config: Any) -> str:
    if checkpoint is not None:
        return checkpoint.resolve().name
    return str(getattr(config.model, "path", "") or config.model.kind)


def _stop_on_signals(server: ThreadingHTTPServer) -> threading.Event:
    import signal

    stopped = threading.Event()

    def stop(_signum: int, _frame: object) -> None:
        if not stopped.is_set():
            stopped.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    return stopped


class BadRequest(ValueError):
    """A request the API refuses: `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ChatApi:
    """Chat completions on `engine` (a started rollout engine) with `tokenizer` (its
    `PolicyTokenizer`): each request's messages rendered by the model's chat template,
    one `GenerationRequest` each, answered in OpenAI's chat.completion shape."""

    def __init__(self, engine: Any, tokenizer: Any, model: str, max_seq_len: int, key: str) -> None:
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.max_seq_len, self.key = max_seq_len, key

    def complete(self, body: Any) -> dict[str, Any]:
        """The chat.completion of one request body. Raises BadRequest naming the field."""
        from rollout_service.engines.api import GenerationRequest
        from scalerl.rpc.errors import InvalidArgument
        from scalerl.v1 import rollout_pb2

        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        if body.get("stream"):
            raise BadRequest("stream", "streaming is not served")
        if body.get("n", 1) != 1:
            raise BadRequest("n", "only n = 1 is served")
        prompt = self._prompt_ids(body.get("messages"))
        room = self.max_seq_len - len(prompt)
        if room < 1:
            limit = self.max_seq_len
            raise BadRequest("messages", f"{len(prompt)} tokens leave no room in {limit}")
        request = GenerationRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            prompt_ids=tuple(prompt),
            max_new_tokens=_number(body, "max_tokens", int, room),
            temperature=_number(body, "temperature", float, 1.0),
            top_p=_number(body, "top_p", float, 1.0),
            seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
        )
        try:
            done = self.engine.submit(request).result(timeout=REQUEST_TIMEOUT_S)
        except InvalidArgument as exc:
            raise BadRequest(_param(exc.field), exc.message) from None
        forced = done.forced or [False] * len(done.token_ids)
        stops = self.tokenizer.stop_token_ids
        pairs = zip(done.token_ids, forced, strict=True)
        ids = [t for t, was_forced in pairs if not was_forced and t not in stops]
        length = done.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
        return {
            "id": request.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.tokenizer.decode(ids)},
                    "finish_reason": "length" if length else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(done.token_ids),
                "total_tokens": len(prompt) + len(done.token_ids),
            },
        }

    def _prompt_ids(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", "must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise BadRequest(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise BadRequest(f"messages[{i}].content", "must be text")
        try:
            return list(self.tokenizer.prompt_ids(messages, ""))
        except KeyError as exc:  # the tiny model's characters
            raise BadRequest("messages", f"character {exc} is outside the vocabulary") from None

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self._refused():
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._reply(200, api.models())
                else:
                    self._reply(404, _error(f"no route {self.path}", "path"))

            def do_POST(self) -> None:  # noqa: N802
                if self._refused():
                    return
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._reply(404, _error(f"no route {self.path}", "path"))
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY_BYTES:
                    self._reply(400, _error(f"a body of 1..{MAX_BODY_BYTES} bytes", "body"))
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                    self._reply(200, api.complete(body))
                except BadRequest as exc:
                    self._reply(400, _error(str(exc), exc.param))
                except ValueError as exc:
                    self._reply(400, _error(f"not JSON: {exc}", "body"))

            def _refused(self) -> bool:
                if api.key and self.headers.get("Authorization") != f"Bearer {api.key}":
                    self._reply(401, _error("invalid API key", "authorization"))
                    return True
                return False

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up

            def log_message(self, *args: object) -> None:
                return None

        return Handler


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(name, f"must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise BadRequest(name, f"must be an integer, got {value!r}")
    return kind(value)


def _param(field: str) -> str:
    """The API's name of an engine request field."""
    return {"max_new_tokens": "max_tokens", "prompt_ids": "messages"}.get(field, field)


def _error(message: str, param: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param}}
