"""The push writer: one thread per prefill tensor-parallel worker, named
``neuron-disagg-push-writer-<rank>``.

The engine and the side channel put events in its inbox (queue puts, nothing more); the thread
(its loop is ``worker.TransferThread``) feeds them to the producer core, performs the actions the
core returns — post WRITEs, notify D, free blocks — polls in-flight WRITEs, and ticks the core so
leases and write deadlines fire. Handshakes with new D agents run on a separate executor, so a slow
or dead D never delays writes to other peers. On shutdown every in-flight transfer fails with a
reason and its blocks are freed. With host staging (staging.py) finished blocks are first copied to
host slots — the engine gets its blocks back right then — and the core plans with the slots.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from ..protocol.actions import (
    AbortWrite, FailTransfer, FinishLoad, FreeBlocks, SendMessage, SubmitWrite, Transitioned,
)
from ..protocol.messages import Cancel, Heartbeat, Registration, TransferId
from ..protocol.producer import ProducerCore
from ..protocol.wire import WireCodec
from ..platforms.fence import KVFence
from .peers import Peers
from .inflight import InFlight, Part
from .staging import HostStaging
from .transport import Transport
from .worker import TransferThread

log = logging.getLogger(__name__)


class PushWriter(TransferThread):
    def __init__(self, core: ProducerCore, transport: Transport, codec: WireCodec, peers: Peers,
                 on_free: Callable[[TransferId, tuple[int, ...]], None], staging: HostStaging | None = None,
                 **intervals: float):
        super().__init__(f"neuron-disagg-push-writer-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec = core, transport, codec
        self.on_free = on_free
        self.staging = staging
        self.stats: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # by reason, for metrics
        self.writes = InFlight(transport, peers, lambda agent, error: self._inbox.put(("peer_ready", agent, error)),
                               self.stats)

    # -- called from other threads: queue puts only ------------------------------------------------
    def kv_ready(self, transfer_id: TransferId, block_ids: tuple[int, ...], fence: KVFence | None = None) -> None:
        """Engine: prefill of this request finished; its blocks are ours until ``on_free``. With a
        ``fence`` (recorded by the engine, asynchronous accelerators) nothing is written before it."""
        self._inbox.put(("kv_ready", transfer_id, tuple(block_ids), fence))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(("abort", transfer_id, reason))

    def deliver(self, message: Registration | Heartbeat | Cancel) -> None:
        """Side channel: a verified message from D."""
        self._inbox.put(("message", message))

    # -- the thread ------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.writes)

    def _tick(self, now: float) -> None:
        self._perform(self.core.tick(now))

    def _poll(self) -> None:
        done, failed = self.writes.poll()
        for tid in done:
            self.timeline.mark(tid, "p_write_done")
            self.stats["done"] += 1
            self._perform(self.core.write_done(tid, time.time()))
        for tid, reason in failed:
            self._failed(tid, reason)

    def _on_stop(self) -> None:
        self._fail_all("prefill writer shut down")

    def _handle(self, item: tuple, now: float) -> None:
        kind = item[0]
        if kind == "kv_ready":
            if item[3] is not None:
                item[3].wait()
            if self.staging is None:
                self._perform(self.core.kv_ready(item[1], item[2], now))
            else:
                self._stage(item[1], item[2])
        elif kind == "abort":
            blocks = self.staging.withdraw(item[1]) if self.staging else None
            if blocks is not None:  # never copied: the engine's blocks go straight back
                self.on_free(item[1], blocks)
            self._perform(self.core.abort(item[1], item[2], now))
        elif kind == "message":
            message = item[1]
            handler = {Registration: self.core.registration_received, Heartbeat: self.core.heartbeat,
                       Cancel: self.core.cancel}[type(message)]
            if isinstance(message, Registration):
                self.timeline.mark(message.transfer_id, "p_registration")
            self._perform(handler(message, now))
        elif kind == "peer_ready":
            for tid, reason in self.writes.peer_ready(item[1], item[2]):
                self._failed(tid, reason)

    # -- host staging ---------------------------------------------------------------------------------
    def _stage(self, tid: TransferId, blocks: tuple[int, ...]) -> None:
        def copy(slots: tuple[int, ...]) -> None:
            self.staging.to_host(blocks, slots)
            self.on_free(tid, blocks)  # copied: the engine may reuse them now
            self._perform(self.core.kv_ready(tid, slots, time.time()))

        try:
            self.staging.take(tid, blocks, copy)
        except ValueError as exc:
            self.on_free(tid, blocks)
            self._perform(self.core.abort(tid, str(exc), time.time()))

    def _free(self, tid: TransferId, block_ids: tuple[int, ...]) -> None:
        if self.staging is None:
            return self.on_free(tid, block_ids)
        self.staging.release(tid)  # the engine had its blocks back when they were copied

    # -- performing the core's actions ---------------------------------------------------------------
    def _perform(self, actions) -> None:
        for action in actions:
            if isinstance(action, SubmitWrite):
                self._submit(action)
            elif isinstance(action, AbortWrite):
                self.writes.release(action.transfer_id)
            elif isinstance(action, SendMessage):
                self.peers.send(action.peer, action.ranks, action.message)
            elif isinstance(action, FreeBlocks):
                self._free(action.transfer_id, action.block_ids)
            elif isinstance(action, FailTransfer):
                self.stats["failed"] += 1
                self.failures[action.reason.split(":")[0]] += 1
                log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
            elif isinstance(action, Transitioned):
                self._log_transition(action)
            elif not isinstance(action, FinishLoad):
                raise TypeError(f"unexpected action {action!r}")

    def _submit(self, submit: SubmitWrite) -> None:
        self.stats["writes"] += 1
        if not submit.plan.writes:  # full prefix hit on D: nothing to move, only the notice
            self.peers.send(submit.d_side_channel, (0,), submit.notification)
            for event in ("p_write_posted", "p_write_done"):
                self.timeline.mark(submit.transfer_id, event)
            return self._perform(self.core.write_done(submit.transfer_id, time.time()))
        parts = [Part(submit.d_side_channel, w.d_rank, w) for w in submit.plan.writes]
        # Marked before posting: with UCX's cma the copy, and D's notification, happen inside it.
        self.timeline.mark(submit.transfer_id, "p_write_posted")
        error = self.writes.submit(submit.transfer_id, "WRITE", parts, self.codec.encode(submit.notification))
        if error:
            self._failed(submit.transfer_id, error)

    def _failed(self, tid: TransferId, reason: str) -> None:
        self.writes.release(tid)
        self.stats["write_failed"] += 1
        self._perform(self.core.write_failed(tid, reason, time.time()))

    def _fail_all(self, reason: str) -> None:
        for tid, blocks in self.staging.withdraw_all() if self.staging else ():
            self.on_free(tid, blocks)
        for tid in self.writes.tids():
            self._failed(tid, reason)
        now = time.time()
        for entry in self.core.live():  # held blocks go back; D learns the reason
            self._perform(self.core.abort(entry.transfer_id, reason, now))
