"""The push writer: one thread per prefill tensor-parallel worker, named
``neuron-disagg-push-writer-<rank>``.

The engine and the side channel put events in its inbox (queue puts, nothing more); the thread
(its loop is ``worker.TransferThread``) feeds them to the producer core, performs the actions the
core returns — post WRITEs, notify D, free blocks — polls in-flight WRITEs, and ticks the core so
leases and write deadlines fire. Handshakes with new D agents run on a separate executor, so a slow
or dead D never delays writes to other peers. On shutdown every in-flight transfer fails with a
reason and its blocks are freed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol.actions import (
    AbortWrite, FailTransfer, FinishLoad, FreeBlocks, SendMessage, SubmitWrite, Transitioned,
)
from ..protocol.messages import Cancel, Heartbeat, Registration, TransferId
from ..protocol.plan import RankWrite
from ..protocol.producer import ProducerCore
from ..protocol.wire import WireCodec
from .peers import Peers
from .transport import TransferFailed, Transport, spans_cover
from .worker import TransferThread

log = logging.getLogger(__name__)


@dataclass
class _Write:
    """One transfer's WRITEs: posted handles and sub-writes parked until their D agent is known."""

    submit: SubmitWrite
    frame: bytes  # the signed WriteDone that rides on every WRITE
    handles: list[Any] = field(default_factory=list)
    parked: list[RankWrite] = field(default_factory=list)
    posted_at: float = 0.0


class PushWriter(TransferThread):
    def __init__(self, core: ProducerCore, transport: Transport, codec: WireCodec, peers: Peers,
                 on_free: Callable[[TransferId, tuple[int, ...]], None], **intervals: float):
        super().__init__(f"neuron-disagg-push-writer-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec = core, transport, codec
        self.on_free = on_free
        self.stats: Counter[str] = Counter()
        self.post_seconds: list[float] = []
        self._writes: dict[TransferId, _Write] = {}

    # -- called from other threads: queue puts only ------------------------------------------------
    def kv_ready(self, transfer_id: TransferId, block_ids: tuple[int, ...]) -> None:
        """Engine: prefill of this request finished; its blocks are ours until ``on_free``."""
        self._inbox.put(("kv_ready", transfer_id, tuple(block_ids)))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(("abort", transfer_id, reason))

    def deliver(self, message: Registration | Heartbeat | Cancel) -> None:
        """Side channel: a verified message from D."""
        self._inbox.put(("message", message))

    # -- the thread ------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._writes)

    def _tick(self, now: float) -> None:
        self._perform(self.core.tick(now))

    def _poll(self) -> None:
        self._poll_writes()

    def _on_stop(self) -> None:
        self._fail_all("prefill writer shut down")

    def _handle(self, item: tuple, now: float) -> None:
        kind = item[0]
        if kind == "kv_ready":
            self._perform(self.core.kv_ready(item[1], item[2], now))
        elif kind == "abort":
            self._perform(self.core.abort(item[1], item[2], now))
        elif kind == "message":
            message = item[1]
            handler = {Registration: self.core.registration_received, Heartbeat: self.core.heartbeat,
                       Cancel: self.core.cancel}[type(message)]
            self._perform(handler(message, now))
        elif kind == "peer_ready":
            self._peer_ready(item[1], item[2])

    # -- performing the core's actions ---------------------------------------------------------------
    def _perform(self, actions) -> None:
        for action in actions:
            if isinstance(action, SubmitWrite):
                self._submit(action)
            elif isinstance(action, AbortWrite):
                self._release(action.transfer_id)
            elif isinstance(action, SendMessage):
                self.peers.send(action.peer, action.ranks, action.message)
            elif isinstance(action, FreeBlocks):
                self.on_free(action.transfer_id, action.block_ids)
            elif isinstance(action, FailTransfer):
                self.stats["failed"] += 1
                log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
            elif isinstance(action, Transitioned):
                self._log_transition(action)
            elif not isinstance(action, FinishLoad):
                raise TypeError(f"unexpected action {action!r}")

    def _submit(self, submit: SubmitWrite) -> None:
        write = _Write(submit, self.codec.encode(submit.notification), posted_at=time.perf_counter())
        self._writes[submit.transfer_id] = write
        self.stats["writes"] += 1
        for rank_write in submit.plan.writes:
            if self.transport.has_peer(rank_write.d_agent):
                self._post(write, rank_write)
            else:
                write.parked.append(rank_write)
                self.peers.handshake(submit.d_side_channel, rank_write.d_rank, rank_write.d_agent,
                                     lambda agent, error: self._inbox.put(("peer_ready", agent, error)))
            if submit.transfer_id not in self._writes:  # a post failed and ended the transfer
                return
        if not submit.plan.writes:  # full prefix hit on D: nothing to move, only the notice
            self._writes.pop(submit.transfer_id)
            self.peers.send(submit.d_side_channel, (0,), submit.notification)
            self._perform(self.core.write_done(submit.transfer_id, time.time()))
        self.post_seconds.append(time.perf_counter() - write.posted_at)

    def _post(self, write: _Write, rank_write: RankWrite) -> None:
        spans = self.peers.spans.get(rank_write.d_agent)
        if spans is not None and not spans_cover(spans, rank_write.dst_addr, rank_write.length):
            self.stats["registration_rejected"] += 1
            return self._failed(write.submit.transfer_id, "registration rejected: destination lies "
                                f"outside the memory {rank_write.d_agent} registered")
        try:
            write.handles.append(self.transport.post("WRITE", rank_write.d_agent, rank_write, write.frame))
            self.stats["descriptors"] += len(rank_write)
            self.stats["bytes"] += rank_write.bytes
        except TransferFailed as exc:
            self._failed(write.submit.transfer_id, str(exc), rank_write.d_agent)

    def _peer_ready(self, agent: str, error: str | None) -> None:
        self.peers.handshake_finished(agent)
        for tid, write in list(self._writes.items()):
            for rank_write in [w for w in write.parked if w.d_agent == agent]:
                write.parked.remove(rank_write)
                if error is not None:
                    self._failed(tid, error, None)
                    break
                self._post(write, rank_write)
                if tid not in self._writes:
                    break

    def _poll_writes(self) -> None:
        for tid, write in list(self._writes.items()):
            try:
                done = [self.transport.poll(h) for h in write.handles]
            except TransferFailed as exc:
                self._failed(tid, str(exc), *{w.d_agent for w in write.submit.plan.writes})
                continue
            if all(done) and not write.parked:
                for handle in write.handles:
                    self.transport.release(handle)
                del self._writes[tid]
                self.stats["done"] += 1
                self._perform(self.core.write_done(tid, time.time()))

    def _failed(self, tid: TransferId, reason: str, *suspect_agents: str | None) -> None:
        self._release(tid)
        if "disconnect" in reason:  # a restarted peer comes back with a new agent: re-handshake
            for agent in suspect_agents:
                if agent:
                    self.transport.remove_peer(agent)
        self.stats["write_failed"] += 1
        self._perform(self.core.write_failed(tid, reason, time.time()))

    def _release(self, tid: TransferId) -> None:
        write = self._writes.pop(tid, None)
        for handle in write.handles if write else ():
            self.transport.release(handle)

    def _fail_all(self, reason: str) -> None:
        for tid in list(self._writes):
            self._failed(tid, reason)
        now = time.time()
        for entry in self.core.live():  # held blocks go back; D learns the reason
            self._perform(self.core.abort(entry.transfer_id, reason, now))
