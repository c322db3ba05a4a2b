"""What both roles' worker sides share: runs in each vLLM worker process (one per TP rank).

``register_kv_caches`` describes the KV tensors as regions and starts this rank's transfer machinery
(``transfer.rank.Rank``: agents, threads, side channel). Each engine step the role's worker
(``prefill.PrefillWorker``, ``decode.DecodeWorker``) hands the step's metadata to the rank's threads
(queue puts only) and drains what the threads report (``transfer.outbox``) into one record per
transfer, whose explicit state says what vLLM has still to be told.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from ..config import Config
from ..platforms import select_platform
from ..platforms.fence import LayerFences
from ..platforms.kv_layout import KVGeometry, described_kv_caches, staging_rows
from ..protocol.messages import RankRegions, Region, TransferId
from ..protocol.wire import WireCodec
from ..timeline import Timeline
from ..transfer.outbox import Failed, Freed, Loaded, Quarantined, Result
from ..transfer.rank import Rank, RankTimeouts, StagingSpec
from .metadata import RankHandshake, StepMetadata
from .stats import Deltas

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    IN_THREADS = "in_threads"    # the transfer threads hold its blocks
    FAILING = "failing"          # D: its KV will not come; its blocks wait for their fence (I2)
    QUARANTINED = "quarantined"  # D: told vLLM the load failed; its blocks still wait for their fence
    ENDED = "ended"              # the threads are done with it; vLLM has not been told yet


@dataclass
class TransferRecord:
    """One transfer the threads hold for vLLM request ``request_id``, until vLLM is told it ended."""

    request_id: str
    state: TransferState = TransferState.IN_THREADS
    failure: str | None = None           # D: why the KV will not come
    block_ids: tuple[int, ...] = ()      # D: the blocks allocated for it
    released_blocks: tuple[int, ...] = ()
    finished_by_vllm: bool = False       # P: vLLM listed the request finished (it takes only those)
    reported: bool = False               # D, quarantined: vLLM has been told the load failed


class WorkerSide:
    role: ClassVar[str]
    #: P streaming by layers: the running step's fences, which ``save_kv_layer`` counts layers off
    layers_in_forward: LayerFences | None = None
    layer_hook_once: bool = True  # vLLM calls save_kv_layer once per layer and step (no micro-batches)

    def __init__(self, config: Config, engine_id: str, tp_rank: int, tp_size: int,
                 total_heads: int | None = None, recompute: bool = False):
        self.config, self.engine_id = config, engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.total_heads = total_heads  # the model's KV heads (1 with MLA): ranks may hold replicas
        self.recompute = recompute  # vLLM's kv_load_failure_policy: a failed load is computed locally
        self.codec = WireCodec(config.load_secret(), config.max_message_bytes)
        self.agent_name = f"{engine_id}-rank{tp_rank}"
        self.address = f"{config.side_channel_host}:{config.side_channel_port}"  # rank r listens on port + r
        self.rank: Rank | None = None
        self._transfers: dict[TransferId, TransferRecord] = {}
        self._unreported: list[TransferId] = []  # records ENDED since the last report, in order
        self._totals: Counter[str] = Counter()   # what this side counts itself, for metrics
        self._failure_reasons: Counter[str] = Counter()
        self.failed_blocks: set[int] = set()  # D: of the loads the last transfer_results reported failed
        self._deltas = Deltas()                  # what earlier stats snapshots already sent
        self.step_us: list[float] = []           # connector time on the engine loop, per step
        self.step_cpu_us: list[float] = []       # ... as the engine thread's CPU time

    # -- start-up ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, dims: dict[str, tuple[str, ...]], block_tokens: int) -> None:
        """``dims``: what each dimension of each layer's tensor holds, as its attention backend
        declares (``compat.kv_dims``); ``block_tokens``: the scheduler's block size."""
        described = described_kv_caches(kv_caches, dims, KVGeometry(block_tokens, self.tp_rank, self.tp_size,
                                                                    self.total_heads))
        regions = tuple(region for region, _ in described)
        platform, reason = select_platform(self.config.platform)
        self.platform = platform
        join = self._join(list(kv_caches), regions)
        backend = platform.nixl_backend(self.config.backend)
        log.info("neuron-disagg rank %d: %s", self.tp_rank, reason)
        platform.use_kv_device(next(iter(kv_caches.values())).device)  # before any NIXL agent
        c = self.config
        staging = StagingSpec(platform.host_staging(c.host_staging), staging_rows(described),
                              c.host_staging_blocks)
        self.rank = Rank(
            self.role, self.tp_rank, self.tp_size, regions, codec=self.codec, agent_name=self.agent_name,
            side_channel_host=c.side_channel_host, side_channel_port=c.side_channel_port, advertised=self.address,
            timeouts=RankTimeouts(producer=c.producer_timeouts(), consumer=c.consumer_timeouts(),
                                  lender=c.lender_timeouts(), reader=c.reader_timeouts()),
            backend=backend, memory_type=platform.memory_type, total_heads=self.total_heads, staging=staging,
            join=join, timeline=Timeline(c.timeline_dir, f"{self.role}-rank{self.tp_rank}")).start()
        self.rank_regions = RankRegions(self.tp_rank, self.agent_name, regions)
        log.info("neuron-disagg %s rank %d: %d KV regions registered with NIXL %s; side channel %s",
                 self.role, self.tp_rank, len(regions), backend, self.rank.server.address)

    def _join(self, layer_names: list[str], regions: tuple[Region, ...]) -> tuple[int, ...] | None:
        """Each region's join class for planning (``plan.plan_rank_write``); None: one class."""
        return None

    # -- each engine step (engine loop) ----------------------------------------------------------------
    def hand_off(self, step: StepMetadata) -> None:
        """Before the step's forward: the step's work to the threads (queue puts only)."""
        raise NotImplementedError

    def after_forward(self) -> None:
        """After the step's forward (``wait_for_save``)."""

    def wait_for_landing(self) -> None:
        """Before ``transfer_results`` in a step (D: may wait briefly for KV in flight)."""

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        raise NotImplementedError

    def _track(self, tid: TransferId, request_id: str, block_ids: tuple[int, ...] = ()) -> None:
        """Before the threads hear of a transfer, so that what they report finds its record."""
        if tid in self._transfers:  # the scheduler side hands each transfer over once
            self._totals["connector_bugs"] += 1
            log.error("transfer %s handed to the threads twice (a bug; the first record kept)", tid)
            return
        self._transfers[tid] = TransferRecord(request_id, block_ids=block_ids)

    def _take_results(self) -> None:
        """What the threads reported since the last step, into the records, in order."""
        for result in self.rank.outbox.drain():
            self._result(result)

    def _result(self, result: Result) -> None:
        record = self._transfers.get(result.transfer_id)
        if record is None or record.state is TransferState.ENDED:
            return  # a late duplicate (a transfer ends once)
        if record.state is TransferState.QUARANTINED:
            if isinstance(result, Freed):  # vLLM was told the load failed; now its scheduler may reuse the blocks
                self._released(result.transfer_id, record)
            return
        if isinstance(result, Quarantined) and record.state is TransferState.IN_THREADS:
            self._quarantined(result.transfer_id, record, result.reason)
        elif isinstance(result, Freed):
            record.released_blocks = result.block_ids  # a failed load: vLLM < 0.32 learns of it by these
            self._ended(result.transfer_id)
        elif isinstance(result, Loaded):
            self._loaded(result.transfer_id, record)
        elif isinstance(result, Failed) and record.state is TransferState.IN_THREADS:  # told once
            self._failed(result.transfer_id, record, result.reason)

    def _ended(self, tid: TransferId) -> None:
        self._transfers[tid].state = TransferState.ENDED
        self._unreported.append(tid)

    def _loaded(self, tid: TransferId, record: TransferRecord) -> None:
        raise NotImplementedError(f"a {self.role} rank loads nothing")

    def _failed(self, tid: TransferId, record: TransferRecord, reason: str) -> None:
        raise NotImplementedError(f"a {self.role} rank loads nothing")

    def _quarantined(self, tid: TransferId, record: TransferRecord, reason: str) -> None:
        raise NotImplementedError(f"a {self.role} rank loads nothing")

    def _released(self, tid: TransferId, record: TransferRecord) -> None:
        raise NotImplementedError(f"a {self.role} rank loads nothing")

    # -- metrics -----------------------------------------------------------------------------------------
    def stats(self) -> dict | None:
        """What changed since the last call, as the plain dict ``stats.ConnectorStats`` carries."""
        if self.rank is None:
            return None
        self._take_results()  # counted as the threads reported them, whatever vLLM asks first
        totals, failures, write_seconds = self.rank.stats()
        totals.update(self._totals)
        failures.update(self._failure_reasons)
        step_us, self.step_us = self.step_us, []
        step_cpu_us, self.step_cpu_us = self.step_cpu_us, []
        return self._deltas.payload(totals, failures, write_seconds, step_us, step_cpu_us, self._told(),
                                    recompute=self.role == "decode" and self.recompute)

    def _told(self) -> dict[str, str]:
        """D, policy fail: router transfer id -> why its KV did not come, for the client's error."""
        return {}

    def handshake(self) -> RankHandshake:
        return RankHandshake(self.rank_regions)

    def shutdown(self) -> None:
        if self.rank is not None:
            self.rank.shutdown()
