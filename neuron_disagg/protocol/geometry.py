"""Synthetic KV region layouts for a model shape: what a platform layer would read off the real
KV tensors. Used by the demo, the benchmarks and the tests; real deployments describe the tensors
vLLM actually allocated (see ``neuron_disagg.platforms``)."""

from __future__ import annotations

from dataclasses import dataclass

from .messages import Region
from .plan import rank_heads


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """The KV one token of a model holds, all ranks together: a K and a V of every KV head in every
    layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    block_tokens: int = 16

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)


QWEN3_32B = ModelShape(num_layers=64, num_kv_heads=8, head_dim=128, dtype_bytes=2, block_tokens=16)


def rank_regions(shape: ModelShape, num_blocks: int, tp_rank: int = 0, tp_size: int = 1,
                 base_addr: int = 0, layout: str = "HND", device_id: int = 0,
                 blocks_outermost: bool = False) -> tuple[Region, ...]:
    """One block-major region per layer and K/V, packed back to back from ``base_addr``; inside a
    block heads then tokens (``HND``) or tokens then heads (``NHD``). ``blocks_outermost``: the
    regions interleave instead, each block holding every layer's and K's and V's share back to
    back (vLLM's ``BLHNC``). With fewer KV heads than ranks each head is replicated, as vLLM does."""
    first_head, heads = rank_heads(tp_rank, tp_size, shape.num_kv_heads)
    head_bytes = shape.head_dim * shape.dtype_bytes
    block_bytes = heads * shape.block_tokens * head_bytes
    head_stride, token_stride = ((shape.block_tokens * head_bytes, head_bytes) if layout == "HND"
                                 else (head_bytes, heads * head_bytes))
    count = 2 * shape.num_layers
    # where region i starts, and how far apart its blocks lie
    start, stride = (block_bytes, count * block_bytes) if blocks_outermost else (block_bytes * num_blocks, block_bytes)
    return tuple(Region(
        name=f"layers.{i // 2}.{'kv'[i % 2]}", base_addr=base_addr + i * start, block_stride_bytes=stride,
        num_blocks=num_blocks, heads=heads, first_head=first_head, head_bytes=head_bytes,
        block_tokens=shape.block_tokens, head_stride_bytes=head_stride, token_stride_bytes=token_stride,
        device_id=device_id) for i in range(count))


def regions_bytes(regions: tuple[Region, ...]) -> int:
    """Bytes from the lowest region start to the highest region end."""
    lo = min(r.base_addr for r in regions)
    return max(r.base_addr + r.extent_bytes for r in regions) - lo
