"""The sans-I/O protocol core: messages, both sides' state machines, and transfer plans.

No threads, sockets, clocks, or imports of vllm, nixl or torch: time comes in as an argument and
every decision comes out as an action (see ``actions.py``).
"""

from .actions import (
    AbortRead, AbortWrite, Action, FailTransfer, FinishLoad, FreeBlocks, SendMessage, SubmitRead, SubmitWrite,
    Transitioned,
)
from .consumer import ConsumerCore, ConsumerTimeouts, DState
from .lender import LenderCore, LenderTimeouts, LState
from .errors import (
    BadSignature, MalformedMessage, MessageError, OversizeMessage, PlanError, ProtocolError,
    UnknownVersion,
)
from .messages import (
    AgentInfo, AgentInfoRequest, Cancel, CancelAck, Heartbeat, PullOffer, ReadDone, ReadFailed, Message, RankRegions, Region, Registration, TransferId,
    Withdraw, WriteDone, WriteFailed, WriteStarting,
)
from .plan import WritePlan, peer_ranks, plan_write
from .producer import ProducerCore, ProducerTimeouts, PState
from .reader import ReaderCore, ReaderTimeouts, RState
from .wire import WireCodec

# Written out: mypy (strict: no implicit re-export) and ruff read the package's names from a literal list.
__all__ = [
    "AbortRead", "AbortWrite", "Action", "AgentInfo", "AgentInfoRequest", "BadSignature", "Cancel",
    "CancelAck", "ConsumerCore", "ConsumerTimeouts", "DState", "FailTransfer", "FinishLoad", "FreeBlocks",
    "Heartbeat", "LenderCore", "LenderTimeouts", "LState", "MalformedMessage", "Message", "MessageError",
    "OversizeMessage", "peer_ranks", "plan_write", "PlanError", "ProducerCore", "ProducerTimeouts",
    "ProtocolError", "PState", "PullOffer", "RankRegions", "ReadDone", "ReaderCore", "ReaderTimeouts",
    "ReadFailed", "Region", "Registration", "RState", "SendMessage", "SubmitRead", "SubmitWrite", "TransferId",
    "Transitioned", "UnknownVersion", "WireCodec", "Withdraw", "WriteDone", "WriteFailed", "WritePlan",
    "WriteStarting",
]
