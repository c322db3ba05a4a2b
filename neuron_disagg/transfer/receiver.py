"""The push receiver: one thread per decode tensor-parallel worker, named
``neuron-disagg-push-receiver-<rank>``.

The engine tells it about decode legs (``expect``), allocated destination blocks (``allocated``)
and aborts; the side channel hands it P's verdicts; and it polls its transport for the WriteDone
notifications that ride on P's WRITEs. It feeds all of that to the consumer core, performs the
actions — registrations, heartbeats and cancels to P (on the peers executor, never blocking), and
loaded / failed / freed reports to the engine — and ticks the core so watchdogs and fences fire.
With host staging (staging.py) it registers host slots instead of the allocated blocks and copies
the slots into those blocks once P's write landed, before reporting the load.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from msgspec.structs import replace

from ..protocol.actions import FailTransfer, FinishLoad, FreeBlocks, Quarantine, SendMessage
from ..protocol.consumer import ConsumerCore
from ..protocol.errors import MessageError
from ..protocol.messages import (
    CancelAck, RankRegions, Registration, TransferId, WriteDone, WriteFailed, WriteStarting,
)
from ..protocol.wire import WireCodec
from ..platforms.fence import KVFence
from .inbox import Abort, Allocated, Deliver, Expect, Undelivered
from .outbox import Failed, Freed, Loaded, Outbox, Quarantined
from .peers import Peers
from .staging import HostStaging
from .transport import Transport
from .thread import TransferThread

log = logging.getLogger(__name__)


class PushReceiver(TransferThread[ConsumerCore]):
    idle_progress_s = 0.25  # P writes into our agent: it must progress even with nothing live here
    def __init__(self, core: ConsumerCore, transport: Transport, codec: WireCodec, peers: Peers,
                 outbox: Outbox, staging: HostStaging | None = None, **intervals: float):
        super().__init__(f"neuron-disagg-push-receiver-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec, self.outbox = core, transport, codec, outbox
        self.rejected: Counter[str] = Counter()
        self.staging = staging
        # Transfers P said it is writing: only these make us poll closely for the notification. A
        # registration otherwise waits out P's prefill (in push, all of it) costing D's core nothing.
        self._writing: set[TransferId] = set()
        self._handlers.update({Expect: self._expect, Allocated: self._allocated, Abort: self._abort,
                               Deliver: self._deliver, Undelivered: self._undelivered})
        self._performers[SendMessage] = self._send
        self._performers.update({FinishLoad: lambda a: self._loaded(a.transfer_id),
                                 FailTransfer: self._failed,
                                 Quarantine: self._quarantined,
                                 FreeBlocks: lambda a: self._free(a.transfer_id, a.block_ids)})
        self._watches_peers()

    # -- called from other threads: queue puts only --------------------------------------------------
    def expect(self, transfer_id: TransferId, p_side_channel: str, p_tp_size: int) -> None:
        self._inbox.put(Expect(transfer_id, p_side_channel, p_tp_size))

    def allocated(self, registration: Registration, fence: KVFence | None = None) -> None:
        """Engine: fresh destination blocks. With a ``fence`` (asynchronous accelerators: the engine
        zeroes new blocks on its stream) P hears of them only once it passed, so no write of P's
        lands before the zeroing."""
        self._inbox.put(Allocated(registration, fence))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(Abort(transfer_id, reason))

    def deliver(self, message: WriteStarting | WriteDone | WriteFailed | CancelAck) -> None:
        self._inbox.put(Deliver(message))

    def expecting_a_landing(self) -> bool:
        """Engine: P said it is writing into our blocks and the write has not been seen to land."""
        return bool(self._writing)

    # -- the thread -------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return self.expecting_a_landing()

    def _poll(self) -> None:
        for sender, frame in self.transport.notifications():
            self._notification(sender, frame)

    def _tick(self, now: float) -> None:
        self._perform(self.core.tick(now))
        if self._writing:  # ended without a verdict we saw (P's ranks each end theirs)
            self._writing &= {entry.transfer_id for entry in self.core.live()}

    def _send(self, action: SendMessage) -> None:
        """A registration that P's rank never received can never be written: the core hears so, as
        that rank's word that it writes nothing, and need not fence the blocks for it."""
        message = action.message
        on_failure = None
        if isinstance(message, Registration):
            def on_failure(rank: int, why: str, tid: TransferId = message.transfer_id) -> None:
                self._inbox.put(Undelivered(tid, rank, why))
        self.peers.send(action.peer, action.ranks, message, on_failure)

    def _undelivered(self, item: Undelivered, now: float) -> None:
        self._perform(self.core.undelivered(item.transfer_id, item.rank, item.reason, now))

    def _deliver(self, item: Deliver, now: float) -> None:
        message = item.message
        if isinstance(message, WriteStarting):
            self._writing.add(message.transfer_id)  # the loop polls right after this
        elif isinstance(message, (WriteDone, WriteFailed, CancelAck)):
            self._verdict(message, now)
        else:  # deliver() takes only P's messages to D
            self.rejected["unexpected"] += 1

    def _expect(self, item: Expect, now: float) -> None:
        self._perform(self.core.expect(item.transfer_id, item.p_side_channel, item.p_tp_size, now))

    def _allocated(self, item: Allocated, now: float) -> None:
        if item.fence is not None:
            item.fence.wait()
        if self.staging is None:
            self._perform(self.core.allocated(item.registration, now))
        else:
            self._stage(item.registration)
            self._perform(())  # slots taken at once registered with the core (deferred)

    def _abort(self, item: Abort, now: float) -> None:
        blocks = self.staging.withdraw(item.transfer_id) if self.staging else None
        if blocks is not None:  # P never heard of these blocks: the engine may have them back
            self.outbox.put(Freed(item.transfer_id, blocks))
        self._perform(self.core.abort(item.transfer_id, item.reason, now))

    # -- host staging ---------------------------------------------------------------------------------
    def _stage(self, registration: Registration) -> None:
        tid, blocks = registration.transfer_id, registration.block_ids
        staging = self.staging
        assert staging is not None  # only with host staging

        def register(slots: tuple[int, ...]) -> None:  # now, or when a release frees slots
            ranks = tuple(RankRegions(r.tp_rank, r.agent_name, staging.regions) for r in registration.ranks)
            self._then(lambda: self.core.allocated(replace(registration, ranks=ranks, block_ids=slots), time.time()))

        try:
            staging.take(tid, blocks, register)
        except ValueError as exc:
            self._perform(self.core.abort(tid, str(exc), time.time()))
            self.outbox.put(Freed(tid, blocks))

    def _loaded(self, tid: TransferId) -> None:
        self._writing.discard(tid)
        staging = self.staging
        held = staging.held(tid) if staging is not None else None
        if staging is not None and held is not None:
            staging.to_device(held[1], held[0])
            staging.release(tid)
        self.outbox.put(Loaded(tid))

    def _free(self, tid: TransferId, block_ids: tuple[int, ...]) -> None:
        self._writing.discard(tid)
        blocks = self.staging.release(tid) if self.staging else None  # P is done with the slots
        self.outbox.put(Freed(tid, block_ids if blocks is None else blocks))

    def _notification(self, sender: str, frame: bytes) -> None:
        try:
            message = self.codec.decode(frame)
        except MessageError as exc:
            self.rejected[exc.reason] += 1
            log.warning("rejected a notification from %s: %s", sender, exc)
            return
        if not isinstance(message, WriteDone):
            self.rejected["unexpected"] += 1
            return
        self._verdict(message, time.time())

    def _verdict(self, message: WriteDone | WriteFailed | CancelAck, now: float) -> None:
        """P's word on a transfer, by NIXL notification or by side channel."""
        if isinstance(message, WriteDone):
            self.timeline.mark(message.transfer_id, "d_notified")
        self._perform(self.core.verdict(message, now))

    def _failed(self, action: FailTransfer) -> None:
        log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
        self.outbox.put(Failed(action.transfer_id, action.reason))

    def _quarantined(self, action: Quarantine) -> None:
        log.warning("transfer %s goes on without its KV: %s; its blocks wait for their fence",
                    action.transfer_id, action.reason)
        self.outbox.put(Quarantined(action.transfer_id, action.reason))

    def _on_stop(self) -> None:
        self._abort_all("decode receiver shut down")

    def _abort_all(self, reason: str) -> None:
        for tid, blocks in self.staging.withdraw_all() if self.staging else ():
            self.outbox.put(Freed(tid, blocks))
        now = time.time()
        for entry in self.core.live():
            self._perform(self.core.abort(entry.transfer_id, reason, now))
