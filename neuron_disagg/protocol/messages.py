"""Every message that crosses the wire between a prefill (P) and a decode (D) instance.

Direction D -> P: Registration, Heartbeat, Cancel.
Direction P -> D: WriteDone (rides on the WRITE itself as its completion notification),
WriteFailed, CancelAck.
Router -> P: Withdraw (no D took the request; what P holds for it is freed).
D -> a P rank, answered on the same connection: Probe, Alive (is the rank that holds our transfers
still the same live process?).

Times are Unix seconds from the sender's clock; deployments keep clocks in sync (chrony on AWS) and
every deadline derived from a remote time is padded by ``clock_skew_allowance_s``.
Encoding, signing and the checks on decode live in ``wire.py``.
"""

from __future__ import annotations

import msgspec


class TransferId(msgspec.Struct, frozen=True, array_like=True):
    """Names one attempt to move one request's KV from P to D.

    ``request`` is the router's request id, shared by both legs. A retry of the same request gets
    ``attempt + 1`` and supersedes every older attempt on both sides (invariant I1). The connector
    moves each prompt of a request as its own transfer (a prompt list, ``n`` > 1 samples of one
    prompt share one): ``prompt`` names it, a digest of its tokens; the router's own ids have none.
    """

    request: str
    attempt: int = 0
    prompt: str = ""

    def __str__(self) -> str:
        return f"{self.request}/{self.prompt}#{self.attempt}" if self.prompt else f"{self.request}#{self.attempt}"

    @property
    def lineage(self) -> tuple[str, str]:
        """What the attempts of one transfer share: a newer attempt supersedes the older ones."""
        return (self.request, self.prompt)

    def supersedes(self, other: TransferId) -> bool:
        return self.lineage == other.lineage and self.attempt > other.attempt

    def router_attempt(self) -> TransferId:
        """The router's transfer id this one belongs to (itself, for one of the router's own)."""
        return TransferId(self.request, self.attempt)


class Region(msgspec.Struct, frozen=True):
    """One KV region on one rank: one layer's K, V, or K and V together, as the attention backend
    laid it out in memory.

    The unit that moves is a chunk of ``head_bytes``: one head of one token (K, V, or both, as the
    backend packs them). Scheduler block ``b``, head ``h`` (counted from ``first_head``), token ``t``
    lives at ``base_addr + b * block_stride_bytes + (t // k) * kernel_stride_bytes +
    (t % k) * token_stride_bytes + h * head_stride_bytes``, where ``k = kernel_block_tokens`` when the
    backend splits a scheduler block into kernel blocks of ``k`` tokens, else ``block_tokens``. The
    strides are read off the tensor, so any physical order (head-major, token-major, layers or heads
    outside blocks) is described exactly. A rank holds heads ``first_head .. first_head + heads - 1``
    of the model's KV heads (the same heads on several ranks when heads are replicated).
    """

    name: str  # e.g. "model.layers.3.self_attn.attn" or "...attn.k": both sides must use the same names
    base_addr: int
    block_stride_bytes: int
    num_blocks: int
    heads: int
    first_head: int
    head_bytes: int  # bytes of one head of one token: one contiguous chunk
    block_tokens: int
    head_stride_bytes: int
    token_stride_bytes: int
    kernel_block_tokens: int = 0  # 0: no kernel split
    kernel_stride_bytes: int = 0
    device_id: int = 0

    @property
    def kernel_tokens(self) -> int:
        return self.kernel_block_tokens or self.block_tokens

    @property
    def kernels_per_block(self) -> int:
        return self.block_tokens // self.kernel_tokens

    @property
    def layout(self) -> str:
        """The order inside a block, for messages and compatibility checks: head-major or not."""
        return "HND" if self.heads == 1 or self.head_stride_bytes > self.token_stride_bytes else "NHD"

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (what moves per block)."""
        return self.heads * self.block_tokens * self.head_bytes

    @property
    def extent_bytes(self) -> int:
        """From ``base_addr`` to the end of the last byte any block of this region holds."""
        return ((self.num_blocks - 1) * self.block_stride_bytes
                + (self.kernels_per_block - 1) * self.kernel_stride_bytes
                + (self.heads - 1) * self.head_stride_bytes
                + (self.kernel_tokens - 1) * self.token_stride_bytes + self.head_bytes)


class RankRegions(msgspec.Struct, frozen=True):
    """Where one D tensor-parallel rank's KV lives, and which NIXL agent owns it."""

    tp_rank: int
    agent_name: str
    regions: tuple[Region, ...]


class Registration(msgspec.Struct, frozen=True, tag="registration"):
    """D -> P: "write this request's KV into these blocks of mine before ``expires_at``"."""

    transfer_id: TransferId
    d_engine_id: str
    d_request_id: str
    d_side_channel: str  # host:port where D listens for our replies
    d_tp_size: int
    ranks: tuple[RankRegions, ...]
    block_ids: tuple[int, ...]  # D's destination blocks, the same ids on every D rank
    # D already holds the request's first ``first_block_index`` blocks (a prefix-cache hit):
    # block_ids[i] receives P's block number first_block_index + i.
    first_block_index: int
    expires_at: float
    # D's clock when it sent this. A P whose clock reads earlier by more than the skew allowance
    # would honour the registration past D's fence: it refuses instead (0: not stamped).
    sent_at: float = 0.0


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """D -> P: "I still want this transfer" — renews P's lease on its finished blocks."""

    transfer_id: TransferId
    sent_at: float


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """D -> P: D gave up on the transfer; P must not start a write and must answer with CancelAck."""

    transfer_id: TransferId
    d_side_channel: str
    d_tp_size: int
    reason: str


class WriteDone(msgspec.Struct, frozen=True, tag="write_done"):
    """P -> D: every byte P's rank ``p_rank`` owed D's rank has landed."""

    transfer_id: TransferId
    p_rank: int
    p_tp_size: int


class WriteStarting(msgspec.Struct, frozen=True, tag="write_starting"):
    """P -> D: P's rank ``p_rank`` is posting its WRITE for the transfer now. A wake-up, not a state
    change: D's receiver waits for notifications lazily while P still computes (seconds, in push)
    and polls closely from this until the transfer ends. Lost, it costs D up to one tick."""

    transfer_id: TransferId
    p_rank: int


class WriteFailed(msgspec.Struct, frozen=True, tag="write_failed"):
    """P -> D: P's rank ``p_rank`` will write nothing (more); no write of it is in flight."""

    transfer_id: TransferId
    p_rank: int
    p_tp_size: int
    reason: str


class CancelAck(msgspec.Struct, frozen=True, tag="cancel_ack"):
    """P -> D: P's rank ``p_rank`` honoured a Cancel; no write of it is in flight or will start."""

    transfer_id: TransferId
    p_rank: int
    p_tp_size: int


class AgentInfoRequest(msgspec.Struct, frozen=True, tag="agent_info_request"):
    """Either side -> a peer rank's side channel: "send me your transfer agent's metadata"."""

    requester: str


class AgentInfo(msgspec.Struct, frozen=True, tag="agent_info"):
    """The answer: what a peer needs to reach this rank's agent (NIXL agent metadata)."""

    tp_rank: int
    agent_name: str
    metadata: bytes
    # (address, length) of every memory span the agent registered: P checks each WRITE's
    # destination against these before posting (invariant I6).
    spans: tuple[tuple[int, int], ...] = ()


class PullOffer(msgspec.Struct, frozen=True, tag="pull_offer"):
    """Pull mode, P -> D through the router: "my KV for this request is in these blocks until
    ``expires_at``; read it". P holds the blocks until every reading D rank confirms or the lease
    ``expires_at + max_read_s + clock_skew_allowance_s`` ends (D starts no READ after
    ``expires_at`` and gives up on a READ after ``max_read_s``)."""

    transfer_id: TransferId
    p_engine_id: str
    p_side_channel: str
    p_tp_size: int
    ranks: tuple[RankRegions, ...]  # P's regions and agent per P rank
    block_ids: tuple[int, ...]      # the prompt's blocks on P, in order
    expires_at: float
    sent_at: float = 0.0  # P's clock when it offered; a D reading behind it refuses (0: not stamped)


class ReadDone(msgspec.Struct, frozen=True, tag="read_done"):
    """Pull mode, D -> P: rides on D rank ``d_rank``'s READ; P may free once every reader is done."""

    transfer_id: TransferId
    d_rank: int
    d_tp_size: int


class ReadFailed(msgspec.Struct, frozen=True, tag="read_failed"):
    """Pull mode, D -> P: D rank ``d_rank`` will read nothing (more); none of its READs is in flight."""

    transfer_id: TransferId
    d_rank: int
    d_tp_size: int
    reason: str


class Withdraw(msgspec.Struct, frozen=True, tag="withdraw"):
    """Router -> every P rank: no decode instance will take the KV of the router's transfer
    ``transfer_id`` (D refused the request, e.g. for a parameter P's one-token leg does not carry,
    or could not be reached). P frees, now or as soon as it is computed, the KV every engine request
    of it holds for a registration or a read that will never come, instead of holding it a lease."""

    transfer_id: TransferId  # the router's; engine requests' transfers match by router_attempt()
    reason: str


class Probe(msgspec.Struct, frozen=True, tag="probe"):
    """D -> a P rank's side channel: "are you there?", answered with ``Alive`` on the same connection.
    D probes each P rank its live transfers wait on; silence or a refused connection is how D learns
    that P died, stopped or lost its network, in seconds rather than at its watchdog."""

    sent_at: float


class Alive(msgspec.Struct, frozen=True, tag="alive"):
    """A rank's answer to ``Probe``. ``incarnation`` is random per process start, so D tells a P
    restarted at the same address (which holds none of the old transfers) from the one it registered with."""

    tp_rank: int
    incarnation: str


Message = (PullOffer | ReadDone | ReadFailed | Registration | Heartbeat | Cancel | WriteDone | WriteStarting | WriteFailed
           | CancelAck | AgentInfoRequest | AgentInfo | Withdraw | Probe | Alive)
ToProducer = Registration | Heartbeat | Cancel
ToConsumer = WriteDone | WriteFailed | CancelAck
