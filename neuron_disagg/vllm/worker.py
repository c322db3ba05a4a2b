"""The connector's worker side: runs in each vLLM worker process (one per TP rank).

``register_kv_caches`` describes the KV tensors as regions, registers them with a NIXL agent,
opens this rank's side channel and starts the transfer threads for the instance's role. Each
engine step the step's metadata is handed to those threads (queue puts only), and the threads'
results come back through ``get_transfer_results`` as request ids vLLM understands.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..config import Config
from ..platforms import select_platform
from ..platforms.kv_layout import KVGeometry, described_kv_caches, staging_rows
from ..protocol.consumer import ConsumerCore
from ..protocol.messages import (
    AgentInfo, AgentInfoRequest, Cancel, CancelAck, Heartbeat, RankRegions, ReadFailed,
    Registration, TransferId, Withdraw, WriteDone, WriteFailed, WriteStarting,
)
from ..protocol.producer import ProducerCore
from ..protocol.lender import LenderCore
from ..protocol.reader import ReaderCore
from ..protocol.wire import WireCodec
from ..timeline import Timeline
from ..transfer.peers import Peers
from ..transfer.pull import PullLender, PullReader
from ..transfer.receiver import PushReceiver
from ..transfer.side_channel import SideChannelClient, SideChannelServer
from ..transfer.staging import HostStaging
from ..transfer.transport import NixlTransport, region_spans
from ..transfer.writer import PushWriter
from .failures import router_transfer_id
from .metadata import RankHandshake, StepMetadata
from .stats import Deltas

log = logging.getLogger(__name__)


@dataclass
class TransferRecord:
    """One transfer the threads hold for vLLM request ``request_id``, until it is reported to vLLM."""

    request_id: str
    failure: str | None = None           # D: why the KV will not come
    released_blocks: tuple[int, ...] = ()


PULL_NEEDS_REGISTERED_KV = "pull reads device memory directly, and this instance stages KV through host memory"


class WorkerSide:
    def __init__(self, config: Config, role: str, engine_id: str, tp_rank: int, tp_size: int,
                 total_heads: int | None = None, recompute: bool = False):
        if role not in ("prefill", "decode"):
            raise ValueError("neuron-disagg runs an instance as prefill (kv_producer) or decode "
                             f"(kv_consumer), not {role!r}")
        self.config, self.role, self.engine_id = config, role, engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.total_heads = total_heads  # the model's KV heads (1 with MLA): ranks may hold replicas
        self.recompute = recompute  # vLLM's kv_load_failure_policy: a failed load is computed locally
        self.codec = WireCodec(config.load_secret(), config.max_message_bytes)
        self.agent_name = f"{engine_id}-rank{tp_rank}"
        self.address = f"{config.side_channel_host}:{config.side_channel_port}"  # rank r listens on port + r
        self.push: PushWriter | PushReceiver | None = None  # P's writer or D's receiver
        self.staging: HostStaging | None = None
        self.pull: PullLender | PullReader | None = None    # P's lender or D's reader
        self._lock = threading.Lock()  # the threads' callbacks against the engine loop's reads
        self._ended_changed = threading.Condition(self._lock)  # D: a load or free to report
        self._no_forward = False   # the step in hand runs no forward (StepMetadata.no_forward)
        self._reported = False     # the last transfer_results reported something
        self._transfers: dict[TransferId, TransferRecord] = {}  # in the transfer threads' hands
        self._ended: list[TransferRecord] = []       # ended; not yet reported to vLLM
        self._finished_by_vllm: set[str] = set()     # P: ours vLLM listed finished (it takes only those)
        self.failed_blocks: set[int] = set()  # of the loads the last transfer_results reported failed
        self._totals: Counter[str] = Counter()       # D-side outcomes, for metrics
        self._failure_reasons: Counter[str] = Counter()
        self._told: dict[str, str] = {}  # D, policy fail: router transfer id -> why, for the client's error
        self._deltas = Deltas()                      # what earlier stats snapshots already sent
        self.step_us: list[float] = []               # connector time on the engine loop, per step
        self.step_cpu_us: list[float] = []           # ... as the engine thread's CPU time
        self._after_forward: list = []               # P: this step's KvReady for after its forward

    # -- start-up ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, dims: dict[str, tuple[str, ...]], block_tokens: int) -> None:
        """``dims``: what each dimension of each layer's tensor holds, as its attention backend
        declares (``compat.kv_dims``); ``block_tokens``: the scheduler's block size."""
        described = described_kv_caches(kv_caches, dims, KVGeometry(block_tokens, self.tp_rank, self.tp_size,
                                                                    self.total_heads))
        self.regions = tuple(region for region, _ in described)
        platform, reason = select_platform(self.config.platform)
        self.platform = platform
        backend = platform.nixl_backend(self.config.backend)
        log.info("neuron-disagg rank %d: %s", self.tp_rank, reason)
        platform.use_kv_device(next(iter(kv_caches.values())).device)  # before any NIXL agent
        # Two agents per rank, each owned by one thread. The target's (P's lender, D's receiver)
        # is the one peers learn, by name, from offers and registrations; the initiator's (P's
        # writer, D's reader) posts, and may be replaced after a failed transfer (transport.py).
        self.transport = NixlTransport(self.agent_name, backend, platform.memory_type)
        self.staging = self._staging(described, platform.memory_type)
        memory_type = "DRAM" if self.staging else platform.memory_type
        exposed = self.staging.regions if self.staging else self.regions  # what peers may touch
        if self.staging:
            self.transport.memory_type = memory_type
            self.transport.register(exposed)
        initiator = "writer" if self.role == "prefill" else "reader"
        self.initiator = NixlTransport(f"{self.agent_name}-{initiator}", backend, memory_type)
        self.initiator.register(exposed)
        info = AgentInfo(self.tp_rank, self.agent_name, self.transport.metadata(),
                         tuple((span.addr, span.length) for span in region_spans(exposed)))
        self.rank_regions = RankRegions(self.tp_rank, self.agent_name, self.regions)

        def peers(transport, kind: str) -> Peers:
            return Peers(transport, SideChannelClient(self.codec), self.address,
                         f"{self.role}{self.tp_rank}-{kind}")

        t = self.config
        if self.role == "prefill":
            heads = self.total_heads
            core = ProducerCore(exposed, self.tp_rank, self.tp_size, t.producer_timeouts(), total_heads=heads)
            self.push = PushWriter(core, self.initiator, self.codec, peers(self.initiator, "push"), self._on_free,
                                     self.staging)
            self.pull = PullLender(LenderCore(self.tp_rank, self.tp_size, t.lender_timeouts(), total_heads=heads),
                                   self.transport, self.codec, peers(self.transport, "pull"), self._on_free)
            routes = {Registration: self.push, Heartbeat: self.push, Cancel: self.push, ReadFailed: self.pull}
            withdrawn = (self.push, self.pull)  # the router's Withdraw names no mode: both look
        else:
            heads = self.total_heads
            core = ConsumerCore(self.address, self.tp_rank, self.tp_size, t.consumer_timeouts(), total_heads=heads)
            self.push = PushReceiver(core, self.transport, self.codec, peers(self.transport, "push"),
                                       self._on_loaded, self._on_failed, self._on_free, self.staging)
            self.pull = PullReader(ReaderCore(self.tp_rank, self.tp_size, t.reader_timeouts(), total_heads=heads),
                                   self.initiator, self.codec, peers(self.initiator, "pull"), self._on_loaded,
                                   self._on_failed, self._on_free)
            routes = {WriteStarting: self.push, WriteDone: self.push, WriteFailed: self.push, CancelAck: self.push}
            withdrawn = ()

        def on_message(message):
            if isinstance(message, AgentInfoRequest):
                return info
            if isinstance(message, Withdraw):
                for thread in withdrawn:
                    thread.deliver(message)
                return None
            thread = routes.get(type(message))
            if thread is not None:
                thread.deliver(message)
            return None

        self.server = SideChannelServer(self.config.side_channel_host, self.config.side_channel_port + self.tp_rank,
                                        self.codec, on_message, f"side-channel-{self.tp_rank}").start()
        self.push.timeline = self.pull.timeline = Timeline(t.timeline_dir, f"{self.role}-rank{self.tp_rank}")
        self.push.start()
        self.pull.start()
        log.info("neuron-disagg %s rank %d: %d KV regions registered with NIXL %s; side channel %s",
                 self.role, self.tp_rank, len(self.regions), backend, self.server.address)

    def _staging(self, described, memory_type: str) -> HostStaging | None:
        """Registers the KV with ``self.transport`` unless staging; returns the staging, if any."""
        mode, reason = self.platform.host_staging(self.config.host_staging), "host_staging: always in the config"
        if mode != "always":
            try:
                self.transport.register(self.regions)
                return None
            except Exception as exc:  # NIXL raises its own status types; all mean "cannot register"
                if mode == "never":
                    raise RuntimeError(f"NIXL cannot register the KV cache's {memory_type} memory ({exc}) and "
                                       f"host_staging is never on {self.platform.name}; fix the registration "
                                       "(GPUDirect RDMA / the EFA driver), or set host_staging: auto to stage "
                                       "through host memory, much slower") from exc
                reason = f"NIXL cannot register {memory_type} KV memory ({type(exc).__name__}: {exc})"
        slots = self.config.host_staging_blocks or max(1, self.regions[0].num_blocks // 4)
        staging = HostStaging(staging_rows(described), self.regions, slots)
        log.warning("neuron-disagg rank %d stages KV through %d host blocks (%s); pull mode is off",
                    self.tp_rank, staging.slots, reason)
        return staging

    # -- each engine step (engine loop: queue puts only) ----------------------------------------------
    def hand_off(self, step: StepMetadata) -> None:
        """Before the step's forward."""
        if self._after_forward:  # the last step's forward ended without after_forward (never seen)
            self.after_forward()
        self._no_forward = step.no_forward
        # One fence per step, recorded on the engine thread (never waited on here): the threads wait
        # on it before reading finished KV or letting anything land in freshly allocated blocks.
        fence = self.platform.wait_for_kv() if (step.kv_ready or step.register or step.read) else None
        self._to_writer(step.kv_ready, fence)
        self._after_forward = step.kv_ready_after_forward
        for r in (*step.kv_coming, *self._after_forward):  # this forward computes their last tokens:
            self.push.kv_coming(r.transfer_id, r.block_ids)  # the writer plans their writes meanwhile
        for expected in step.expect:
            self.push.expect(expected.transfer_id, expected.p_side_channel, expected.p_tp_size)
        for alloc in step.register:
            self._track(alloc.transfer_id, alloc.request_id)
            self.push.allocated(Registration(
                alloc.transfer_id, self.engine_id, alloc.request_id, self.address, self.tp_size,
                (RankRegions(self.tp_rank, self.agent_name, self.regions),), alloc.block_ids,
                alloc.first_block_index, 0.0), fence)
        for lend in step.lend:  # our own scheduler's offer: no need to verify it
            self._track(lend.transfer_id, lend.request_id)
            if self.staging:  # D's read fails with the reason below; the blocks go back now
                self._on_free(lend.transfer_id, lend.offer.block_ids)
                continue
            self.pull.lend(lend.offer)
        for read in step.read:
            alloc = read.allocated
            self._track(alloc.transfer_id, alloc.request_id)
            if self.staging:
                self._on_failed(alloc.transfer_id, f"{PULL_NEEDS_REGISTERED_KV}; use push")
                self._on_free(alloc.transfer_id, alloc.block_ids)
                continue
            self.pull.offered(alloc.transfer_id, read.offers)  # verified on the reader thread
            self.pull.allocated(alloc.transfer_id, self.rank_regions, alloc.block_ids, alloc.first_block_index,
                                fence)
        for abort in step.abort:
            self.push.abort(abort.transfer_id, abort.reason)
            self.pull.abort(abort.transfer_id, abort.reason)

    def after_forward(self) -> None:
        """After the step's forward (vLLM's wait_for_save): prefills that forward completed go to the
        writer now, not a step later, with a fence recorded behind the forward."""
        ready, self._after_forward = self._after_forward, []
        if ready:
            self._to_writer(ready, self.platform.wait_for_kv(), time.time())

    def _to_writer(self, ready: list, fence, ready_at: float | None = None) -> None:
        # The puts wake the writer last: once it runs, anything here that waits (a lock, a file
        # write) may give it the GIL, and the engine loop waits out the writer's turn. For the same
        # reason the writer, not the engine loop, writes the timeline's p_kv_ready (at ready_at).
        for r in ready:
            self._track(r.transfer_id, r.request_id)
        for r in ready:
            self.push.kv_ready(r.transfer_id, r.block_ids, fence, ready_at)

    def _track(self, tid: TransferId, request_id: str) -> None:
        """Before the threads hear of a transfer, so that their callbacks find its record."""
        with self._lock:
            self._transfers[tid] = TransferRecord(request_id)

    def wait_for_landing(self) -> None:
        """D, before ``transfer_results`` in a step that runs no forward: while a write or read into
        our blocks is in flight, wait up to ``landing_wait_s`` for it to land, so that this step
        reports it rather than the next. Without it a CPU D reported a landing 2 ms after it on
        average (the next step began 2.4 ms after the last, 1 ms of it vLLM's sleep); with it, 0.9 ms
        (measured). Not after a step that reported (its requests are being scheduled), and never in
        a step with a forward."""
        wait_s = self.config.landing_wait_s
        if (self.role != "decode" or not wait_s or not self._no_forward or self._reported
                or not (self.push.expecting_a_landing() or self.pull.expecting_a_landing())):
            return
        with self._ended_changed:
            if self._ended:
                return
            started = time.perf_counter()
            if self._ended_changed.wait(wait_s):
                self._totals["landings_awaited"] += 1
            # I5: reported beside the per-step series, which it would swamp on an idle D
            self._totals["landing_wait_us"] += int((time.perf_counter() - started) * 1e6)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call; the failed
        loads' blocks are in ``failed_blocks`` until the next call (vLLM < 0.32 takes those).
        Raises ``TransferThreadDied`` if a transfer thread died: the engine stops rather than hang
        every request whose KV that thread held."""
        self.push.check()
        self.pull.check()
        with self._lock:
            if self.role == "prefill":
                # vLLM accepts only ids it has already listed as finished on this worker.
                if finished_req_ids:  # most steps finish nothing: skip the scan on the engine loop
                    ours = {r.request_id for r in self._transfers.values()} | {r.request_id for r in self._ended}
                    self._finished_by_vllm |= finished_req_ids & ours
                if not self._ended:
                    return set(), set(), set()
                sent = [r for r in self._ended if r.request_id in self._finished_by_vllm]
                self._ended = [r for r in self._ended if r.request_id not in self._finished_by_vllm]
                sending = {r.request_id for r in sent}
                self._finished_by_vllm -= sending
                return sending, set(), set()
            ended, self._ended = self._ended, []
            self._reported = bool(ended)
            failed = [r for r in ended if r.failure is not None]
            self.failed_blocks = {b for r in failed for b in r.released_blocks}
            return set(), {r.request_id for r in ended}, {r.request_id for r in failed}

    # -- transfer threads' callbacks (any thread) ------------------------------------------------------
    def _on_free(self, tid: TransferId, blocks: tuple[int, ...]) -> None:
        """The threads are done with the transfer's blocks (P: sent or given up; D: fenced)."""
        with self._lock:
            record = self._transfers.pop(tid, None)
            if record is not None:
                record.released_blocks = tuple(blocks)  # a failed load: vLLM < 0.32 learns of it by these
                self._ended.append(record)
                self._ended_changed.notify()

    def _on_loaded(self, tid: TransferId) -> None:
        self._totals["transfers"] += 1
        with self._lock:
            record = self._transfers.pop(tid, None)
            if record is not None:
                self._ended.append(record)
                self._ended_changed.notify()

    def _on_failed(self, tid: TransferId, reason: str) -> None:
        """D: the KV will not come; FreeBlocks follows and ends the transfer."""
        with self._lock:
            record = self._transfers.get(tid)
            if record is None or record.failure is not None:  # counted once per request
                return
            record.failure = reason
            self._totals["transfers_failed"] += 1
            self._failure_reasons[reason.split(":")[0]] += 1
            if not self.recompute:  # the request fails: its client learns why (failures.py)
                self._told[router_transfer_id(tid)] = reason
        log.warning("request %s (transfer %s) gets no KV: %s", record.request_id, tid, reason)

    # -- metrics -----------------------------------------------------------------------------------------
    def stats(self) -> dict | None:
        """What changed since the last call, as the plain dict ``stats.ConnectorStats`` carries."""
        if self.push is None:
            return None
        totals = Counter(self._totals)
        failures = Counter(self._failure_reasons)
        totals["messages_rejected"] += sum(self.server.rejected.values()) + sum(
            sum(getattr(thread, "rejected", {}).values()) for thread in (self.push, self.pull))
        totals["registrations_rejected"] = self.push.core.counters["registration_rejected"]
        for mode, thread in (("push", self.push), ("pull", self.pull)):
            totals[f"{mode}_thread_cpu_us"] = int(thread.cpu_seconds * 1e6)
        write_seconds: list[float] = []
        for initiator in (self.push, self.pull):  # P's writer, D's reader: whoever posts transfers
            if isinstance(initiator, (PushWriter, PullReader)):
                for name in ("bytes", "descriptors", "agent_resets"):
                    totals[name] += initiator.stats[name]
        if isinstance(self.push, PushWriter):
            t = self.push.stats
            totals.update({"transfers": t["done"], "transfers_failed": t["failed"]})
            totals["registrations_rejected"] += t["registration_rejected"]
            totals["writes_planned_ahead"] = self.push.core.counters["write_planned_ahead"]
            totals["writes_prepared_ahead"] = t["prepared_posted"]
            failures = Counter(self.push.failures)
            totals["lease_expiries"] = failures["lease expired"]
            write_seconds = self.push.writes.done_seconds
        step_us, self.step_us = self.step_us, []
        step_cpu_us, self.step_cpu_us = self.step_cpu_us, []
        with self._lock:
            told, self._told = self._told, {}
        return self._deltas.payload(totals, failures, write_seconds, step_us, step_cpu_us, told,
                                    recompute=self.role == "decode" and self.recompute)

    def handshake(self) -> RankHandshake:
        return RankHandshake(self.rank_regions)

    def shutdown(self) -> None:
        if self.push is not None:
            self.pull.shutdown()
            self.push.shutdown()
            self.server.close()
            self.transport.close()
            self.initiator.close()
