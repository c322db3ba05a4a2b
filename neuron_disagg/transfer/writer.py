"""The push writer: one thread per prefill tensor-parallel worker, named
``neuron-disagg-push-writer-<rank>``.

The engine and the side channel put events in its inbox (queue puts, nothing more); the thread
(its loop is ``thread.TransferThread``) feeds them to the producer core, performs the actions the
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
from functools import partial
from collections.abc import Callable
from typing import Any

from ..protocol.actions import AbortWrite, Action, FailTransfer, FreeBlocks, SubmitWrite
from ..protocol.messages import Cancel, Heartbeat, Registration, TransferId, Withdraw, WriteStarting
from ..protocol.producer import PState, ProducerCore
from ..protocol.wire import WireCodec
from ..platforms.fence import KVFence, LayerFences
from ..protocol.plan import split_by_group, target_ranks
from .inbox import Abort, Deliver, KvChunk, KvComing, KvReady, LayersFenced, PeerReady, Preempted
from .inflight import InFlight, Part
from .outbox import Freed, Outbox
from .peers import Peers
from .staging import HostStaging
from .transport import Transport
from .thread import TransferThread

log = logging.getLogger(__name__)
LAYERS_FENCED = LayersFenced()


class PushWriter(TransferThread[ProducerCore]):
    def __init__(self, core: ProducerCore, transport: Transport, codec: WireCodec, peers: Peers,
                 outbox: Outbox, staging: HostStaging | None = None, **intervals: float):
        super().__init__(f"neuron-disagg-push-writer-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec, self.outbox = core, transport, codec, outbox
        self.staging = staging
        self._forwards: list[LayerFences] = []  # streaming by layers: steps whose fences have not all passed, oldest first
        self.stats: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # by reason, for metrics
        self.writes = InFlight(transport, peers, lambda agent, error: self._inbox.put(PeerReady(agent, error)),
                               self.stats)
        self._handlers.update({KvComing: self._kv_coming, KvReady: self._kv_ready, KvChunk: self._kv_chunk,
                               Preempted: self._preempted, Abort: self._abort, Deliver: self._message,
                               LayersFenced: lambda item, now: None,  # the turn's _poll posts what opened
                               PeerReady: self._peer_ready})
        self._performers.update({SubmitWrite: self._submit, AbortWrite: lambda a: self.writes.release(a.transfer_id),
                                 FreeBlocks: lambda a: self._free(a.transfer_id, a.block_ids),
                                 FailTransfer: self._count_failure})

    # -- called from other threads: queue puts only ------------------------------------------------
    def kv_ready(self, transfer_id: TransferId, block_ids: tuple[int, ...], fence: KVFence | None = None,
                 ready_at: float | None = None) -> None:
        """Engine: prefill of this request finished; its blocks are ours until we report them ``Freed``. With a
        ``fence`` (recorded by the engine, asynchronous accelerators) nothing is written before it.
        ``ready_at``: this thread marks the timeline's p_kv_ready then (a file write on the engine
        loop cost it 35-110 us a step in the bench)."""
        self._inbox.put(KvReady(transfer_id, tuple(block_ids), fence, ready_at))

    def kv_chunk(self, transfer_id: TransferId, block_ids: tuple[int, ...],
                 fence: KVFence | LayerFences | None = None) -> None:
        """Engine, after a step of a prefill (streaming by chunks): ``block_ids``, the prompt's
        leading blocks, hold final KV once ``fence`` has passed. Or before the step's forward
        (streaming by layers): they will, each group of layers once ``fence`` says so. They stay the
        engine's."""
        if self.staging is None:  # staging copies whole prefills; it streams nothing
            self._inbox.put(KvChunk(transfer_id, tuple(block_ids), fence))

    def layers_fenced(self) -> None:
        """Engine, streaming by layers: another group of the running forward's layers is fenced."""
        self._inbox.put(LAYERS_FENCED)

    def preempted(self, transfer_id: TransferId) -> None:
        """Engine: the prefill was preempted and its blocks freed; it is computed again."""
        if self.staging is None:
            self._inbox.put(Preempted(transfer_id))

    def kv_coming(self, transfer_id: TransferId, block_ids: tuple[int, ...]) -> None:
        """Engine, before the forward that completes this prefill: plan its write during the
        forward (``ProducerCore.kv_coming``), not after it, when the write waits for the plan."""
        if self.staging is None:  # staging plans with the host slots, known only once copied
            self._inbox.put(KvComing(transfer_id, tuple(block_ids)))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(Abort(transfer_id, reason))

    def expecting_a_landing(self) -> bool:
        """Nothing lands in P's blocks (``Rank.expecting_a_landing`` asks either side's threads)."""
        return False

    def deliver(self, message: Registration | Heartbeat | Cancel | Withdraw) -> None:
        """Side channel: a verified message from D (or the router's Withdraw)."""
        self._inbox.put(Deliver(message))

    # -- the thread: inbox items ---------------------------------------------------------------------
    def _kv_coming(self, item: KvComing, now: float) -> None:
        plan = self.core.kv_coming(item.transfer_id, item.block_ids)
        if plan is not None:  # NIXL's requests too: after the forward, the write is only posted
            self.writes.prepare(item.transfer_id, "WRITE", plan.writes, key=plan)

    def _kv_ready(self, item: KvReady, now: float) -> None:
        if item.ready_at is not None:
            self.timeline.mark(item.transfer_id, "p_kv_ready", item.ready_at)
        if item.fence is not None:
            item.fence.wait()
        if self.staging is None:
            self._perform(self.core.kv_ready(item.transfer_id, item.block_ids, now))
        else:
            self._stage(item.transfer_id, item.block_ids)
            self._perform(())  # a copy that ran at once reported to the core (deferred)

    def _kv_chunk(self, item: KvChunk, now: float) -> None:
        if isinstance(item.fence, LayerFences):  # handed before the forward: its parts wait on their layers
            if not self._forwards or item.fence is not self._forwards[-1]:
                self._forwards.append(item.fence)
        elif item.fence is not None:
            item.fence.wait()
        self._perform(self.core.chunk_ready(item.transfer_id, item.block_ids, now))

    def _preempted(self, item: Preempted, now: float) -> None:
        self._perform(self.core.preempted(item.transfer_id, now))

    def _abort(self, item: Abort, now: float) -> None:
        blocks = self.staging.withdraw(item.transfer_id) if self.staging else None
        if blocks is not None:  # never copied: the engine's blocks go straight back
            self.outbox.put(Freed(item.transfer_id, blocks))
        self._perform(self.core.abort(item.transfer_id, item.reason, now))

    def _message(self, item: Deliver, now: float) -> None:
        message = item.message
        handlers: dict[type, Callable[[Any, float], list[Action]]] = {
            Registration: self.core.registration_received, Heartbeat: self.core.heartbeat, Cancel: self.core.cancel,
            Withdraw: lambda m, now: self.core.withdraw(m.transfer_id, m.reason, now)}
        handler = handlers[type(message)]
        if isinstance(message, Registration):
            self.timeline.mark(message.transfer_id, "p_registration")
        self._perform(handler(message, now))

    def _peer_ready(self, item: PeerReady, now: float) -> None:
        for tid, reason in self.writes.peer_ready(item.agent, item.error):
            self._perform(self._failed(tid, reason))

    # -- the thread: progress and deadlines ----------------------------------------------------------
    def _busy(self) -> bool:
        # Parts waiting on layers the forward has not fenced need no polling: the engine wakes the
        # thread when it fences them (LayersFenced). Polling the whole forward would contend for
        # the GIL with the engine thread on every turn.
        if self.writes.moving():
            return True
        # Of async scheduling's overlapping steps, an older one's fences may still be on the device.
        while self._forwards and self._forwards[0].passed():  # oldest first: the last stays the newest
            self._forwards.pop(0)
        return any(layers.on_device() for layers in self._forwards)

    def _tick(self, now: float) -> None:
        self._perform(self.core.tick(now))

    def _poll(self) -> None:
        # Each turn, as a thread with nothing live sleeps until its next item: what was built for
        # a plan the core dropped (the transfer ended, or kv_ready planned anew) goes at once.
        self.writes.keep_prepared(lambda tid, plan: self.core.planned_write(tid) is plan)
        now = time.time()
        for tid in self.writes.gated():
            # A chunk write is posted whole while D's registration holds, as the protocol has it:
            # parts still waiting on their layers when it is given up (cancelled, timed out, the
            # request ended) or the registration lapses never go.
            entry = self.core.entries.get(tid)
            if (entry is None or entry.state not in (PState.STREAMING, PState.FINISHING)
                    or (entry.registration_deadline is not None and now >= entry.registration_deadline)):
                self.writes.drop_gated(tid)
        done, failed = self.writes.poll()
        for tid in done:
            entry = self.core.entries.get(tid)
            if entry is None or not entry.chunk_in_flight:
                self.timeline.mark(tid, "p_write_done")
                self.stats["done"] += 1
            self._perform(self.core.write_done(tid, time.time()))
        for tid, reason in failed:
            self._perform(self._failed(tid, reason))

    def _on_stop(self) -> None:
        self._fail_all("prefill writer shut down")
        self.writes.keep_prepared(lambda tid, plan: False)

    # -- host staging ---------------------------------------------------------------------------------
    def _stage(self, tid: TransferId, blocks: tuple[int, ...]) -> None:
        staging = self.staging
        assert staging is not None  # only with host staging

        def copy(slots: tuple[int, ...]) -> None:  # now, or when a release frees slots
            staging.to_host(blocks, slots)
            self.outbox.put(Freed(tid, blocks))  # copied: the engine may reuse them now
            self._then(lambda: self.core.kv_ready(tid, slots, time.time()))

        try:
            staging.take(tid, blocks, copy)
        except ValueError as exc:
            # the reason is taken now: Python unbinds `exc` when the except block ends, and _then runs later
            reason = str(exc)
            self.outbox.put(Freed(tid, blocks))
            self._then(lambda: self.core.abort(tid, reason, time.time()))

    def _free(self, tid: TransferId, block_ids: tuple[int, ...]) -> None:
        if self.staging is None:
            return self.outbox.put(Freed(tid, block_ids))
        self.staging.release(tid)  # the engine had its blocks back when they were copied

    # -- performing the core's actions ---------------------------------------------------------------
    def _count_failure(self, action: FailTransfer) -> None:
        self.stats["failed"] += 1
        self.failures[action.reason.split(":")[0]] += 1
        log.warning("transfer %s failed: %s", action.transfer_id, action.reason)

    def _submit(self, submit: SubmitWrite) -> None:
        notification = submit.notification
        parts = [Part(submit.d_side_channel, w.d_rank, w) for w in submit.plan.writes]
        if notification is None:  # finished chunks, while the prefill runs: D hears nothing of them
            self.stats["chunk_writes"] += 1
            layers = self._forwards[-1] if self._forwards else None
            if layers is not None and not layers.passed():
                # Blocks the running forward is still computing: each group of layers goes once its
                # fence is ready. The newest step's fences cover what earlier steps finished too.
                parts = [Part(submit.d_side_channel, w.d_rank, piece, partial(layers.ready, g))
                         for w in submit.plan.writes
                         for g, piece in split_by_group(w, layers.group_of_region)]
                self.stats["layer_parts"] += len(parts)
            self.timeline.mark(submit.transfer_id, "p_chunk_posted")
            return self._post(submit, parts, b"")
        self.stats["writes"] += 1
        if not submit.plan.writes:  # nothing left to move (a full prefix hit on D): only the notice
            entry = self.core.entries.get(submit.transfer_id)
            d_tp = entry.registration.d_tp_size if entry is not None and entry.registration is not None else 1
            self.peers.send(submit.d_side_channel, target_ranks(self.core.tp_rank, self.core.tp_size, d_tp,
                                                                self.core.total_heads), notification)
            for event in ("p_write_posted", "p_write_done"):
                self.timeline.mark(submit.transfer_id, event)
            return self._then(lambda: self.core.write_done(submit.transfer_id, time.time()))
        # D waits for notifications lazily until told a write is coming (messages.WriteStarting).
        self.peers.send(submit.d_side_channel, tuple(sorted({part.peer_rank for part in parts})),
                        WriteStarting(submit.transfer_id, self.core.tp_rank))
        # Marked before posting: with UCX's cma the copy, and D's notification, happen inside it.
        self.timeline.mark(submit.transfer_id, "p_write_posted")
        self._post(submit, parts, self.codec.encode(notification))

    def _post(self, submit: SubmitWrite, parts: list[Part], frame: bytes) -> None:
        error = self.writes.submit(submit.transfer_id, "WRITE", parts, frame)
        if error:
            self._then(lambda: self._failed(submit.transfer_id, error))

    def _failed(self, tid: TransferId, reason: str) -> list[Action]:
        """The write's parts released; the core's actions for its failure."""
        self.writes.release(tid)
        self.stats["write_failed"] += 1
        return self.core.write_failed(tid, reason, time.time())

    def _fail_all(self, reason: str) -> None:
        for tid, blocks in self.staging.withdraw_all() if self.staging else ():
            self.outbox.put(Freed(tid, blocks))
        for tid in self.writes.tids():
            self._perform(self._failed(tid, reason))
        now = time.time()
        for entry in self.core.live():  # held blocks go back; D learns the reason
            self._perform(self.core.abort(entry.transfer_id, reason, now))
