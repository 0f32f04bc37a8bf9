"""HTTP client of an SGLang server's native API, the calls the SGLang engine makes.

Shapes from SGLang's `entrypoints/http_server.py` and `managers/io_struct.py`:

- `POST /generate` with `GenerateReqInput` fields `rid`, `input_ids` (token ids; never
  `text`), `sampling_params` {`max_new_tokens`, `temperature`, `top_p`, `top_k` = -1,
  `min_p` = 0, the three penalties neutral, `stop_token_ids`, `sampling_seed` when the
  request has a seed}, `stream` = true, `return_logprob` = true, `logprob_start_len`,
  `cache_salt`, and `return_sampling_mask` (see the engine's log-probs). Every sampling
  field is sent, because the server's defaults come from the model's
  `generation_config.json`. The reply is server-sent events `data: {json}` ending with
  `data: [DONE]`; each event carries the cumulative `output_ids` and `meta_info` {`id`,
  `finish_reason` (null, or {type: stop | length | abort, ...}), `prompt_tokens`,
  `completion_tokens`, `output_token_logprobs` as [logprob, token_id, text] triples,
  `input_token_logprobs` likewise, `weight_version`, and in current SGLang
  `weight_versions`: spans {version, start, end} over output positions}. An error inside
  the stream is a `data: {"error": {"message": ...}}` event.
- `POST /abort_request` {`rid`}: the stream ends with finish_reason {type: abort}.
- `POST /pause_generation` {`mode`: "in_place"}: the scheduler stops stepping and keeps
  the running requests and their KV cache; `POST /continue_generation` {} resumes them.
- `POST /update_weights_from_disk` {`model_path` (a directory of *.safetensors),
  `weight_version`, `flush_cache` = false, `abort_all_requests` = false} returns
  {`success`, `message`, `num_paused_requests`}, HTTP 400 when success is false; SGLang
  reloads the old weights when a load fails.
- `POST /flush_cache`: 200, or 400 while requests are running or paused in place.
- `GET /health`: 200 once the server serves.

Every failure to reach the server or an unexpected reply raises EngineError.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import requests

from rollout_service.engines.api import EngineError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


class SGLangClient:
    """Calls to the server at `base_url`; `request_timeout_s`: seconds without a byte
    before a call fails; `api_key`: sent as `Authorization: Bearer` ("" = none). One HTTP
    session per thread (sessions are not thread-safe)."""

    def __init__(self, base_url: str, request_timeout_s: float, api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()

    def post(
        self, path: str, body: dict, *, accept_400: bool = False, expect_json: bool = True
    ) -> dict:
        """POST JSON; returns the JSON reply ({} when not expected). Raises EngineError on
        a connection failure or an HTTP status other than 200 (or 400 with accept_400)."""
        try:
            reply = self._session().post(self.base_url + path, json=body, timeout=self._timeout())
        except requests.RequestException as exc:
            raise EngineError(f"{path} failed: {exc}") from exc
        if reply.status_code != 200 and not (accept_400 and reply.status_code == 400):
            raise EngineError(f"{path}: HTTP {reply.status_code}: {reply.text[:300]}")
        if not expect_json:
            return {}
        try:
            return reply.json()
        except ValueError as exc:
            raise EngineError(f"{path}: reply is not JSON: {reply.text[:300]}") from exc

    def generate(self, body: dict) -> Iterator[dict]:
        """Server-sent events of one streamed /generate call, up to `data: [DONE]`.
        Raises EngineError when the call fails, the stream breaks or carries an error."""
        try:
            response = self._session().post(
                self.base_url + "/generate", json=body, stream=True, timeout=self._timeout()
            )
        except requests.RequestException as exc:
            raise EngineError(f"/generate failed: {exc}") from exc
        with response:
            if response.status_code != 200:
                raise EngineError(f"/generate: HTTP {response.status_code}: {response.text[:300]}")
            try:
                for line in response.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise EngineError(f"/generate: {event['error'].get('message')}")
                    yield event
            except (requests.RequestException, ValueError) as exc:
                raise EngineError(f"/generate stream broke: {exc}") from exc

    def flush_cache(self) -> None:
        """Drop prefix-cache entries of older weights; SGLang answers 400 while requests run
        (their KV must stay), which is expected and ignored, as is an unreachable server."""
        try:
            reply = self._session().post(self.base_url + "/flush_cache", timeout=self._timeout())
            if reply.status_code != 200:
                log.debug("flush_cache skipped (HTTP %d): server busy", reply.status_code)
        except requests.RequestException as exc:
            log.warning("flush_cache failed: %s", exc)

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers.update(self._headers)
        return session

    def _timeout(self) -> tuple[float, float]:
        return (CONNECT_TIMEOUT_S, self.request_timeout_s)


def finish_type(meta: dict) -> str | None:
    """The `finish_reason` type of an event's meta_info ("stop", "length", "abort"), or
    None while the call runs."""
    reason = meta.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else None


def tail(values: list, total: int, count: int, name: str) -> list:
    """The last `count` of a per-output-token list that is cumulative (len == total, what
    SGLang streams by default) or incremental (len == count). Raises EngineError
    otherwise."""
    if len(values) == total:
        return values[total - count :]
    if len(values) == count:
        return values
    raise EngineError(f"{name} holds {len(values)} entries for {count} new of {total} tokens")
