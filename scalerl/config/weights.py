"""`learner.weights`: how new weights reach the workers, one variant per transport."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    Tag,
)

from scalerl.config.base import _Section, told_apart_by


class _Transport(_Section):
    """What every transport answers: whether its versions go as lossless deltas."""

    @property
    def sends_deltas(self) -> bool:
        """Versions go as deltas where a receiver holds the one before."""
        return False


class _DeltaTransport(_Transport):
    """A transport that can send a version as its difference from the one before."""

    delta: Literal["auto", "off"] = Field(
        "off",
        description="Lossless delta versions (scalerl.weights.delta): auto = a version "
        "goes to a worker that received the one before as their difference (an XOR in "
        "byte planes, Zstandard-compressed; 6x smaller on the default job, 23x for its bf16 "
        "tensors), rebuilt bit for bit and checked against the announced sha256 there, "
        "else whole. It costs the learner an encode and each worker a decode per version "
        "(about 0.5 and 0.6 s for SmolLM2-135M on one core) and each worker the RAM of one "
        "payload: worth it where versions cross a network (workers on other hosts), not "
        "where every process shares one machine (the default job made 44 and 38 steps in "
        "15 minutes with it against 50 and 48 without, interleaved; BENCHMARKS.md). off = "
        "every version whole.",
    )

    @property
    def sends_deltas(self) -> bool:
        return self.delta == "auto"


class UriWeights(_DeltaTransport):
    """A file on shared storage that every worker loads (the run folder on one machine, a
    shared volume in a cluster); the learner sends only its header (with deltas: the
    header of a delta file beside it, which a worker reads instead)."""

    transport: Literal["uri"] = "uri"


class StreamWeights(_DeltaTransport):
    """The learner pushes the payload as gRPC chunks to each worker in turn, and sends the
    latest version again to a worker whose heartbeat says it is behind."""

    transport: Literal["stream"] = "stream"


class PullWeights(_DeltaTransport):
    """The learner holds the newest two versions in RAM and every worker fetches the latest
    itself (FetchWeights, checksummed chunks; no shared disk); with `relay_fanout`, workers
    that loaded a version serve it to their peers."""

    transport: Literal["pull"] = "pull"
    relay_fanout: int = Field(
        0,
        ge=0,
        le=16,
        description="Weight relay: each worker that loaded a version serves it to at most "
        "this many peers at once, and the learner to as many; a fetcher takes the least "
        "busy holder. Publishing to N workers then takes about log_(f+1)(N) payload "
        "transfers of one uplink instead of N of the learner's. Every peer's bytes are "
        "checked against the learner's signed announcement. A relaying worker keeps the "
        "payload it loaded in RAM. 0 = every worker fetches from the learner.",
    )


class BroadcastWeights(_Transport):
    """One torch.distributed broadcast per tensor to every READY worker (an epoch-numbered
    group, rebuilt when the READY set changes); joiners and members that miss the deadline
    pull, as with `pull`. The group sends tensors, never deltas (its members hold
    tensors, not the last payload), so it has no `delta` field: setting one is refused."""

    transport: Literal["broadcast"] = "broadcast"
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the broadcast group's store, served by the learner (0 = a "
        "free port chosen at start, fine on one machine; set it where a firewall or a "
        "Service must name it).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Backend of the broadcast group: gloo (CPU tensors), nccl (CUDA; every "
        "member needs a GPU of its own); auto = per epoch, nccl when the learner and every "
        "member report a GPU of their own, else gloo (one machine with one GPU: gloo).",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Deadline of the broadcast group's join and of each collective, the "
        "largest tensor's transfer included (seconds); a member that misses it is dropped "
        "from the epoch and pulls.",
    )


# `learner.weights`: one variant per transport, told apart by `transport`.
WeightsConfig = Annotated[
    Annotated[UriWeights, Tag("uri")]
    | Annotated[StreamWeights, Tag("stream")]
    | Annotated[PullWeights, Tag("pull")]
    | Annotated[BroadcastWeights, Tag("broadcast")],
    told_apart_by("transport", ("uri", "stream", "pull", "broadcast")),
]
