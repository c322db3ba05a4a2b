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
from typing import Callable

from ..protocol.actions import AbortRead, FailTransfer, FinishLoad, FreeBlocks, SendMessage, SubmitRead, Transitioned
from ..protocol.errors import MessageError
from ..protocol.messages import PullOffer, RankRegions, ReadDone, ReadFailed, TransferId
from ..protocol.lender import LenderCore
from ..protocol.reader import ReaderCore
from ..protocol.wire import WireCodec
from ..platforms.fence import KVFence
from .inflight import InFlight, Part
from .peers import Peers
from .transport import Transport
from .worker import TransferThread

log = logging.getLogger(__name__)


class _Reports:
    """Performs the actions both pull threads share."""

    def _report(self, action) -> bool:
        if isinstance(action, SendMessage):
            self.peers.send(action.peer, action.ranks, action.message)
        elif isinstance(action, FreeBlocks):
            self.on_free(action.transfer_id, action.block_ids)
        elif isinstance(action, FailTransfer):
            log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
            self.stats["failed"] += 1
        elif isinstance(action, Transitioned):
            self._log_transition(action)
        else:
            return False
        return True


class PullReader(_Reports, TransferThread):
    def __init__(self, core: ReaderCore, transport: Transport, codec: WireCodec, peers: Peers,
                 on_loaded: Callable[[TransferId], None], on_failed: Callable[[TransferId, str], None],
                 on_free: Callable[[TransferId, tuple[int, ...]], None], **intervals: float):
        super().__init__(f"neuron-disagg-pull-reader-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec = core, transport, codec
        self.on_loaded, self.on_failed, self.on_free = on_loaded, on_failed, on_free
        self.stats: Counter[str] = Counter()
        self.reads = InFlight(transport, peers, lambda agent, error: self._inbox.put(("peer_ready", agent, error)),
                              self.stats)

    # -- engine side: queue puts only ---------------------------------------------------------------
    def offered(self, offer: PullOffer) -> None:
        self._inbox.put(("offered", offer))

    def allocated(self, transfer_id: TransferId, local: RankRegions, block_ids: tuple[int, ...],
                  first_block_index: int = 0, fence: KVFence | None = None) -> None:
        """Engine: fresh destination blocks; no READ into them before ``fence`` (see PushReceiver)."""
        self._inbox.put(("allocated", transfer_id, local, tuple(block_ids), first_block_index, fence))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(("abort", transfer_id, reason))

    # -- the thread ------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.reads)

    def _handle(self, item: tuple, now: float) -> None:
        kind = item[0]
        if kind == "offered":
            self._perform(self.core.offered(item[1], now))
        elif kind == "allocated":
            if item[5] is not None:
                item[5].wait()
            self._perform(self.core.allocated(*item[1:5], now))
        elif kind == "abort":
            self._perform(self.core.abort(item[1], item[2], now))
        elif kind == "peer_ready":
            for tid, reason in self.reads.peer_ready(item[1], item[2]):
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

    def _perform(self, actions) -> None:
        for action in actions:
            if isinstance(action, SubmitRead):
                self._submit(action)
            elif isinstance(action, AbortRead):
                self.reads.release(action.transfer_id)
            elif isinstance(action, FinishLoad):
                self.on_loaded(action.transfer_id)
            elif isinstance(action, FailTransfer):
                self.on_failed(action.transfer_id, action.reason)
                self._report(action)
            elif not self._report(action):
                raise TypeError(f"unexpected action {action!r}")

    def _submit(self, submit: SubmitRead) -> None:
        self.stats["reads"] += 1
        parts = [Part(submit.p_side_channel, p_rank, write)
                 for p_rank, plan in submit.plans.items() for write in plan.writes]
        if not parts:  # a full prefix hit: nothing to read; tell P it may free
            self.peers.send(submit.p_side_channel, tuple(submit.plans), ReadFailed(
                submit.transfer_id, self.core.tp_rank, self.core.tp_size, "nothing to read"))
            for event in ("d_read_posted", "d_read_done"):
                self.timeline.mark(submit.transfer_id, event)
            return self._perform(self.core.read_done(submit.transfer_id, time.time()))
        self.timeline.mark(submit.transfer_id, "d_read_posted")  # before: cma copies inside the post
        error = self.reads.submit(submit.transfer_id, "READ", parts, self.codec.encode(submit.notification))
        if error:
            self._perform(self.core.read_failed(submit.transfer_id, error, time.time()))


class PullLender(_Reports, TransferThread):
    def __init__(self, core: LenderCore, transport: Transport, codec: WireCodec, peers: Peers,
                 on_free: Callable[[TransferId, tuple[int, ...]], None], **intervals: float):
        super().__init__(f"neuron-disagg-pull-lender-{core.tp_rank}", peers, **intervals)
        self.core, self.transport, self.codec = core, transport, codec
        self.on_free = on_free
        self.stats: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()

    def lend(self, offer: PullOffer) -> None:
        """Engine: prefill finished and ``offer`` went to the router; hold its blocks."""
        self._inbox.put(("lend", offer))

    def deliver(self, message: ReadFailed) -> None:
        self._inbox.put(("confirmed", message))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(("abort", transfer_id, reason))

    def _busy(self) -> bool:
        return bool(self.core.live())

    def _handle(self, item: tuple, now: float) -> None:
        if item[0] == "lend":
            self._perform(self.core.offer(item[1], now))
        elif item[0] == "confirmed":
            self._perform(self.core.confirmed(item[1], now))
        elif item[0] == "abort":
            self._perform(self.core.abort(item[1], item[2], now))

    def _poll(self) -> None:
        for sender, frame in self.transport.notifications():
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

    def _perform(self, actions) -> None:
        for action in actions:
            if not self._report(action):
                raise TypeError(f"unexpected action {action!r}")
