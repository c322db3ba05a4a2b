"""Push transfers between two real processes over NIXL (UCX, DRAM, loopback), one 16k-token-shaped
request at a time: Qwen3-32B rank 0 of TP 8 (64 layers x K/V, 1 KV head, head_dim 128, bf16, blocks
of 16 tokens) = 1,024 blocks = 512 MiB per request.

Prints, from one run: the writer's submission latency; registration-to-completion latency p50/p99
as D sees it; bandwidth with merged descriptors (128 per request) and unmerged (131,072); raw NIXL
bandwidth for the same bytes in one descriptor as the limit; and the engine-side cost of handing a
finished request to the writer (a queue put). Run: .venv/bin/python microbenchmarks/transfer.py
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from neuron_disagg.testing.peer_process import PeerProcess

BLOCKS = 1024
MIB = 1 << 20


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def run_push(label: str, requests: int, *p_flags: str) -> dict:
    d = PeerProcess("decode", "--shape", "qwen3-32b-tp8", "--blocks", str(BLOCKS + 1), "--watchdog-s", "60",
                    "--max-write-s", "30")
    p = PeerProcess("prefill", "--shape", "qwen3-32b-tp8", "--blocks", str(BLOCKS + 1), "--lease-s", "60",
                    "--max-write-s", "30", *p_flags)
    try:
        latencies = []
        blocks = list(range(1, BLOCKS + 1))
        for i in range(requests + 1):  # the first request pays the handshake: reported apart
            tid = [f"{label}-{i}", 0]
            d.call("expect", tid=tid, p_address=p.address)
            d.call("allocate", tid=tid, blocks=blocks)
            p.call("kv_ready", tid=tid, blocks=blocks)
            latencies.append(d.event_for("loaded", tid, timeout=120)["ms_since_allocate"])
            p.event_for("free", tid, timeout=30)
        stats = p.call("stats")
    finally:
        p.stop()
        d.stop()
    write_ms = stats["transfer_ms"][1:]
    return {"label": label, "first_ms": latencies[0], "latency": latencies[1:], "post_ms": stats["post_ms"][1:],
            "write_ms": write_ms, "descriptors": stats["writer"]["descriptors"] // (requests + 1),
            "gbps": (BLOCKS * 128 * 4096) / (statistics.median(write_ms) / 1e3) / 1e9}


def raw_nixl(nbytes: int, reps: int) -> float:
    """One-descriptor WRITE of the same bytes between two agents in one process (cma over UCX)."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("raw-a", cfg), nixl_agent("raw-b", cfg)
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    a.register_memory(np.array([[src.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
    b.register_memory(np.array([[dst.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    times = []
    for _ in range(reps):
        local = a.get_xfer_descs(np.array([[src.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
        remote = a.get_xfer_descs(np.array([[dst.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
        t0 = time.perf_counter()
        handle = a.initialize_xfer("WRITE", local, remote, "raw-b", b"x")
        a.transfer(handle)
        while a.check_xfer_state(handle) != "DONE":
            b.get_new_notifs()
        times.append(time.perf_counter() - t0)
        a.release_xfer_handle(handle)
    return nbytes / statistics.median(times) / 1e9


def handoff_us(n: int) -> float:
    """What the engine loop pays to hand a finished request to the writer thread."""
    import os

    from neuron_disagg.protocol import ProducerCore, TransferId, WireCodec
    from neuron_disagg.protocol.geometry import QWEN3_32B, rank_regions
    from neuron_disagg.transfer.outbox import Outbox
    from neuron_disagg.transfer.peers import Peers
    from neuron_disagg.transfer.side_channel import SideChannelClient
    from neuron_disagg.transfer.transport import InMemoryTransport
    from neuron_disagg.transfer.writer import PushWriter

    codec = WireCodec(os.urandom(32))
    transport = InMemoryTransport("handoff")
    writer = PushWriter(ProducerCore(rank_regions(QWEN3_32B, BLOCKS + 1, 0, 8)), transport, codec,
                        Peers(transport, SideChannelClient(codec), "127.0.0.1:1", "bench"), Outbox()).start()
    blocks = tuple(range(1, BLOCKS + 1))
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        writer.kv_ready(TransferId(f"h{i}"), blocks)
        times.append(time.perf_counter() - t0)
    writer.shutdown()
    return statistics.median(times) * 1e6


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # the hand-off probe aborts 1,000 held transfers at shutdown
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    merged = run_push("merged", args.requests)
    unmerged = run_push("unmerged", args.requests, "--no-merge")
    raw = raw_nixl(BLOCKS * 128 * 4096, 5)
    handoff = handoff_us(1000)
    print(f"\n16k-token request, Qwen3-32B TP8 rank 0: {BLOCKS * 128 * 4096 / MIB:.0f} MiB, "
          f"{args.requests} requests after one warm-up (which also handshakes)\n")
    print(f"{'':<12}{'descs':>9}{'post p50 ms':>13}{'write p50 ms':>14}{'reg->done p50':>15}{'p99':>9}{'GB/s':>8}")
    for r in (merged, unmerged):
        print(f"{r['label']:<12}{r['descriptors']:>9,}{statistics.median(r['post_ms']):>13.2f}"
              f"{statistics.median(r['write_ms']):>14.1f}{pct(r['latency'], 50):>15.1f}{pct(r['latency'], 99):>9.1f}"
              f"{r['gbps']:>8.2f}")
    print(f"{'raw NIXL':<12}{1:>9}{'':>13}{BLOCKS * 128 * 4096 / raw / 1e6:>14.1f}{'':>15}{'':>9}{raw:>8.2f}")
    print(f"\nmerged vs unmerged write time: {statistics.median(unmerged['write_ms']) / statistics.median(merged['write_ms']):.2f}x faster")
    print(f"merged bandwidth / raw NIXL:   {merged['gbps'] / raw:.2f}")
    print(f"first request (with handshake): merged {merged['first_ms']:.1f} ms, unmerged {unmerged['first_ms']:.1f} ms")
    print(f"engine-side hand-off to the writer: {handoff:.1f} us per request (median of 1000)")


if __name__ == "__main__":
    main()
