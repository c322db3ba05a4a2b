"""``NeuronDisaggConnector``: vLLM's KVConnectorBase_V1, push mode over NIXL.

vLLM builds it twice: once in the engine-core process (``role=SCHEDULER``) and once in every worker
process (``role=WORKER``). Each method below says which side calls it and when; the work lives in
the instance's role's module — ``prefill.py`` (``kv_producer``) or ``decode.py`` (``kv_consumer``),
each a scheduler half and a worker half — picked once, from ``kv_role``. Load with
``--kv-transfer-config '{"kv_connector": "NeuronDisaggConnector",
"kv_connector_module_path": "neuron_disagg.vllm.connector", ...}'`` — ``neuron-disagg serve``
writes that for you.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from ..config import Config
from ..protocol.wire import WireCodec
from ..timeline import Timeline
from . import compat
from .decode import DecodeScheduler, DecodeWorker
from .metadata import QuarantineNotices, RankHandshake, StepMetadata
from .neuron_plugin import refuse_unsupported_platform
from .prefill import OfferMaker, PrefillScheduler, PrefillWorker
from .stats import ConnectorPromMetrics, ConnectorStats, empty

#: vLLM's kv_role -> (our role, its scheduler side, its worker side)
_ROLES = {"kv_producer": ("prefill", PrefillScheduler, PrefillWorker),
          "kv_consumer": ("decode", DecodeScheduler, DecodeWorker)}


class StepClock:
    """What one engine step spends in our worker hooks (I5), two ways: wall time, what the engine
    loop waited, and the engine thread's CPU time, what our code cost it. They differ by the time
    the thread waited, for a lock or for its core: where an instance shares one core (the bench),
    mostly other processes' turns — P's API server wakes in the step after a request ends — which
    would have delayed whatever the engine loop was running."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> StepClock:
        # The thread's CPU clock is a system call (the wall clock is not): read it outside the wall
        # window, or another process woken meanwhile preempts us on its return, inside the window.
        self._cpu = time.thread_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.thread_time() - self._cpu

    def add(self, seconds: float) -> None:
        """Time spent in a hook that never waits, read off the wall clock alone (a per-layer hook
        cannot afford the CPU clock's two system calls): there, wall time is CPU time."""
        self.wall += seconds
        self.cpu += seconds

    def take(self) -> tuple[float, float]:
        """(wall, cpu) seconds since the last take, and start over."""
        spent, (self.wall, self.cpu) = (self.wall, self.cpu), (0.0, 0.0)
        return spent


class NeuronDisaggConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_runtime()
        refuse_unsupported_platform()
        _refuse_hybrid_kv_cache(kv_cache_config)
        self._vllm_config = vllm_config
        transfer = vllm_config.kv_transfer_config
        self.config = Config.from_mapping(transfer.kv_connector_extra_config or {},
                                          source="kv_connector_extra_config")
        if transfer.kv_role not in _ROLES:
            raise ValueError(f"kv_role {transfer.kv_role!r}: run each instance as kv_producer (prefill) "
                             "or kv_consumer (decode)")
        self._step = StepClock()
        self.scheduler_side: PrefillScheduler | DecodeScheduler | None = None
        self.worker_side: PrefillWorker | DecodeWorker | None = None
        self._engine_id = transfer.engine_id
        name, scheduler_side, worker_side = _ROLES[transfer.kv_role]
        if role == KVConnectorRole.SCHEDULER:
            timeline = Timeline(self.config.timeline_dir, f"{name}-scheduler")
            block_size, signer = vllm_config.cache_config.block_size, self.config.params_signer()
            if scheduler_side is PrefillScheduler:
                async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
                self.scheduler_side = PrefillScheduler(block_size, signer, timeline=timeline,
                                                       async_scheduling=async_scheduling,
                                                       accept_unsigned=self.config.accept_unsigned_prefill_legs,
                                                       stream=self.config.stream != "off")
            else:
                self.scheduler_side = DecodeScheduler(block_size, signer, timeline=timeline)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            model = vllm_config.model_config
            self.worker_side = worker_side(self.config, transfer.engine_id, get_tensor_model_parallel_rank(),
                                           vllm_config.parallel_config.tensor_parallel_size,
                                           total_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
                                           recompute=getattr(transfer, "kv_load_failure_policy", "fail") == "recompute")
            # With micro-batching (DBO) vLLM runs each layer once a micro-batch, so its per-layer
            # hook would count a layer done while another micro-batch still writes its KV.
            self.worker_side.layer_hook_once = not getattr(vllm_config.parallel_config, "use_ubatching", False)
        self._failed_blocks: set[int] = set()  # vLLM < 0.32: this step's failed loads, as their blocks

    # -- scheduler side (engine-core process, engine loop) --------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, for a waiting request: D loads the prompt's KV from P asynchronously."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Scheduler, after allocating blocks: D registers the fresh ones with P (next step)."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        """Scheduler, once per step: this step's work for the workers."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, when a request ends: P keeps its blocks until the writer is done with them."""
        return self.scheduler_side.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        """Scheduler, after each step: what the workers finished sending or receiving."""
        self.scheduler_side.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """Scheduler, once after start-up: every worker's agent and regions, for P's pull offers."""
        if not isinstance(self.scheduler_side, PrefillScheduler) or not metadata:
            return
        ranks = tuple(metadata[rank].rank_regions for rank in sorted(metadata))
        self.scheduler_side.offers = OfferMaker(
            WireCodec(self.config.load_secret(), self.config.max_message_bytes), self._engine_id,
            self.config.side_channel, ranks, self.config.lease_s)

    def get_handshake_metadata(self) -> RankHandshake | None:
        """Worker, once after registering the KV caches: what the scheduler needs for pull offers."""
        return self.worker_side.handshake() if self.worker_side is not None else None

    def has_pending_push_work(self) -> bool:
        """Scheduler: keep stepping while P holds blocks for the writer, or D keeps blocks in
        quarantine, so that the workers' word that frees them is seen."""
        return self.scheduler_side.has_pending_push_work()

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """Scheduler, at start-up: vLLM's block pool, where D keeps quarantined blocks out of use."""
        if isinstance(self.scheduler_side, DecodeScheduler):
            self.scheduler_side.bind_block_pool(gpu_block_pool)

    def may_load_async(self, request) -> bool:
        """Scheduler (vLLM 0.34+), as a request is queued: D's legs load asynchronously, so they may
        start loading while the running batch is full (``--max-num-inflight-kv-loads``)."""
        side = self.scheduler_side
        return isinstance(side, DecodeScheduler) and side.may_load_async(request)

    # -- worker side (worker process, engine loop) ------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        """Worker, once at start-up: register the KV tensors (described as their attention backend
        declares them) and start the transfer threads."""
        self.worker_side.register_kv_caches(kv_caches, compat.kv_dims(self._vllm_config, kv_caches),
                                            self._vllm_config.cache_config.block_size)

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Worker, each step before the forward: hand the step's work to the transfer threads now
        (queue puts). vLLM calls start_load_kv and wait_for_save after the forward, so handing off
        there would make a finished prefill's write wait for a whole further step; on CPU, where the
        forward is synchronous, that is a whole prefill of another request."""
        super().bind_connector_metadata(connector_metadata)
        self._step.take()  # a new step
        with self._step:
            self.worker_side.hand_off(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Worker, each step: nothing to do here; loads are asynchronous on our threads."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per layer: never waits (loads complete between steps)."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """Worker, per attention layer during the forward, once the layer wrote its KV (where vLLM
        calls it: CUDA and CPU attention, not Neuron's compiled graph): streaming by layers, P
        counts the layer off its group, and a group complete is fenced for the writer."""
        layers = self.worker_side.layers_in_forward  # None unless P streams by layers in this step
        if layers is not None:
            started = time.perf_counter()
            layers.saved(layer_name)
            self._step.add(time.perf_counter() - started)

    def wait_for_save(self) -> None:
        """Worker, once per step after the forward: prefills this forward completed go to the writer
        now (push); nothing here waits for the KV or the write."""
        with self._step:
            self.worker_side.after_forward()

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Worker, each step (vLLM 0.32+): requests whose blocks the threads released, loaded, or
        failed to load (those also count as received; vLLM's kv_load_failure_policy applies). In a
        step that computes nothing, KV in flight is first waited for briefly (``landing_wait_s``)."""
        sending, recving, failed = self._results(finished_req_ids)
        return compat.transfer_results(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]):
        """Worker, each step (vLLM < 0.32): as get_transfer_results; a failed load is reported
        through its blocks in get_block_ids_with_load_errors, which vLLM calls right after."""
        sending, recving, failed = self._results(finished_req_ids)
        self._failed_blocks = set(self.worker_side.failed_blocks)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, each step after get_finished (vLLM < 0.32): blocks whose load failed."""
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def _results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        self.worker_side.wait_for_landing()  # outside the clock: a step with nothing to compute
        with self._step:
            sending, recving, failed = self.worker_side.transfer_results(finished_req_ids)
        wall, cpu = self._step.take()  # I5: what the engine loop paid us
        if sending or recving or self.has_connector_metadata():
            self.worker_side.step_us.append(wall * 1e6)
            self.worker_side.step_cpu_us.append(cpu * 1e6)
        return sending, recving, failed

    def build_connector_worker_meta(self) -> QuarantineNotices | None:
        """Worker, each step after the results: D's word on quarantined blocks for the scheduler side."""
        if isinstance(self.worker_side, DecodeWorker):
            return self.worker_side.worker_meta()
        return None

    def get_kv_connector_stats(self) -> ConnectorStats | None:
        """Worker, each step: counters since the last call, for vLLM's stats and /metrics.
        Scheduler, each step: the blocks it holds for transfers when that changed, and requests
        whose kv_transfer_params it rejected."""
        if self.worker_side is not None:
            data = self.worker_side.stats()
            return ConnectorStats(data) if data else None
        data = self.scheduler_side.stats()
        return None if data is None else ConnectorStats({**empty(), **data})

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """Engine start-up: head-major blocks, so a rank's heads are one span of a block when P and D
        run different TP sizes ("HND" is vLLM 0.29+'s LBHNC too). MLA has one head: no preference.
        Any layout vLLM ends up with is read off the tensors (platforms.kv_layout)."""
        return None if vllm_config.model_config.use_mla else "HND"

    @classmethod
    def kv_cache_access(cls, kv_transfer_config=None):
        """Engine start-up (vLLM 0.34+): NIXL registers the KV cache's memory for RDMA (device memory,
        or host memory on CPU and with host staging), so each KV segment must be one allocation."""
        return compat.registers_kv_cache()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """vLLM 0.33+: sleep mode frees and re-allocates the KV cache under our NIXL registrations."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ConnectorStats:
        """Logger process: rebuild worker stats sent as a plain dict."""
        return ConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """API server process: the ``neuron_disagg_*`` series on vLLM's /metrics."""
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Worker, at exit: stop the threads (in-flight transfers fail with a reason)."""
        if self.worker_side is not None:
            self.worker_side.shutdown()


def _refuse_hybrid_kv_cache(kv_cache_config) -> None:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) > 1:
        raise ValueError(f"this model's KV cache has {len(groups)} groups (sliding-window or state layers "
                         "beside full attention); neuron-disagg transfers one group: start vLLM with "
                         "--disable-hybrid-kv-cache-manager")
