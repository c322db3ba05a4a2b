"""Descriptors per transfer after churn at the seed preset's geometry: runs merged in token order,
in source-address order (both layer-major, as vLLM's CPU attention lays the KV out), and in
source order with the blocks outermost on both sides (vLLM's BLHNC, which CUDA's FLASH_ATTN takes),
where a block's layers join. Simulated; starts no vLLM.

    .venv/bin/python scripts/descriptor_count.py [--seeds 5] [--fifo]

P's and D's block pools work as vLLM 0.24-0.34's with prefix caching off (as the bench runs it): a
request takes blocks from the free queue's front, and a finished one's go back onto the front, tail
first (``free_blocks(reversed(blocks))`` into ``prepend_n``). ``--fifo``: onto the back, as earlier
vLLM's ``append_n`` put them. The bench's churn (prompts of 20-180% of 55% of the input, four at a
time), then its load: 2,048-token prompts at the rate that keeps P 80% busy, chunked prefill of 2,048
tokens a step on P, D allocating on arrival and decoding once the write is done.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import statistics
from collections import deque
from dataclasses import dataclass, field

from msgspec.structs import replace

import numpy as np

from neuron_disagg.bench.load import CHURN_MEAN_SHARE
from neuron_disagg.bench.preset import SEED
from neuron_disagg.demo.tiny_model import KV_HEAVY
from neuron_disagg.protocol import RankRegions, Registration, TransferId, plan_write
from neuron_disagg.protocol.geometry import ModelShape, rank_regions
from neuron_disagg.protocol.plan import merge_runs

BLOCK, STEP_TOKENS, DTYPE_BYTES = 32, 2048, 4  # bench's --block-size, vLLM CPU's batch, float32
PREFILL_MS, WRITE_MS, DECODE_STEP_MS = 647.0, 50.0, 45.0  # the seed point's (docs/benchmarks.md)
# vLLM 0.29+ gives a CPU connector one (blocks, heads, tokens, K|V) view a layer: one region a layer
# whose chunk is one head's K and V (rank_regions' "k" region of a head twice as wide).
SHAPE = ModelShape(KV_HEAVY["layers"], KV_HEAVY["kv_heads"], 2 * KV_HEAVY["head_dim"], DTYPE_BYTES, BLOCK)
POOL = SEED.kv_cache_bytes // (SHAPE.bytes_per_token() // 2 * BLOCK)
REGIONS = rank_regions(SHAPE, POOL)[::2]
# BLHNC: each layer's share of a block back to back inside the block
OUTERMOST = tuple(replace(r, base_addr=i * r.block_bytes, block_stride_bytes=len(REGIONS) * r.block_bytes)
                  for i, r in enumerate(REGIONS))


def take(free: deque, n: int) -> list[int]:
    return [free.popleft() for _ in range(n)]


def give(free: deque, blocks: list[int], fifo: bool) -> None:
    free.extend(reversed(blocks)) if fifo else free.extendleft(blocks)


def counts(src: list[int], dst: list[int]) -> tuple[int, int, int]:
    """(token-order, source-order, blocks-outermost) descriptors of one transfer."""
    def registration(regions):
        return Registration(TransferId("r"), "d", "d", "d:1", 1, (RankRegions(0, "d0", regions),), tuple(dst), 0, 1e9)

    reg = registration(REGIONS)
    unmerged = plan_write(REGIONS, 0, 1, reg, src, merge=False).writes[0]  # region by region, token order
    rows = zip(*(a.reshape(len(REGIONS), -1) for a in (unmerged.src_addr, unmerged.dst_addr, unmerged.length)), strict=True)
    return (sum(len(merge_runs(*row)[2]) for row in rows), plan_write(REGIONS, 0, 1, reg, src).descriptor_count,
            plan_write(OUTERMOST, 0, 1, registration(OUTERMOST), src).descriptor_count)


@dataclass
class Request:
    prompt: int
    output: int
    churn: bool
    src: list[int] = field(default_factory=list)  # P's and D's blocks, in token order
    dst: list[int] = field(default_factory=list)
    prefilled: int = 0
    decoded: int = 0


def simulate(seed: int, fifo: bool, loaded: int = 96) -> list[tuple[int, int, int]]:
    """``counts`` of each transfer of the load, which follows the churn."""
    rng, order = np.random.default_rng(seed), itertools.count()
    p, d = deque(range(1, POOL)), deque(range(1, POOL))  # block 0 is vLLM's null block
    mean = round(SEED.input_lens[0] * CHURN_MEAN_SHARE)  # as bench.load's churn and pool_churn_prompts
    n_churn = max(8, -(-3 * SEED.kv_cache_bytes // (2 * (SHAPE.bytes_per_token() // 2) * mean)))
    reqs = [Request(int(rng.integers(mean * 0.2, mean * 1.8 + 1)), int(rng.integers(3, 29)), True)
            for _ in range(n_churn)] + [Request(SEED.input_lens[0], SEED.output_len, False) for _ in range(loaded)]
    events, prefilling, decoding, out, busy, churned = [], [], [], [], {"p": False, "d": False}, 0
    at = lambda t, kind, r=None: heapq.heappush(events, (t, next(order), kind, r))  # noqa: E731

    def wake(side: str, t: float) -> None:
        if not busy[side]:
            busy[side] = True
            at(t, side)

    for r in reqs[:4]:  # the churn: four at a time, each that ends starting the next
        at(0.0, "arrive", r)
    while events:
        t, _, kind, r = heapq.heappop(events)
        if kind == "arrive":  # D allocates the prompt's blocks and registers; P queues the prefill
            r.dst = take(d, -(-r.prompt // BLOCK))
            prefilling.append(r)
            wake("p", t)
        elif kind == "p":  # one step of chunked prefill, first come first served
            budget, busy["p"] = STEP_TOKENS, False
            for r in list(prefilling):
                chunk = min(budget, r.prompt - r.prefilled)
                r.prefilled, budget = r.prefilled + chunk, budget - chunk
                r.src += take(p, -(-r.prefilled // BLOCK) - len(r.src))
                if r.prefilled == r.prompt:
                    prefilling.remove(r)
                    at(t + (STEP_TOKENS - budget) * PREFILL_MS / SEED.input_lens[0] + WRITE_MS, "written", r)
                if not budget:
                    break
            if prefilling:
                wake("p", t + (STEP_TOKENS - budget) * PREFILL_MS / SEED.input_lens[0])
        elif kind == "written":  # WriteDone: P frees its blocks, D decodes
            if not r.churn:
                out.append(counts(r.src, r.dst[:len(r.src)]))
            give(p, r.src, fifo)
            decoding.append(r)
            wake("d", t)
        else:  # one decode step on D: a token each, a new block where one fills
            busy["d"] = False
            for r in list(decoding):
                r.decoded += 1
                r.dst += take(d, -(-(r.prompt + r.decoded) // BLOCK) - len(r.dst))
                if r.decoded == r.output:
                    decoding.remove(r)
                    give(d, r.dst, fifo)
                    churned += r.churn
                    if r.churn and churned + 3 < n_churn:
                        at(t, "arrive", reqs[churned + 3])
                    elif r.churn and churned == n_churn:  # then the load: Poisson, P 80% busy
                        gaps = rng.exponential(PREFILL_MS / SEED.p_busy[0], loaded)
                        for r2, when in zip(reqs[n_churn:], t + np.cumsum(gaps), strict=True):
                            at(float(when), "arrive", r2)
            if decoding:
                wake("d", t + DECODE_STEP_MS)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="simulated runs, pooled")
    parser.add_argument("--fifo", action="store_true", help="freed blocks onto the back of the queue")
    args = parser.parse_args()
    result = [c for seed in range(1, args.seeds + 1) for c in simulate(seed, args.fifo)]
    before, after, outermost = (statistics.median(c[i] for c in result) for i in (0, 1, 2))
    print(f"seed preset ({SHAPE.num_layers} regions x {SEED.input_lens[0] // BLOCK} blocks, {POOL - 1}-block pools, "
          f"{'FIFO' if args.fifo else 'LIFO'} free queue), median descriptors per transfer over {len(result)} "
          f"after churn: token order {before:,.0f}, source order {after:,.0f} ({before / after:.2f}x fewer), "
          f"blocks outermost {outermost:,.0f} ({outermost / after:.3f}x of source order)")
