"""What the scheduler side tells the worker side each engine step, and what the workers tell it back.

vLLM pickles this object from the engine-core process to every worker process; it carries only
plain values (no sockets, no tensors). Each list holds the step's new work for the transfer threads;
where the worker passes a record on to a thread unchanged, it is the thread's own inbox record
(``transfer/inbox.py``), defined once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorWorkerMetadata,
)

from ..protocol.messages import PullOffer, RankRegions, TransferId
from ..transfer.inbox import Abort, Expect


@dataclass(frozen=True)
class AllocatedBlocks:
    """D: our scheduler allocated ``block_ids`` for prompt blocks ``first_block_index`` onwards of
    ``request_id``'s transfer (the worker turns it into a protocol ``Registration`` or a read)."""

    transfer_id: TransferId
    request_id: str
    block_ids: tuple[int, ...]
    first_block_index: int


@dataclass(frozen=True)
class HandOff:
    """P: request ``request_id``'s prefill is (or, for ``kv_coming``, is about to be) computed into
    ``block_ids``; push hands them to the writer."""

    transfer_id: TransferId
    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class OfferMade:
    """P, pull: the prefill finished and its blocks are offered (the lender holds them)."""

    transfer_id: TransferId
    request_id: str
    offer: PullOffer


@dataclass(frozen=True)
class ReadOffer:
    """D, pull: read P's offer into the allocated blocks; ``offers`` are the signed offers the router
    carried, one per prompt of the HTTP request (the worker takes this transfer's)."""

    allocated: AllocatedBlocks
    offers: tuple[bytes, ...]


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One engine step's new work for the transfer threads, in the order the worker hands it over."""

    expect: list[Expect] = field(default_factory=list)             # D, push: heartbeat P from now on
    register: list[AllocatedBlocks] = field(default_factory=list)  # D, push
    kv_ready: list[HandOff] = field(default_factory=list)          # P, push
    kv_ready_after_forward: list[HandOff] = field(default_factory=list)  # this step's forward ends them
    kv_coming: list[HandOff] = field(default_factory=list)  # so do these; handed over next step (async)
    # Prefills this step's forward takes further without ending: their leading blocks, final after it.
    chunks_after_forward: list[HandOff] = field(default_factory=list)
    preempted: list[TransferId] = field(default_factory=list)  # P: streamed prefills vLLM preempted
    lend: list[OfferMade] = field(default_factory=list)     # P, pull
    read: list[ReadOffer] = field(default_factory=list)     # D, pull
    abort: list[Abort] = field(default_factory=list)        # either: the request ended first
    # The step schedules no tokens: its worker runs no forward, and vLLM's engine loop sleeps after it.
    no_forward: bool = False

    def __bool__(self) -> bool:
        return bool(self.expect or self.register or self.kv_ready or self.kv_ready_after_forward
                    or self.kv_coming or self.chunks_after_forward or self.preempted or self.lend or self.read
                    or self.abort)


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: this rank's agent and KV regions (pull offers list them)."""

    rank_regions: RankRegions


@dataclass
class QuarantineNotices(KVConnectorWorkerMetadata):
    """Workers -> scheduler, with a step's output (vLLM adds up every worker's): D requests whose load
    a worker reported failed while their blocks still wait for their fence (``held``), and those
    whose blocks a worker has since released (``released``). The scheduler keeps a request's blocks
    out of vLLM's pool until every worker that held them released them."""

    held: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> QuarantineNotices:
        if isinstance(other, QuarantineNotices):
            self.held += other.held
            self.released += other.released
        return self

    def __bool__(self) -> bool:
        return bool(self.held or self.released)
