"""Pull mode's two threads.

``PullReader`` — one per decode TP worker (``neuron-disagg-pull-reader-<rank>``): takes P's offer
and our allocated blocks from the engine, posts READs from every P rank it needs (handshakes on
the peers executor), polls them, and reports loaded / failed / freed. READ submission and polling
never run on the engine loop — that is what made the reference pull connector slow under load.

``PullLender`` — one per prefill TP worker (``neuron-disagg-pull-lender-<rank>``): holds offered
blocks under the lease, frees them when every reading D rank confirmed (``ReadDone`` rides on the
READ and arrives as a transport notification; ``ReadFailed`` comes over the side channel) or when
the lease ends.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from ..protocol.actions import AbortRead, FailTransfer, FinishLoad, FreeBlocks, Quarantine, SubmitRead
from ..protocol.errors import MessageError
from ..protocol.messages import PullOffer, RankRegions, ReadDone, ReadFailed, TransferId, Withdraw
from ..protocol.lender import LenderCore
from ..protocol.reader import ReaderCore
from ..protocol.wire import WireCodec
from ..platforms.fence import KVFence
from .inbox import Abort, Deliver, Lend, Offered, PeerReady, ReadInto
from .inflight import InFlight, Part
from .outbox import Failed, Freed, Loaded, Outbox, Quarantined
from .peers import Peers
from .transport import Transport
from .thread import TransferThread

log = logging.getLogger(__name__)


class PullReader(TransferThread[ReaderCore]):
    def __init__(self, core: ReaderCore, transport: Transport, codec: WireCodec, peers: Peers,
                 outbox: Outbox, **intervals: float):
        super().__init__(f"neuron-disagg-pull-reader-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec, self.outbox = core, transport, codec, outbox
        self.stats: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # offers whose frames failed verification, by reason
        self.reads = InFlight(transport, peers, lambda agent, error: self._inbox.put(PeerReady(agent, error)),
                              self.stats)
        self._handlers.update({
            Offered: self._offered,
            ReadInto: self._read_into,
            Abort: lambda item, now: self._perform(self.core.abort(item.transfer_id, item.reason, now)),
            PeerReady: self._peer_ready})
        self._performers.update({
            SubmitRead: self._submit, AbortRead: lambda a: self.reads.release(a.transfer_id),
            FinishLoad: lambda a: self.outbox.put(Loaded(a.transfer_id)),
            FailTransfer: self._failed,
            Quarantine: lambda a: self.outbox.put(Quarantined(a.transfer_id, a.reason)),
            FreeBlocks: lambda a: self.outbox.put(Freed(a.transfer_id, a.block_ids))})
        self._watches_peers()

    # -- engine side: queue puts only ---------------------------------------------------------------
    def offered(self, transfer_id: TransferId, frames: tuple[bytes, ...]) -> None:
        """Engine: the decode leg's signed offers (``frames``), one of them for ``transfer_id``."""
        self._inbox.put(Offered(transfer_id, tuple(frames)))

    def allocated(self, transfer_id: TransferId, local: RankRegions, block_ids: tuple[int, ...],
                  first_block_index: int = 0, fence: KVFence | None = None) -> None:
        """Engine: fresh destination blocks; no READ into them before ``fence`` (see PushReceiver)."""
        self._inbox.put(ReadInto(transfer_id, local, tuple(block_ids), first_block_index, fence))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(Abort(transfer_id, reason))

    def expecting_a_landing(self) -> bool:
        """Engine: a READ into our blocks is posted and not yet complete."""
        return bool(self.reads)

    # -- the thread ------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return self.expecting_a_landing()

    def _offered(self, item: Offered, now: float) -> None:
        try:
            offer = self._verified_offer(item.transfer_id, item.frames)
        except MessageError as exc:
            # The core never hears of it: the allocation that follows finds no transfer and goes
            # straight back (ReaderCore.allocated), and the request fails with this reason.
            self.rejected[exc.reason] += 1
            log.warning("transfer %s: prefill's offer rejected: %s", item.transfer_id, exc)
            self.outbox.put(Failed(item.transfer_id, f"offer rejected: {exc}"))
            return
        self._perform(self.core.offered(offer, now))

    def _verified_offer(self, transfer_id: TransferId, frames: tuple[bytes, ...]) -> PullOffer:
        for frame in frames:
            offer = self.codec.decode(frame)  # raises on a bad signature, version or schema
            if isinstance(offer, PullOffer) and offer.transfer_id == transfer_id:
                return offer
        raise MessageError(f"none of the {len(frames)} offers is for this prompt's transfer {transfer_id}")

    def _read_into(self, item: ReadInto, now: float) -> None:
        if item.fence is not None:
            item.fence.wait()
        self._perform(self.core.allocated(item.transfer_id, item.local, item.block_ids, item.first_block_index, now))

    def _peer_ready(self, item: PeerReady, now: float) -> None:
        for tid, reason in self.reads.peer_ready(item.agent, item.error):
            self._perform(self.core.read_failed(tid, reason, time.time()))

    def _poll(self) -> None:
        done, failed = self.reads.poll()
        for tid in done:
            self.timeline.mark(tid, "d_read_done")
            self._perform(self.core.read_done(tid, time.time()))
        for tid, reason in failed:
            self._perform(self.core.read_failed(tid, reason, time.time()))

    def _tick(self, now: float) -> None:
        self._perform(self.core.tick(now))

    def _on_stop(self) -> None:
        for tid in self.reads.tids():
            self.reads.release(tid)
            self._perform(self.core.read_failed(tid, "decode reader shut down", time.time()))

    def _failed(self, action: FailTransfer) -> None:
        log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
        self.stats["failed"] += 1
        self.outbox.put(Failed(action.transfer_id, action.reason))

    def _submit(self, submit: SubmitRead) -> None:
        self.stats["reads"] += 1
        parts = [Part(submit.p_side_channel, p_rank, write)
                 for p_rank, plan in submit.plans.items() for write in plan.writes]
        if not parts:  # a full prefix hit: nothing to read; tell P it may free
            self.peers.send(submit.p_side_channel, tuple(submit.plans), ReadFailed(
                submit.transfer_id, self.core.tp_rank, self.core.tp_size, "nothing to read"))
            for event in ("d_read_posted", "d_read_done"):
                self.timeline.mark(submit.transfer_id, event)
            return self._then(lambda: self.core.read_done(submit.transfer_id, time.time()))
        self.timeline.mark(submit.transfer_id, "d_read_posted")  # before: cma copies inside the post
        assert submit.notification is not None  # the reader core puts its ReadDone on every SubmitRead
        error = self.reads.submit(submit.transfer_id, "READ", parts, self.codec.encode(submit.notification))
        if error:
            self._then(lambda: self.core.read_failed(submit.transfer_id, error, time.time()))


class PullLender(TransferThread[LenderCore]):
    idle_progress_s = 0.25  # D reads from our agent: it must progress even with nothing live here
    def __init__(self, core: LenderCore, transport: Transport, codec: WireCodec, peers: Peers,
                 outbox: Outbox, **intervals: float):
        super().__init__(f"neuron-disagg-pull-lender-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec, self.outbox = core, transport, codec, outbox
        self.stats: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # by reason, for metrics (a lease that ran out)
        self._handlers.update({
            Lend: lambda item, now: self._perform(self.core.offer(item.offer, now)),
            Deliver: self._message,
            Abort: lambda item, now: self._perform(self.core.abort(item.transfer_id, item.reason, now))})
        self._performers.update({
            FreeBlocks: lambda a: self.outbox.put(Freed(a.transfer_id, a.block_ids)),
            FailTransfer: self._failed})

    def _message(self, item: Deliver, now: float) -> None:
        message = item.message
        if isinstance(message, Withdraw):
            self._perform(self.core.withdraw(message.transfer_id, message.reason, now))
        elif isinstance(message, (ReadDone, ReadFailed)):
            self._perform(self.core.confirmed(message, now))
        else:  # deliver() takes only D's confirmations and the router's Withdraw
            self.rejected["unexpected"] += 1

    def lend(self, offer: PullOffer) -> None:
        """Engine: prefill finished and ``offer`` went to the router; hold its blocks."""
        self._inbox.put(Lend(offer))

    def expecting_a_landing(self) -> bool:
        """Nothing lands in P's blocks (``Rank.expecting_a_landing`` asks either side's threads)."""
        return False

    def deliver(self, message: ReadFailed | Withdraw) -> None:
        self._inbox.put(Deliver(message))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(Abort(transfer_id, reason))

    def _busy(self) -> bool:
        return bool(self.core.live())

    def _failed(self, action: FailTransfer) -> None:
        log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
        self.stats["failed"] += 1
        self.failures[action.reason.split(":")[0]] += 1

    def _poll(self) -> None:
        for _sender, frame in self.transport.notifications():
            try:
                message = self.codec.decode(frame)
            except MessageError as exc:
                self.rejected[exc.reason] += 1
                continue
            if isinstance(message, ReadDone):
                self._perform(self.core.confirmed(message, time.time()))
            else:
                self.rejected["unexpected"] += 1

    def _tick(self, now: float) -> None:
        self._perform(self.core.tick(now))
