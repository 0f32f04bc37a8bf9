"""The signatures of privileged RPCs (`scalerl.rpc.request_auth`): a server accepts a call
signed with the run's key for its own instance, once, within FRESH_S of its clock."""

from __future__ import annotations

import pytest

from scalerl.rpc.request_auth import (
    FRESH_S,
    HEADER,
    SCHEME,
    ServerIdentity,
    call_mac,
    hello_proof,
    rpc_key,
)

METHOD = "/scalerl.v1.RolloutService/UpdateWeights"
KEY = rpc_key("the-run-token")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def signed(
    identity: ServerIdentity, unix_s: int, nonce: str = "n1", key: bytes = KEY, method: str = METHOD
) -> list[tuple[str, str]]:
    mac = call_mac(key, method, identity.instance, unix_s, nonce)
    return [(HEADER, f"{SCHEME} {unix_s}.{nonce}.{mac}")]


def test_a_call_is_accepted_once_within_the_freshness_window() -> None:
    clock = Clock()
    server = ServerIdentity(KEY, "scalerl.v1.RolloutService", clock=clock)
    now = int(clock.now)
    assert server.refusal(METHOD, signed(server, now - int(FRESH_S))) is None  # the boundary
    assert "already used" in server.refusal(METHOD, signed(server, now - int(FRESH_S)))
    assert "off this server's clock" in server.refusal(METHOD, signed(server, now - 61, "n2"))
    assert "off this server's clock" in server.refusal(METHOD, signed(server, now + 61, "n3"))
    assert server.refusal(METHOD, signed(server, now + 60, "n4")) is None
    clock.now += 2 * FRESH_S + 1  # the nonce is forgotten once its signature is stale anyway
    assert "off this server's clock" in server.refusal(METHOD, signed(server, now, "n1"))


@pytest.mark.parametrize(
    "metadata, reason",
    [
        ([], "needs metadata"),
        ([(HEADER, "Bearer the-run-token")], "needs metadata"),  # the old scheme: refused
        ([(HEADER, f"{SCHEME} 1.2")], "malformed"),
        ([(HEADER, f"{SCHEME} x.n.ff")], "malformed"),
    ],
)
def test_an_unsigned_or_malformed_call_is_refused(metadata, reason) -> None:
    assert reason in ServerIdentity(KEY, "s").refusal(METHOD, metadata)


def test_a_signature_binds_the_key_the_method_and_the_instance() -> None:
    clock = Clock()
    server = ServerIdentity(KEY, "scalerl.v1.RolloutService", clock=clock)
    other = ServerIdentity(KEY, "scalerl.v1.RolloutService", clock=clock)
    now = int(clock.now)
    refused = "not made for this server process"
    assert refused in server.refusal(METHOD, signed(server, now, key=rpc_key("another-run")))
    assert refused in other.refusal(METHOD, signed(server, now))  # another instance
    interrupt = "/scalerl.v1.RolloutService/Interrupt"
    assert refused in server.refusal(interrupt, signed(server, now))  # another method
    assert server.instance != other.instance and len(server.instance) == 32


def test_the_hello_proof_covers_every_claim() -> None:
    proof = hello_proof(KEY, b"c" * 16, "svc", "127.0.0.1:1", "i")
    assert proof != hello_proof(KEY, b"c" * 16, "svc", "127.0.0.1:2", "i")
    assert proof != hello_proof(KEY, b"d" * 16, "svc", "127.0.0.1:1", "i")
    assert proof != hello_proof(KEY, b"c" * 16, "svc", "127.0.0.1:1", "j")
    assert proof != hello_proof(rpc_key("x"), b"c" * 16, "svc", "127.0.0.1:1", "i")
    # Length-prefixed fields: moving a separator does not give the same message.
    assert hello_proof(KEY, b"c" * 16, "ab", "c", "i") != hello_proof(
        KEY, b"c" * 16, "a", "bc", "i"
    )
