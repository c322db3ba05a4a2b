"""What other threads put in a transfer thread's inbox: one record per kind of event, so that the
thread reads named fields and dispatches by type (``TransferThread._handlers``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..platforms.fence import KVFence, LayerFences
from ..protocol.messages import Message, PullOffer, RankRegions, Registration, TransferId


@dataclass(frozen=True, slots=True)
class KvReady:
    """Engine, P: a prefill finished; its blocks are the thread's until it frees them."""

    transfer_id: TransferId
    block_ids: tuple[int, ...]
    fence: KVFence | None
    ready_at: float | None = None  # when the engine saw the KV computed, for the thread's timeline


@dataclass(frozen=True, slots=True)
class KvChunk:
    """Engine, P: a prefill runs on; its leading ``block_ids`` hold final KV once ``fence`` passed
    (``LayerFences``: layer group by layer group, as the forward that computes them runs).
    The blocks stay the engine's."""

    transfer_id: TransferId
    block_ids: tuple[int, ...]
    fence: KVFence | LayerFences | None


@dataclass(frozen=True, slots=True)
class Preempted:
    """Engine, P: the prefill was preempted and its blocks freed; it is computed again."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class LayersFenced:
    """Engine, P, streaming by layers: the running forward fenced another group of layers, so parts
    waiting on it may go (the writer sleeps, rather than polls, while parts wait on a forward)."""


@dataclass(frozen=True, slots=True)
class KvComing:
    """Engine, P: the forward about to run completes this prefill, into these blocks."""

    transfer_id: TransferId
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Expect:
    """Engine, D, push: a decode leg whose KV P will push."""

    transfer_id: TransferId
    p_side_channel: str
    p_tp_size: int


@dataclass(frozen=True, slots=True)
class Allocated:
    """Engine, D, push: fresh destination blocks, to register with P once ``fence`` passed."""

    registration: Registration
    fence: KVFence | None


@dataclass(frozen=True, slots=True)
class Offered:
    """Engine, D, pull: the signed offers the decode leg carried for a transfer (one per prompt of
    the request), unverified: the reader checks them, off the engine loop."""

    transfer_id: TransferId
    frames: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ReadInto:
    """Engine, D, pull: fresh destination blocks for an offered transfer, to read into once ``fence`` passed."""

    transfer_id: TransferId
    local: RankRegions
    block_ids: tuple[int, ...]
    first_block_index: int
    fence: KVFence | None


@dataclass(frozen=True, slots=True)
class Lend:
    """Engine, P, pull: a prefill finished and its blocks are offered."""

    offer: PullOffer


@dataclass(frozen=True, slots=True)
class Abort:
    """Engine: the request ended before its transfer did."""

    transfer_id: TransferId
    reason: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """Side channel: a verified message from the peer."""

    message: Message


@dataclass(frozen=True, slots=True)
class PeerReady:
    """Peers executor: the handshake with ``agent`` ended (``error`` if it failed)."""

    agent: str
    error: str | None


@dataclass(frozen=True, slots=True)
class ProbeEnded:
    """Peers' prober: rank ``rank`` at ``peer`` answered as ``incarnation``, or did not (``refused``:
    nothing listens there, or the connection broke; else it timed out)."""

    peer: str
    rank: int
    incarnation: str | None
    refused: bool


@dataclass(frozen=True, slots=True)
class Undelivered:
    """Peers' executor, D: our registration of ``transfer_id`` never reached P rank ``rank``."""

    transfer_id: TransferId
    rank: int
    reason: str
