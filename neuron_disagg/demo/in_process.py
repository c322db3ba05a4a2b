"""`neuron-disagg demo --in-process`: the protocol core end to end in one process.

One prefill instance with TP 2 and one decode instance with TP 1 (so each P rank writes its half of
the KV heads into D's single rank) exchange signed messages through the real wire codec; writes are
byte copies between in-memory "device" buffers following the real transfer plans. Each scenario
prints its timeline; every delivered request is checked byte for byte. Exit status is non-zero if
any check fails, so the demo doubles as a smoke test.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console

from ..config import Config
from ..protocol import (
    AbortWrite, ConsumerCore, FailTransfer, FinishLoad, FreeBlocks, MessageError, ProducerCore,
    RankRegions, Registration, SendMessage, SubmitWrite, TransferId, Transitioned, WireCodec,
    Heartbeat, Cancel,
)
from ..protocol.geometry import ModelShape, rank_regions, regions_bytes
from ..transfer.memory import MemoryFabric

SHAPE = ModelShape(num_layers=4, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_tokens=16)
P_TP, D_TP, POOL = 2, 1, 64
P_ADDR, D_ADDR = "127.0.0.1:5601", "127.0.0.1:5602"


@dataclass
class DemoRow:
    """One request's line in the demo's table: when each step happened (ms after it started), what
    moved and how it ended."""

    started: float
    marks: dict[str, float] = field(default_factory=dict)
    outcome: str = "-"
    bytes: int = 0
    unmerged: int = 0
    merged: int = 0

    def mark(self, what: str, at: float) -> None:
        self.marks.setdefault(what, (at - self.started) * 1000)


class InProcessCluster:
    def __init__(self, config: Config, secret: bytes):
        self.codec = WireCodec(secret, config.max_message_bytes)
        self.fabric = MemoryFabric()
        self.p_regions = [rank_regions(SHAPE, POOL, r, P_TP) for r in range(P_TP)]
        self.d_regions = rank_regions(SHAPE, POOL, 0, D_TP)
        for r, regions in enumerate(self.p_regions):
            self.fabric.register(f"p{r}", regions_bytes(regions))
        self.fabric.register("d0", regions_bytes(self.d_regions))
        self.p = [ProducerCore(self.p_regions[r], r, P_TP, config.producer_timeouts()) for r in range(P_TP)]
        self.d = ConsumerCore(D_ADDR, 0, D_TP, config.consumer_timeouts())
        self.to_p: list[tuple[int, bytes]] = []
        self.to_d: list[bytes] = []
        self.rows: dict[TransferId, DemoRow] = {}
        self.p_free, self.d_free = set(range(1, POOL)), set(range(1, POOL))  # block 0: pad block
        self.rejected = 0
        self.prefill_alive = True
        self.decoding: dict[TransferId, tuple[int, ...]] = {}

    # -- engines -------------------------------------------------------------------------------------
    def logical_kv(self, tid: TransferId, position: int) -> np.ndarray:
        """What prefill computes for one block position: [heads, tokens, head bytes]."""
        rng = np.random.default_rng([sum(map(ord, str(tid))), position])
        return rng.integers(0, 256, (SHAPE.num_kv_heads, SHAPE.block_tokens, SHAPE.head_dim * 2), np.uint8)

    def prefill(self, tid: TransferId, n_blocks: int) -> tuple[int, ...]:
        blocks = tuple(sorted(self.p_free)[:n_blocks])
        self.p_free -= set(blocks)
        for rank, regions in enumerate(self.p_regions):
            mem = np.frombuffer(self.fabric.memory[f"p{rank}"], np.uint8)
            for region in regions:
                for pos, b in enumerate(blocks):
                    kv = self.logical_kv(tid, pos)[region.first_head:region.first_head + region.heads]
                    start = region.base_addr + b * region.block_stride_bytes
                    mem[start:start + region.block_bytes] = kv.ravel()
        return blocks

    def kv_ready(self, tid: TransferId, blocks: tuple[int, ...]) -> None:
        self.rows[tid].mark("kv ready", time.time())
        for rank, core in enumerate(self.p):
            self.perform(("p", rank), core.kv_ready(tid, blocks, time.time()))

    def decode_leg(self, tid: TransferId) -> None:
        self.rows[tid] = self.rows.get(tid) or DemoRow(time.time())
        self.perform(("d", 0), self.d.expect(tid, P_ADDR, P_TP, time.time()))

    def allocate(self, tid: TransferId, n_blocks: int, cached: int = 0) -> tuple[int, ...]:
        blocks = tuple(sorted(self.d_free)[:n_blocks - cached])
        self.d_free -= set(blocks)
        self.decoding[tid] = blocks
        reg = Registration(tid, "decode-0", f"cmpl-{tid.request}", D_ADDR, D_TP,
                           (RankRegions(0, "d0", self.d_regions),), blocks, cached, 0.0)
        self.rows[tid].mark("registered", time.time())
        self.perform(("d", 0), self.d.allocated(reg, time.time()))
        return blocks

    def finish_decode(self, tid: TransferId) -> None:
        self.d_free.update(self.decoding.pop(tid, ()))

    def verify(self, tid: TransferId, d_blocks: tuple[int, ...], cached: int) -> bool:
        mem = np.frombuffer(self.fabric.memory["d0"], np.uint8)
        for region in self.d_regions:
            for i, b in enumerate(d_blocks):
                want = self.logical_kv(tid, cached + i)[region.first_head:region.first_head + region.heads]
                start = region.base_addr + b * region.block_stride_bytes
                if not np.array_equal(mem[start:start + region.block_bytes], want.ravel()):
                    return False
        return True

    # -- what the cores ask for ---------------------------------------------------------------------
    def perform(self, side: tuple[str, int], actions) -> None:
        for action in actions:
            tl = self.rows.get(getattr(action, "transfer_id", None))
            if isinstance(action, SubmitWrite):
                tl.mark("write posted", time.time())
                tl.unmerged += action.plan.unmerged_count
                tl.merged += action.plan.descriptor_count
                tl.bytes += self.fabric.execute(f"p{side[1]}", action.plan)
                self.to_d.append(self.codec.encode(action.notification))
                self.perform(side, self.p[side[1]].write_done(action.transfer_id, time.time()))
            elif isinstance(action, SendMessage):
                frame = self.codec.encode(action.message)
                if side[0] == "p":
                    self.to_d.append(frame)
                else:
                    self.to_p.extend((rank, frame) for rank in action.ranks)
            elif isinstance(action, FreeBlocks):
                (self.p_free if side[0] == "p" else self.d_free).update(action.block_ids)
                if side[0] == "d":
                    self.decoding.pop(action.transfer_id, None)
            elif isinstance(action, FinishLoad):
                tl.mark("decode starts", time.time())
                tl.outcome = "delivered"
            elif isinstance(action, FailTransfer) and side[0] == "d":
                tl.outcome = f"failed: {action.reason}"
            elif isinstance(action, Transitioned) and side[0] == "d" and action.after == "CANCELLED":
                tl.outcome = "cancelled"
            elif isinstance(action, AbortWrite):
                pass

    def pump(self) -> None:
        """Deliver every queued message until the cluster is quiet."""
        while self.to_p or self.to_d:
            if self.to_p and not self.prefill_alive:
                self.to_p.clear()  # nobody is listening
            elif self.to_p:
                rank, frame = self.to_p.pop(0)
                try:
                    message = self.codec.decode(frame)
                except MessageError:
                    self.rejected += 1
                    continue
                core, now = self.p[rank], time.time()
                handler = {Registration: core.registration_received, Heartbeat: core.heartbeat,
                           Cancel: core.cancel}[type(message)]
                self.perform(("p", rank), handler(message, now))
            else:
                message = self.codec.decode(self.to_d.pop(0))
                tl = self.rows.get(message.transfer_id)
                if tl and type(message).__name__ == "WriteDone":
                    tl.mark("write done seen", time.time())
                self.perform(("d", 0), self.d.verdict(message, time.time()))

    def tick(self) -> None:
        now = time.time()
        for rank, core in enumerate(self.p if self.prefill_alive else ()):
            self.perform(("p", rank), core.tick(now))
        self.perform(("d", 0), self.d.tick(now))
        self.pump()


def _scenarios(c: InProcessCluster, forger: WireCodec, prefill_s: float):
    """Each yields (name, transfer id, check) and drives the cluster through one story."""
    def run(name, tid, blocks, cached=0, order="registration first", abort_decode=False):
        c.decode_leg(tid)
        if order == "registration first":
            d_blocks = c.allocate(tid, blocks, cached)
            c.pump()
            time.sleep(prefill_s)
            c.kv_ready(tid, c.prefill(tid, blocks))
        else:
            p_blocks = c.prefill(tid, blocks)
            time.sleep(prefill_s)
            c.kv_ready(tid, p_blocks)
            if abort_decode:
                c.perform(("d", 0), c.d.abort(tid, "client disconnected", time.time()))
                c.pump()
                return name, tid, lambda: c.rows[tid].outcome == "cancelled"
            d_blocks = c.allocate(tid, blocks, cached)
        c.pump()
        delivered = c.rows[tid].outcome == "delivered" and c.verify(tid, d_blocks, cached)
        c.finish_decode(tid)
        return name, tid, lambda: delivered

    yield run("registration before KV ready", TransferId("req-1"), 8)
    yield run("KV ready before registration", TransferId("req-2"), 8, order="kv first")
    yield run("prefix hit on D (3 of 6 blocks cached)", TransferId("req-3"), 6, cached=3)
    yield run("client aborts on D before registering", TransferId("req-4"), 4, order="kv first", abort_decode=True)

    tid = TransferId("req-5")
    c.decode_leg(tid)
    reg = Registration(tid, "decode-0", "x", "6.6.6.6:1", D_TP, (RankRegions(0, "d0", c.d_regions),),
                       (1, 2, 3), 0, time.time() + 60)
    c.to_p.extend((r, forger.encode(reg)) for r in range(P_TP))
    rejected_before = c.rejected
    c.pump()
    c.perform(("d", 0), c.d.abort(tid, "demo done", time.time()))
    c.pump()
    yield "forged registration (wrong secret)", tid, lambda: c.rejected == rejected_before + P_TP

    tid = TransferId("req-6")
    c.decode_leg(tid)
    c.allocate(tid, 4)
    c.prefill_alive = False  # prefill dies: it will never write, answer or tick again
    deadline = time.time() + 10
    while c.rows[tid].outcome == "-" and time.time() < deadline:
        time.sleep(0.05)
        c.tick()
    yield ("prefill dies after D registered", tid,
           lambda: c.rows[tid].outcome == "failed: no KV from prefill within watchdog_s")


def _scenarios_warm_up(c: InProcessCluster) -> None:
    """One unreported request so first-call costs (imports, allocations) do not colour the timelines."""
    tid = TransferId("warm-up")
    c.decode_leg(tid)
    c.allocate(tid, 2)
    c.pump()
    c.kv_ready(tid, c.prefill(tid, 2))
    c.pump()
    c.finish_decode(tid)


def run_demo(console: Console | None = None, prefill_ms: float = 20.0) -> int:
    console = console or Console()
    config = Config(watchdog_s=0.5, max_write_s=0.3, clock_skew_allowance_s=0.1, lease_s=2,
                    heartbeat_interval_s=0.5)
    secret = os.environ.get(config.secret_env, "").encode() or os.urandom(32)
    cluster = InProcessCluster(config, secret)
    forger = WireCodec(os.urandom(32))
    console.print(f"[bold]neuron-disagg push protocol in one process[/]: prefill TP{P_TP} -> decode TP{D_TP}, "
                  f"{SHAPE.num_layers} layers, {SHAPE.num_kv_heads} KV heads, blocks of {SHAPE.block_tokens} tokens; "
                  f"watchdog {config.watchdog_s} s (short, to show liveness)\n")
    _scenarios_warm_up(cluster)
    ok = True
    for name, tid, check in _scenarios(cluster, forger, prefill_ms / 1000):
        tl = cluster.rows[tid]
        passed = bool(check())
        ok &= passed
        verdict = "[green]ok[/]" if passed else "[red]CHECK FAILED[/]"
        console.print(f"[bold]{tid}[/] {name}: {tl.outcome}  {verdict}")
        steps = "  ->  ".join(f"{k} {v:.1f} ms" for k, v in sorted(tl.marks.items(), key=lambda kv: kv[1]))
        if steps:
            console.print(f"    {steps}")
        if tl.bytes:
            console.print(f"    {tl.bytes:,} bytes; descriptors {tl.unmerged} before merging, {tl.merged} after; "
                          "bytes verified on D")
    leaks = (POOL - 1 - len(cluster.p_free), POOL - 1 - len(cluster.d_free))
    console.print(f"rejected messages: {cluster.rejected}; blocks still held on P/D: {leaks[0]}/{leaks[1]}")
    ok &= leaks == (0, 0)
    console.print("[green]all checks passed[/]" if ok else "[red]some checks failed[/]")
    return 0 if ok else 1
