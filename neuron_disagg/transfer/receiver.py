"""The push receiver: one thread per decode tensor-parallel worker, named
``neuron-disagg-push-receiver-<rank>``.

The engine tells it about decode legs (``expect``), allocated destination blocks (``allocated``)
and aborts; the side channel hands it P's verdicts; and it polls its transport for the WriteDone
notifications that ride on P's WRITEs. It feeds all of that to the consumer core, performs the
actions — registrations, heartbeats and cancels to P (on the peers executor, never blocking), and
loaded / failed / freed reports to the engine — and ticks the core so watchdogs and fences fire.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from typing import Callable

from ..protocol.actions import FailTransfer, FinishLoad, FreeBlocks, SendMessage, Transitioned
from ..protocol.consumer import ConsumerCore
from ..protocol.errors import MessageError
from ..protocol.messages import CancelAck, Registration, TransferId, WriteDone, WriteFailed
from ..protocol.wire import WireCodec
from .peers import Peers
from .transport import Transport

log = logging.getLogger(__name__)
_STOP = object()


class PushReceiver:
    def __init__(self, core: ConsumerCore, transport: Transport, codec: WireCodec, peers: Peers,
                 on_loaded: Callable[[TransferId], None],
                 on_failed: Callable[[TransferId, str], None],
                 on_free: Callable[[TransferId, tuple[int, ...]], None],
                 tick_interval_s: float = 0.05, poll_interval_s: float = 0.0005):
        self.core, self.transport, self.codec, self.peers = core, transport, codec, peers
        self.on_loaded, self.on_failed, self.on_free = on_loaded, on_failed, on_free
        self.tick_interval_s, self.poll_interval_s = tick_interval_s, poll_interval_s
        self.rejected: Counter[str] = Counter()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"neuron-disagg-push-receiver-{core.tp_rank}")

    # -- called from other threads: queue puts only --------------------------------------------------
    def start(self) -> "PushReceiver":
        self._thread.start()
        return self

    def expect(self, transfer_id: TransferId, p_side_channel: str, p_tp_size: int) -> None:
        self._inbox.put(("expect", transfer_id, p_side_channel, p_tp_size))

    def allocated(self, registration: Registration) -> None:
        self._inbox.put(("allocated", registration))

    def abort(self, transfer_id: TransferId, reason: str) -> None:
        self._inbox.put(("abort", transfer_id, reason))

    def deliver(self, message: WriteDone | WriteFailed | CancelAck) -> None:
        self._inbox.put(("verdict", message))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)
        self.peers.shutdown()
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} did not stop within {timeout_s} s")
        error, self._error = self._error, None  # report it once
        if error is not None:
            raise RuntimeError(f"{self._thread.name} failed") from error

    # -- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            next_tick = 0.0
            while True:
                wait = self.poll_interval_s if self.core.live() else self.tick_interval_s
                try:
                    item = self._inbox.get(timeout=wait)
                    while True:
                        if item is _STOP:
                            return self._abort_all("decode receiver shut down")
                        self._handle(item)
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                for sender, frame in self.transport.notifications():
                    self._notification(sender, frame)
                now = time.time()
                if now >= next_tick:
                    self._perform(self.core.tick(now))
                    next_tick = now + self.tick_interval_s
        except BaseException as exc:
            self._error = exc
            log.exception("%s died", self._thread.name)

    def _handle(self, item: tuple) -> None:
        kind, now = item[0], time.time()
        if kind == "expect":
            self._perform(self.core.expect(item[1], item[2], item[3], now))
        elif kind == "allocated":
            self._perform(self.core.allocated(item[1], now))
        elif kind == "abort":
            self._perform(self.core.abort(item[1], item[2], now))
        elif kind == "verdict":
            self._perform(self.core.verdict(item[1], now))

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
        self._perform(self.core.verdict(message, time.time()))

    def _perform(self, actions) -> None:
        for action in actions:
            if isinstance(action, SendMessage):
                self.peers.send(action.peer, action.ranks, action.message)
            elif isinstance(action, FinishLoad):
                self.on_loaded(action.transfer_id)
            elif isinstance(action, FailTransfer):
                log.warning("transfer %s failed: %s", action.transfer_id, action.reason)
                self.on_failed(action.transfer_id, action.reason)
            elif isinstance(action, FreeBlocks):
                self.on_free(action.transfer_id, action.block_ids)
            elif isinstance(action, Transitioned):
                log.debug("transfer %s %s -> %s on %s", action.transfer_id, action.before,
                          action.after, action.event)
            else:
                raise TypeError(f"unexpected action {action!r}")

    def _abort_all(self, reason: str) -> None:
        now = time.time()
        for entry in self.core.live():
            self._perform(self.core.abort(entry.transfer_id, reason, now))
