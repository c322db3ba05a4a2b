"""H200 device check: the project's own transfer layer moving GPU memory between processes on one GPU.

    python scripts/h200_check.py              # a CUDA host: NIXL UCX, KV in VRAM (cuda:0)
    python scripts/h200_check.py --dry-run    # anywhere: host memory for VRAM, an emulated device queue

Each P and D rank is its own process with KV laid out as vLLM 0.29+'s LBHNC hands it a connector (one
buffer, per-layer (blocks, heads, tokens, K|V) views), described by the connector's own geometry
reading, moved by the real push writer and receiver threads over NIXL with signed side channels:

1. platform: selection picks CUDA (CPU in the dry run);
2. push: P's blocks land in D's byte for byte;
3. P fence: P's KV is written by device work queued behind a delay (a sleeping kernel) just before
   P hands it to its writer; with the platform's fence D gets the new KV, and a control run without
   the fence must show the race (D gets what was there before); the same for a streamed chunk,
   handed over behind its step's fence while the prefill runs on, and for a step streamed by
   layers, handed over before its forward, each group of layers posted once the event recorded
   behind that group's kernels passed (the control records none: each group goes as the host
   leaves the layer, the kernels still queued);
4. D fence: D's engine zeroes fresh blocks behind a delay on its stream before registering them;
   with the fence P's write lands after the zeroing, and the control run shows it overwritten;
5. tensor parallelism: P TP 1 -> D TP 2 and P TP 2 -> D TP 1, each byte-exact;
6. blocks outermost (vLLM's BLHNC, ``VLLM_KV_CACHE_LAYOUT=BLHNC``): every layer's share of a block
   back to back, so a run of blocks goes as one descriptor for all layers (NIXL writing across the
   layers' views inside one registered span), byte-exact; and streamed by layers, where descriptors
   join only within a group of layers, byte-exact behind each group's fence.

Prints a line per check and a JSON summary last; exits 1 if any check fails. Needs torch, numpy,
msgspec and NIXL (nixl-cu13 on CUDA 13); nothing else of the package's dependencies. See the
docs/h200-device-check.md for bringing NIXL's wheel to a host without network.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import secrets
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS, BLOCKS, TOKENS, HEAD_SIZE, TOTAL_HEADS = 4, 32, 16, 64, 4
DELAY_S = 2.0  # how long queued device work waits: far longer than a write on one GPU


# -- one rank, in its own process -----------------------------------------------------------------------
class DeviceQueue:
    """Device work queued behind a delay, and a fence for it: on CUDA a sleeping kernel on the
    current stream and the platform's own fence; in the dry run a worker thread standing in for the
    device's queue, and a fence that waits for it to drain."""

    def __init__(self, torch, device, platform):
        self.torch, self.device, self.platform = torch, device, platform
        if device.type == "cpu":
            self.work: queue.Queue = queue.Queue()
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            delay, fn = self.work.get()
            time.sleep(delay)
            fn()
            self.work.task_done()

    def later(self, delay_s: float, fn) -> None:
        if self.device.type == "cpu":
            self.work.put((delay_s, fn))
            return
        self.torch.cuda._sleep(int(delay_s * 2e9))  # ~2 GHz: H200's SM clock under load
        fn()

    def fence(self):
        """What the engine records after queuing work: on CUDA the platform's event; in the dry run
        a marker queued behind that work, passed when the emulated device reaches it."""
        return _Marker(self.work) if self.device.type == "cpu" else self.platform.wait_for_kv()

    def synchronize(self) -> None:
        if self.device.type == "cpu":
            self.work.join()
        else:
            self.torch.cuda.synchronize(self.device)


class _Marker:
    """Dry run: an event on the emulated device's queue (``ready`` polls it, ``wait`` blocks)."""

    def __init__(self, work: queue.Queue) -> None:
        self.passed = threading.Event()
        work.put((0.0, self.passed.set))

    def ready(self) -> bool:
        return self.passed.is_set()

    def wait(self) -> None:
        self.passed.wait()


def expected(torch, layer: int, heads: range, blocks: int, seed: int):
    """The logical KV (heads, positions, K|V) of a request of ``blocks`` blocks."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    full = torch.randn(TOTAL_HEADS, blocks * TOKENS, 2 * HEAD_SIZE, generator=gen).to(torch.bfloat16)
    return full[heads.start:heads.stop]


def rank_main(spec: dict, conn) -> None:
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    sys.path.insert(0, str(REPO))
    import torch

    from neuron_disagg.platforms import select_platform
    from neuron_disagg.platforms.fence import LayerFences, ReadyFence
    from neuron_disagg.platforms.kv_layout import VLLM_LAYER_VIEW, KVGeometry, layer_groups, regions_from_kv_caches
    from neuron_disagg.protocol import (
        ConsumerTimeouts, ProducerTimeouts, RankRegions, Registration, TransferId, WireCodec,
    )
    from neuron_disagg.protocol.plan import rank_heads
    from neuron_disagg.transfer.outbox import Failed, Loaded
    from neuron_disagg.transfer.rank import Rank, RankTimeouts

    role, rank, tp, dry = spec["role"], spec["rank"], spec["tp"], spec["dry_run"]
    platform, reason = select_platform("cpu" if dry else "auto")
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    first, heads = rank_heads(rank, tp, TOTAL_HEADS)
    if spec["layout"] == "BLHNC":  # blocks outermost: a layer's view strides over every layer's share
        buffer = torch.zeros(BLOCKS, LAYERS, heads, TOKENS, 2 * HEAD_SIZE, dtype=torch.bfloat16, device=device)
        caches = {f"model.layers.{i}.self_attn.attn": buffer[:, i] for i in range(LAYERS)}
    else:  # LBHNC per-layer views
        buffer = torch.zeros(LAYERS, BLOCKS, heads, TOKENS, 2 * HEAD_SIZE, dtype=torch.bfloat16, device=device)
        caches = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}
    regions = regions_from_kv_caches(caches, dict.fromkeys(caches, VLLM_LAYER_VIEW),
                                     KVGeometry(TOKENS, rank, tp, TOTAL_HEADS))
    platform.use_kv_device(device)
    device_queue = DeviceQueue(torch, device, platform)
    agent = f"{role}{rank}-{os.getpid()}"
    address = f"127.0.0.1:{spec['port']}"
    # The rank as the connector's worker assembles it: two agents, both of the role's threads.
    timeouts = RankTimeouts(producer=ProducerTimeouts(lease_s=30, max_write_s=10, watchdog_s=60,
                                                      clock_skew_allowance_s=0.5, tombstone_s=60),
                            consumer=ConsumerTimeouts(watchdog_s=60, admission_timeout_s=60, heartbeat_interval_s=1,
                                                      max_write_s=10, clock_skew_allowance_s=0.5, tombstone_s=60))
    node = Rank(role, rank, tp, regions, codec=WireCodec(bytes.fromhex(spec["secret"])), agent_name=agent,
                side_channel_host="127.0.0.1", side_channel_port=spec["port"], advertised=address,
                timeouts=timeouts, memory_type=platform.memory_type, total_heads=TOTAL_HEADS).start()
    thread = node.push
    conn.send({"platform": platform.name, "reason": reason, "memory": platform.memory_type,
               "backends": node.target.loaded_backends(), "device": str(device)})

    def blocks_of(layer: int, block_ids):
        return [caches[f"model.layers.{layer}.self_attn.attn"][b] for b in block_ids]  # (heads, tokens, K|V)

    def write_layer(layer, block_ids, seed, only=None):
        data = expected(torch, layer, range(first, first + heads), len(block_ids), seed).to(device)
        for i, view in enumerate(blocks_of(layer, block_ids[:only])):
            view.copy_(data[:, i * TOKENS:(i + 1) * TOKENS])

    def write(block_ids, seed, only=None):  # ``only``: the first blocks alone (a step's chunk)
        for layer in range(LAYERS):
            write_layer(layer, block_ids, seed, only)

    while True:
        cmd = conn.recv()
        op = cmd["op"]
        tid = TransferId(cmd["tid"]) if "tid" in cmd else None
        if op == "fill":  # now, or (delay) by device work queued behind a sleeping kernel
            if cmd.get("delay_s"):
                device_queue.later(cmd["delay_s"], lambda c=cmd: write(c["blocks"], c["seed"], c.get("only")))
            else:
                write(cmd["blocks"], cmd["seed"], cmd.get("only"))
                device_queue.synchronize()
            conn.send({})
        elif op == "kv_ready":  # the fence recorded now covers the fill queued before it
            thread.kv_ready(tid, tuple(cmd["blocks"]), device_queue.fence() if cmd["fenced"] else ReadyFence())
            conn.send({})
        elif op == "kv_chunk":  # push streaming: the prompt's leading blocks, final behind this fence
            thread.kv_chunk(tid, tuple(cmd["blocks"]), device_queue.fence() if cmd["fenced"] else ReadyFence())
            conn.send({})
        elif op == "layers_forward":  # push streaming by layers: the chunk first, then the forward
            groups = layer_groups(list(caches), regions, cmd["groups"])
            node.push.core.join = groups.group_of_region  # as the prefill worker's rank plans by layers
            record = device_queue.fence if cmd["fenced"] else ReadyFence
            layers = LayerFences(groups.group_of_layer, groups.group_of_region, groups.groups, record,
                                 thread.layers_fenced)
            thread.kv_chunk(tid, tuple(cmd["blocks"]), layers)
            for layer, name in enumerate(caches):  # each layer's KV behind a kernel; the host goes on
                device_queue.later(cmd["delay_s"] / LAYERS,
                                   lambda c=cmd, i=layer: write_layer(i, c["blocks"], c["seed"]))
                layers.saved(name)  # as vLLM's save_kv_layer: the layer is queued, not run
            layers.finish(device_queue.fence() if cmd["fenced"] else ReadyFence())
            conn.send({})
        elif op == "register":  # D: expect the transfer, then register its fresh blocks
            thread.expect(tid, cmd["p_address"], cmd["p_tp"])
            if cmd.get("zero_delay_s"):  # the engine zeroes new blocks on its stream first
                device_queue.later(cmd["zero_delay_s"],
                                   lambda c=cmd: [v.zero_() for layer in range(LAYERS) for v in blocks_of(layer, c["blocks"])])
            fence = device_queue.fence() if cmd["fenced"] else ReadyFence()
            thread.allocated(Registration(tid, agent, f"d-{tid.request}", address, tp,
                                          (RankRegions(rank, agent, regions),), tuple(cmd["blocks"]), 0, 0.0), fence)
            conn.send({})
        elif op == "wait":  # D: the first load or failure reported within the bound
            deadline, event = time.monotonic() + cmd["within_s"], None
            while event is None and time.monotonic() < deadline:
                for result in node.outbox.take(deadline - time.monotonic()):
                    if event is None and isinstance(result, (Loaded, Failed)):
                        event = (type(result).__name__.lower(), result.transfer_id, getattr(result, "reason", ""))
            conn.send({"event": [str(x) for x in event or ("timeout",)]})
        elif op == "check":  # D's blocks, through the layer views, against P's KV for our heads
            device_queue.synchronize()
            wrong = 0
            for layer in range(LAYERS):
                want = expected(torch, layer, range(first, first + heads), len(cmd["blocks"]), cmd["seed"])
                for i, view in enumerate(blocks_of(layer, cmd["blocks"])):
                    wrong += not torch.equal(view.cpu(), want[:, i * TOKENS:(i + 1) * TOKENS])
            conn.send({"wrong_blocks": wrong, "of": LAYERS * len(cmd["blocks"])})
        elif op == "descriptors":  # P: posted so far
            conn.send({"descriptors": thread.stats["descriptors"]})
        elif op == "stop":
            node.shutdown()
            conn.send({})
            return


# -- the checks, driven from here ------------------------------------------------------------------------
class Rank:
    def __init__(self, ctx, **spec):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=rank_main, args=(spec, child), daemon=True)
        self.process.start()
        self.info = self._recv(300)
        self.address = f"127.0.0.1:{spec['port']}"

    def _recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError("a rank process did not answer in time")
        return self.conn.recv()

    def __call__(self, op: str, timeout_s: float = 120, **kw) -> dict:
        self.conn.send({"op": op, **kw})
        return self._recv(timeout_s)

    def stop(self) -> None:
        try:
            self("stop", timeout_s=30)
        except Exception:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def free_port() -> int:
    """A base port for an instance's ranks (port + rank), as every integration test picks one: below
    the kernel's ephemeral range and clear of the neighbours of ports already handed out. (A port
    from bind(("", 0)) is ephemeral: with a TP 2 instance, port + 1 was once some other socket's.)"""
    sys.path.insert(0, str(REPO))
    from neuron_disagg.local_cluster import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range()


class Instances:
    """P ranks and D ranks (each rank listening on its instance's base port + rank)."""

    def __init__(self, ctx, dry_run: bool, secret: str, p_tp: int, d_tp: int, layout: str = "LBHNC"):
        p_port, d_port = free_port(), free_port()
        common = {"dry_run": dry_run, "secret": secret, "layout": layout}
        self.p = [Rank(ctx, role="prefill", rank=r, tp=p_tp, port=p_port, **common) for r in range(p_tp)]
        self.d = [Rank(ctx, role="decode", rank=r, tp=d_tp, port=d_port, **common) for r in range(d_tp)]
        self.p_tp = p_tp

    def push(self, tid: str, src, dst, seed: int, *, p_delay_s=0.0, p_fenced=True, d_zero_delay_s=0.0,
             d_fenced=True, register_first=True, chunk=0, layers=0) -> list[dict]:
        """One request from every P rank into every D rank; each D rank's check of its blocks. With
        ``chunk``, P streams: its first ``chunk`` blocks are computed behind the delayed kernel and
        handed over with (``p_fenced``) or without the fence, the rest at once with it. With
        ``layers`` (groups), P streams the one step by layers, each behind its share of the delay."""
        def prefill():
            for p in self.p:
                if layers:
                    p("fill", blocks=src, seed=seed + 1000)  # what the blocks held before
                    p("layers_forward", tid=tid, blocks=src, seed=seed, delay_s=p_delay_s, fenced=p_fenced,
                      groups=layers)
                    p("kv_ready", tid=tid, blocks=src, fenced=True)  # after the forward, behind it
                    continue
                if chunk:
                    p("fill", blocks=src, seed=seed + 1000)  # what the blocks held before
                    p("fill", blocks=src, seed=seed, only=chunk, delay_s=p_delay_s)  # the step's KV, behind a kernel
                    p("kv_chunk", tid=tid, blocks=src[:chunk], fenced=p_fenced)
                    time.sleep(2 * p_delay_s)  # the chunk's write has gone, the kernel has run
                    p("fill", blocks=src, seed=seed)  # the last step
                    p("kv_ready", tid=tid, blocks=src, fenced=True)
                    continue
                p("fill", blocks=src, seed=seed, delay_s=p_delay_s)
                p("kv_ready", tid=tid, blocks=src, fenced=p_fenced)

        def register():
            for d in self.d:
                d("register", tid=tid, blocks=dst, p_address=self.p[0].address, p_tp=self.p_tp,
                  zero_delay_s=d_zero_delay_s, fenced=d_fenced)

        if register_first:
            register()
            time.sleep(1.0)  # the registrations are at P: the write starts the moment P hands over
            prefill()
        else:
            prefill()
            register()
        events = [d("wait", within_s=60)["event"] for d in self.d]
        checks = [d("check", blocks=dst, seed=seed) for d in self.d]
        return [{"event": e, **c} for e, c in zip(events, checks, strict=True)]

    def stop(self):
        for rank in self.p + self.d:
            rank.stop()


def exact(results: list[dict]) -> bool:
    return all(r["event"][0] == "loaded" and r["wrong_blocks"] == 0 for r in results)


def run(dry_run: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    secret = secrets.token_hex(32)
    checks: list[dict] = []

    def record(name: str, ok: bool, **detail) -> None:
        checks.append({"check": name, "ok": ok, **detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {json.dumps(detail)}", flush=True)

    pair = Instances(ctx, dry_run, secret, 1, 1)
    try:
        info = pair.p[0].info
        want = "cpu" if dry_run else "cuda"
        record("platform", info["platform"] == want and "UCX" in info["backends"]
               and info["memory"] == ("DRAM" if dry_run else "VRAM"), **info)
        first = pair.push("warm-up", [3, 4, 5], [7, 8, 9], seed=1)
        record("push byte-exact", exact(first), ranks=first)
        fenced = pair.push("p-fenced", [10, 11], [12, 13], seed=2, p_delay_s=DELAY_S)
        control = pair.push("p-unfenced", [14, 15], [16, 17], seed=3, p_delay_s=DELAY_S, p_fenced=False)
        record("P fence: KV written behind a delayed kernel", exact(fenced) and not exact(control),
               fenced=fenced, control_without_fence=control, control_shows_race=not exact(control))
        fenced = pair.push("chunk-fenced", [26, 27, 28], [29, 30, 31], seed=6, p_delay_s=DELAY_S, chunk=2)
        control = pair.push("chunk-unfenced", [0, 1, 2], [3, 4, 5], seed=7, p_delay_s=DELAY_S,
                            p_fenced=False, chunk=2)
        record("P fence, streamed: a chunk written behind the step's kernel", exact(fenced) and not exact(control),
               fenced=fenced, control_without_fence=control, control_shows_race=not exact(control))
        fenced = pair.push("layers-fenced", [6, 7, 8], [9, 10, 11], seed=8, p_delay_s=DELAY_S, layers=2)
        control = pair.push("layers-unfenced", [12, 13, 14], [15, 16, 17], seed=9, p_delay_s=DELAY_S,
                            p_fenced=False, layers=2)
        record("P fence, by layers: each group written behind its layers' kernels",
               exact(fenced) and not exact(control),
               fenced=fenced, control_without_fence=control, control_shows_race=not exact(control))
        fenced = pair.push("d-fenced", [18, 19], [20, 21], seed=4, d_zero_delay_s=DELAY_S, register_first=False)
        control = pair.push("d-unfenced", [22, 23], [24, 25], seed=5, d_zero_delay_s=DELAY_S, d_fenced=False,
                            register_first=False)
        record("D fence: fresh blocks zeroed behind a delay", exact(fenced) and not exact(control),
               fenced=fenced, control_without_fence=control, control_shows_race=not exact(control))
    finally:
        pair.stop()
    for p_tp, d_tp in ((1, 2), (2, 1)):
        group = Instances(ctx, dry_run, secret, p_tp, d_tp)
        try:
            results = group.push(f"tp-{p_tp}-{d_tp}", [2, 3, 4, 5], [9, 10, 11, 12], seed=6 + p_tp)
            record(f"TP {p_tp} -> {d_tp}, LBHNC", exact(results), ranks=results)
        finally:
            group.stop()
    outermost = Instances(ctx, dry_run, secret, 1, 1, layout="BLHNC")
    try:
        results = outermost.push("blhnc", [5, 4, 3, 20], [9, 8, 7, 30], seed=10)  # two runs of blocks
        posted = outermost.p[0]("descriptors")["descriptors"]
        record("BLHNC: a run of blocks one descriptor for every layer", exact(results) and posted == 2,
               descriptors=posted, of_layer_major=2 * LAYERS, ranks=results)
        results = outermost.push("blhnc-layers", [21, 22, 23], [24, 25, 26], seed=11, p_delay_s=DELAY_S, layers=2)
        record("BLHNC by layers: descriptors joined within a group, each behind its fence", exact(results),
               ranks=results)
    finally:
        outermost.stop()
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="host memory in place of VRAM (any machine)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    checks = run(args.dry_run)
    ok = all(c["ok"] for c in checks)
    print(json.dumps({"ok": ok, "dry_run": args.dry_run, "seconds": round(time.monotonic() - started, 1),
                      "checks": checks}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
