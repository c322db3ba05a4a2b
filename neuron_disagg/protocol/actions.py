"""What the protocol cores ask their owner to do. The owner (a transfer thread, a test harness or
the demo) performs each action in the order returned; the cores never do I/O themselves."""

from __future__ import annotations

from dataclasses import dataclass, field

from .messages import Message, ReadDone, TransferId, WriteDone
from .plan import WritePlan


@dataclass(frozen=True, slots=True)
class SubmitWrite:
    """P: post the plan's WRITEs; each D rank's WRITE carries ``notification`` as its completion
    notice (None: a write of chunks, which D hears nothing of). Report the outcome as
    ``write_done`` or ``write_failed`` on the producer core."""

    transfer_id: TransferId
    plan: WritePlan
    d_side_channel: str
    notification: WriteDone | None


@dataclass(frozen=True, slots=True)
class AbortWrite:
    """P: release the transfer's in-flight WRITEs now; they must not touch D's memory afterwards."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class SubmitRead:
    """D: post one READ per P rank in ``plans`` (p_rank -> plan); each carries ``notification``.
    Report the outcome as ``read_done`` or ``read_failed`` on the reader core."""

    transfer_id: TransferId
    plans: dict[int, WritePlan] = field(hash=False)
    p_side_channel: str = ""
    notification: ReadDone | None = None


@dataclass(frozen=True, slots=True)
class AbortRead:
    """D: release the transfer's in-flight READs now; they must not land in our blocks afterwards."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Send ``message`` to the peer instance at ``peer`` (side-channel host:port), to its
    tensor-parallel ranks ``ranks``."""

    peer: str
    ranks: tuple[int, ...]
    message: Message


@dataclass(frozen=True, slots=True)
class FreeBlocks:
    """Return these KV blocks to the engine: no transfer will touch them again."""

    transfer_id: TransferId
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FinishLoad:
    """D: the request's KV is complete; the engine may start decoding it."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class FailTransfer:
    """The transfer ended without delivering KV; fail the request upstream with ``reason``."""

    transfer_id: TransferId
    reason: str


@dataclass(frozen=True, slots=True)
class Quarantine:
    """D: the transfer's KV will not come, and the request must not wait for its blocks' fence:
    it goes on now without them (computed here, or failed, as ``kv_load_failure_policy`` says).
    The blocks themselves stay out of use, where a late write may still land, until this
    transfer's ``FreeBlocks``."""

    transfer_id: TransferId
    reason: str


@dataclass(frozen=True, slots=True)
class ProbePeer:
    """D: ask the peer rank whether it is still there (``Probe``); report its ``Alive`` or the
    failure back to the core (``probe_answered`` / ``probe_failed``)."""

    peer: str
    rank: int


@dataclass(frozen=True, slots=True)
class Transitioned:
    """A request changed state. For logs, metrics and timelines; needs no action."""

    transfer_id: TransferId
    before: str
    after: str
    event: str
    at: float
    reason: str | None = None


Action = (SubmitWrite | AbortWrite | SubmitRead | AbortRead | SendMessage | FreeBlocks | FinishLoad | FailTransfer
          | Quarantine | ProbePeer | Transitioned)
