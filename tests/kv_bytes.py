"""Byte-exact checks of KV moved between real KV tensors, shared by the layout tests.

P ranks fill a request's blocks through the backend's logical view, the connector's own geometry
reading (``kv_layout``) describes the tensors, ``plan_write`` plans, a memmove carries the bytes
(every address is this process's memory), and every D rank's blocks are checked through its logical
view: the request's blocks hold the right heads' KV, every head arrived from exactly one P rank, and
no other block was touched.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from neuron_disagg.platforms.kv_layout import KVGeometry, regions_from_kv_caches
from neuron_disagg.protocol import RankRegions, Registration, TransferId, plan_write
from neuron_disagg.protocol.plan import rank_heads

SRC_BLOCKS, DST_BLOCKS = (4, 1, 2), (0, 5, 3)  # P's blocks of the request, and where D wants them
SENTINEL = 7.0  # every D byte a transfer must not touch keeps it
#: (rank's KV heads) -> (layer name -> KV tensor, kernel block tokens)
BuildRank = Callable[[int], tuple[dict, int]]


def planes(tensor, logical: tuple[str, ...], kernel_block: int) -> list:
    """Views (not copies) of the tensor at one kernel block as (heads, kernel tokens, content),
    through the backend's logical shape: one per K/V plane where K and V are planes, else one."""
    index = tuple(kernel_block if d == "blocks" else slice(None) for d in logical)
    view, rest = tensor[index], [d for d in logical if d != "blocks"]
    if "heads" not in rest:
        view, rest = view.unsqueeze(0), ["heads", *rest]
    if "kv" not in rest:
        return [view.permute(rest.index("heads"), rest.index("tokens"), rest.index("head"))]
    kv_dim = rest.index("kv")
    others = [d for d in rest if d != "kv"]
    order = (others.index("heads"), others.index("tokens"), others.index("head"))
    return [view.select(kv_dim, kv).permute(*order) for kv in range(2)]


MAX_POSITIONS = 512  # a request's tokens: SRC_BLOCKS of up to 128 tokens each


@functools.cache
def _head(layer: int, head: int, width: int, dtype) -> torch.Tensor:
    """One head's KV at every position: random, the same whichever rank fills or checks it."""
    gen = torch.Generator().manual_seed(1000 + 1000 * layer + head)
    return torch.randn(MAX_POSITIONS, width, generator=gen).to(dtype)


def expected(layer: int, heads: range, positions: range, width: int, dtype):
    assert positions.stop <= MAX_POSITIONS
    return torch.stack([_head(layer, h, width, dtype)[positions.start:positions.stop] for h in heads])


def fill(caches: dict, logical, block_tokens: int, kernel_tokens: int, heads: range) -> None:
    split = block_tokens // kernel_tokens
    for layer, tensor in enumerate(caches.values()):
        for i, block in enumerate(SRC_BLOCKS):
            for j in range(split):
                views = planes(tensor, logical, block * split + j)
                start = i * block_tokens + j * kernel_tokens
                width = sum(v.shape[-1] for v in views)
                content = expected(layer, heads, range(start, start + kernel_tokens), width, tensor.dtype)
                for view, part in zip(views, content.split(views[0].shape[-1], dim=-1), strict=True):
                    view.copy_(part)


def check(caches: dict, logical, block_tokens: int, kernel_tokens: int, heads: range, rank: int,
          num_blocks: int) -> None:
    split = block_tokens // kernel_tokens
    for layer, tensor in enumerate(caches.values()):
        for block in range(num_blocks):
            for j in range(split):
                got = torch.cat(planes(tensor, logical, block * split + j), dim=-1)
                if block in DST_BLOCKS:
                    start = DST_BLOCKS.index(block) * block_tokens + j * kernel_tokens
                    want = expected(layer, heads, range(start, start + kernel_tokens), got.shape[-1], got.dtype)
                else:
                    want = torch.full_like(got, SENTINEL)
                assert torch.equal(got, want), (f"D rank {rank}, layer {layer}, block {block}, kernel block {j}: "
                                                f"{'wrong KV' if block in DST_BLOCKS else 'touched'}")


def move(plan) -> dict[int, int]:
    """Carry out a plan with memmove (every address is this process's memory); bytes per D rank."""
    written: dict[int, int] = {}
    for write in plan.writes:
        for src, dst, n in zip(write.src_addr.tolist(), write.dst_addr.tolist(), write.length.tolist(), strict=True):
            ctypes.memmove(dst, src, n)
        written[write.d_rank] = written.get(write.d_rank, 0) + write.bytes
    return written


def transfer(build_p: BuildRank, build_d: BuildRank, dims: tuple[str, ...], logical: tuple[str, ...],
             block_tokens: int, p_tp: int, d_tp: int, total_heads: int, num_blocks: int) -> None:
    """Move one request from every P rank into every D rank and check every byte. ``dims``: what
    the connector reads the tensors as; ``logical``: what the backend's source says they are."""
    assert dims == logical, f"the connector reads {dims}, the backend's source says {logical}"

    def rank(build: BuildRank, r: int, tp: int):
        first, count = rank_heads(r, tp, total_heads)
        caches, kernel = build(count)
        regions = regions_from_kv_caches(caches, dict.fromkeys(caches, dims), KVGeometry(block_tokens, r, tp, total_heads))
        return caches, kernel, regions, range(first, first + count)

    d_ranks = [rank(build_d, r, d_tp) for r in range(d_tp)]
    for caches, *_ in d_ranks:
        for tensor in caches.values():
            tensor.fill_(SENTINEL)
    registration = Registration(
        TransferId("layout-test"), "d", "d-request", "127.0.0.1:1", d_tp,
        tuple(RankRegions(r, f"d{r}", regions) for r, (_, _, regions, _) in enumerate(d_ranks)),
        DST_BLOCKS, 0, expires_at=1e18)
    written: dict[int, int] = {}
    for p in range(p_tp):
        caches, kernel, regions, heads = rank(build_p, p, p_tp)
        fill(caches, logical, block_tokens, kernel, heads)
        for d_rank, n in move(plan_write(regions, p, p_tp, registration, SRC_BLOCKS, total_heads=total_heads)).items():
            written[d_rank] = written.get(d_rank, 0) + n
    for r, (caches, kernel, regions, heads) in enumerate(d_ranks):
        check(caches, logical, block_tokens, kernel, heads, r, num_blocks)
        payload = sum(region.block_bytes for region in regions) * len(DST_BLOCKS)
        assert written.get(r) == payload, f"D rank {r} got {written.get(r)} bytes for {payload}: a head came twice"
