"""The life of every transfer thread (push writer, push receiver, pull reader, pull lender).

Other threads only put items in the inbox. The thread takes items (waiting briefly when transfers
are in flight, longer when idle), hands each to ``_handle``, drives I/O progress with ``_poll``,
and ticks its protocol core every ``tick_interval_s`` so deadlines fire. ``shutdown`` stops it
after ``_on_stop`` has ended what is in flight, joins within a bound, and re-raises (once) any
error that killed the thread — an engine must learn that its transfer thread is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..protocol.actions import Transitioned
from ..timeline import OFF, Timeline
from .peers import Peers

log = logging.getLogger(__name__)
_STOP = object()


class TransferThread:
    timeline: Timeline = OFF  # set before start() to record per-transfer timestamps
    def __init__(self, name: str, peers: Peers, tick_interval_s: float = 0.05,
                 poll_interval_s: float = 0.0005):
        self.peers = peers
        self.tick_interval_s, self.poll_interval_s = tick_interval_s, poll_interval_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- any thread ---------------------------------------------------------------------------------
    def start(self):
        self._thread.start()
        return self

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
                try:
                    item = self._inbox.get(timeout=self.poll_interval_s if self._busy() else self.tick_interval_s)
                    while True:
                        if item is _STOP:
                            return self._on_stop()
                        self._handle(item, time.time())
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                self._poll()
                now = time.time()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + self.tick_interval_s
        except BaseException as exc:  # kept for shutdown()
            self._error = exc
            log.exception("%s died", self._thread.name)

    def _log_transition(self, action: Transitioned) -> None:
        log.debug("transfer %s %s -> %s on %s%s", action.transfer_id, action.before, action.after,
                  action.event, f" ({action.reason})" if action.reason else "")

    # -- for subclasses ---------------------------------------------------------------------------------
    def _busy(self) -> bool:
        """True while transfers are in flight: poll often."""
        return False

    def _handle(self, item: tuple, now: float) -> None:
        raise NotImplementedError

    def _poll(self) -> None:
        pass

    def _tick(self, now: float) -> None:
        pass

    def _on_stop(self) -> None:
        pass
