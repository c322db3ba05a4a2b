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


@dataclass(frozen=True)
class AllocatedBlocks:
    """D: our scheduler allocated ``block_ids`` for prompt blocks ``first_block_index`` onwards of
    ``request_id``'s transfer (the worker turns it into a protocol ``Registration`` or a read)."""

    transfer_id: TransferId
    request_id: str
    block_ids: tuple[int, ...]
    first_block_index: int


@dataclass(frozen=True)
class Expect:
    """D, push: a decode leg seen for the first time; the worker heartbeats P from now on."""

    transfer_id: TransferId
    p_side_channel: str
    p_tp_size: int


@dataclass(frozen=True)
class KvReady:
    """P, push: the prefill finished; the writer may write these blocks."""

    transfer_id: TransferId
    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Lend:
    """P, pull: the prefill finished and its blocks are offered."""

    transfer_id: TransferId
    request_id: str
    offer: PullOffer


@dataclass(frozen=True)
class ReadOffer:
    """D, pull: read P's offer into the allocated blocks; ``offers`` are the signed offers the router
    carried, one per prompt of the HTTP request (the worker takes this transfer's)."""

    allocated: AllocatedBlocks
    offers: tuple[bytes, ...]


@dataclass(frozen=True)
class Abort:
    """Either side: the request ended before its transfer did."""

    transfer_id: TransferId
    role: str
    reason: str


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One engine step's new work for the transfer threads, in the order the worker hands it over."""

    expect: list[Expect] = field(default_factory=list)
    register: list[AllocatedBlocks] = field(default_factory=list)
    kv_ready: list[KvReady] = field(default_factory=list)
    kv_ready_after_forward: list[KvReady] = field(default_factory=list)  # this step's forward ends them
    kv_coming: list[KvReady] = field(default_factory=list)  # so do these; handed over next step (async)
    lend: list[Lend] = field(default_factory=list)
    read: list[ReadOffer] = field(default_factory=list)
    abort: list[Abort] = field(default_factory=list)
    # The step schedules no tokens: its worker runs no forward, and vLLM's engine loop sleeps after it.
    no_forward: bool = False

    def __bool__(self) -> bool:
        return bool(self.expect or self.register or self.kv_ready or self.kv_ready_after_forward
                    or self.kv_coming or self.lend or self.read or self.abort)


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: this rank's agent and KV regions (pull offers list them)."""

    rank_regions: RankRegions
