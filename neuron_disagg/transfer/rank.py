"""One tensor-parallel rank's transfer machinery, assembled the same way wherever a rank runs: in
the vLLM connector's worker, in the test peer process and in the H200 device check.

A rank is one role's. It has two NIXL agents, each owned by one thread: the target's — P's lender,
D's receiver — is the one peers learn by name from offers and registrations, and the initiator's —
P's writer, D's reader — posts transfers and may be replaced after a failed one (``transport.py``:
LIBFABRIC keeps an error on a poisoned rail). Both of the role's threads run, push and pull, so one
instance serves either mode. Its side-channel server hands each verified message to the thread
whose protocol it belongs to; a message only the other role takes is refused and counted. The
threads' results come up through one ``Outbox``; what the rank has counted comes up through
``stats``. ``shutdown`` ends the threads (in-flight transfers fail with a reason), then the server
and the agents.

With ``host_staging`` the KV moves through host slots where NIXL cannot register the device's
memory (``staging.py``): "auto" falls back to them when registering fails, "always" uses them.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal
from collections.abc import Callable, Sequence

from ..kv_params import Role
from ..protocol.consumer import ConsumerCore, ConsumerTimeouts
from ..protocol.lender import LenderCore, LenderTimeouts
from ..protocol.messages import (
    AgentInfo, AgentInfoRequest, Alive, Cancel, CancelAck, Heartbeat, Message, Probe, ReadFailed, Region,
    Registration, Withdraw, WriteDone, WriteFailed, WriteStarting,
)
from ..protocol.producer import ProducerCore, ProducerTimeouts
from ..protocol.reader import ReaderCore, ReaderTimeouts
from ..protocol.wire import WireCodec
from ..timeline import OFF, Timeline
from .outbox import Outbox
from .peers import Peers
from .pull import PullLender, PullReader
from .receiver import PushReceiver
from .side_channel import SideChannelClient, SideChannelServer
from .staging import HostStaging
from .transport import NixlTransport, Transport, region_spans
from .writer import PushWriter

log = logging.getLogger(__name__)

#: Which of a role's threads takes each message a peer may send it: "push", "pull" or both (the
#: router's Withdraw names no mode). A message of a type missing here is the other role's.
ROUTES: dict[Role, dict[type, tuple[str, ...]]] = {
    "prefill": {Registration: ("push",), Heartbeat: ("push",), Cancel: ("push",), ReadFailed: ("pull",),
                Withdraw: ("push", "pull")},
    "decode": {WriteStarting: ("push",), WriteDone: ("push",), WriteFailed: ("push",), CancelAck: ("push",)},
}


@dataclass(frozen=True)
class RankTimeouts:
    producer: ProducerTimeouts = ProducerTimeouts()
    consumer: ConsumerTimeouts = ConsumerTimeouts()
    lender: LenderTimeouts = LenderTimeouts()
    reader: ReaderTimeouts = ReaderTimeouts()


@dataclass(frozen=True)
class StagingSpec:
    """How to stage through host memory: "never", "auto" (when registering fails) or "always";
    ``rows``: each region's blocks as a (blocks, bytes) view (``platforms.kv_layout.staging_rows``)."""

    mode: Literal["never", "auto", "always"] = "never"
    rows: Sequence[Any] = ()
    slots: int = 0


class Rank:
    def __init__(self, role: Role, tp_rank: int, tp_size: int, regions: Sequence[Region], *, codec: WireCodec,
                 agent_name: str, side_channel_host: str, side_channel_port: int, advertised: str | None = None,
                 timeouts: RankTimeouts = RankTimeouts(), backend: str = "UCX", memory_type: str = "DRAM",
                 total_heads: int | None = None, staging: StagingSpec = StagingSpec(),
                 transport: Callable[..., Transport] = NixlTransport, merge_descriptors: bool = True,
                 join: tuple[int, ...] | None = None, timeline: Timeline = OFF):
        """``side_channel_port``: the instance's base port (this rank listens on port + tp_rank, or
        on any free port when it is 0); ``advertised``: the instance address peers are told
        ("host:base port"; by default this rank's own server address); ``join``: P's regions' join
        classes, where writes are parted by group of layers (``plan.plan_rank_write``)."""
        if role not in ROUTES:
            raise ValueError(f"a rank is a prefill or a decode rank, not {role!r}")
        self.role, self.tp_rank, self.tp_size, self.codec = role, tp_rank, tp_size, codec
        self.regions = tuple(regions)
        self.alive = Alive(tp_rank, secrets.token_hex(8))  # what a probe hears: this process, not its address
        self.outbox = Outbox()
        self.wrong_role: Counter[str] = Counter()  # messages only the other role takes, by type
        self.target = transport(agent_name, backend, memory_type)
        self.staging = self._register(staging, memory_type)
        exposed = self.staging.regions if self.staging else self.regions  # what peers may touch
        initiator = "writer" if role == "prefill" else "reader"
        self.initiator = transport(f"{agent_name}-{initiator}", backend, "DRAM" if self.staging else memory_type)
        self.initiator.register(exposed)
        self.info = AgentInfo(tp_rank, agent_name, self.target.metadata(),
                              tuple((span.addr, span.length) for span in region_spans(exposed)))
        port = side_channel_port + tp_rank if side_channel_port else 0
        self.server = SideChannelServer(side_channel_host, port, codec, self._on_message,
                                        f"side-channel-{tp_rank}")
        self.address = advertised or self.server.address

        def peers(transport: Transport, kind: str) -> Peers:
            return Peers(transport, SideChannelClient(codec), self.address, f"{role}{tp_rank}-{kind}",
                         probe_timeout_s=timeouts.consumer.suspect_after_s)

        t = timeouts
        if role == "prefill":
            producer = ProducerCore(exposed, tp_rank, tp_size, t.producer, merge_descriptors=merge_descriptors,
                                    total_heads=total_heads, join=join)
            self.push: PushWriter | PushReceiver = PushWriter(
                producer, self.initiator, codec, peers(self.initiator, "push"), self.outbox, self.staging)
            self.pull: PullLender | PullReader = PullLender(
                LenderCore(tp_rank, tp_size, t.lender, total_heads=total_heads), self.target, codec,
                peers(self.target, "pull"), self.outbox)
        else:
            consumer = ConsumerCore(self.address, tp_rank, tp_size, t.consumer, total_heads=total_heads)
            self.push = PushReceiver(consumer, self.target, codec, peers(self.target, "push"), self.outbox,
                                     self.staging)
            self.pull = PullReader(ReaderCore(tp_rank, tp_size, t.reader, total_heads=total_heads), self.initiator,
                                   codec, peers(self.initiator, "pull"), self.outbox)
        self.push.timeline = self.pull.timeline = timeline
        self._routes = {kind: tuple(getattr(self, mode) for mode in modes) for kind, modes in ROUTES[role].items()}

    def _register(self, staging: StagingSpec, memory_type: str) -> HostStaging | None:
        """Registers the KV with the target's agent, or host slots in its place; the staging, if any."""
        reason = "host_staging: always"
        if staging.mode != "always":
            try:
                self.target.register(self.regions)
                return None
            except Exception as exc:  # NIXL raises its own status types; all mean "cannot register"
                if staging.mode == "never":
                    raise RuntimeError(f"NIXL cannot register the KV cache's {memory_type} memory ({exc}); fix "
                                       "the registration (GPUDirect RDMA / the EFA driver), or set host_staging: "
                                       "auto to stage through host memory, much slower") from exc
                reason = f"NIXL cannot register {memory_type} KV memory ({type(exc).__name__}: {exc})"
        slots = staging.slots or max(1, self.regions[0].num_blocks // 4)
        host = HostStaging(staging.rows, self.regions, slots)
        log.warning("neuron-disagg rank %d stages KV through %d host blocks (%s); pull mode is off",
                    self.tp_rank, host.slots, reason)
        self.target.memory_type = "DRAM"
        self.target.register(host.regions)
        return host

    def _on_message(self, message: Message) -> Message | None:
        """The side-channel server's thread: a verified message, to the threads it is for."""
        if isinstance(message, AgentInfoRequest):
            return self.info
        if isinstance(message, Probe):
            return self.alive
        threads = self._routes.get(type(message))
        if threads is None:  # a peer that takes us for the other role (swapped addresses)
            self.wrong_role[type(message).__name__] += 1
            log.warning("a %s rank got a %s, which only a %s rank takes: refused", self.role,
                        type(message).__name__, "decode" if self.role == "prefill" else "prefill")
            return None
        for thread in threads:
            thread.deliver(message)
        return None

    def start(self) -> Rank:
        self.server.start()
        self.push.start()
        self.pull.start()
        return self

    def check(self) -> None:
        """The engine loop, each step: raises ``TransferThreadDied`` if a thread died or is stuck."""
        self.push.check()
        self.pull.check()

    def expecting_a_landing(self) -> bool:
        """D: a write or read into our blocks is under way and has not been seen to land."""
        return self.push.expecting_a_landing() or self.pull.expecting_a_landing()

    def stats(self) -> tuple[Counter[str], Counter[str], list[float]]:
        """(cumulative counts, transfer failures by reason, every completed write's seconds) — what
        the threads and the server counted; the caller adds what it counts itself."""
        totals: Counter[str] = Counter()
        totals["messages_rejected"] = (sum(self.server.rejected.values()) + sum(self.wrong_role.values())
                                       + sum(sum(getattr(t, "rejected", {}).values()) for t in (self.push, self.pull)))
        totals["registrations_rejected"] = self.push.core.counters["registration_rejected"]
        totals["landed_in_quarantine"] = (self.push.core.counters["landed_in_quarantine"]
                                          + self.pull.core.counters["landed_in_quarantine"])
        totals["push_thread_cpu_us"] = int(self.push.cpu_seconds * 1e6)
        totals["pull_thread_cpu_us"] = int(self.pull.cpu_seconds * 1e6)
        # whoever posts transfers: P's push writer, D's pull reader
        initiator = self.push if isinstance(self.push, PushWriter) else self.pull
        for name in ("bytes", "descriptors", "agent_resets"):
            totals[name] = initiator.stats[name]
        if not isinstance(self.push, PushWriter) or not isinstance(self.pull, PullLender):  # D
            return totals, Counter(), []
        t = self.push.stats
        totals.update({"transfers": t["done"], "transfers_failed": t["failed"]})
        totals["registrations_rejected"] += t["registration_rejected"]
        totals["writes_planned_ahead"] = self.push.core.counters["write_planned_ahead"]
        totals["writes_prepared_ahead"] = t["prepared_posted"]
        totals["chunk_writes"] = t["chunk_writes"]
        totals["layer_parts"] = t["layer_parts"]
        totals["streams_rewritten"] = self.push.core.counters["stream_rewritten"]
        failures = Counter(self.push.failures) + Counter(self.pull.failures)  # both hold KV under a lease
        totals["lease_expiries"] = failures["lease expired"]
        return totals, failures, self.push.writes.done_seconds

    def shutdown(self) -> None:
        try:
            self.pull.shutdown()
            self.push.shutdown()
        finally:
            self.server.close()
            self.target.close()
            self.initiator.close()
