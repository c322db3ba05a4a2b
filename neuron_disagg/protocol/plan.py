"""Transfer plans: which bytes of P's KV go where in D's, as few descriptors as possible.

Pure arithmetic on the two sides' region geometry (see ``messages.Region``) and block-id lists.
Heads are split evenly across tensor-parallel ranks, so with different TP sizes a P rank writes
the slice of its heads that each overlapping D rank holds. Contiguous descriptors within one region
pair are merged: one descriptor per block per layer is the reference implementation's cost
(tens of thousands per request); a contiguous block list collapses to one descriptor per region.
Runs are found in source-address order, not token order, so block lists that both sides hand out
in the same non-ascending order (vLLM's free queue, once a pool has gone round) merge as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

import numpy as np

from .errors import PlanError
from .messages import RankRegions, Region, Registration

_U64 = np.uint64


def peer_ranks(my_rank: int, my_tp: int, peer_tp: int) -> tuple[int, ...]:
    """Ranks of a peer instance (TP size ``peer_tp``) whose share of the heads overlaps rank
    ``my_rank``'s (each rank holds an equal share; replicated heads are shares of one head)."""
    if not (0 <= my_rank < my_tp) or peer_tp < 1:
        raise PlanError(f"rank {my_rank} is outside TP size {my_tp} (peer TP {peer_tp})")
    # In units of 1/(my_tp*peer_tp) of the heads: mine span [my_rank*peer_tp, (my_rank+1)*peer_tp),
    # the peer's rank r spans [r*my_tp, (r+1)*my_tp).
    lo, hi = my_rank * peer_tp, (my_rank + 1) * peer_tp
    first, last = lo // my_tp, -(-hi // my_tp) - 1
    return tuple(range(first, last + 1))


def rank_heads(rank: int, tp: int, total_heads: int) -> tuple[int, int]:
    """(first head, heads) that rank ``rank`` of ``tp`` holds, as vLLM splits KV heads: evenly, and
    with fewer heads than ranks each head on ``tp // total_heads`` consecutive ranks."""
    if total_heads < 1 or tp < 1 or (total_heads % tp and tp % total_heads):
        raise PlanError(f"{total_heads} KV heads cannot be split over TP {tp}: one must divide the other")
    if total_heads >= tp:
        per_rank = total_heads // tp
        return rank * per_rank, per_rank
    return rank * total_heads // tp, 1


def writer_ranks(d_rank: int, d_tp: int, p_tp: int, total_heads: int | None = None) -> tuple[int, ...]:
    """The P ranks that write into D rank ``d_rank``: every head it holds from exactly one P rank.
    Of P ranks holding the same replicated head, the first whose share overlaps D's writes, so the
    load spreads over P's ranks as vLLM's own connector spreads its reads. ``total_heads`` None:
    no replication (every P rank overlapping D's share holds heads of its own)."""
    candidates = peer_ranks(d_rank, d_tp, p_tp)
    if total_heads is None:
        return candidates
    first, count = rank_heads(d_rank, d_tp, total_heads)
    wanted, chosen = set(range(first, first + count)), []
    for p in candidates:
        p_first, p_count = rank_heads(p, p_tp, total_heads)
        mine = wanted & set(range(p_first, p_first + p_count))
        if mine:
            chosen.append(p)
            wanted -= mine
    return tuple(chosen)


def target_ranks(p_rank: int, p_tp: int, d_tp: int, total_heads: int | None = None) -> tuple[int, ...]:
    """The D ranks P rank ``p_rank`` writes into (the inverse of ``writer_ranks``)."""
    return tuple(d for d in peer_ranks(p_rank, p_tp, d_tp)
                 if p_rank in writer_ranks(d, d_tp, p_tp, total_heads))


@dataclass(frozen=True)
class RankWrite:
    """All descriptors from one P rank into one D rank, merged. Arrays share one length.
    ``remote_agent`` is the agent on the far side of the transfer: D's for a push WRITE, P's for a
    pull READ."""

    d_rank: int
    remote_agent: str
    src_addr: np.ndarray
    dst_addr: np.ndarray
    length: np.ndarray
    src_dev: np.ndarray
    dst_dev: np.ndarray
    unmerged_count: int
    #: the index in P's regions of the region where each descriptor starts reading; a descriptor
    #: runs on into another region only of the same join class (``plan_rank_write``)
    src_region: np.ndarray | None = None

    @property
    def bytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


@dataclass(frozen=True)
class WritePlan:
    writes: tuple[RankWrite, ...] = field(default_factory=tuple)

    @property
    def descriptor_count(self) -> int:
        return sum(len(w) for w in self.writes)

    @property
    def unmerged_count(self) -> int:
        return sum(w.unmerged_count for w in self.writes)

    @property
    def bytes(self) -> int:
        return sum(w.bytes for w in self.writes)


def _check_compatible(src: Region, dst: Region) -> None:
    # Chunks move one (head, token) at a time wherever each side keeps them, so the two sides may
    # order a block differently (a P with token-major and a D with head-major KV plan correctly).
    for attr in ("head_bytes", "block_tokens"):
        if getattr(src, attr) != getattr(dst, attr):
            raise PlanError(
                f"region {src.name}: {attr} differs between prefill ({getattr(src, attr)}) and "
                f"decode ({getattr(dst, attr)}); both must serve the same model with the same "
                "block size and attention backend"
            )


def _check_region(region: Region, side: str) -> None:
    if region.heads < 1 or region.head_bytes < 1 or region.block_tokens < 1:
        raise PlanError(f"{side} region {region.name} declares an empty block")
    if region.block_tokens % region.kernel_tokens or min(
            region.block_stride_bytes, region.head_stride_bytes, region.token_stride_bytes,
            region.kernel_stride_bytes) < 0:
        raise PlanError(f"{side} region {region.name} declares an impossible block geometry")
    if region.base_addr < 0 or region.num_blocks < 1:
        raise PlanError(f"{side} region {region.name} has no memory")


def _check_blocks(bounds: tuple[int, int], region: Region, side: str) -> None:
    low, high = bounds
    if low < 0 or high >= region.num_blocks:
        raise PlanError(
            f"{side} block ids must lie in 0..{region.num_blocks - 1} for region {region.name}; "
            f"got {low}..{high}"
        )


def _chunk_offsets(region: Region, heads: np.ndarray) -> np.ndarray:
    """Offsets inside a block of every (head, token) chunk of ``heads``, head by head."""
    t = np.arange(region.block_tokens, dtype=_U64)
    k = _U64(region.kernel_tokens)
    token = (t // k) * _U64(region.kernel_stride_bytes) + (t % k) * _U64(region.token_stride_bytes)
    offsets: np.ndarray = ((heads - region.first_head).astype(_U64)[:, None] * _U64(region.head_stride_bytes)
                           + token[None, :]).ravel()
    return offsets


#: (src offsets, dst offsets, lengths): descriptors, one array per column
Descriptors = tuple[np.ndarray, np.ndarray, np.ndarray]
#: a region's block geometry (``_geometry``)
Geometry = tuple[int, ...]


def _block_pattern(src: Region, dst: Region) -> Descriptors | None:
    """(src offsets, dst offsets, lengths) inside one block of the heads both regions hold, merged
    where both sides continue; None when they share no head. Computed once per pair of block
    geometries, then laid over every block of the request."""
    h0 = max(src.first_head, dst.first_head)
    h1 = min(src.first_head + src.heads, dst.first_head + dst.heads)
    if h0 >= h1:
        return None
    heads = np.arange(h0, h1, dtype=np.int64)
    s, d = _chunk_offsets(src, heads), _chunk_offsets(dst, heads)
    order = np.argsort(s, kind="stable")
    return merge_runs(s[order], d[order], np.full(len(s), src.head_bytes, dtype=_U64))


def _geometry(region: Region) -> Geometry:
    """Everything but where a region lies and what it is called: regions that share it share plans."""
    return (region.block_stride_bytes, region.heads, region.first_head, region.head_bytes, region.block_tokens,
            region.head_stride_bytes, region.token_stride_bytes, region.kernel_block_tokens,
            region.kernel_stride_bytes)


def merge_runs(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Descriptors:
    """Merge back-to-back descriptors whose source and destination both continue the previous."""
    if len(length) < 2:
        return src, dst, length
    continues = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def _interleave(regions: Sequence[Region]) -> bool:
    """Some region starts before another on its device ends. Otherwise a descriptor can run on
    into another region only from one region's last block into the next one's first: not worth
    a pass over every descriptor (vLLM's layer-major layouts, a region per layer)."""
    end: dict[int, int] = {}
    for device, base, stop in sorted((r.device_id, r.base_addr, r.base_addr + r.extent_bytes) for r in regions):
        if base < end.get(device, base):
            return True
        end[device] = max(end.get(device, stop), stop)
    return False


def join_regions(s: np.ndarray, d: np.ndarray, n: np.ndarray, sdev: np.ndarray, ddev: np.ndarray,
                 owners: np.ndarray, join: np.ndarray) -> tuple[np.ndarray, ...]:
    """Descriptors merged across regions: where one continues another on both sides, on the same
    devices, and their source regions share a join class (``join[owner]``). With the blocks
    outermost (vLLM's ``BLHNC``) a block's layers lie back to back on both sides, so a block of
    every layer becomes one descriptor. Each merged descriptor keeps the region it starts in."""
    key = join[owners]
    order = np.lexsort((s, key))
    s, d, n, sdev, ddev, owners, key = (a[order] for a in (s, d, n, sdev, ddev, owners, key))
    continues = ((s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1]) & (key[1:] == key[:-1])
                 & (sdev[1:] == sdev[:-1]) & (ddev[1:] == ddev[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return s[starts], d[starts], np.add.reduceat(n, starts), sdev[starts], ddev[starts], owners[starts]


def plan_rank_write(
    local: Sequence[Region],
    remote: RankRegions,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    merge: bool = True,
    join: Sequence[int] | None = None,
) -> RankWrite:
    """Descriptors from one P rank's regions into one D rank's, merged within each region pair and
    then across regions where they interleave (``join_regions``). ``join``: the join class of each
    of ``local``'s regions (streaming by layers parts writes by group of layers, so a descriptor
    must not run from one group into the next); None: one class. A merged descriptor stays inside
    one registered span on each side, since regions that touch are registered as one
    (``transport.region_spans``).

    Region pairs that share a block geometry are planned together, so a 16k-token request costs
    a few vectorised passes over its block list, not one pass per layer."""
    by_name = {r.name: r for r in remote.regions}
    if set(by_name) != {r.name for r in local}:
        missing = sorted({r.name for r in local} ^ set(by_name))[:4]
        raise PlanError(
            f"decode rank {remote.tp_rank} declares different KV regions than this prefill rank "
            f"(e.g. {missing}); both must serve the same model"
        )
    groups: dict[tuple[Geometry, Geometry], list[tuple[Region, Region]]] = {}
    patterns: dict[tuple[Geometry, Geometry], Descriptors | None] = {}
    src_bounds = (int(src_blocks.min()), int(src_blocks.max())) if len(src_blocks) else (0, -1)
    dst_bounds = (int(dst_blocks.min()), int(dst_blocks.max())) if len(dst_blocks) else (0, -1)
    for src in local:
        dst = by_name[src.name]
        _check_region(dst, "decode")
        _check_compatible(src, dst)
        _check_blocks(src_bounds, src, "prefill")
        _check_blocks(dst_bounds, dst, "decode")
        key = (_geometry(src), _geometry(dst))
        if key not in patterns:
            patterns[key] = _block_pattern(src, dst)
        if patterns[key] is not None:
            groups.setdefault(key, []).append((src, dst))
    if not groups:
        raise PlanError(f"decode rank {remote.tp_rank} shares no KV heads with this prefill rank")
    parts, unmerged = [], 0
    index = {r.name: i for i, r in enumerate(local)}
    for key, pairs in groups.items():
        src_stride, dst_stride = key[0][0], key[1][0]
        pattern = patterns[key]
        assert pattern is not None  # groups holds only the pairs that share heads
        pat_src, pat_dst, pat_len = pattern
        # Contiguity does not depend on a region's base address, so runs are found once on the
        # offsets within a region and then placed at every region's base.
        rel_src = ((src_blocks.astype(_U64) * _U64(src_stride))[:, None] + pat_src[None, :]).ravel()
        rel_dst = ((dst_blocks.astype(_U64) * _U64(dst_stride))[:, None] + pat_dst[None, :]).ravel()
        run = np.tile(pat_len, len(src_blocks))
        if merge:
            # A descriptor moves the same bytes to the same place in any order, so the pairs are
            # sorted by source first (each pair kept whole): then a descriptor that continues
            # another on both sides comes right after it and merges, in whatever order the blocks
            # sit in the token positions. After churn vLLM's free queue hands both sides descending
            # runs of ids, which in token order merge to almost nothing. With distinct source blocks
            # this gives the fewest runs there are.
            order = np.argsort(rel_src, kind="stable")
            rel_src, rel_dst, run = merge_runs(rel_src[order], rel_dst[order], run[order])
        src_base = np.array([p[0].base_addr for p in pairs], dtype=_U64)[:, None]
        dst_base = np.array([p[1].base_addr for p in pairs], dtype=_U64)[:, None]
        s, d = (src_base + rel_src).ravel(), (dst_base + rel_dst).ravel()
        n = np.tile(run, len(pairs))
        unmerged += len(pairs) * len(src_blocks) * len(pat_len)
        owner = np.repeat(np.array([index[p[0].name] for p in pairs], dtype=np.int32), len(run))
        parts.append((s, d, n, _devices(s, pairs, 0), _devices(d, pairs, 1), owner))
    s, d, n, sdev, ddev, owners = (np.concatenate(cols) for cols in zip(*parts, strict=True))
    if merge and len(n) > 1 and _interleave(local):
        classes = np.zeros(len(local), dtype=np.int64) if join is None else np.asarray(join, dtype=np.int64)
        s, d, n, sdev, ddev, owners = join_regions(s, d, n, sdev, ddev, owners, classes)
    return RankWrite(remote.tp_rank, remote.agent_name, s, d, n, sdev, ddev, unmerged, owners)


def _devices(addr: np.ndarray, pairs: Sequence[tuple[Region, Region]], side: int) -> np.ndarray:
    """The device id of the region each (merged) descriptor starts in."""
    devices = {p[side].device_id for p in pairs}
    if len(devices) == 1:
        return np.full(len(addr), devices.pop(), dtype=np.int64)
    bases = np.array([p[side].base_addr for p in pairs], dtype=_U64)
    order = np.argsort(bases)
    idx = order[np.searchsorted(bases[order], addr, side="right") - 1]
    return np.array([p[side].device_id for p in pairs], dtype=np.int64)[idx]


def split_by_group(write: RankWrite, group_of_region: Sequence[int]) -> list[tuple[int, RankWrite]]:
    """``write``'s descriptors parted by the group of the region of P's each reads (regions may
    interleave in memory, so by ``src_region``, never by address), as (group, part), groups
    ascending. Streaming by layers posts each part once its layers' KV is written."""
    if write.src_region is None:
        raise PlanError("this write was not planned by plan_rank_write: its descriptors' regions are unknown")
    group = np.asarray(group_of_region, dtype=np.int64)[write.src_region]
    parts: list[tuple[int, RankWrite]] = []
    for g in np.unique(group):
        mine = group == g
        parts.append((int(g), RankWrite(write.d_rank, write.remote_agent, write.src_addr[mine], write.dst_addr[mine],
                                        write.length[mine], write.src_dev[mine], write.dst_dev[mine],
                                        write.unmerged_count if not parts else 0, write.src_region[mine])))
    return parts


def plan_write(
    local: Sequence[Region],
    p_rank: int,
    p_tp_size: int,
    registration: Registration,
    src_block_ids: Sequence[int],
    merge: bool = True,
    total_heads: int | None = None,
    *,
    start: int = 0,
    final: bool = True,
    join: Sequence[int] | None = None,
) -> WritePlan:
    """What P's rank ``p_rank`` must write for ``registration`` from the prompt's block ``start``
    on: to its end (``final``), or, while the prefill runs, up to the last of ``src_block_ids``, the
    leading blocks finished so far. Raises PlanError if the registration is inconsistent with our
    geometry or block list — before any byte moves. ``merge=False`` keeps one descriptor per block
    and span: only for measuring what merging saves. ``total_heads``: the model's KV heads, when
    ranks may hold replicas (see ``writer_ranks``). ``join``: see ``plan_rank_write``."""
    first = registration.first_block_index
    dst_blocks = np.asarray(registration.block_ids, dtype=np.int64)
    wanted = first + len(dst_blocks)
    if first < 0 or (wanted != len(src_block_ids) if final else wanted < len(src_block_ids)):
        raise PlanError(
            f"decode asks for blocks {first}..{first + len(dst_blocks) - 1} of a request that "
            f"holds {len(src_block_ids)} blocks on prefill"
        )
    if len(np.unique(dst_blocks)) != len(dst_blocks):
        raise PlanError("decode listed one destination block twice")
    lo = max(start, first)
    src_blocks = np.asarray(src_block_ids[lo:], dtype=np.int64)
    dst_blocks = dst_blocks[lo - first:lo - first + len(src_blocks)]
    ranks = {r.tp_rank: r for r in registration.ranks}
    writes = []
    for d_rank in target_ranks(p_rank, p_tp_size, registration.d_tp_size, total_heads):
        if d_rank not in ranks:
            raise PlanError(f"registration lacks decode rank {d_rank} of {registration.d_tp_size}")
        if len(dst_blocks) == 0:
            continue
        writes.append(plan_rank_write(local, ranks[d_rank], src_blocks, dst_blocks, merge, join))
    return WritePlan(tuple(writes))
