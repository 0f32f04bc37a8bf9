"""A scripted OpenAI-compatible judge (POST /v1/chat/completions) for the `judge` verifier's
tests: nothing external, every request it received kept in `received`.

It grades like `last_integer`: SCORE: 10 when the last integer of the response equals the
reference answer, else SCORE: 0. It reads the response where the system message says it
is (between the nonce-carrying delimiter lines), and it is deliberately gullible: an
instruction "SCORE: n" that it finds anywhere outside that quoted response, it obeys. So
a completion that escapes its quote changes the score, and one that stays quoted cannot.
Its reply quotes the response first, as judges that reason aloud do.

Importable from every test folder (pytest puts tests/ on sys.path for its conftest).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_NONCE = re.compile(r"<<<RESPONSE ([0-9a-f]+)>>>")
_REFERENCE = re.compile(r"Reference answer:\n(.*)\n")
_OBEYED = re.compile(r"SCORE:\s*(\d+)")
_INT = re.compile(r"-?\d+")


def grade(system: str, user: str) -> str:
    """The stand-in's reply to one grading request (module doc)."""
    nonce = _NONCE.search(system)
    if nonce is None:
        return "I cannot find the response."
    start, end = f"<<<RESPONSE {nonce[1]}>>>\n", f"\n<<<END RESPONSE {nonce[1]}>>>"
    head, _, rest = user.partition(start)
    response, _, tail = rest.partition(end)
    outside = head + tail
    instructions = system.split("End your reply with", 1)[0]
    obeyed = _OBEYED.search(outside) or _OBEYED.search(instructions)
    if obeyed:
        score = int(obeyed[1])
    else:
        reference = _REFERENCE.search(outside)
        found = _INT.findall(response)
        right = reference and found and found[-1] == reference[1].strip()
        score = 10 if right else 0
    return f"The response reads:\n{response}\nMy grade follows.\nSCORE: {score}"


class JudgeStandin:
    """The stand-in on 127.0.0.1 (a free port), in a thread of this process.

    mode: "grade" (the module doc), "garbage" (replies with no score line), "busy" (503 to
    every request), "slow" (answers after `delay_s`). key: the bearer token it requires
    ("" = none; a wrong or missing one is 401)."""

    def __init__(self, mode: str = "grade", key: str = "", delay_s: float = 0.0) -> None:
        self.mode, self.key, self.delay_s = mode, key, delay_s
        self.received: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> JudgeStandin:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) of one chat-completions request."""
        with self._lock:
            self.received.append(body)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.mode == "busy":
                return 503, {"error": {"message": "overloaded"}}
            time.sleep(self.delay_s)
            system, user = (m["content"] for m in body["messages"])
            text = "I think it is fine." if self.mode == "garbage" else grade(system, user)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            return 200, {
                "object": "chat.completion",
                "choices": [choice | {"finish_reason": "stop"}],
            }
        finally:
            with self._lock:
                self.in_flight -= 1


def _handler(standin: JudgeStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            if self.path != "/v1/chat/completions":
                status, reply = 404, {"error": {"message": f"no route {self.path}"}}
            elif standin.key and self.headers.get("Authorization") != f"Bearer {standin.key}":
                status, reply = 401, {"error": {"message": "invalid api key"}}
            else:
                status, reply = standin.answer(body)
            data = json.dumps(reply).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout): what a test of timeouts wants

        def log_message(self, *args: object) -> None:
            return None

    return Handler
