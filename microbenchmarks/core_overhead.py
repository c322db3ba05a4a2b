"""Per-request cost of the protocol core and the size of its transfer plans.

Geometry: Qwen3-32B (64 layers, 8 KV heads, head_dim 128, bf16), blocks of 16 tokens, TP 8 on both
sides, a 16k-token request (1,024 blocks). For each block-list shape it prints the descriptors one
P rank would post before and after merging, the time to plan them, the whole core's time per
request on each side (P: registration + kv-ready + plan + write-done; D: expect + allocated +
verdict), and P's kv-ready alone — what the write waits for once the prefill's KV is computed —
as it is when the writer planned while the last forward ran (``kv_coming``) and when it did not.
Then, with two real NIXL agents (UCX) in this process over memory laid out as those ranks' KV, the
time to build the write's NIXL request (descriptor lists and ``initialize_xfer``): the writer now
does that during the last forward too, so after it the write is only posted.
Run: .venv/bin/python microbenchmarks/core_overhead.py [--requests N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from neuron_disagg.protocol import (
    ConsumerCore, ProducerCore, RankRegions, Registration, TransferId, WireCodec, WriteDone, plan_write,
)
from neuron_disagg.protocol.geometry import QWEN3_32B, rank_regions, regions_bytes

TP, TOKENS = 8, 16_384
BLOCKS = TOKENS // QWEN3_32B.block_tokens
POOL = 4 * BLOCKS


def block_lists(rng):
    contiguous = list(range(100, 100 + BLOCKS))
    runs_of_8 = [int(b) for start in rng.choice(POOL // 8, BLOCKS // 8, replace=False) for b in range(start * 8, start * 8 + 8)]
    scattered = [int(b) for b in rng.choice(POOL, BLOCKS, replace=False)]
    return {"contiguous": (contiguous, list(range(2000, 2000 + BLOCKS))),
            "runs of 8 blocks": (runs_of_8, [b + 1 for b in runs_of_8]),
            "scattered": (scattered, [int(b) for b in rng.choice(POOL, BLOCKS, replace=False)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    p_regions = rank_regions(QWEN3_32B, POOL, 0, TP)
    d_ranks = tuple(RankRegions(r, f"d{r}", rank_regions(QWEN3_32B, POOL, r, TP, base_addr=1 << 40))
                    for r in range(TP))
    codec = WireCodec(b"benchmark-secret-0123456789abcdef")
    print(f"Qwen3-32B, TP{TP}->TP{TP}, {TOKENS} tokens = {BLOCKS} blocks, "
          f"{len(p_regions)} regions per rank, {args.requests} requests per row\n")
    header = (f"{'block list':<18}{'unmerged':>10}{'merged':>9}{'ratio':>8}{'plan ms':>9}"
              f"{'P core us':>11}{'D core us':>11}{'reg bytes':>11}{'kv-ready us':>13}{'planned ahead':>15}")
    print(header)
    print("-" * len(header))
    for name, (src, dst) in block_lists(rng).items():
        producer = ProducerCore(p_regions, 0, TP)
        consumer = ConsumerCore("127.0.0.1:1", 0, TP)
        ahead = ProducerCore(p_regions, 0, TP)
        plan_ms, p_us, d_us, ready_us, ahead_us = [], [], [], [], []
        for i in range(args.requests):
            tid = TransferId(f"r{i}")
            reg = Registration(tid, "d", f"d{i}", "127.0.0.1:1", TP, d_ranks, tuple(dst), 0, 0.0)
            t0 = time.perf_counter()
            consumer.expect(tid, "127.0.0.1:2", TP, 0.0)
            sent = next(a for a in consumer.allocated(reg, 0.0) if hasattr(a, "message"))
            t1 = time.perf_counter()
            producer.registration_received(sent.message, 0.0)
            t_ready = time.perf_counter()
            submit = next(a for a in producer.kv_ready(tid, tuple(src), 0.0) if hasattr(a, "plan"))
            ready_us.append((time.perf_counter() - t_ready) * 1e6)
            producer.write_done(tid, 0.0)
            t2 = time.perf_counter()
            consumer.verdict(WriteDone(tid, 0, TP), 0.0)
            t3 = time.perf_counter()
            plan_write(p_regions, 0, TP, sent.message, src)
            t4 = time.perf_counter()
            plan_ms.append((t4 - t3) * 1e3)
            ahead.registration_received(sent.message, 0.0)
            ahead.kv_coming(tid, tuple(src))  # during the last forward: off the write's path
            t5 = time.perf_counter()
            early = next(a for a in ahead.kv_ready(tid, tuple(src), 0.0) if hasattr(a, "plan"))
            ahead_us.append((time.perf_counter() - t5) * 1e6)
            assert early.plan.descriptor_count == submit.plan.descriptor_count
            ahead.write_done(tid, 0.0)
            p_us.append((t2 - t1) * 1e6)
            d_us.append(((t1 - t0) + (t3 - t2)) * 1e6)
        plan = submit.plan
        print(f"{name:<18}{plan.unmerged_count:>10,}{plan.descriptor_count:>9,}"
              f"{plan.unmerged_count / plan.descriptor_count:>7.0f}x{statistics.median(plan_ms):>9.2f}"
              f"{statistics.median(p_us):>11,.0f}{statistics.median(d_us):>11,.0f}"
              f"{len(codec.encode(sent.message)):>11,}{statistics.median(ready_us):>13,.0f}"
              f"{statistics.median(ahead_us):>15,.0f}")
    print("\nP core includes planning; D core is expect + allocated + one verdict; kv-ready is P's core "
          "from the KV computed to the write submitted, planned then or ahead. Medians.")
    nixl_requests(rng, args.requests)


def nixl_requests(rng, requests: int) -> None:
    """What building a write's NIXL request costs, for the same plans, with real agents."""
    from neuron_disagg.transfer.transport import NixlTransport

    blocks = POOL + 1  # block_lists' destinations run one past the pool
    size = regions_bytes(rank_regions(QWEN3_32B, blocks, 0, TP))
    p_memory, d_memory = np.zeros(size, np.uint8), np.zeros(size, np.uint8)  # untouched: never copied
    p_regions = rank_regions(QWEN3_32B, blocks, 0, TP, base_addr=p_memory.ctypes.data)
    d_regions = rank_regions(QWEN3_32B, blocks, 0, TP, base_addr=d_memory.ctypes.data)
    p, d = NixlTransport("p0"), NixlTransport("d0")
    p.register(p_regions)
    d.register(d_regions)
    p.add_peer(d.metadata())
    d_ranks = (RankRegions(0, "d0", d_regions),)
    print(f"\n{'block list':<18}{'descriptors':>12}{'NIXL request ms':>17}   (built during the last forward now)")
    for name, (src, dst) in block_lists(rng).items():
        reg = Registration(TransferId("nixl"), "d", "d0", "127.0.0.1:1", TP, d_ranks, tuple(dst), 0, 0.0)
        (write,) = plan_write(p_regions, 0, TP, reg, src).writes
        build_ms = []
        for _ in range(max(3, requests // 4)):
            t0 = time.perf_counter()
            prepared = p.prepare("WRITE", "d0", write)
            build_ms.append((time.perf_counter() - t0) * 1e3)
            p.discard(prepared)
        print(f"{name:<18}{len(write):>12,}{statistics.median(build_ms):>17.2f}")
    p.close()
    d.close()


if __name__ == "__main__":
    main()
