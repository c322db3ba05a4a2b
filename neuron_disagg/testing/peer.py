"""A stand-alone P or D rank with KV-shaped host memory, driven by JSON lines on stdin.

``python -m neuron_disagg.testing.peer --role prefill|decode`` builds block-major regions (``--layout``) for a
small model shape in one numpy buffer and runs a rank on them exactly as the connector's worker
does (``transfer.rank.Rank``: two agents over a real transport, the side channel, the role's push
and pull threads), then answers commands for the thread of its ``--mode``:

  {"op": "fill", "blocks": [..], "seed": n}            P: write a known pattern into blocks
  {"op": "digest", "blocks": [..]}                      sha256 of each block (all layers, K and V)
  {"op": "read", "block": n}                            the block's bytes in each region, hex
  {"op": "kv_ready", "tid": [req, attempt], "blocks": [..]}          P
  {"op": "kv_chunk", "tid": [..], "blocks": [..]}    P, push: the prompt's leading blocks, final (streaming)
  {"op": "preempted", "tid": [..]}                   P, push: the prefill's blocks were freed; computed again
  {"op": "expect", "tid": [..], "p_address": "h:p", "p_tp": 1}      D
  {"op": "allocate", "tid": [..], "blocks": [..], "first": 0}       D
  {"op": "regions"}                                      this rank's regions and agent, JSON
  {"op": "lend", "tid": [..], "blocks": [..], "ranks": [..]}  pull, P: returns {"offer": base64};
                                                         "ranks": every P rank's "regions" (TP > 1)
  {"op": "offered", "tid": [..], "offer": ".."}          pull, D (then "allocate")
  {"op": "abort", "tid": [..], "reason": ".."}
  {"op": "stats"}

Each reply is {"reply": <seq>, ...}; asynchronous events are {"event": "free"|"loaded"|"failed"|
"quarantined"} (quarantined: D's load failed now, P being gone, and its blocks follow with "free").
It is what the integration tests and the transfer benchmark run as real processes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import itertools
import json
import os
import sys
import threading
import time

import msgspec
import numpy as np

from ..config import Config
from ..kv_params import ROLES
from ..protocol.consumer import ConsumerTimeouts
from ..protocol.geometry import QWEN3_32B, ModelShape, rank_regions, regions_bytes
from ..protocol.lender import LenderTimeouts
from ..protocol.messages import PullOffer, RankRegions, Registration, TransferId
from ..protocol.producer import ProducerTimeouts
from ..protocol.reader import ReaderTimeouts
from ..protocol.wire import WireCodec
from ..transfer.outbox import Failed, Freed, Loaded, Quarantined
from ..transfer.rank import Rank, RankTimeouts
from ..transfer.transport import InMemoryTransport, NixlTransport

EVENTS = sys.stdout
_instances = itertools.count()
SHAPE = ModelShape(num_layers=4, num_kv_heads=2, head_dim=64, dtype_bytes=2, block_tokens=16)
# name -> (model shape, TP size whose rank 0 this process plays)
SHAPES = {"small": (SHAPE, 1), "qwen3-32b-tp8": (QWEN3_32B, 8)}


class Peer:
    """One rank (``transfer.rank.Rank``, as the connector's worker builds it: two agents, both of the
    role's threads) over host memory; ``--mode`` says which thread the commands drive."""

    def __init__(self, args, emit=None):
        self.role, self.mode, self.lease_s = args.role, args.mode, args.lease_s
        self._emit = emit
        self.codec = WireCodec(Config().load_secret())
        shape, shape_tp = SHAPES[args.shape]
        # With --tp-size this process is rank --tp-rank of that many (one process per rank, each
        # listening on --port + rank); without, it plays rank 0 alone.
        rank, tp = args.tp_rank, args.tp_size or 1
        if rank and not args.port:
            raise SystemExit("--tp-rank > 0 needs --port (the instance's base side-channel port)")
        layout_tp = args.tp_size or shape_tp
        outermost = args.layout == "blocks-outermost"
        self.buffer = np.zeros(regions_bytes(rank_regions(shape, args.blocks, rank, layout_tp, blocks_outermost=outermost)),
                               dtype=np.uint8)
        self.regions = rank_regions(shape, args.blocks, rank, layout_tp, base_addr=self.buffer.ctypes.data,
                                    blocks_outermost=outermost)
        self.agent = f"{args.role}-{os.getpid()}-{next(_instances)}"
        timeouts = RankTimeouts(
            producer=ProducerTimeouts(lease_s=args.lease_s, max_write_s=args.max_write_s, watchdog_s=args.watchdog_s,
                                      clock_skew_allowance_s=0.2, tombstone_s=60),
            consumer=ConsumerTimeouts(watchdog_s=args.watchdog_s, admission_timeout_s=args.admission_s,
                                      heartbeat_interval_s=args.heartbeat_s, max_write_s=args.max_write_s,
                                      clock_skew_allowance_s=0.2, tombstone_s=60, suspect_after_s=args.suspect_after_s),
            lender=LenderTimeouts(max_read_s=args.max_write_s, clock_skew_allowance_s=0.2),
            reader=ReaderTimeouts(max_read_s=args.max_write_s, suspect_after_s=args.suspect_after_s))
        self.rank = Rank(
            args.role, rank, tp, self.regions, codec=self.codec, agent_name=self.agent,
            side_channel_host="127.0.0.1", side_channel_port=args.port,
            advertised=f"127.0.0.1:{args.port}" if args.port else None, timeouts=timeouts, backend=args.backend,
            transport=NixlTransport if args.transport == "nixl" else InMemoryTransport,
            merge_descriptors=not args.no_merge)
        self.address, self.server = self.rank.address, self.rank.server
        self.thread = self.rank.push if self.mode == "push" else self.rank.pull  # what the commands drive
        self.core = self.thread.core
        self.transport = self.thread.transport
        self.outstanding: dict[TransferId, tuple[int, ...]] = {}  # blocks lent to a transfer
        self.allocated_at: dict[TransferId, float] = {}
        self._out = threading.Lock()
        self._reporting = True
        self.rank.start()
        self._reporter = threading.Thread(target=self._report, name="peer-reporter", daemon=True)
        self._reporter.start()

    # -- events out -------------------------------------------------------------------------------------
    def emit(self, obj) -> None:
        if self._emit is not None:
            return self._emit(obj)
        with self._out:
            EVENTS.write(json.dumps(obj) + "\n")
            EVENTS.flush()

    def _report(self) -> None:
        """The rank's results as events, as they come (the engine would drain them each step)."""
        while self._reporting:
            self._events(self.rank.outbox.take(0.2))

    def _events(self, results) -> None:
        for result in results:
            tid = [result.transfer_id.request, result.transfer_id.attempt]
            if isinstance(result, Freed):
                self.outstanding.pop(result.transfer_id, None)
                self.emit({"event": "free", "tid": tid, "blocks": list(result.block_ids)})
            elif isinstance(result, Loaded):
                self.outstanding.pop(result.transfer_id, None)  # handed to decode: the engine owns them now
                started = self.allocated_at.pop(result.transfer_id, None)
                latency = None if started is None else (time.perf_counter() - started) * 1e3
                self.emit({"event": "loaded", "tid": tid, "ms_since_allocate": latency})
            elif isinstance(result, Failed):
                self.emit({"event": "failed", "tid": tid, "reason": result.reason})
            elif isinstance(result, Quarantined):
                self.emit({"event": "quarantined", "tid": tid, "reason": result.reason})

    def _inflight(self):
        for name in ("writes", "reads"):
            if hasattr(self.thread, name):
                return getattr(self.thread, name)
        return None

    # -- commands -----------------------------------------------------------------------------------------
    def own_regions(self) -> RankRegions:
        return RankRegions(self.rank.tp_rank, self.agent, self.regions)

    def block_view(self, region, block):
        start = region.base_addr - self.buffer.ctypes.data + block * region.block_stride_bytes
        return self.buffer[start:start + region.block_bytes]

    def command(self, cmd: dict) -> dict:
        op = cmd["op"]
        tid = TransferId(*cmd["tid"]) if "tid" in cmd else None
        if op == "fill":
            for pos, block in enumerate(cmd["blocks"]):
                rng = np.random.default_rng([cmd["seed"], pos])
                for region in self.regions:
                    self.block_view(region, block)[:] = rng.integers(0, 256, region.block_bytes, np.uint8)
            return {}
        if op == "read":
            return {"regions": [self.block_view(r, cmd["block"]).tobytes().hex() for r in self.regions]}
        if op == "regions":
            return {"regions": msgspec.to_builtins(self.own_regions())}
        if op == "digest":
            return {"digest": [hashlib.sha256(b"".join(self.block_view(r, b).tobytes() for r in self.regions)).hexdigest()
                               for b in cmd["blocks"]]}
        if op in ("kv_ready", "allocate", "lend"):
            self.outstanding[tid] = tuple(cmd["blocks"])
        if op == "allocate":
            self.allocated_at[tid] = time.perf_counter()
        if op == "kv_ready":
            self.rank.push.kv_ready(tid, tuple(cmd["blocks"]))
        elif op == "kv_chunk":
            self.rank.push.kv_chunk(tid, tuple(cmd["blocks"]))
        elif op == "preempted":
            self.rank.push.preempted(tid)
        elif op == "kv_coming":  # push, P: the blocks the prefill's last forward is about to fill
            self.thread.kv_coming(tid, tuple(cmd["blocks"]))
        elif op == "expect":
            self.thread.expect(tid, cmd["p_address"], cmd.get("p_tp", 1))
        elif op == "lend":  # pull, P: hold the blocks and return the signed offer for the router
            ranks = tuple(msgspec.convert(r, RankRegions) for r in cmd["ranks"]) if "ranks" in cmd else (self.own_regions(),)
            offer = PullOffer(tid, self.agent, self.address, len(ranks), ranks,
                              tuple(cmd["blocks"]), time.time() + self.lease_s, time.time())
            self.thread.lend(offer)
            return {"offer": base64.b64encode(self.codec.encode(offer)).decode()}
        elif op == "offered":  # pull, D: the decode leg arrived with P's offer
            self.thread.offered(tid, (base64.b64decode(cmd["offer"]),))
        elif op == "allocate" and self.mode == "pull":
            self.thread.allocated(tid, self.own_regions(), tuple(cmd["blocks"]),
                                  cmd.get("first", 0))
        elif op == "allocate":
            self.thread.allocated(Registration(
                tid, self.agent, f"d-{tid}", self.address, self.rank.tp_size,
                (self.own_regions(),),
                tuple(cmd["blocks"]), cmd.get("first", 0), 0.0))
        elif op == "abort":
            self.thread.abort(tid, cmd.get("reason", "aborted"))
        elif op == "stats":
            return {"counters": dict(self.core.counters), "rejected": dict(self.server.rejected),
                    "live": len(self.core.live()),
                    "outstanding_blocks": sum(len(b) for b in self.outstanding.values()),
                    "writer": dict(getattr(self.thread, "stats", {})),
                    "initiator": self.rank.initiator.name,  # "-writer"/"-reader", ".N" after N resets
                    "post_ms": [s * 1e3 for s in getattr(self._inflight(), "post_seconds", [])],
                    "transfer_ms": [s * 1e3 for s in getattr(self._inflight(), "done_seconds", [])],
                    "notifications_rejected": dict(getattr(self.thread, "rejected", {}))}
        elif op == "shutdown":
            self.shutdown()
            return {"stopped": True}
        else:
            return {"error": f"unknown op {op}"}
        return {}

    def shutdown(self) -> None:
        try:
            self.rank.shutdown()
        finally:
            self._reporting = False
            self.rank.outbox.wake()
            self._reporter.join(5)
            self._events(self.rank.outbox.drain())  # what shutting down released


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--transport", choices=["nixl", "memory"], default="nixl")
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=0, help="TP size this rank belongs to (default: alone)")
    parser.add_argument("--no-merge", action="store_true", help="post one descriptor per block (to measure merging)")
    parser.add_argument("--layout", choices=["layer-major", "blocks-outermost"], default="layer-major",
                        help="a region per layer and K/V one after another, or every layer's share of a block "
                             "back to back in it (vLLM's BLHNC)")
    parser.add_argument("--backend", default="UCX")
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--watchdog-s", type=float, default=3.0)
    parser.add_argument("--admission-s", type=float, default=10.0)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--max-write-s", type=float, default=2.0)
    parser.add_argument("--suspect-after-s", type=float, default=3.0,
                        help="D: a P rank silent this long is gone (its transfers go on without their KV)")
    parser.add_argument("--clock-offset-s", type=float, default=0.0,
                        help="run this process's wall clock this far ahead (negative: behind) of the host's")
    return parser


def _nixl_version() -> str | None:
    try:
        return importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    global EVENTS
    # Native libraries (UCX, NIXL) print to fd 1: keep the real stdout for our JSON lines only.
    EVENTS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    args = parser().parse_args()
    if args.clock_offset_s:  # a host whose clock is off: every wall-clock reading in this process
        host_time = time.time
        time.time = lambda: host_time() + args.clock_offset_s
    peer = Peer(args)
    peer.emit({"event": "ready", "address": peer.address, "agent": peer.agent, "pid": os.getpid(),
               "backends": peer.rank.target.loaded_backends(), "nixl": _nixl_version()})
    for line in sys.stdin:
        cmd = json.loads(line)
        reply = peer.command(cmd)
        peer.emit({"reply": cmd.get("seq"), **reply})
        if cmd["op"] == "shutdown":
            break


if __name__ == "__main__":
    main()
