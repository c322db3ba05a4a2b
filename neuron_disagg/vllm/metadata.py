"""What the scheduler side tells the worker side each engine step.

vLLM pickles this object from the engine-core process to every worker process; it carries only
plain values (no sockets, no tensors). Each list holds the step's new work for the transfer threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata, KVConnectorMetadata,
)

from ..protocol.messages import PullOffer, RankRegions, TransferId


@dataclass
class Registration:
    """D: our scheduler allocated ``block_ids`` for prompt blocks ``first_block_index``..."""

    transfer_id: TransferId
    request_id: str
    block_ids: tuple[int, ...]
    first_block_index: int


@dataclass
class StepMetadata(KVConnectorMetadata):
    # D, push: decode legs seen for the first time -> (transfer id, P side channel, P TP size)
    expect: list[tuple[TransferId, str, int]] = field(default_factory=list)
    register: list[Registration] = field(default_factory=list)
    # P, push: prefill finished -> (transfer id, request id, the prompt's blocks)
    kv_ready: list[tuple[TransferId, str, tuple[int, ...]]] = field(default_factory=list)
    # P, pull: prefill finished and its blocks are offered -> (transfer id, request id, the offer)
    lend: list[tuple[TransferId, str, PullOffer]] = field(default_factory=list)
    # D, pull: blocks allocated; read P's offer into them -> (what was allocated, the signed offers
    # the router carried: one per prompt of the HTTP request, the worker takes this transfer's)
    read: list[tuple[Registration, tuple[bytes, ...]]] = field(default_factory=list)
    # either side: the request ended early -> (transfer id, role, reason)
    abort: list[tuple[TransferId, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.expect or self.register or self.kv_ready or self.lend or self.read or self.abort)


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: this rank's agent and KV regions (pull offers list them)."""

    rank_regions: RankRegions
