"""Per-request authentication of privileged RPCs: nothing on the wire that a listener
could use again.

The run's secret (`Security.token`) never travels. A key derived from it (`rpc_key`)
signs each privileged call for one server process:

1. **The server proves itself.** Every server of a run with a token serves
   `scalerl.v1.IdentityService/Hello` (identity.proto), open to anyone. Before each
   privileged call the client sends a fresh random challenge; the server answers with its
   service, its address (for a service a run has several of: the rollout workers), its
   instance (a random id new at every start) and an HMAC over all four. A client that
   does not get a valid proof, for the service the method belongs to and, for a rollout
   worker, the address it dialed, sends nothing: a process squatting the port between a
   worker's crash and its restart holds no key, and relaying the Hello to another worker
   of the run gives that worker's address.
2. **The call is signed for that instance.** Metadata `authorization: ScaleRL-HMAC
   <unix seconds>.<nonce>.<mac>`, the MAC over (method, instance, seconds, nonce). The
   server accepts it once (nonce cache), within `FRESH_S` of its clock, and only with its
   own instance: a recorded signature is worthless to a restarted process, to another
   server and, once used, to this one.

What a privileged call carries besides (its request) is not covered: a listener that
could change a request in flight would have to hold the port while the genuine server
does, which the kernel does not allow to another user.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from scalerl.v1 import identity_pb2, identity_pb2_grpc

SCHEME = "ScaleRL-HMAC"
HEADER = "authorization"
FRESH_S = 60.0  # a signed call older (or newer) than this by the server's clock is refused
NONCE_CACHE_MAX = 1_000_000  # nonces remembered at most (FRESH_S x 2 of calls)
HELLO_TIMEOUT_S = 10.0  # the proof's deadline when the call itself has none
# Services a run has several servers of: a client also checks it reached the one it
# dialed (another replica could be relayed the Hello). The others are one per run.
REPLICATED_SERVICES = frozenset({"scalerl.v1.RolloutService"})
IDENTITY_SERVICE = identity_pb2.DESCRIPTOR.services_by_name["IdentityService"].full_name
# The generated stub and registration (untyped code: held as Any, as scalerl.rpc.services).
IDENTITY_STUB: Any = identity_pb2_grpc.IdentityServiceStub
ADD_IDENTITY: Any = identity_pb2_grpc.add_IdentityServiceServicer_to_server
_CONTEXT = b"scalerl rpc requests v1"


def rpc_key(token: str) -> bytes:
    """The key of RPC signatures: HMAC-SHA256(token, context), so the signatures of RPCs
    and of Redis entries (`scalerl.state.signing`) never share a key."""
    return hmac.new(token.encode(), _CONTEXT, hashlib.sha256).digest()


def hello_proof(key: bytes, challenge: bytes, service: str, address: str, instance: str) -> bytes:
    """HMAC-SHA256 over the challenge and the server's claims (length-prefixed fields)."""
    return _mac(key, b"hello", challenge, service.encode(), address.encode(), instance.encode())


def call_mac(key: bytes, method: str, instance: str, unix_s: int, nonce: str) -> str:
    """Hex HMAC-SHA256 of one privileged call for one server instance."""
    parts = (b"call", method.encode(), instance.encode(), str(unix_s).encode(), nonce.encode())
    return _mac(key, *parts).hex()


def _mac(key: bytes, *parts: bytes) -> bytes:
    message = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


def service_of(method: str) -> str:
    """ "/scalerl.v1.RolloutService/Generate" -> "scalerl.v1.RolloutService"."""
    return method.strip("/").split("/", 1)[0]


# ----- server side -----------------------------------------------------------------------


class ServerIdentity(identity_pb2_grpc.IdentityServiceServicer):
    """One server process's identity (`Hello`) and the check of the calls signed for it.

    key: `rpc_key` of the run's token. service: the full name of the service it runs.
    address: host:port the run dials it by, set once bound (only a replicated service's
    is told; "" for the others). clock: Unix seconds."""

    def __init__(self, key: bytes, service: str, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self.service = service
        self.address = ""
        self.instance = secrets.token_hex(16)
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it expires
        self._lock = threading.Lock()

    def Hello(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC
        challenge = bytes(request.challenge)
        if not 16 <= len(challenge) <= 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "challenge: 16 to 64 bytes")
        proof = hello_proof(self._key, challenge, self.service, self.address, self.instance)
        return identity_pb2.HelloReply(
            service=self.service, address=self.address, instance=self.instance, proof=proof
        )

    def refusal(self, method: str, metadata: Any) -> str | None:
        """Why the call of `method` with `metadata` is refused; None: it is signed for this
        instance, fresh, and its nonce was not used before (it is now)."""
        header = _header(metadata)
        if header is None or not header.startswith(SCHEME + " "):
            return f"needs metadata '{HEADER}: {SCHEME} ...' signed with the run's secret"
        try:
            unix_s, nonce, mac = header[len(SCHEME) + 1 :].split(".")
            signed_at = int(unix_s)
        except ValueError:
            return "a malformed signature"
        expected = call_mac(self._key, method, self.instance, signed_at, nonce)
        if not hmac.compare_digest(mac, expected):
            return "a signature not made for this server process with the run's secret"
        now = self._clock()
        if abs(now - signed_at) > FRESH_S:
            return f"a signature {now - signed_at:+.0f} s off this server's clock (> {FRESH_S:g})"
        with self._lock:
            return self._remember(nonce, now)

    def _remember(self, nonce: str, now: float) -> str | None:
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "a signature already used (a replay)"
        if len(self._seen) >= NONCE_CACHE_MAX:  # a flood of valid calls: wait it out
            return "too many signed calls within the freshness window"
        self._seen[nonce] = now + 2 * FRESH_S
        return None


def _header(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == HEADER:
            return value.decode() if isinstance(value, bytes) else value
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED to a privileged method whose call is not signed for this
    server (`ServerIdentity.refusal`), before its handler runs; every other method
    passes untouched."""

    def __init__(self, identity: ServerIdentity, privileged: frozenset[str]) -> None:
        self._identity = identity
        self._privileged = privileged

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._privileged:
            return handler
        refusal = self._identity.refusal(method, handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        return _denied(handler, f"{method.rsplit('/', 1)[-1]}: {refusal}")


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind):
            return handler._replace(**{kind: deny})
    return handler


# ----- client side -----------------------------------------------------------------------


class Unproven(grpc.RpcError):
    """The server did not prove it is the run's (no valid Hello): the call was not sent.
    Behaves as a failed call with status UNAUTHENTICATED."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self._message = message

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self) -> str:
        return self._message


class _Call(grpc.ClientCallDetails):
    def __init__(
        self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str | bytes]]
    ) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class SigningInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Signs the `privileged` calls of a channel to `target` (host:port) for the server
    process that proves itself there (module docstring); other calls pass unsigned.

    raw: the channel before interception (the Hello goes on it). Raises `Unproven` in
    place of a call the server did not prove itself for; a Hello that fails (the server
    down) raises that call's `grpc.RpcError`."""

    def __init__(
        self,
        raw: grpc.Channel,
        target: str,
        token: str,
        privileged: frozenset[str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        stub: Any = IDENTITY_STUB(raw)
        self._hello = stub.Hello
        self._target = target
        self._key = rpc_key(token)
        self._privileged = privileged
        self._clock = clock

    def _signed(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        method = details.method
        name = method.decode() if isinstance(method, bytes) else method
        if name not in self._privileged:
            return details
        instance = self._proven_instance(
            service_of(name), details.timeout, bool(details.wait_for_ready)
        )
        unix_s, nonce = int(self._clock()), secrets.token_hex(16)
        mac = call_mac(self._key, name, instance, unix_s, nonce)
        header = (HEADER, f"{SCHEME} {unix_s}.{nonce}.{mac}")
        return _Call(details, [*(details.metadata or ()), header])

    def _proven_instance(self, service: str, timeout: float | None, wait_for_ready: bool) -> str:
        """The instance of the server at the target, proven for `service` now. The Hello
        waits as its call would: with `wait_for_ready`, for a server that is down
        (restarting) until the call's own deadline; else HELLO_TIMEOUT_S at most."""
        challenge = secrets.token_bytes(32)
        limit = timeout if wait_for_ready and timeout else HELLO_TIMEOUT_S
        reply = self._hello(
            identity_pb2.HelloRequest(challenge=challenge),
            timeout=min(timeout or limit, limit),
            wait_for_ready=wait_for_ready,
        )
        proof = hello_proof(self._key, challenge, reply.service, reply.address, reply.instance)
        where = f"the server at {self._target}"
        if not hmac.compare_digest(bytes(reply.proof), proof):
            raise Unproven(
                f"{where} did not prove it holds the run's secret (another process on the "
                "port?): the call was not sent"
            )
        if reply.service != service:
            raise Unproven(f"{where} runs {reply.service}, not {service}: the call was not sent")
        if service in REPLICATED_SERVICES and reply.address != self._target:
            raise Unproven(
                f"{where} proved to be the one at {reply.address or '(no address)'}: the "
                "call was not sent"
            )
        return str(reply.instance)

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._signed(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._signed(details), request)

    def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        details: grpc.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return continuation(self._signed(details), request_iterator)

    def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        details: grpc.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return continuation(self._signed(details), request_iterator)
