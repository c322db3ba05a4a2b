"""Measure, on this machine, the per-request and per-descriptor costs the simulator's profiles cite,
and write them to ``measured_costs.json`` beside this file.

Why a script: every cost parameter in ``neuron_disagg/sim/profiles.py`` must name where it came from.
The ones measured here (not published hardware figures) are re-measurable with one command:

    .venv/bin/python microbenchmarks/calibration/measure_costs.py [--out FILE] [--reps N]

What it measures (``--reps`` repetitions; the machine is a shared 2-vCPU CPU box where other jobs
only ever add time, so the JSON keeps the median *and* the minimum, and the profiles cite the
minimum as the least-disturbed estimate; the JSON records the host it ran on):

1. ``plan``: our protocol core's write plan for a 16k-token Qwen3-32B TP8 request
   (``neuron_disagg.protocol.plan_write``), contiguous blocks (128 merged descriptors) and scattered
   blocks (131,072 descriptors). Divided by descriptor count it gives the *preparation* cost per
   descriptor that P's writer thread pays in push mode.
2. ``nixl``: the reference pull path's three steps on D's engine loop, per descriptor, with NIXL's
   UCX backend over DRAM in one process (two agents, progress thread off), one descriptor per block
   and layer and K/V, blocks scattered so nothing merges:
   - building the descriptor index list (Python list, as vLLM's pull connector did, and numpy);
   - ``make_prepped_xfer`` (handle creation from prepared lists);
   - ``transfer`` (posting). With UCX cma the copy happens inside ``transfer``, so descriptors are
     64 bytes to keep the copy negligible: what remains is per-descriptor posting overhead.
   The slope (seconds per descriptor) is fitted over 1,024 .. 131,072 descriptors.
   The published EFA/LIBFABRIC figure (46 ms for 18,880 descriptors, ~2.4 us each) is what the
   p5en/trn2 profiles use; this loopback number is recorded to show the order of magnitude holds
   on a different backend, not to replace it.
3. ``handoff``: the engine loop's cost to hand a finished request to a writer thread (a queue put).
4. ``tokenize``: an API server's cost to tokenize a text prompt, per token, with the repository's
   tiny byte-level BPE tokenizer (``neuron_disagg.demo.tiny_model``; Qwen3's is byte-level BPE too, with a
   far larger vocabulary, so this is an order of magnitude, not Qwen3's figure). Pull pays it again
   on D after prefill (the router relays the text); push pays it on D in parallel with prefill.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import queue
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOKENS = 16_384


def _times(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _min_s(fn, reps: int) -> float:
    return min(_times(fn, reps))


def measure_plan(reps: int) -> dict:
    """Our writer's planning cost (push mode, off the engine loop) for one 16k-token request."""
    from neuron_disagg.protocol import RankRegions, Registration, TransferId, plan_write
    from neuron_disagg.protocol.geometry import QWEN3_32B, rank_regions

    tp = 8
    blocks = TOKENS // QWEN3_32B.block_tokens
    pool = 4 * blocks
    rng = np.random.default_rng(0)
    p_regions = rank_regions(QWEN3_32B, pool, 0, tp)
    d_ranks = tuple(RankRegions(r, f"d{r}", rank_regions(QWEN3_32B, pool, r, tp, base_addr=1 << 40))
                    for r in range(tp))
    shapes = {
        "contiguous": (list(range(100, 100 + blocks)), list(range(2000, 2000 + blocks))),
        "scattered": ([int(b) for b in rng.choice(pool, blocks, replace=False)],
                      [int(b) for b in rng.choice(pool, blocks, replace=False)]),
    }
    out = {}
    for name, (src, dst) in shapes.items():
        reg = Registration(TransferId("cal"), "d", "d0", "127.0.0.1:1", tp, d_ranks, tuple(dst), 0, 0.0)
        plan = plan_write(p_regions, 0, tp, reg, src)
        times = _times(lambda: plan_write(p_regions, 0, tp, reg, src), reps)
        out[name] = {"descriptors_unmerged": plan.unmerged_count, "descriptors": plan.descriptor_count,
                     "seconds": statistics.median(times), "seconds_min": min(times),
                     "seconds_min_per_unmerged_descriptor": min(times) / plan.unmerged_count}
    return out


class ScatteredLoopback:
    """Two NIXL agents in this process (UCX, DRAM, progress thread off) and prepared lists of
    ``count`` descriptors of ``desc_bytes`` each, one in every other slot so that nothing merges:
    the per-descriptor worst case, with no network in the way. Also used by microbenchmarks/gil.py."""

    def __init__(self, count: int, desc_bytes: int, initiator: str, target: str):
        from nixl._api import nixl_agent, nixl_agent_config

        self.count, self.desc_bytes, self.target_name = count, desc_bytes, target
        cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.initiator, self.target = nixl_agent(initiator, cfg), nixl_agent(target, cfg)
        self.src = np.zeros(2 * count * desc_bytes, np.uint8)
        self.dst = np.ones(2 * count * desc_bytes, np.uint8)
        self.initiator.register_memory(np.array([[self.src.ctypes.data, self.src.nbytes, 0]], np.uint64), "DRAM")
        self.target.register_memory(np.array([[self.dst.ctypes.data, self.dst.nbytes, 0]], np.uint64), "DRAM")
        self.initiator.add_remote_agent(self.target.get_agent_metadata())
        self.local = self.initiator.prep_xfer_dlist("NIXL_INIT_AGENT", self.rows(self.src.ctypes.data), "DRAM")
        self.remote = self.prep_remote()

    def rows(self, base: int) -> np.ndarray:
        n = self.count
        addrs = base + np.arange(n, dtype=np.uint64) * np.uint64(2 * self.desc_bytes)
        return np.stack([addrs, np.full(n, self.desc_bytes, np.uint64), np.zeros(n, np.uint64)], axis=1)

    def prep_remote(self):
        return self.initiator.prep_xfer_dlist(self.target_name, self.rows(self.dst.ctypes.data), "DRAM")


def measure_nixl(reps: int) -> dict:
    """Per-descriptor cost of the reference pull path's preparation and posting, UCX loopback."""
    desc_bytes, counts = 64, (1_024, 16_384, 131_072)
    n_max = max(counts)
    loop = ScatteredLoopback(n_max, desc_bytes, "cal-d", "cal-p")
    a, b, local, remote = loop.initiator, loop.target, loop.local, loop.remote
    rng = np.random.default_rng(1)
    result = {"desc_bytes": desc_bytes, "points": []}
    for n in counts:
        idx = np.sort(rng.choice(n_max, n, replace=False)).astype(np.int32)
        regions, blocks = 128, n // 128

        def build_list():  # the reference pull connector's per-request index list, in Python
            return [r * n_max // 128 + blk for r in range(regions) for blk in range(blocks)]

        def build_numpy():
            return (np.arange(regions, dtype=np.int64)[:, None] * (n_max // 128)
                    + np.arange(blocks, dtype=np.int64)[None, :]).ravel()

        t_list = _min_s(build_list, reps)
        t_numpy = _min_s(build_numpy, reps)
        make, post = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            h = a.make_prepped_xfer("WRITE", local, idx, remote, idx, b"cal", skip_desc_merge=True)
            t1 = time.perf_counter()
            state = a.transfer(h)
            t2 = time.perf_counter()
            while state != "DONE":
                state = a.check_xfer_state(h)
                b.get_new_notifs()
            a.release_xfer_handle(h)
            make.append(t1 - t0)
            post.append(t2 - t1)
        result["points"].append({"descriptors": n, "index_list_python_s": t_list, "index_list_numpy_s": t_numpy,
                                 "make_prepped_xfer_s": min(make), "transfer_post_s": min(post),
                                 "make_prepped_xfer_median_s": statistics.median(make),
                                 "transfer_post_median_s": statistics.median(post)})
    xs = np.array([p["descriptors"] for p in result["points"]], float)
    for key in ("index_list_python_s", "index_list_numpy_s", "make_prepped_xfer_s", "transfer_post_s",
                "make_prepped_xfer_median_s", "transfer_post_median_s"):
        slope = float(np.polyfit(xs, np.array([p[key] for p in result["points"]]), 1)[0])
        result[key[:-2] + "_s_per_descriptor"] = slope  # minimum-based unless named median
    result["nixl_version"] = _version("nixl")
    return result


def measure_handoff(n: int) -> float:
    """Median of many single puts: one put is too short for the minimum to mean anything."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    item = ("tid", tuple(range(1024)))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        q.put(item)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_tokenize(reps: int) -> dict:
    from tokenizers import Tokenizer

    from neuron_disagg.demo.tiny_model import _corpus, build

    tok = Tokenizer.from_file(str(build() / "tokenizer.json"))
    text, n = "", 0
    lines = _corpus(4000)
    while n < TOKENS:
        text += " ".join(lines[:200]) + " "
        lines = lines[200:] + lines[:200]
        n = len(tok.encode(text).ids)
    times = _times(lambda: tok.encode(text), reps)
    return {"tokens": n, "seconds": statistics.median(times), "seconds_min": min(times),
            "seconds_min_per_token": min(times) / n}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "measured_costs.json")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--skip-nixl", action="store_true", help="where the nixl package is not installed")
    args = parser.parse_args(argv)
    data = {
        "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                 "note": "shared 2-vCPU CPU machine; other jobs were running, medians are noisy"},
        "command": "python microbenchmarks/calibration/measure_costs.py",
        "plan_16k_qwen3_32b_tp8": measure_plan(args.reps),
        "engine_handoff_s": measure_handoff(10_000),
        "tokenize_tiny_bpe": measure_tokenize(args.reps),
    }
    if not args.skip_nixl:
        data["nixl_ucx_loopback"] = measure_nixl(args.reps)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
